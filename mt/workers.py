"""Batches searched at once, one per core (``translate --workers``), and put back in order.

A decoding step is hundreds of small operators; splitting each of them over cores costs more in
synchronisation than it gains, while whole batches on separate cores scale almost linearly
(2.3-2.4x for bfloat16 beam search on 2 cores; docs/decoding-history.md). ``map_batches`` cuts
length-sorted items into token-budget batches, runs a function over them on ``worker_threads``
and returns its results in item order; ``translate``, ``--score`` and ``mt-eval`` all go through it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from mt.batching import budget_batches


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
                progress: bool | Any) -> list:
    """``fn`` over batches of item indices (length-sorted, longest first so that memory peaks
    early, at most ``budget`` tokens each, padding included), ``workers`` batches at once on a
    CPU (a GPU runs one batch at a time anyway); returns ``fn``'s per-item results in item order.
    ``progress``: True for a bar of its own, or the caller's tqdm bar to advance per item.
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
    with worker_threads(min(workers, len(batches))) as pool:
        for batch, outs in zip(batches, pool.map(fn, batches), strict=True):
            for i, out in zip(batch, outs, strict=True):
                results[i] = out
            if bar is not None:
                bar.update(len(batch))
    if progress is True:
        bar.close()
    return results


class _Sequential:
    """The one-worker pool: ``map`` in the calling thread, lazily, like ThreadPoolExecutor's."""

    @staticmethod
    def map(fn, items):
        return map(fn, items)


def default_workers(device: str) -> int:
    """Batches to search at once: one per core torch may use on a CPU (2.3x one batch split over
    2 cores for bf16 beam search, docs/decoding-history.md), one on a GPU."""
    return torch.get_num_threads() if torch.device(device).type == "cpu" else 1


_THREADS_LOCK = threading.Lock()
_THREADS_USERS = [0, 0]  # pools open now, torch's thread count before the first of them


@contextmanager
def worker_threads(workers: int) -> Iterator[ThreadPoolExecutor | _Sequential]:
    """A pool that searches ``workers`` batches at once, each thread running its operators on one
    core (torch's intra-op threads are set to 1 while any such pool is open, then restored).

    A decoding step is hundreds of small operators; splitting each of them over cores costs more
    in synchronisation than it gains, while whole batches on separate cores scale almost linearly
    (docs/decoding-history.md has the measurements). The threads share the model's weights and
    release the GIL inside every operator.
    """
    if workers <= 1:
        yield _Sequential()
        return
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
