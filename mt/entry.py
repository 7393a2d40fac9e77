"""The console scripts' entry points: each imports its command's module and runs it.

A command's module imports torch (and Hydra, datasets, ...), which takes seconds; Ctrl-C in
those seconds printed some forty lines of KeyboardInterrupt traceback from inside torch, and a
SIGTERM or SIGHUP ended the process without a word. Here the import runs with SIGTERM and SIGHUP
turned into KeyboardInterrupt, and an interrupt ends the command in one line, with the status of
the signal (130 for Ctrl-C), as an interrupt later in the command does. ``python -m mt.X`` runs
the module itself, as before.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from importlib import import_module

# Each console script's command, "module:function" (pyproject.toml's [project.scripts] names the
# function of this module that runs it).
COMMANDS: dict[str, str] = {
    "mt-train": "mt.train:main",
    "translate": "mt.translate:cli",
    "mt-eval": "mt.evaluate:main",
    "mt-export": "mt.interop:export_main",
    "mt-import": "mt.interop:import_main",
    "mt-average": "mt.average:main",
    "mt-shortlist": "mt.shortlist:main",
}

# Commands that end by the signal itself after an interrupt (translate: a shell loop running it
# stops as for any other program), not by exit status 128 + signal.
_DIES_BY_SIGNAL = {"translate"}


def command(name: str) -> Callable[[], object]:
    """The function that runs the command ``name`` (a key of COMMANDS), its module imported
    with SIGTERM and SIGHUP raising KeyboardInterrupt (mt.interrupts.terminate_as_interrupt)."""
    from mt.interrupts import HANGUP, terminate_as_interrupt

    module, function = COMMANDS[name].split(":")
    with terminate_as_interrupt((signal.SIGTERM, *HANGUP)):
        return getattr(import_module(module), function)


def run(name: str) -> object:
    """Runs the command ``name`` and returns what it returns (an exit status, for sys.exit); an
    interrupt while its module is imported, or one that its own code leaves uncaught, ends it
    with one line on stderr."""
    try:
        return command(name)()
    except KeyboardInterrupt as err:
        _stop(name, getattr(err, "signal", signal.SIGINT))


def _stop(name: str, signum: int) -> None:
    """Says that ``name`` stopped on ``signum`` and ends the process as the command does."""
    said = ("\n" + f"{name}: interrupted" if signum == signal.SIGINT  # after the terminal's ^C
            else f"{name}: terminated ({signal.Signals(signum).name})")
    print(said, file=sys.stderr, flush=True)
    if name in _DIES_BY_SIGNAL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)


def mt_train() -> object:
    """``mt-train``."""
    return run("mt-train")


def translate() -> object:
    """``translate``."""
    return run("translate")


def mt_eval() -> object:
    """``mt-eval``."""
    return run("mt-eval")


def mt_export() -> object:
    """``mt-export``."""
    return run("mt-export")


def mt_import() -> object:
    """``mt-import``."""
    return run("mt-import")


def mt_average() -> object:
    """``mt-average``."""
    return run("mt-average")


def mt_shortlist() -> object:
    """``mt-shortlist``."""
    return run("mt-shortlist")
