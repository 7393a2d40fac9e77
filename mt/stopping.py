"""When a training run stops on its own: the budget that ends it (``budget_spent``, what
``Trainer.stop_reason`` says). The stop signals (SIGTERM, SIGHUP), which end it early with
``last.pt`` saved, are ``mt.distributed.SigtermWatch``'s.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from mt.config import TrainConfig


class Run(Protocol):
    """What ``budget_spent`` reads and sets: ``mt.trainer.Trainer``'s attributes."""

    cfg: TrainConfig
    step: int
    epoch: int
    bad_validations: int
    world: int
    device: torch.device
    elapsed: float  # the clock every rank agrees on, which the time-budgeted schedule reads

    def seconds(self) -> float: ...


def budget_spent(run: Run) -> str:
    """Why training ends now, for the log ("" while it goes on): a run that ends before the
    bar's total (a time budget, patience) says which budget ended it. Under DDP every rank calls
    it at every step: the ranks agree on the clock here (``run.elapsed``)."""
    t = run.cfg.trainer
    if t.max_steps and run.step >= t.max_steps:
        return f"trainer.max_steps={t.max_steps} reached"
    if t.max_epochs and run.epoch >= t.max_epochs:
        return f"trainer.max_epochs={t.max_epochs} reached"
    if t.patience and run.bad_validations >= t.patience:
        by = (f" (by more than trainer.min_improvement={t.min_improvement:g})"
              if t.min_improvement else "")
        return (f"trainer.patience={t.patience}: no better valid {t.best_metric}{by} in "
                f"{run.bad_validations} validations")
    elapsed = run.seconds()
    if run.world > 1:  # every rank must see the same clock: same stop step, same lr
        clock = torch.tensor([elapsed], dtype=torch.float64, device=run.device)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        elapsed = clock.item()
    run.elapsed = elapsed
    if t.max_minutes and elapsed / 60 >= t.max_minutes:
        return (f"trainer.max_minutes={t.max_minutes:g} reached "
                f"({elapsed / 60:.1f} minutes of training)")
    return ""
