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
from multiprocessing.connection import Connection

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


def test_a_worker_killed_while_idle_or_before_reading_is_an_error_too(monkeypatch):
    """A worker can die between batches (the out-of-memory killer picks the process that holds
    the most, and a worker keeps its peak heap): the next hand-over then finds no reader, or
    the worker's end is reset. Both are the worker's death, not an I/O error of the caller's."""
    parent = os.getpid()
    real_send, real_recv = Connection.send, Connection.recv

    def send_then_die(self, obj):  # a worker dies just after answering the first batch
        if os.getpid() == parent and obj and obj > 1:
            time.sleep(0.2)  # and is gone when the parent hands it the next one
        real_send(self, obj)
        if os.getpid() != parent and obj[0] and 3 in obj[1]:  # item 3: one of the longest
            os.kill(os.getpid(), signal.SIGKILL)

    def die_before_reading(self):  # a worker dies before reading its second item
        if os.getpid() != parent:
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_recv(self)

    for name, fake in (("send", send_then_die), ("recv", die_before_reading)):
        calls: list[int] = []
        with monkeypatch.context() as m:
            m.setattr(Connection, name, fake)
            with pytest.raises(WorkerDied, match="killed by signal 9"):
                map_batches(lambda batch: batch, LENGTHS, 12, 2, CPU, False, processes=True)
        assert not multiprocessing.active_children()


class _TwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_a_workers_exception_keeps_its_type_and_traceback():
    def fn(batch):
        if 30 in batch:
            raise KeyError("item 30")
        return batch

    with pytest.raises(KeyError, match="item 30") as caught:
        map_batches(fn, LENGTHS, 12, 2, CPU, False, processes=True)
    assert "in fn" in str(caught.value.__cause__)  # the worker's own frames
    # one that pickles but cannot be rebuilt comes back as a RuntimeError that names it
    with pytest.raises(RuntimeError, match="_TwoArguments: x and y"):
        map_batches(lambda b: (_ for _ in ()).throw(_TwoArguments("x", "y")), LENGTHS, 12, 2,
                    CPU, False, processes=True)


def test_a_signal_during_the_fork_is_raised_after_it_not_lost():
    """A raising handler (translate's for SIGTERM) must not fire inside the fork's callbacks,
    which drop exceptions: the signal waits until the workers exist, then raises."""
    code = ("import os, signal, multiprocessing, torch\n"
            "from mt.workers import map_batches\n"
            "class Term(BaseException): pass\n"
            "def term(*_): raise Term\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "sent = []\n"
            "def after():\n"
            "    if not sent: sent.append(1); os.kill(os.getpid(), signal.SIGTERM)\n"
            "os.register_at_fork(after_in_parent=after)\n"
            "try:\n"
            "    map_batches(lambda b: b, [3] * 40, 6, 2, torch.device('cpu'), False,"
            " processes=True)\n"
            "    print('lost')\n"
            "except Term:\n"
            "    print('raised', len(multiprocessing.active_children()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["raised", "0"], out.stderr


def test_a_daemonic_process_searches_in_threads():
    """A multiprocessing.Pool's worker may not fork workers of its own: threads there."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=lambda: queue.put(map_batches(
        lambda batch: [os.getpid()] * len(batch), LENGTHS, 12, 2, CPU, False, processes=True)),
        daemon=True)
    proc.start()
    pids = queue.get(timeout=60)
    proc.join(60)
    assert set(pids) == {proc.pid}


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
