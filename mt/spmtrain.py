"""SentencePiece training (``train_one``: mt's settings) in a spawned child process, which a stop
signal can end at once.

``SentencePieceTrainer.train`` runs in C++ for minutes on a large corpus, and Python runs a
signal's handler only when it returns: Ctrl-C looked ignored, and a scheduler's SIGTERM ended in
its SIGKILL after the grace period. Here the training runs in a fresh interpreter
(``python -c`` importing this module, never torch), and this process waits on pipes, where a
handler runs as the signal comes: the child is killed and the signal's exception goes on
(mt-train's "terminated (SIGTERM) before the first checkpoint"). Nothing is saved until the model
is back, so nothing half-written is left.

Spawned, not forked: SentencePiece trains with OpenMP (the libgomp torch ships), and a child
forked from a process whose OpenMP pool was alive (after torch's CPU work) waited forever in
GOMP_parallel for pool threads that did not survive the fork (commit 319c87e).

The protocol: on the child's stdin a pickled header ``(seed, options, count)`` then ``count``
sentences, each a 4-byte little-endian length and its UTF-8, read by a generator that
SentencePiece consumes (no list of them in the child); on its stdout one pickled answer:
``("model", bytes)``, ``("raised", exception)`` (SentencePiece's own error, raised here as
in-process training raised it) or ``("failed", text)``. Its stderr is this process's, as
SentencePiece's log was. The model is the same, byte for byte, as one trained in this process:
the same call, options and seed. Where there is no POSIX ``select`` on pipes or no interpreter
to spawn, the training runs in this process, as before.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import selectors
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from mt.config import BOS_ID, BYTE_PIECES, EOS_ID, PAD_ID, UNK_ID, TokenizerConfig
from mt.pdeathsig import die_with

SPAWN = os.name == "posix"
# Ctrl-C reaches the terminal's whole process group, a scheduler's SIGTERM maybe every process
# of the job: the child ignores them from birth and this process, which handles them, kills it
# (a child dying of them first would be "the training process was killed" instead of mt-train's
# "terminated").
STOPS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
              if hasattr(signal, name))
_LENGTH = struct.Struct("<I")
_CHUNK = 1 << 20  # bytes written to the child at a time
# The child's program: argv[1] the directory that holds the mt this process runs (whatever the
# working directory), argv[2] this process's id, argv[3:] this process's sys.path, which becomes
# the child's (as multiprocessing's spawn does): "python -c" put the working directory first, so
# a random.py or token.py there (not on this process's path) broke the child's imports, and a
# PYTHONPATH that "python -I" ignored here could give the child another SentencePiece
_CHILD = ("import sys; sys.path[:] = [sys.argv[1], *sys.argv[3:]]; "
          "from mt.spmtrain import child_main; child_main(int(sys.argv[2]))")


class TrainingProcessFailed(ValueError):
    """The child ended without a model or SentencePiece's error: killed, or an error of its own.
    A ValueError, which mt-train says in one line."""


def train_one(sentences: list[str], cfg: TokenizerConfig, seed: int,
              user_symbols: Sequence[str] = (), side: str = "") -> bytes:
    """A SentencePiece model of ``sentences`` with mt's special ids, trained in a child process
    (``train_model``); ``side`` ("source ", "target " for separate vocabularies) names the text
    whose vocabulary is too small in the error."""
    if not sentences:  # which side, and where from: a blank target file named neither
        raise ValueError(f"no non-empty {side}sentence to train SentencePiece on in the sample of "
                         "data.train (up to data.tokenizer.input_sentence_size="
                         f"{cfg.input_sentence_size} sentences): is that side of the corpus blank?")
    # With the '▁' that SentencePiece puts before every word, a symbol at a sentence's start (where
    # data.tag goes) is one piece, and the first. The sample may hold tagged sources: a user
    # symbol is cut out of the text before pieces are learned, so it bends no other piece.
    symbols = ({"user_defined_symbols": ["\u2581" + u for u in dict.fromkeys(user_symbols)]}
               if user_symbols else {})  # (a symbol given twice is one: SentencePiece refused it)
    try:
        return train_model(
            seed, sentences,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            byte_fallback=cfg.byte_fallback,  # 256 pieces <0x00>..<0xFF> in the vocabulary
            normalization_rule_name=cfg.normalization,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            # A vocabulary on a small corpus may be larger than the text supports; shrink instead
            # of failing (SentencePiece picks the largest size it can; valid for unigram and bpe).
            hard_vocab_limit=False,
            input_sentence_size=0,  # all of them: we sampled already
            # Every sampled line, however long: past max_sentence_length (4,192 bytes by
            # default) SentencePiece skips a line without a word, and characters found only in
            # long lines (a document-level corpus) got no piece.
            max_sentence_length=max(4192, 1 + max(len(s.encode("utf-8")) for s in sentences)),
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **symbols,
        )
    except RuntimeError as err:  # "Vocabulary size is smaller than required_chars. 300 vs 304."
        need = re.search(r"required_chars\. \d+ vs (\d+)", str(err))
        if not need:
            raise
        parts = "its characters, 4 special ids" + (", user symbols" if user_symbols else "")
        if cfg.byte_fallback:
            parts += f", {BYTE_PIECES} byte pieces: or set data.tokenizer.byte_fallback=false"
        raise ValueError(f"data.tokenizer.vocab_size={cfg.vocab_size}: the {side}text needs at "
                         f"least {need[1]} pieces; raise it or lower "
                         f"data.tokenizer.character_coverage ({parts})") from None


def train_model(seed: int, sentences: Sequence[str], **options) -> bytes:
    """``SentencePieceTrainer.train(sentence_iterator=iter(sentences), **options)``'s model, with
    SentencePiece's random generator seeded with ``seed``, trained in a child process; its
    exceptions are raised here."""
    if not SPAWN or not sys.executable or getattr(sys, "frozen", False):
        # (a frozen application's executable is the application, not an interpreter for -c)
        return train_here(seed, sentences, options)
    header = pickle.dumps((seed, options, len(sentences)))
    root = str(Path(__file__).resolve().parents[1])  # the mt this process runs, wherever cwd is
    child: subprocess.Popen | None = None
    try:  # from the spawn on: a signal held over it runs its handler as the block ends
        with _held():  # the child inherits the block, until it ignores them
            child = subprocess.Popen([sys.executable, *_interpreter_flags(), "-c", _CHILD, root,
                                      str(os.getpid()), *map(str, sys.path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        answer = _exchange(child, header, sentences)
        status = child.wait()
    except BaseException:
        if child is not None:
            child.kill()
            child.wait()
        raise
    finally:
        if child is not None:
            for pipe in (child.stdin, child.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
    return _unpack(answer, status)


def _interpreter_flags() -> list[str]:
    """This interpreter's command-line flags (-I, -E, -s, -X ..., -W ...), for the child as
    multiprocessing passes them to its spawned processes: "python -I" is isolated from the
    environment's PYTHONPATH and sitecustomize in the child too."""
    try:
        return subprocess._args_from_interpreter_flags()
    except AttributeError:  # (a private helper: an interpreter without it spawns plainly)
        return []


def train_here(seed: int, sentences: Sequence[str], options: dict) -> bytes:
    """The training itself, in this process (the child's, or where there is no child)."""
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # SentencePiece's own sampling, for reproducible models
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                   **options)
    return model.getvalue()


def _exchange(child: subprocess.Popen, header: bytes, sentences: Sequence[str]) -> bytes:
    """Writes the header and sentences to the child, then reads its answer. Each wait is a
    system call that a signal interrupts: its handler runs there (PEP 475) and ends the wait."""
    try:
        child.stdin.write(header)
        buffer = bytearray()
        for sentence in sentences:
            data = sentence.encode("utf-8", "surrogatepass")
            buffer += _LENGTH.pack(len(data)) + data
            if len(buffer) >= _CHUNK:
                child.stdin.write(buffer)
                buffer.clear()
        child.stdin.write(buffer)
        child.stdin.close()
    except BrokenPipeError:  # the child ended early: its status says how
        pass
    parts = []
    fd = child.stdout.fileno()
    with selectors.DefaultSelector() as waiting:  # (select.select refuses a descriptor >= 1024)
        waiting.register(fd, selectors.EVENT_READ)
        while True:
            # a timeout, so that a signal that a thread other than this one took (its handler
            # waits for this thread's next Python line) is seen within a second
            if waiting.select(1.0):
                part = os.read(fd, _CHUNK)
                if not part:
                    return b"".join(parts)
                parts.append(part)


def _unpack(answer: bytes, status: int) -> bytes:
    """The model in the child's answer, or its failure raised: SentencePiece's own error as in
    this process, anything else in one line (``TrainingProcessFailed``)."""
    what = "the SentencePiece training process"
    if not answer:
        if status < 0:
            try:
                name = signal.Signals(-status).name
            except ValueError:  # one without a name (a real-time signal)
                name = f"signal {-status}"
            hint = (": out of memory? lower data.tokenizer.input_sentence_size"
                    if -status == signal.SIGKILL else "")
            raise TrainingProcessFailed(f"{what} was killed by {name}{hint}")
        raise TrainingProcessFailed(f"{what} exited with status {status} without a model "
                                    "(its error, if any, is above)")
    try:
        kind, value = pickle.loads(answer)
    except Exception as err:  # noqa: BLE001 - a torn answer, in words
        raise TrainingProcessFailed(f"{what} answered what is not a model ({err})") from None
    if kind == "model":
        return value
    if kind == "raised":
        raise value
    raise TrainingProcessFailed(f"{what} failed: {value}")


@contextlib.contextmanager
def _held() -> Iterator[None]:
    """The stop signals wait while the child is spawned; as the block ends their handlers run,
    with the child known (and killed). Two holds: this thread blocks them, so that the child is
    born with them blocked (a signal mask survives fork and exec) until it ignores them; and
    their Python handlers only note them meanwhile, since another thread (OpenMP's, gloo's) may
    take a signal this one blocks, and Python would then run the handler in this thread at once,
    inside Popen, before the child is known: a training process nobody ends. Only the main
    thread may set a handler, and only where there is a signal mask (not on Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    noted: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.getsignal(s) for s in STOPS}
        handlers = {s: h for s, h in handlers.items() if callable(h)}  # not SIG_IGN, SIG_DFL
        for s in handlers:
            signal.signal(s, lambda signum, frame: noted.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # (one held runs its handler here)
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)  # its own handler, now: one that came meanwhile


def _sentences(stream: io.BufferedReader, count: int) -> Iterator[str]:
    """The ``count`` sentences on ``stream``, one at a time, as SentencePiece reads them."""
    for _ in range(count):
        size = _LENGTH.unpack(_exactly(stream, _LENGTH.size))[0]
        yield _exactly(stream, size).decode("utf-8", "surrogatepass")


def _exactly(stream: io.BufferedReader, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the input ended {size - len(data)} bytes early")
    return data


def child_main(parent: int) -> None:  # pragma: no cover - runs in the child
    """The child: ignores the stop signals (its parent ends it), reads the header and
    sentences, trains, and writes its answer to the stdout it was given; anything else that
    writes to stdout (a library's print) goes to stderr instead."""
    for s in STOPS:
        signal.signal(s, signal.SIG_IGN)  # (a signal pending from the block is dropped)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    die_with(parent)  # a parent killed outright (SIGKILL) takes the training with it
    answer_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        seed, options, count = pickle.load(sys.stdin.buffer)
        try:
            answer = ("model", train_here(seed, _sentences(sys.stdin.buffer, count), options))
        except (RuntimeError, ValueError, TypeError) as err:  # SentencePiece's: raised there
            answer = ("raised", err)
            try:
                pickle.dumps(err)
            except Exception:  # noqa: BLE001 - one that does not pickle, in words
                answer = ("failed", f"{type(err).__name__}: {err}")
    except Exception as err:  # noqa: BLE001 - the child's own failure, in one line there
        answer = ("failed", f"{type(err).__name__}: {err}")
    with contextlib.suppress(BrokenPipeError):  # a parent gone (no PR_SET_PDEATHSIG there)
        answer_to.write(pickle.dumps(answer))
        answer_to.close()
