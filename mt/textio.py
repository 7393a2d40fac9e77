"""Line-parallel text files for ``translate``: read as needed, checked with the file and line
named, and an output file that appears under its name only once it is whole.

A file of millions of lines is never held whole: it is read a line at a time and handed on in
chunks. A regular file can be read twice, so it is checked whole (UTF-8, line count) before any
work; stdin, a pipe or a process substitution (``<(...)``) can be read only once, so it is
checked as it is read.
"""

from __future__ import annotations

import gzip
import io
import itertools
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO


class InputError(Exception):
    """A problem with the user's input files: the message names the file and line."""


def _lines(stream: BinaryIO, name: str, errors: str) -> Iterator[str]:
    """The lines of a byte stream, decoded one at a time (a final newline ends the last line; it
    does not start a new one); invalid UTF-8 stops with the file's name and the line number."""
    for lineno, raw in enumerate(stream, start=1):
        try:
            yield raw.removesuffix(b"\n").decode("utf-8", errors=errors).rstrip("\r")
        except UnicodeDecodeError as err:
            raise InputError(f"{name}:{lineno}: invalid UTF-8 ({err.reason}); "
                             "use --errors replace to translate it anyway") from None


def is_stdin(path: str | None) -> bool:
    return path is None or path == "-"


def read_lines(path: str | None, errors: str = "strict") -> Iterator[str]:
    """The lines of a file, or of stdin for None or '-', read as they are needed; a file named
    ``*.gz`` is decompressed on the way (large corpora are kept gzipped)."""
    if is_stdin(path):
        yield from _lines(sys.stdin.buffer, "<stdin>", errors)
        return
    try:
        f = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    with f:
        try:
            yield from _lines(f, path, errors)
        except (OSError, EOFError) as err:  # a corrupt or truncated .gz shows only when read
            raise InputError(f"{path}: cannot read ({err})") from None


def count_lines(path: str | None, errors: str = "strict") -> int | None:
    """Lines in a regular file, every one checked for UTF-8, so that its mistakes stop before any
    work; None for stdin, a pipe or a device, which reading here would consume."""
    if is_stdin(path):
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    return sum(1 for _ in read_lines(path, errors))


def parallel_lines(first: Iterator[str], others: list[tuple[str, Iterator[str]]],
                   ) -> Iterator[tuple[str, ...]]:
    """Line i of every stream together; a stream that ends before or after the first one stops
    with its name (for files that could not be counted beforehand)."""
    for row in itertools.zip_longest(first, *(lines for _, lines in others)):
        for (name, _), line in zip(others, row[1:], strict=True):
            if line is None or row[0] is None:
                which = "fewer" if line is None else "more"
                raise InputError(f"{name}: {which} lines than the input; one line per input line")
        yield row


def chunks(items: Iterator, size: int) -> Iterator[list]:
    """Successive lists of ``size`` items (the last one shorter)."""
    while chunk := list(itertools.islice(items, size)):
        yield chunk


STDOUT_NAMES = ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def _written_directly(path: str) -> bool:
    """Whether ``path`` is written in place rather than through a partial file renamed over it:
    anything that exists and is not a regular file (a device, a named pipe), and anything under
    /dev or /proc (``/dev/stderr`` or ``>(...)`` name a descriptor whose target a rename would
    replace or cannot reach)."""
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False  # a new file (or a dangling symlink: its target is created)
    except OSError as err:
        raise InputError(f"{path}: cannot write ({err.strerror})") from None


def check_output(path: str | None) -> None:
    """Stops before any work if ``path`` cannot be written (atomic_output's way)."""
    if path is None or path in STDOUT_NAMES:
        return
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory")
    if _written_directly(path):
        if not os.access(path, os.W_OK):
            raise InputError(f"{path}: cannot write (permission denied)")
        return
    parent = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise InputError(f"{path}: cannot write there (no such writable directory)")


@contextmanager
def atomic_output(path: str | None) -> Iterator[TextIO]:
    """stdout, or a file that appears under its name only once whole.

    A regular file (or a new one, or the file a symlink points to) is written as ``PATH.partial``
    beside it (gzipped for a name ending in ``.gz``) and renamed over it at the end, keeping an
    existing file's permissions: a file under the name given always has one line per input line,
    and a failed or interrupted run leaves neither. ``PATH.partial`` is created afresh (never
    through a link, never shared with another run writing PATH). Devices, named pipes and /dev
    or /proc paths are written in place (see ``_written_directly``).
    """
    if path is None or path in STDOUT_NAMES:
        yield sys.stdout
        return
    if _written_directly(path):
        try:
            f = open(path, "w", encoding="utf-8")
        except OSError as err:
            raise InputError(f"{path}: cannot write ({err.strerror})") from None
        with f:
            yield f
        return
    target = os.path.realpath(path)  # through symlinks: the link stays, its file is replaced
    partial = target + ".partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
    except FileExistsError:
        raise InputError(f"{partial} exists: another translate is writing {path}, or a killed "
                         "one left it; remove it and run again") from None
    except OSError as err:
        raise InputError(f"{partial}: cannot write ({err.strerror})") from None
    try:
        with open(fd, "wb") as raw, (gzip.open(raw, "wt", encoding="utf-8")
                                     if target.endswith(".gz")
                                     else io.TextIOWrapper(raw, encoding="utf-8")) as f:
            yield f
        if os.path.exists(target):
            shutil.copymode(target, partial)
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
