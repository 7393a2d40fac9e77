"""The process group of a run under ``torchrun``: which process this is, on which device.

Scaling past one process is plain DistributedDataParallel (``mt.trainer``); this module only starts
the group (gloo on CPU, NCCL on GPU), lets ranks wait for each other, and gives every rank rank 0's
run directory and config.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import takewhile
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from mt.hydra_dirs import SAVED_CONFIGS, holds_only, remove_made
from mt.interrupts import HANGUP

log = logging.getLogger("mt.distributed")

T = TypeVar("T")


def setup_distributed(device_cfg: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_cfg == "auto":
        use_cuda, index = torch.cuda.is_available(), None
    else:
        try:
            chosen = torch.device(device_cfg)
        except RuntimeError:
            chosen = None
        if chosen is None or chosen.type not in ("cpu", "cuda"):
            raise ValueError(f"trainer.device must be auto, cpu, cuda or cuda:N, got "
                             f"{device_cfg!r}")
        use_cuda, index = chosen.type == "cuda", chosen.index
        if use_cuda and not torch.cuda.is_available():
            raise ValueError(f"trainer.device={device_cfg}, but this torch sees no CUDA device")
    if use_cuda:
        # under torchrun each process takes its local rank's GPU; alone, the one asked for
        local = int(os.environ.get("LOCAL_RANK", index if index is not None else 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, device


class PeerFailed(RuntimeError):
    """Another process of the run ended (its own error says why) while this one waited for it."""


def barrier(world: int) -> None:
    """Waits for every rank (nothing to wait for alone): rank 0 writes caches and checkpoints
    that the others then read. Where a rank stops on a mistake in the data or the config, the
    others learn of it here, from a broken connection: a PeerFailed, which mt-train says in one
    line, instead of gloo's or NCCL's traceback beside the one line that says what is wrong."""
    if world > 1:
        try:
            dist.barrier()
        except RuntimeError as err:
            raise _peer_failed() from err


def _peer_failed() -> PeerFailed:
    return PeerFailed(f"rank {os.environ.get('RANK', '0')} stopped: another process of the run "
                      "ended or did not answer while it waited (that process's error says why)")


def peer_gone(err: BaseException) -> PeerFailed | None:
    """The PeerFailed for a collective of the training step (DDP's gradient all-reduce, the
    agreement on a stop signal) that failed because another rank is gone: a rank killed
    outright (the kernel's OOM killer, SIGKILL) left the others with gloo's 'Connection closed
    by peer' traceback under Hydra's report, not the one line a barrier's wait gives. None for
    any other error, which keeps its traceback (NCCL's watchdog ends a rank whose peer is gone
    itself)."""
    if isinstance(err, RuntimeError) and "/gloo/transport/" in str(err):
        return _peer_failed()
    return None


def rank_seed(seed: int, rank: int) -> int:
    """Rank 0's seed is ``seed``; other ranks get 32-bit seeds of their own (torch's CPU generator
    keeps only 32 bits of a seed: ``seed + rank * 2**32`` would give every rank one stream)."""
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed & 0xFFFF_FFFF, rank]).generate_state(1)[0])


def share_run(run_dir: Path, cfg: T, meta: str | None) -> tuple[Path, T]:
    """Rank 0's run directory and resolved config, on every rank of an initialised group.

    Each torchrun process resolved ``${now}`` itself, so each named a directory of its own; and
    interpolations such as ``data.dir=${hydra:runtime.output_dir}/data`` differ the same way, so
    the whole config comes from rank 0 too. Ranks above 0 log warnings only (rank 0 tells the
    story once) and leave the directory they named (``leave_run_dir``).
    """
    shared = [str(run_dir), cfg]
    dist.broadcast_object_list(shared, src=0)
    # Several ranks may have named the same directory: the first of them removes it.
    named = [""] * dist.get_world_size()
    dist.all_gather_object(named, str(run_dir))
    if dist.get_rank() > 0:
        logging.getLogger().setLevel(logging.WARNING)
        leave_run_dir(run_dir, Path(shared[0]), named.index(str(run_dir)) == dist.get_rank(), meta)
    return Path(shared[0]), shared[1]


def leave_run_dir(own: Path, shared: Path, remove: bool, meta: str | None = ".hydra") -> None:
    """Run by ranks above 0 once they know rank 0's directory (``shared``): the run's log is rank
    0's, and the directory Hydra made for this process (``own``: its clock named it, a second
    after rank 0's) is removed by ``remove``, the first rank that named it, so that a
    multi-process run leaves one run directory, not one per rank.

    Only what Hydra wrote is removed: its ``meta`` folder (``hydra.output_subdir``) with its three
    files and the log files this process had open there (``mt.hydra_dirs.holds_only``, as for a
    refused command's directory); a directory holding anything else, or a link (itself, its log,
    its meta folder: someone's, reached through it), stays.
    Tidying up never stops the run: a failure is a warning. A process that Hydra moved into
    ``own`` (``hydra.job.chdir=true``) moves to ``shared``, where rank 0 works, so that relative
    paths mean the same on every rank and its working directory is never one that was removed.
    """
    if own.is_dir() and Path.cwd().resolve() == own.resolve():
        os.chdir(shared)
    root, logs = logging.getLogger(), set()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == own:
            root.removeHandler(handler)
            handler.close()
            logs.add(Path(handler.baseFilename).name)
    if not remove or not own.is_dir() or own.resolve() == shared.resolve():
        return
    expected = set(logs)
    if meta:
        expected |= {(Path(meta) / name).as_posix() for name in SAVED_CONFIGS}
    # With it go the folders the template made for it alone (``runs/${now:%Y-%m-%d}/
    # ${now:%H-%M-%S}`` with the second rank past midnight): those not on rank 0's path, once
    # empty.
    on_shared_path = shared.resolve().parents
    made = [own, *takewhile(lambda p: p not in on_shared_path, own.resolve().parents)]
    try:
        # A link in it is someone's, not Hydra's (holds_only refuses linked folders, this files).
        if any(p.is_symlink() for p in own.iterdir()) or not holds_only(own, expected):
            return
        remove_made(own, made, expected)
        # remove_made stops quietly at a folder that will not go: rmdir again says why (own, or
        # an empty folder made for it alone: its date folder where permissions keep it). One
        # that holds something else by now is not this process's to remove, and stays unsaid.
        for folder in made:
            try:
                if folder != own and any(folder.iterdir()):
                    break
                folder.rmdir()
            except FileNotFoundError:  # gone already (another rank's took the date folder)
                continue
    except OSError as err:
        log.warning("could not remove %s, the run directory this process named before it took "
                    "rank 0's (%s): %s", own, shared, err)


class Terminated(Exception):  # noqa: N818 - named for the signal, as KeyboardInterrupt is
    """A SIGTERM (a scheduler's preemption notice, ``kill``, ``timeout``) or a SIGHUP (the
    terminal closed, the ssh session dropped) stopped the run at ``step``, which ``last.pt``
    holds; ``signal`` is which."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        super().__init__(step)
        self.step, self.signal = step, signum


class ValidationCut(Exception):  # noqa: N818 - an event, as Terminated
    """A SIGTERM or SIGHUP reached rank 0 while it validated: the validation ends between two of
    its batches, unfinished and unrecorded (``SigtermWatch.between_batches``)."""


# What ends a run as a scheduler's notice does: SIGTERM, and SIGHUP where there is one (not on
# Windows): a closed terminal killed the run at once, losing every step since the last save.
STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, *HANGUP)


class SigtermWatch:
    """Notes a SIGTERM (or SIGHUP) while training runs, so that the run ends after the step in
    progress with last.pt saved there: a scheduler's preemption notice (SLURM waits 30 s by
    default before SIGKILL) or a dropped ssh session costs no training, where the default
    action lost every step since the last save. Every rank must stop at the same step, so
    under DDP they agree (``agreed``); ``signal`` is then the one that came (0 if none)."""

    def __init__(self, world: int, device: torch.device, every: int) -> None:
        self.world, self.device, self.every = world, device, every
        self.signal = 0

    @contextmanager
    def watching(self) -> Iterator[None]:
        """The handlers for the block (only the main thread may set one), the earlier ones
        after. A signal the parent ignores (``nohup`` ignores SIGHUP) stays ignored."""
        self.signal = 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS
                    if signal.getsignal(s) is not signal.SIG_IGN}
        try:
            yield
        finally:  # a handler set outside Python reads as None: put back the default then
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def between_batches(self) -> None:
        """Raises ValidationCut where a stop signal has come: called between the batches of a
        validation (its loss, then its search), which on a large valid set takes minutes, far
        past a scheduler's grace period (SLURM's 30 s), so that the run saves last.pt and ends
        within a batch. The ranks above 0 wait for rank 0 meanwhile; they learn of the cut from
        its broadcast of the validation (``Trainer._validate_and_save``)."""
        if self.signal:
            raise ValidationCut

    def _note(self, signum, frame) -> None:
        self.signal = self.signal or signum

    def agreed(self, step: int, now: bool = False) -> bool:
        """Whether a SIGTERM or SIGHUP reached any rank. They agree at every ``every``-th step
        (the log step, where the loss is read anyway) and, with ``now``, when the loop ends: a
        signal in the last steps must not wait out the final validation and test, which a
        scheduler's grace period does not cover. Every rank must call it at the same steps."""
        if self.world == 1:
            return bool(self.signal)
        if step % self.every and not now:
            return False
        flag = torch.tensor([float(self.signal)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one signal for all: the larger's number
        self.signal = int(flag.item())
        return bool(self.signal)
