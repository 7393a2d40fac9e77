"""Line-parallel text files for ``translate``: read as needed, checked with the file and line
named, and an output file that appears under its name only once it is whole.

A file of millions of lines is never held whole: it is read a line at a time and handed on in
chunks. A regular file can be read twice, so it is checked whole (UTF-8, line count) before any
work; stdin, a pipe or a process substitution (``<(...)``) can be read only once, so it is
checked as it is read.
"""

from __future__ import annotations

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
    """The lines of a file, or of stdin for None or '-', read as they are needed."""
    if is_stdin(path):
        yield from _lines(sys.stdin.buffer, "<stdin>", errors)
        return
    try:
        f = open(path, "rb")
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    with f:
        yield from _lines(f, path, errors)


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


@contextmanager
def atomic_output(path: str | None) -> Iterator[TextIO]:
    """stdout, or a file that appears under its name only once whole.

    A regular file (or a new one, or one a symlink points to) is written as ``PATH.partial`` beside
    it and renamed over it at the end, keeping an existing file's permissions: a file under the
    name given always has one line per input line, and a failed or interrupted run leaves neither.
    Anything else (``/dev/null``, ``/dev/stdout``, a named pipe) is written directly: renaming over
    it would replace the device or pipe with a plain file.
    """
    if path is None or path == "-":
        yield sys.stdout
        return
    target = Path(path).resolve()  # through symlinks: the link stays, its file is replaced
    try:
        mode = target.stat().st_mode if target.exists() else None
    except OSError as err:
        raise InputError(f"{path}: cannot write ({err.strerror})") from None
    if mode is not None and not stat.S_ISREG(mode):
        try:
            f = open(path, "w", encoding="utf-8")
        except OSError as err:
            raise InputError(f"{path}: cannot write ({err.strerror})") from None
        with f:
            yield f
        return
    partial = target.with_name(target.name + ".partial")
    try:
        f = open(partial, "w", encoding="utf-8")
    except OSError as err:
        raise InputError(f"{partial}: cannot write ({err.strerror})") from None
    try:
        with f:
            yield f
        if mode is not None:
            shutil.copymode(target, partial)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
