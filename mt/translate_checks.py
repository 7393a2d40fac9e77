"""What ``translate`` refuses before it loads the model, each in one line that names the option
or file: options that cannot combine or have no effect, an ``-o`` that is one of the files it
reads, one stream (stdin, a pipe) given for two inputs, and side files whose line count differs
from the input's. Translating for an hour and then failing, or writing over the input, loses
work."""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys

from mt.checkpoint import resolved
from mt.inference import device_mistake
from mt.options import (
    flags_mistake,
    min_len_budget_warning,
    unused_options,
    weights_mistake,
)
from mt.textio import InputError, count_lines

log = logging.getLogger("mt.translate")


def check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuses options that cannot run (SystemExit) and warns of those that have no effect.
    Combinations that cannot work are refused before values out of range: a range's message
    asks for another value (--mbr --score: "needs --beam 16"), which would not help."""
    if args.mbr and args.score:
        raise SystemExit("translate: --mbr chooses among translations it searches; it does not "
                         "combine with --score")
    # The sampling flags too: refused later without --sampling, their message asked to add it,
    # which --score then refused.
    shaped = [flag for flag, on in (
        ("--temperature", args.temperature != parser.get_default("temperature")),
        ("--top-k", args.top_k != parser.get_default("top_k")),
        ("--top-p", args.top_p != parser.get_default("top_p")),
        ("--epsilon", args.epsilon != parser.get_default("epsilon"))) if on]
    if args.score is not None and (args.sampling or args.nbest != 1 or args.prefix_file
                                   or args.constraints_file or args.shortlist or args.replace_unk
                                   or shaped):
        raise SystemExit("translate: --score scores given translations; it does not combine with "
                         "--sampling (or its --temperature, --top-k, --top-p, --epsilon), "
                         "--nbest, --prefix-file, --constraints-file, --shortlist or "
                         "--replace-unk")
    mistake = flags_mistake(args) or device_mistake(args.device)
    if mistake:
        raise SystemExit(f"translate: {mistake}")
    if args.weights is not None:  # one model too: a count that differs is a mistake, not unused
        n = len(args.model)
        mistake = weights_mistake(args.weights, n, f"{n} model{'s' if n > 1 else ''} (-m)")
        if mistake:
            raise SystemExit(f"translate: {mistake}")
    unused = unused_options(args, parser)
    if args.weights is not None and len(args.model) == 1:
        unused.append("--weights has no effect with one model")
    if args.no_pack and (args.dtype in ("int8", "float16") or not args.device.startswith("cpu")):
        unused.append(f"--no-pack has no effect with --dtype {args.dtype} on {args.device} (only "
                      "float32 and bfloat16 layers on a CPU are packed)")
    for warning in unused:
        log.warning(warning)
    if warning := min_len_budget_warning(args):
        log.warning(warning)
    if args.constraints_file and (args.sampling or args.beam < 2):
        raise SystemExit("translate: --constraints-file needs beam search with --beam 2 or more "
                         "(a beam of 1 has no room for a hypothesis that places a phrase)")


def _read_files(args: argparse.Namespace, parallel: dict[str, str]
                ) -> list[tuple[str, str, os.stat_result]]:
    """(option, name, stat) of every file translate reads, the input first; stdin (no -i, or
    -i -) is its file descriptor's. A file that cannot be stat'ed (no such file: said later; no
    stdin at all) is left out."""
    out = []
    for option, path in (("-i", args.input), *parallel.items()):
        try:
            if path in (None, "-"):
                out.append((option, "-", os.fstat(sys.stdin.fileno())))
            else:
                out.append((option, path, os.stat(path)))
        except (OSError, ValueError, AttributeError):  # AttributeError: stdin closed (<&-)
            continue
    return out


def refuse_overwrite(args: argparse.Namespace, parallel: dict[str, str]) -> None:
    """SystemExit when the output is a file that translate reads: -o naming the input, a side
    file, a model or the shortlist (the translations would replace it), or stdout appended to
    one (``translate -i in.txt >> in.txt``: each chunk written would be read back as more input,
    without end)."""
    if args.output is None:
        out = _stdout_file()
    else:
        out = os.stat(args.output) if os.path.exists(args.output) else None
    if out is None:
        return
    written = "scores" if args.score is not None else "translations"
    for option, path, read in _read_files(args, parallel) + _model_files(args):
        if (read.st_dev, read.st_ino) != (out.st_dev, out.st_ino):
            continue
        name = "input (stdin)" if (option, path) == ("-i", "-") else option
        if args.output is not None:
            raise SystemExit(f"translate: -o {args.output} is the {name} file; the "
                             f"{written} would replace it: write them elsewhere")
        where = f" ({path})" if path != "-" else ""
        if out.st_size == 0 and not _appending(sys.stdout):
            # `> FILE`: the shell emptied it before we started; saying what "would" happen
            # let the user believe the text was still there
            raise SystemExit(f"translate: stdout is the {name} file{where}, which the shell's "
                             "'>' emptied before translate started (its text is gone: restore "
                             "it); write the output to another file")
        harm = "be read back as input" if option == "-i" else "be written into it"
        raise SystemExit(f"translate: stdout is the {name} file{where}; the {written} would "
                         f"{harm}: write them elsewhere")


def _appending(stream) -> bool:
    """Whether ``stream`` was opened for appending (``>> FILE``), not truncated (``> FILE``)."""
    try:
        import fcntl  # not on Windows

        return bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (ImportError, OSError, ValueError, AttributeError):
        return True  # unknown: say nothing about a truncation


def _stdout_file() -> os.stat_result | None:
    """The stat of stdout where it is a regular file (``> out.txt``, ``>> out.txt``); None for
    a terminal, a pipe, or no stdout."""
    try:
        out = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return out if stat.S_ISREG(out.st_mode) else None


def _model_files(args: argparse.Namespace) -> list[tuple[str, str, os.stat_result]]:
    """(option, name, stat) of the checkpoints (-m, a run directory's as translate picks it) and
    the --shortlist file; those that cannot be found are left out (loading says why)."""
    files = [("-m", resolved(m)) for m in args.model] + [("--shortlist", args.shortlist)]
    return [(option, str(file), os.stat(file)) for option, file in files
            if file and os.path.exists(file)]


def refuse_shared_streams(args: argparse.Namespace, parallel: dict[str, str]) -> None:
    """SystemExit when two of the files read line by line are one stream (stdin twice, one pipe
    or FIFO twice): each would take every other line, and lines would be paired with the wrong
    ones. A regular file given twice is read twice, from its start each time: that is fine."""
    seen: dict[tuple[int, int], str] = {}
    for option, path, read in _read_files(args, parallel):
        if stat.S_ISREG(read.st_mode) and path != "-":  # stdin is one stream, even `< file`
            continue
        name = f"{option} {path}" if path != "-" else (
            "the input (stdin)" if option == "-i" else f"{option} - (stdin)")
        key = (read.st_dev, read.st_ino)
        if key in seen:
            raise SystemExit(f"translate: {name} and {seen[key]} are one stream, which cannot "
                             "be read twice: give one of them as a file")
        seen[key] = name


def count_input(args: argparse.Namespace, parallel: dict[str, str]) -> int | None:
    """The input's lines (None where it cannot be counted ahead: a pipe), with each side file
    checked to have as many: a regular file's mistakes stop translate before any work."""
    try:
        total = count_lines(args.input, args.errors)
        for path in parallel.values():
            n = count_lines(path, args.errors)
            if None not in (n, total) and n != total:
                raise InputError(f"{path}: {n} lines, but the input has {total}; one line per "
                                 "input line")
    except InputError as err:
        raise SystemExit(f"translate: {err}") from None
    return total
