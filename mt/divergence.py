"""Training that blows up: steps whose loss is NaN/inf, and weights that are no longer finite.

A NaN/inf loss skips its update on the device (the fused optimizer's ``found_inf``, set by
``mt.trainer.Trainer.train_step``); ``BadSteps`` counts such steps there too, so that a step costs
no host sync, and reads the count every few steps: a warning for the skipped ones, and ``Diverged``
for a run whose loss stays NaN/inf for ``trainer.max_bad_steps`` steps in a row. Weights are
checked before every save, so that no checkpoint on disk holds NaN.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("mt.train")

ADVICE = "Lower optim.lr, raise optim.warmup_steps or set optim.clip_norm"


class Diverged(RuntimeError):
    """Training blew up (NaN/inf); the message says where the last good weights are."""


class BadSteps:
    """Steps with a NaN/inf loss: counted on the device, read every ``max_bad_steps`` steps (and
    at each log line and save, by the trainer). ``skipped`` counts them over the run, resumed
    runs included (last.pt keeps it)."""

    def __init__(self, device: torch.device, max_bad_steps: int) -> None:
        self.max_bad_steps, self.skipped, self.since_check = max_bad_steps, 0, 0
        # the current run of bad steps, the longest since the last check, bad steps since it
        self.run, self.worst, self.since = (torch.zeros((), dtype=torch.long, device=device)
                                            for _ in range(3))

    def count(self, finite: torch.Tensor) -> None:
        """One step more; ``finite`` (a device bool) says whether its loss was finite."""
        self.run = (self.run + 1) * ~finite
        self.worst = torch.maximum(self.worst, self.run)
        self.since += ~finite
        self.since_check += 1

    def due(self) -> bool:
        """Whether a run of bad steps could reach max_bad_steps before the next check."""
        return self.since_check >= self.max_bad_steps

    def check(self, step: int, last: Path) -> None:
        """Reads the counts (a host sync): warns of skipped steps, and raises Diverged when
        ``max_bad_steps`` came in a row; ``last`` is where the last good weights would be."""
        steps, self.since_check = self.since_check, 0
        bad, worst = int(self.since), int(self.worst)
        self.since.zero_()
        self.worst.copy_(self.run)
        if not bad:
            return
        self.skipped += bad
        log.warning("steps %d-%d: NaN/inf loss in %d of them, update skipped (%d skipped so far)",
                    step - steps + 1, step, bad, self.skipped)
        if worst >= self.max_bad_steps:
            saved = (f"last good weights are in {last}" if last.exists()
                     else "no checkpoint was saved yet")
            raise Diverged(f"training diverged: {worst} steps in a row with a NaN/inf loss "
                           f"(trainer.max_bad_steps={self.max_bad_steps}); {saved}. {ADVICE}")


def check_weights(model: torch.nn.Module, last: Path) -> None:
    """Raises Diverged naming non-finite weights, before they could overwrite ``last``. Run on
    every rank (DDP keeps the weights identical) so that all stop together: under a plain
    launcher (srun, mpirun) the others would wait at the next barrier for a rank 0 that had
    raised."""
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise Diverged(f"training diverged: non-finite weights ({', '.join(bad[:3])}); not "
                       f"overwriting {last}. {ADVICE}")
