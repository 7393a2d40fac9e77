"""Batches searched at once, one per core (``translate --workers``), and put back in order.

A decoding step is hundreds of small operators; splitting each of them over cores costs more in
synchronisation than it gains, while whole batches on separate cores scale almost linearly
(2.3-2.4x for bfloat16 beam search on 2 cores; docs/decoding-history.md). ``map_batches`` cuts
length-sorted items into token-budget batches, runs a function over them on ``worker_threads`` or
``worker_processes`` and returns its results in item order; ``translate``, ``--score`` and
``mt-eval`` all go through it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import wait
from typing import Any

import torch

from mt.batching import budget_batches
from mt.interrupts import HANGUP
from mt.pdeathsig import die_with


def balanced_batches(lengths: list[int], order: list[int], budget: int,
                     workers: int) -> list[list[int]]:
    """Batches of at most ``budget`` tokens (padding included), at most as many as the next
    multiple of ``workers`` above the plain count, each as small as that allows (so about
    equally large).

    With a few batches per worker, the last batches decide when the work ends: a test set that
    fills four and a half batches keeps one of two workers idle for most of a batch. Spread over
    six equal batches, Multi30k test2016 (1,000 lines) decoded 1.08x faster with two workers.
    With many batches per worker the idle tail is a small share, and the search for the budget
    (a pass over the input per halving) would cost more than it saves: they stay as they are.
    """
    batches = list(budget_batches(lengths, order, budget))
    if workers <= 1 or not 1 < len(batches) <= 16 * workers:
        return batches
    wanted = -(-len(batches) // workers) * workers
    lo, hi = 1, budget  # the smallest budget that still needs at most `wanted` batches
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(1 for _ in budget_batches(lengths, order, mid)) <= wanted:
            hi = mid
        else:
            lo = mid + 1
    return list(budget_batches(lengths, order, lo))


def map_batches(fn, lengths: list[int], budget: int, workers: int, device: torch.device,
                progress: bool | Any, processes: bool = False) -> list:
    """``fn`` over batches of item indices (length-sorted, longest first so that memory peaks
    early, at most ``budget`` tokens each, padding included), ``workers`` batches at once on a
    CPU (a GPU runs one batch at a time anyway); returns ``fn``'s per-item results in item order.
    ``progress``: True for a bar of its own, or the caller's tqdm bar to advance per item.
    ``processes``: the workers are forked processes where that is possible (``worker_processes``),
    else threads; ``fn``'s results must then pickle.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    workers = workers if device.type == "cpu" else 1
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = balanced_batches(lengths, order, budget, workers)
    results: list = [None] * len(lengths)
    bar = None if progress is False else progress
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=len(lengths), unit="sent", file=sys.stderr, leave=False)
    with batch_workers(fn, batches, min(workers, len(batches)), processes) as answers:
        for batch, outs in zip(batches, answers, strict=True):
            for i, out in zip(batch, outs, strict=True):
                results[i] = out
            if bar is not None:
                bar.update(len(batch))
    if progress is True:
        bar.close()
    return results


@contextmanager
def batch_workers(fn: Callable[[Any], Any], items: Sequence, workers: int,
                  processes: bool = False) -> Iterator[Iterator]:
    """``fn`` over ``items``, ``workers`` at a time: yields an iterator of its answers in item
    order. In the calling thread for one worker, else in forked processes (``processes`` where
    ``FORK``: ``worker_processes``) or in threads (``worker_threads``)."""
    if workers <= 1:
        yield map(fn, items)
    elif processes and FORK and not multiprocessing.current_process().daemon:
        # (a daemonic process, a multiprocessing.Pool's worker, may not have children)
        with worker_processes(fn, items, workers) as answers:
            yield answers
    else:
        with worker_threads(workers) as pool:
            yield pool.map(fn, items)


def default_workers(device: str) -> int:
    """Batches to search at once: one per core torch may use on a CPU (2.3x one batch split over
    2 cores for bf16 beam search, docs/decoding-history.md), one on a GPU."""
    return torch.get_num_threads() if torch.device(device).type == "cpu" else 1


_THREADS_LOCK = threading.Lock()
_THREADS_USERS = [0, 0]  # pools open now, torch's thread count before the first of them


@contextmanager
def worker_threads(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool that searches ``workers`` batches at once, each thread running its operators on one
    core (torch's intra-op threads are set to 1 while any such pool is open, then restored).

    A decoding step is hundreds of small operators; splitting each of them over cores costs more
    in synchronisation than it gains, while whole batches on separate cores scale almost linearly
    (docs/decoding-history.md has the measurements). The threads share the model's weights and
    release the GIL inside every operator.
    """
    with _THREADS_LOCK:  # torch's thread count is process-wide: the first pool saves it
        if _THREADS_USERS[0] == 0:
            _THREADS_USERS[1] = torch.get_num_threads()
            torch.set_num_threads(1)
        _THREADS_USERS[0] += 1
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="mt-search") as pool:
            yield pool
    finally:
        with _THREADS_LOCK:  # and the last one restores it
            _THREADS_USERS[0] -= 1
            if _THREADS_USERS[0] == 0:
                torch.set_num_threads(_THREADS_USERS[1])


# Where a worker may be a fork of this process. Not on macOS, whose system libraries may not
# survive a fork (CPython starts processes by spawn there); elsewhere there is no fork.
FORK = sys.platform.startswith("linux")


class WorkerDied(RuntimeError):
    """A worker process ended while searching a batch (killed: out of memory, most likely)."""


@contextmanager
def worker_processes(fn: Callable[[Any], Any], items: Sequence, workers: int
                     ) -> Iterator[Iterator]:
    """``workers`` forked copies of this process, each running ``fn`` on one core on the items
    it is handed (by index: the items, like ``fn``, come with the fork, unpickled); yields an
    iterator of the answers in item order, which come back pickled.

    Why processes when threads share everything: in one process the threads take turns at the
    GIL between operators (hundreds a step) and share one heap, and a bfloat16 step on AMX is
    short enough for that to show. ``translate`` of Multi30k test2016, bfloat16, 2 workers:
    3.2-3.3 s against 3.6-3.7 s with threads (1.12x; 10,000 lines 1.09x; float32 1.02-1.04x,
    int8 1.00x; docs/benchmarks.md), at 0.1-0.4 GB more memory (each process keeps its own heap
    and builds its own oneDNN kernels). The weights are not copied: a fork shares the parent's
    pages until one is written, and a search only reads them. A worker pays off over several
    batches: forked for one batch each, from a process holding several models, they were
    slower than threads (``scripts/bench_decode.py --worker-processes``).

    Forking a process that has threads is safe here because the children use nothing another
    thread may hold: they run one intra-op thread (so no OpenMP region, whose pool a fork does
    not copy), and the parent forks from the thread that runs the search, with no other search
    running (Python 3.12 warns of any fork with threads alive; that warning is silenced). A
    worker that dies (the kernel's out-of-memory killer) raises ``WorkerDied`` instead of
    leaving the search waiting; Ctrl-C or an error in the parent ends every worker.
    """
    ctx = multiprocessing.get_context("fork")
    frozen = gc.get_freeze_count() == 0  # (a caller's own freeze stays as it was)
    if frozen:
        gc.freeze()  # the children's collections then leave the parent's objects' pages shared
    ignore_term = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    procs, conns = [], []
    try:
        with _signals_held(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*use of fork\\(\\) may lead to deadlocks",
                                    DeprecationWarning)
            for _ in range(workers):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve,
                                   args=(there, fn, items, [*conns, here], ignore_term,
                                         os.getpid()),
                                   name="mt-search", daemon=True)
                proc.start()  # a fork: fn and what it holds (the model) need no pickling
                there.close()
                procs.append(proc)
                conns.append(here)
    except BaseException:
        _end(procs)
        raise
    finally:
        if frozen:
            gc.unfreeze()
    try:
        yield _in_order(len(items), procs, conns)
    except BaseException:
        _end(procs)
        raise
    for conn in conns:  # done: each worker leaves its loop and exits
        try:
            conn.send(None)
        except OSError:
            pass
    _end(procs, timeout=10)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait until the workers are forked, then reach their handlers.

    A handler that raises (Python's for Ctrl-C, translate's for SIGTERM) could otherwise raise
    inside the fork's own callbacks, which report the exception and drop it (the run goes on as
    if no signal had come), or between a fork and the worker's record (a worker nobody ends).
    Only the main thread runs signal handlers: elsewhere there is nothing to hold.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    saved = {s: signal.signal(s, lambda signum, _: held.append(signum))
             for s in (signal.SIGINT, signal.SIGTERM, *HANGUP)
             if signal.getsignal(s) is not None}  # None: not set from Python, not restorable
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)


def _serve(conn, fn: Callable[[Any], Any], items: Sequence, parents: list,
           ignore_term: bool, parent: int) -> None:
    """A worker's loop: an item's index in, ``(True, answer)`` or ``(False, (exception, its
    traceback))`` out, until None or until the parent is gone.

    Ctrl-C reaches the whole process group; the parent answers it and ends the workers. SIGTERM
    ends a worker at once (translate's handler, inherited, would make it an exception), unless
    the parent ignored it. The parent's ends of the pipes, copied by the fork, are closed here:
    while a worker held one, a parent killed outright would leave it waiting on that pipe for
    ever; the kernel also kills the worker when the parent (``parent``, its process id) dies
    (``mt.pdeathsig``).
    """
    for end in parents:
        end.close()
    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else signal.SIG_DFL)
    for s in HANGUP:  # translate's handler, inherited, would raise here too: end at once
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    torch.set_num_threads(1)
    try:
        while (i := conn.recv()) is not None:
            try:
                answer = (True, fn(items[i]))
            except Exception as err:  # noqa: BLE001 - the parent raises it
                answer = (False, _portable(err))
            try:
                conn.send(answer)
            except (OSError, EOFError):
                raise
            except Exception as err:  # noqa: BLE001 - an answer that does not pickle
                conn.send((False, _portable(RuntimeError(
                    f"a search worker's answer cannot be sent back: {type(err).__name__}: {err}"
                ))))
    except (OSError, EOFError):  # the parent is gone
        return


def _portable(err: Exception) -> tuple[Exception, str]:
    """An exception as the parent can raise it, with its traceback as text: the exception
    itself where it survives pickling (its type is what callers catch), else a RuntimeError
    that names it."""
    text = "".join(traceback.format_exception(err))
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        err = RuntimeError(f"{type(err).__name__}: {err}")
    return err, text


class _WorkerTraceback(Exception):
    """Where a worker's exception came from: its traceback, shown as the exception's cause."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'


def _in_order(n: int, procs: list, conns: list) -> Iterator:
    """Hands each idle worker the next of ``n`` items and yields the answers in item order."""
    idle = list(range(len(procs)))[::-1]
    busy: dict[int, int] = {}  # worker -> item it searches
    answers: dict[int, Any] = {}
    handed = given = 0
    while given < n:
        while idle and handed < n:
            w = idle.pop()
            try:
                conns[w].send(handed)
            except OSError:  # it died since its last answer
                raise _death(procs[w]) from None
            busy[w] = handed
            handed += 1
        ready = wait([conns[w] for w in busy] + [procs[w].sentinel for w in busy])
        for w in list(busy):
            try:
                if conns[w] in ready or conns[w].poll():
                    ok, answer = conns[w].recv()
                elif procs[w].sentinel in ready:
                    raise EOFError
                else:
                    continue
            except (OSError, EOFError):  # it died, before or while answering
                raise _death(procs[w]) from None
            if not ok:
                err, text = answer
                raise err from _WorkerTraceback(text)
            answers[busy.pop(w)] = answer
            idle.append(w)
        while given in answers:
            yield answers.pop(given)
            given += 1


def _death(proc) -> WorkerDied:
    proc.join(1)
    code = proc.exitcode
    how = (f"was killed by signal {-code}" if code is not None and code < 0
           else f"exited with status {code}")
    hint = " (out of memory? fewer --workers or a smaller --batch-tokens)" if code == -9 else ""
    return WorkerDied(f"a search worker process {how}{hint}")


def _end(procs: list, timeout: float = 0) -> None:
    """Waits ``timeout`` seconds for the workers to exit, then kills those that have not."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
