"""The process group of a run under ``torchrun``: which process this is, on which device.

Scaling past one process is plain DistributedDataParallel (``mt.train``); this module only starts
the group (gloo on CPU, NCCL on GPU) and lets ranks wait for each other.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def barrier(world: int) -> None:
    """Waits for every rank (nothing to wait for alone): rank 0 writes caches and checkpoints
    that the others then read."""
    if world > 1:
        dist.barrier()


def rank_seed(seed: int, rank: int) -> int:
    """Rank 0's seed is ``seed``; other ranks get 32-bit seeds of their own (torch's CPU generator
    keeps only 32 bits of a seed: ``seed + rank * 2**32`` would give every rank one stream)."""
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed & 0xFFFF_FFFF, rank]).generate_state(1)[0])
