"""Line-parallel text files for ``translate``: read as needed, checked with the file and line
named, and an output file that appears under its name only once it is whole.

A file of millions of lines is never held whole: it is read a line at a time and handed on in
chunks. A regular file can be read twice, so it is checked whole (UTF-8, line count) before any
work; stdin, a pipe or a process substitution (``<(...)``) can be read only once, so it is
checked as it is read.
"""

from __future__ import annotations

import codecs
import errno
import gzip
import io
import itertools
import os
import shutil
import stat
import sys
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO, cast


class InputError(Exception):
    """A problem with the user's input files: the message names the file and line."""


def carriage_returns_only(raw: bytes, lineno: int) -> str | None:
    """Why a file is not to be read, in words, when its first line read as bytes is the whole
    file and holds carriage returns inside: its lines end in ``\\r`` alone (old Mac files), and
    read as one line they would be translated or trained on as one sentence. None otherwise; a
    ``\\r`` inside one line of a file with line feeds is text (web corpora have them)."""
    if lineno == 1 and not raw.endswith(b"\n") and b"\r" in raw.rstrip(b"\r"):
        return ("its lines end in a carriage return (\\r) alone, so it would read as one line; "
                "convert it first: tr '\\r' '\\n' < FILE > NEW")
    return None


# U+FEFF, the byte-order mark that "UTF-8 with BOM" files start with. At the start of a line it
# is never text: a file's own, or the second file's of `cat a.txt b.txt`, now in mid-file.
BOM = "\ufeff"

# A file saved as UTF-16 (Windows PowerShell's '>' writes one) or UTF-32 starts with its
# byte-order mark; read as UTF-8 it was "invalid at byte 0", and --errors replace split it into
# garbage lines (its line end is two or four bytes), one more than it holds. Longest first: a
# UTF-32LE mark starts with UTF-16LE's. No UTF-8 text starts with any of them.
WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
             (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def wide_text(raw: bytes) -> str | None:
    """What to say of a line that starts with a UTF-16 or UTF-32 byte-order mark (the file is in
    that encoding, named in the ``iconv`` command that converts it), or None."""
    for mark, encoding in WIDE_BOMS:
        if raw.startswith(mark):
            return (f"{encoding} text (it starts with a {encoding} byte-order mark), not UTF-8; "
                    f"convert it first: iconv -f {encoding} -t UTF-8 FILE > NEW")
    return None


def utf8_text(raw: bytes) -> str:
    """A line's bytes as text without its line end (``\\n``, ``\\r\\n``) and without byte-order
    marks before it (``BOM``: kept, the identity and nfkc normalizations, which keep it, made
    the line's first piece <unk>; a tagged back-translation's tag was not seen, and tagged
    again); invalid UTF-8 raises ValueError in the words that translate, mt-eval and mt-train
    share: the reason and the byte's offset, in the line without its end. (Decoded with the
    end, a character cut short just before it read as "invalid continuation byte" to one command
    and "unexpected end of data" to another.)"""
    line = raw.removesuffix(b"\n").rstrip(b"\r")
    try:
        return line.decode("utf-8").lstrip(BOM)
    except UnicodeDecodeError as err:  # (no UTF-8 line starts with a wide mark: looked for here)
        raise ValueError(wide_text(raw)
                         or f"invalid UTF-8 ({err.reason} at byte {err.start})") from None


def decode_line(raw: bytes, name: str, lineno: int, errors: str = "strict") -> str:
    """One line read as bytes, as text without its line end (nor a byte-order mark before it,
    as ``utf8_text``); invalid UTF-8 raises InputError
    with the file's name and the line number (``errors="replace"``: U+FFFD instead), and so
    does a file whose lines end in ``\\r`` alone (``carriage_returns_only``)."""
    if (mistake := carriage_returns_only(raw, lineno)) is not None:
        raise InputError(f"{name}:{lineno}: {mistake}")
    if errors != "strict":
        if (wide := wide_text(raw)) is not None:  # no --errors can align its lines
            raise InputError(f"{name}:{lineno}: {wide}")
        return raw.removesuffix(b"\n").decode("utf-8", errors=errors).rstrip("\r").lstrip(BOM)
    try:
        return utf8_text(raw)
    except ValueError as err:
        advice = "" if wide_text(raw) else "; use --errors replace to read it anyway"
        raise InputError(f"{name}:{lineno}: {err}{advice}") from None


def _lines(stream: BinaryIO, name: str, errors: str) -> Iterator[str]:
    """The lines of a byte stream, decoded one at a time (a final newline ends the last line; it
    does not start a new one); invalid UTF-8 stops with the file's name and the line number."""
    for lineno, raw in enumerate(stream, start=1):
        yield decode_line(raw, name, lineno, errors)


def is_stdin(path: str | None) -> bool:
    return path is None or path == "-"


def is_regular(path: str | None) -> bool:
    """Whether ``path`` names a regular file, which can be read twice (once to check it); stdin
    ('-', even beside a file named '-'), a pipe or a device cannot. Raises InputError if it
    cannot be read."""
    if is_stdin(path):
        return False
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The existing file that one of ``path``'s folders would have to be (``notes.txt/out``):
    making the folders fails with "File exists", which reads as if ``path`` itself existed."""
    for folder in Path(path).parents:  # the nearest first
        if folder.exists():
            return None if folder.is_dir() else folder
    return None


def blank_name_mistake(flag: str, path: str | os.PathLike, what: str = "file") -> str | None:
    """An output name that is empty (``--out "$UNSET"``: the working directory, said as
    "--out  is a directory") or only whitespace, in words; None for any other. A name of spaces
    is a legal name, but one that no listing shows and seldom one meant (it was called empty):
    it is said as what it is, with the way to write it all the same (``./`` before it)."""
    if not str(path):
        return f"{flag} is empty; name the {what} to write"
    if not str(path).strip():
        return (f"{flag} {str(path)!r} is only whitespace (an unset shell variable between "
                f"spaces?); name the {what} to write, or give {flag} {'./' + str(path)!r} for "
                "one of that name")
    return None


def output_mistake(flag: str, path: str, force: bool, reads: Iterable[str | os.PathLike] = (),
                   read_as: str = "a file it reads", what: str = "file",
                   folder_made: bool = True) -> str | None:
    """Why a command must not write ``flag path``, in words; None if it may. A directory (or a
    name ending in '/', a folder not yet made: written as a file of that name); a folder that
    does not exist, where the command does not make it (``folder_made=False``); one of the
    files it ``reads`` (said as ``read_as``), even with ``force``; any other existing file
    without ``force``."""
    if blank := blank_name_mistake(flag, path, what):
        return blank
    out = Path(path)
    if out.is_dir() or str(path).endswith(os.sep):
        return f"{flag} {path} is a directory; name the {what} to write"
    if blocker := file_in_the_way(path):
        return f"{flag} {path}: {blocker} is a file, not a directory"
    if not folder_made and not out.parent.is_dir():
        return f"{flag} {path}: no such directory {out.parent}"
    if not out.exists():
        return None
    if any(os.path.exists(f) and out.samefile(f) for f in reads):
        return f"{flag} {path} is {read_as}; write it elsewhere"
    if not force:
        return f"{path} exists; choose another {flag} or pass --force to replace it"
    return None


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
        except (OSError, EOFError, zlib.error) as err:  # a broken .gz shows only when read
            raise InputError(f"{path}: cannot read ({err})") from None


def count_lines(path: str | None, errors: str = "strict") -> int | None:
    """Lines in a regular file, every one checked for UTF-8, so that its mistakes stop before any
    work; None for stdin, a pipe or a device, which reading here would consume."""
    if not is_regular(path):
        return None
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
# Names of a process's descriptors: what they point to is not a file to rename over (a pipe,
# a terminal, or the file a shell redirection appends to).
_DESCRIPTORS = ("/dev/stdin", "/dev/stdout", "/dev/stderr")
_DESCRIPTOR_DIRS = ("/dev/fd/", "/proc/")


def _written_directly(path: str) -> bool:
    """Whether ``path`` is written in place rather than through a partial file renamed over it:
    a descriptor's name (``/dev/stderr``, ``>(...)``), or anything that exists and is not a
    regular file (a device such as /dev/null, a named pipe)."""
    name = os.path.abspath(path)
    if name in _DESCRIPTORS or name.startswith(_DESCRIPTOR_DIRS):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False  # a new file (or a dangling symlink: its target is created)
    except OSError as err:
        raise InputError(f"{path}: cannot write ({err.strerror})") from None


def _partial(path: str) -> str:
    """The partial file beside the file ``path`` names (through symlinks: the link stays)."""
    return os.path.realpath(path) + ".partial"


def check_output(path: str | None) -> None:
    """Stops before any work if ``path`` cannot be written the way atomic_output writes it."""
    if path is None or path in STDOUT_NAMES:
        return
    if not path:
        raise InputError("-o: an empty file name")
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory")
    if path.endswith(os.sep):  # a folder not yet made: realpath would drop the '/'
        raise InputError(f"{path}: names a directory; give the file to write")
    if _written_directly(path):
        if not os.access(path, os.W_OK):
            raise InputError(f"{path}: cannot write (permission denied)")
        return
    parent = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise InputError(f"{path}: cannot write there (no such writable directory)")
    if os.path.lexists(_partial(path)):
        raise InputError(_LEFTOVER.format(partial=_partial(path), path=path))


def nearest_existing(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists: where making it would start, and
    so what must be writable."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


_LEFTOVER = ("{partial} exists: another translate is writing {path}, or a killed one left it; "
             "remove it and run again")


def _text_writer(raw: BinaryIO, gzipped: bool) -> TextIO:
    """UTF-8 text onto ``raw``, through gzip (level 6 as the gzip command, no timestamp: the same
    lines give the same bytes) for a name ending in ``.gz``."""
    if gzipped:
        raw = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0)
    return io.TextIOWrapper(raw, encoding="utf-8")


class _Utf8Writer:
    """Text written as UTF-8 onto a byte stream that is not its own (stdout's buffer).

    Not an io.TextIOWrapper: that one closes its stream when it is collected, and cannot let go
    of it (``detach``) without flushing, which fails once the reader has left (``| head``). Here
    the bytes wait in stdout's own buffer as before (or, under PYTHONUNBUFFERED, go to the file
    at once, all of them), so a reader that leaves fails the same write or flush, and Python's
    last flush at exit goes where ``translate`` sends it.
    """

    def __init__(self, stream: BinaryIO, line_buffering: bool) -> None:
        self.buffer, self.line_buffering = stream, line_buffering

    def write(self, text: str) -> int:
        data = memoryview(text.encode("utf-8"))
        while data:  # a raw file (PYTHONUNBUFFERED) may take part; a buffered one takes all
            written = self.buffer.write(data)
            if not written:  # None: a non-blocking stdout is full, as a buffered one raises
                raise BlockingIOError(errno.EAGAIN, "stdout is full (non-blocking)")
            data = data[written:]
        if self.line_buffering and "\n" in text:
            self.buffer.flush()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.buffer.flush()


def reader_left(said: str | None = None) -> SystemExit:
    """The exit to raise on a BrokenPipeError from stdout (``cmd | head``), or another failure
    to write it (``said``, its one line: ``> /dev/full``): no traceback, and stdout pointed at
    /dev/null so that Python's flush at exit fails no more (Python's docs, "Note on SIGPIPE")."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return SystemExit(said or 1)


def utf8_stdout() -> TextIO:
    """stdout for text that must be UTF-8 whatever the locale or PYTHONIOENCODING say
    (translations: input is always read as UTF-8 and ``-o FILE`` written so; a latin-1 stdout
    would garble them and an ASCII one fail on the first umlaut). sys.stdout itself where it is
    UTF-8 already and buffered, or has no bytes underneath (a caller's StringIO); else a UTF-8
    writer onto its buffer, line-buffered where sys.stdout is (a terminal).

    Under ``PYTHONUNBUFFERED=1`` (``python -u``, common in containers) stdout's buffer is the raw
    file, whose write may take only part of the bytes (a pipe whose reader left, a signal, a full
    disk), and sys.stdout drops the rest without a word (CPython 3.11: exit status 0 after a lost
    chunk of translations): the writer here writes the rest, or raises."""
    out = sys.stdout
    if not hasattr(out, "buffer") or (codecs.lookup(out.encoding or "ascii").name == "utf-8"
                                      and not isinstance(out.buffer, io.RawIOBase)):
        return out
    out.flush()  # what was printed before comes first
    return cast(TextIO, _Utf8Writer(out.buffer, out.line_buffering))


def replace_file(path: Path, data: str | bytes) -> None:
    """Writes a small file whole under a temporary name beside ``path`` (``.NAME.PID.tmp``), then
    renames it over ``path``: a file under the name is always whole (a kill mid-write leaves the
    old one, or none, and a stray temporary). Text is written as UTF-8, line ends as given; the
    file gets a new file's permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException as err:  # a full disk or a kill: no stray part-file left behind
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and not err.filename:
            raise OSError(err.errno, err.strerror, str(path)) from None  # name the file
        raise


@contextmanager
def atomic_output(path: str | None) -> Iterator[TextIO]:
    """stdout (as UTF-8: ``utf8_stdout``), or a file that appears under its name only once whole.

    A regular file (or a new one, or the file a symlink points to) is written as ``PATH.partial``
    beside it and renamed over it at the end, keeping an existing file's permissions: a file
    under the name given always has one line per input line, and a failed or interrupted run
    leaves neither. ``PATH.partial`` is created afresh (never through a link, never shared with
    another run writing PATH). Devices, named pipes and descriptors' names are written in place
    (``_written_directly``). A name ending in ``.gz`` (the name given, not a link's target) is
    written gzipped, as ``read_lines`` reads it.
    """
    if path is None or path in STDOUT_NAMES:
        yield utf8_stdout()
        return
    gzipped = path.endswith(".gz")
    if _written_directly(path):
        try:  # appending: a descriptor's file (2>>log) keeps what it holds, as the shell meant
            raw = open(path, "ab")
        except OSError as err:
            raise InputError(f"{path}: cannot write ({err.strerror})") from None
        with raw, _text_writer(raw, gzipped) as f:
            yield f
        return
    partial = _partial(path)
    target = partial.removesuffix(".partial")
    fd = -1
    try:  # one try from the creation on: a signal (translate's SIGTERM) just after it is ours too
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        with open(fd, "wb") as raw, _text_writer(raw, gzipped) as f:
            yield f
        if os.path.exists(target):
            shutil.copymode(target, partial)
        os.replace(partial, target)
    except BaseException as err:
        if fd < 0 and isinstance(err, FileExistsError):  # a killed run's, or another run's
            raise InputError(_LEFTOVER.format(partial=partial, path=path)) from None
        Path(partial).unlink(missing_ok=True)
        if fd < 0 and isinstance(err, OSError):
            raise InputError(f"{partial}: cannot write ({err.strerror})") from None
        raise


def text_list(lines: Iterable[str], name: str) -> list[str]:
    """``lines`` (any iterable: a list, a tuple, a generator) as a list of str. One string would
    be read as one line per character, and an item that is not a string failed deep inside
    SentencePiece: both are a TypeError naming the argument."""
    if isinstance(lines, str):
        raise TypeError(f"{name}: a list of strings, not one string (give [{name}])")
    if not isinstance(lines, Iterable):
        raise TypeError(f"{name}: a list of strings, not {type(lines).__name__}")
    lines = list(lines)
    for i, line in enumerate(lines):
        if not isinstance(line, str):
            raise TypeError(f"{name}[{i}] is {type(line).__name__}, not str")
        try:  # a lone surrogate ("\ud800", from a bad decode) failed inside SentencePiece
            line.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{name}[{i}] holds a lone surrogate ({line[err.start]!r} at "
                            f"character {err.start}), which is no text: decode its bytes with "
                            "errors='replace'") from None
    return lines


def fill_closed_descriptors(quiet_stdout: bool = False) -> None:
    """Opens /dev/null on whichever of descriptors 0-2 the caller closed (``<&-``, ``2>&-``, a
    service started that way), as daemons do: else the next file opened (the output's partial
    file, a model) would take the lowest free one and receive what C++ code or a worker writes to
    stderr. Python's ``sys.std*`` stay None for the closed ones, which a command then refuses to
    read or write (translate: "stdout is closed; give the output file with -o FILE"), except
    stderr, whose logs and progress bars go to /dev/null: without it ``mt-train 2>&-`` died
    silently inside Hydra. ``quiet_stdout``: stdout too, for a command whose stdout only
    reports (mt-train's summary), so that closing it means "not wanted"."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the process's life
    if quiet_stdout and sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def json_object(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the file for text that is not JSON, or
    JSON that is not an object (a damaged or hand-edited file)."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # UnicodeDecodeError too
        raise ValueError(f"{path}: not a JSON object ({first_line(err)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object (a JSON {type(value).__name__})")
    return value


def first_line(err: BaseException) -> str:
    """An exception's message for a one-line error: its first line (libraries put tracebacks of
    their own, C++ ones included, below it), or its type's name when it says nothing."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
