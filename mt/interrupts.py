"""Signals that end a command as Ctrl-C does: ``terminate_as_interrupt`` turns SIGTERM (a
job scheduler's ``kill``, ``timeout``) and SIGHUP (``HANGUP``: the terminal closed) into a
KeyboardInterrupt for a block, so that what cleans up after Ctrl-C runs; a process forked
inside such a block dies of them as by default (``_forked``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TerminatedBySignal(KeyboardInterrupt):
    """SIGTERM (or another of ``terminate_as_interrupt``'s signals: ``signal`` says which),
    raised where Ctrl-C would be."""

    signal = signal.SIGTERM


def _raise_terminated(signum, frame) -> None:
    if os.getpid() != _guard_pid:  # a child the signal reached before _forked reset it
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    err = TerminatedBySignal()
    err.signal = signum
    raise err


# The signals that a terminate_as_interrupt block of this process turns into KeyboardInterrupt,
# while it runs; () outside one. A process forked meanwhile does not keep that (_forked).
_guarded: tuple[int, ...] = ()
_guard_pid = 0  # the process whose block that is


def _forked() -> None:
    """A child forked inside a terminate_as_interrupt block (a library's worker pool: datasets'
    map encoding the corpus with data.num_proc > 1) dies of its signals as by default and leaves
    Ctrl-C to its parent, as mt's own workers do (``mt.subwords``, ``mt.workers``). A pool ends
    its workers with SIGTERM (Pool.terminate) and waits: with the parent's handler a worker
    raised KeyboardInterrupt, which datasets' clean-up turned into an error the pool's loop
    caught, and it waited for a task forever: mt-train hung after a SIGTERM. On Ctrl-C, which a
    terminal sends to the whole group, each worker printed a traceback before mt-train's line."""
    global _guarded
    signals, _guarded = _guarded, ()
    if not signals:
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in signals:
        if signal.getsignal(s) is _raise_terminated:
            signal.signal(s, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forked)


# The terminal closed, or the ssh session dropped (where there is such a signal: not on Windows).
HANGUP: tuple[int, ...] = (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()


@contextmanager
def terminate_as_interrupt(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """SIGTERM (``timeout``, ``kill``, a job scheduler), or each of ``signals``, ends the work as
    Ctrl-C does, so that what cleans up after an interrupt runs (a partial output file removed,
    a temporary folder beside mt-export's --out deleted). Only the main thread can set a signal
    handler; a signal the parent ignores (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _guarded, _guard_pid
    _guard_pid = os.getpid()
    previous = {s: signal.signal(s, _raise_terminated) for s in signals
                if signal.getsignal(s) is not signal.SIG_IGN}  # the parent's choice stands
    outer, _guarded = _guarded, tuple({*_guarded, *previous})
    try:
        yield
    finally:  # a handler set outside Python reads as None: put back the default then
        _guarded = outer
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
