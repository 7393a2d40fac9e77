"""Forked search workers (``mt.workers.worker_processes``, translate's default on Linux): answers
in item order from several processes, a worker's error or death raised in the parent instead of
a hang, and no worker left behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import alive, children

from mt.workers import FORK, WorkerDied, map_batches

pytestmark = pytest.mark.skipif(not FORK, reason="forked workers are for Linux only")
CPU = torch.device("cpu")
LENGTHS = [(i * 7) % 11 + 1 for i in range(60)]


def test_answers_come_back_in_item_order_from_several_processes():
    got = map_batches(lambda batch: [(i, os.getpid()) for i in batch], LENGTHS, 12, 2, CPU,
                      False, processes=True)
    assert [i for i, _ in got] == list(range(60))
    pids = {pid for _, pid in got}
    assert len(pids) == 2 and os.getpid() not in pids
    assert not multiprocessing.active_children()
    # the same batches in threads, or in turn, give the same answers
    assert map_batches(lambda batch: batch, LENGTHS, 12, 2, CPU, False, processes=True) == \
        map_batches(lambda batch: batch, LENGTHS, 12, 1, CPU, False) == list(range(60))


def test_an_error_in_a_worker_is_raised_in_the_parent():
    def fn(batch):
        if 30 in batch:
            raise ValueError("item 30 is wrong")
        return batch

    with pytest.raises(ValueError, match="item 30 is wrong"):
        map_batches(fn, LENGTHS, 12, 2, CPU, False, processes=True)
    assert not multiprocessing.active_children()


def test_a_killed_worker_is_an_error_not_a_hang():
    def fn(batch):
        if 30 in batch:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
        return batch

    with pytest.raises(WorkerDied, match="killed by signal 9 .out of memory"):
        map_batches(fn, LENGTHS, 12, 2, CPU, False, processes=True)
    assert not multiprocessing.active_children()


def test_workers_end_with_a_parent_killed_outright():
    code = ("import os, time, torch\n"
            "from mt.workers import map_batches\n"
            "print(os.getpid(), flush=True)\n"
            "map_batches(lambda b: time.sleep(60), [3] * 8, 6, 2, torch.device('cpu'), False,"
            " processes=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    deadline = time.monotonic() + 60
    while len(workers := children(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)
