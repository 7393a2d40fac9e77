"""SentencePiece training in a forked child process, which a stop signal can end at once.

``SentencePieceTrainer.train`` runs in C++ for minutes on a large corpus, and Python runs a
signal's handler only when it returns: Ctrl-C looked ignored, and a scheduler's SIGTERM ended
in its SIGKILL after the grace period (on 40,000 lines, mt-train exited 32 s after a SIGTERM).
Here the training runs in a fork of this process (the sentences come with the fork, unpickled),
and this process waits on a pipe, where a handler runs as the signal comes: the child is killed
and the signal's exception goes on (mt-train's "terminated (SIGTERM) before the first
checkpoint"). Nothing is saved until the model is back, so nothing half-written is left.

The model is the same, byte for byte, as one trained in this process: the same call, with the
same options and seed. Where there is no fork (not Linux: see ``mt.workers.FORK``) the training
runs in this process, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pickle
import signal
import sys
import warnings

import sentencepiece as spm

FORK = sys.platform.startswith("linux")
# Ctrl-C reaches the whole process group, a scheduler's SIGTERM maybe every process of the job:
# the child ignores them and this process, which handles them, kills it (racing its death
# against this process's own handler would say "the child died" instead of "terminated").
_STOPS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


def train_model(seed: int, sentences: list[str], **options) -> bytes:
    """``SentencePieceTrainer.train(sentence_iterator=iter(sentences), **options)``'s model, with
    SentencePiece's random generator seeded with ``seed``; its exceptions are raised here."""
    if not FORK:
        return _train(seed, sentences, options)
    read, write = os.pipe()
    parent, child = os.getpid(), 0
    try:  # from the fork on: a signal held over it runs its handler as the block ends
        # _held: a signal just after the fork would leave a child nobody ends. Python 3.12
        # warns of a fork with threads alive: the child runs SentencePiece's own code only.
        with _held(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*use of fork\\(\\) may lead to deadlocks",
                                    DeprecationWarning)
            child = os.fork()
            if child == 0:  # pragma: no cover - the child; it never returns into the caller
                _child(write, read, parent, seed, sentences, options)
        os.close(write)
        write = -1
        with open(read, "rb") as pipe:
            read = -1  # (the file closes it)
            answer = pipe.read()  # a signal's handler runs here, and its exception ends the wait
    except BaseException:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        raise
    _, status = os.waitpid(child, 0)
    if not answer:
        how = (f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
               if os.WIFSIGNALED(status) else
               f"exited with status {os.waitstatus_to_exitcode(status)}")
        hint = (": out of memory? lower data.tokenizer.input_sentence_size"
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else "")
        raise ValueError(f"the SentencePiece training process {how}{hint}")
    ok, value = pickle.loads(answer)
    if not ok:
        raise value
    return value


def _train(seed: int, sentences: list[str], options: dict) -> bytes:
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # SentencePiece's own sampling, for reproducible models
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                   **options)
    return model.getvalue()


def _child(write: int, read: int, parent: int, seed: int, sentences: list[str],
           options: dict) -> None:  # pragma: no cover - runs in the child
    """Trains and writes ``(True, model)`` or ``(False, exception)`` to the pipe, then exits
    without running anything of the parent's (atexit, buffers to flush)."""
    code = 1
    try:
        os.close(read)
        for s in _STOPS:  # (one the parent ignores, nohup's SIGHUP, is ignored already)
            signal.signal(s, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with a parent killed outright
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)
        try:
            answer = (True, _train(seed, sentences, options))
        except Exception as err:  # noqa: BLE001 - the parent raises it
            try:
                pickle.dumps(err)
            except Exception:  # noqa: BLE001 - one that does not pickle, in words
                err = RuntimeError(f"{type(err).__name__}: {err}")
            answer = (False, err)
        with open(write, "wb") as pipe:
            pipe.write(pickle.dumps(answer))
        code = 0
    finally:
        os._exit(code)


@contextlib.contextmanager
def _held():
    """The stop signals wait (blocked) until the fork is done and the child is known; the child
    unblocks them once it ignores them. Only the main thread runs Python's handlers."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
