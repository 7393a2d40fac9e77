"""How a training step updates the weights: the optimizer, its learning-rate schedule, and the
precision the step computes in (``trainer.precision``). Configured by the ``optim`` group
(``conf/optim/``) and read by ``mt.trainer.Trainer``.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mt.config import TrainConfig, replay


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matrix products about 2x (AVX512-BF16) to 4.5x (AMX) float32's."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``trainer.precision`` (None = float32)."""
    if precision == "auto":
        if device.type == "cuda":
            # Native bf16 only (Ampere on): before it, torch reports emulated bf16 as supported
            return (torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False)
                    else torch.float16)
        return torch.bfloat16 if cpu_has_fast_bf16() else None
    choices = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in choices:
        raise ValueError(f"trainer.precision must be auto, fp32, bf16 or fp16, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("trainer.precision=fp16 needs a CUDA device; use bf16 on CPU")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        logging.getLogger("mt.train").warning(
            "trainer.precision=bf16 on a CPU without bfloat16 instructions (AVX512-BF16 or "
            "AMX): its products are emulated, slower than float32 here; trainer.precision=auto "
            "picks float32 on such a CPU")
    return choices[precision]


def plateau_reductions(history: list[dict], cfg) -> int:
    """How many times the learning rate has been cut on a plateau (``optim.plateau_factor``).

    Replays the validation history that last.pt saves (``trainer.history``): each run of
    ``optim.plateau_patience`` validations in a row that are not better (``mt.config.improves``:
    ``trainer.best_metric``, ``trainer.min_improvement``) than the best so far is one cut, and
    the count of bad validations starts again after it, as in torch's ReduceLROnPlateau. Unlike
    there, the cut comes at the ``plateau_patience``-th bad validation, not the one after it
    (torch's and fairseq's ``patience`` N is mt's N + 1; Marian's ``--lr-decay-strategy
    stalled`` counts as mt does). Derived
    from the history, never kept beside it, so a resumed run knows the count without new state.
    ``trainer.patience`` counts the same bad validations without restarting, so it ends a run
    that keeps failing to improve after a cut.
    """
    o, t = cfg.optim, cfg.trainer
    if not 0 < o.plateau_factor < 1:
        return 0
    bad, cuts = 0, 0
    for _, better in replay(history, t.best_metric, t.min_improvement):
        bad = 0 if better else bad + 1
        if bad == o.plateau_patience:
            cuts, bad = cuts + 1, 0
    return cuts


def lr_lambda(cfg, seconds: Callable[[], float] | None = None,
              history: Callable[[], list[dict]] | None = None) -> Callable[[int], float]:
    """Multiplier of optim.lr at a given step (1-based), for LambdaLR.

    `cosine` decays to optim.min_lr when the first of the run's budgets ends: trainer.max_steps,
    or trainer.max_minutes of training time read from `seconds()`. A time budget is turned into a
    step budget at every step from the pace so far (steps x budget / elapsed), so a recipe that
    trains "for 60 minutes" anneals fully on a fast machine and on a slow one alike.

    With ``optim.plateau_factor`` the schedule's multiplier is also multiplied by
    ``plateau_factor ** plateau_reductions(history())``, read at every step: the schedule's shape
    goes on, at a lower level after each plateau.
    """
    warmup = max(1, cfg.optim.warmup_steps)
    budget = cfg.trainer.max_minutes * 60 if seconds is not None else 0.0

    def inverse_sqrt(step: int) -> float:
        step = max(step, 1)
        return min(step / warmup, math.sqrt(warmup / step))

    def cosine(step: int) -> float:
        step = max(step, 1)
        if step < warmup:
            return step / warmup
        total = cfg.trainer.max_steps or math.inf
        elapsed = seconds() if budget else 0.0
        if elapsed > 0:
            total = min(total, step * budget / elapsed)
        progress = min(1.0, (step - warmup) / max(total - warmup, 1e-9))
        floor = cfg.optim.min_lr / cfg.optim.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def constant(step: int) -> float:
        return min(1.0, max(step, 1) / warmup)

    schedules = {"inverse_sqrt": inverse_sqrt, "cosine": cosine, "constant": constant}
    if cfg.optim.schedule not in schedules:
        raise ValueError(f"optim.schedule must be one of {sorted(schedules)}, "
                         f"got {cfg.optim.schedule!r}")
    if cfg.optim.schedule == "cosine" and not (cfg.trainer.max_steps or cfg.trainer.max_minutes):
        raise ValueError("optim.schedule=cosine decays over a budget: set trainer.max_steps or "
                         "trainer.max_minutes")
    if cfg.optim.schedule == "cosine" and 0 < cfg.trainer.max_steps <= cfg.optim.warmup_steps:
        # the run would end inside the warmup: a ramp that never reaches optim.lr, let alone decays
        raise ValueError(f"optim.schedule=cosine: optim.warmup_steps={cfg.optim.warmup_steps} is "
                         f"not below trainer.max_steps={cfg.trainer.max_steps}, so the rate would "
                         "only rise and never decay to optim.min_lr; lower optim.warmup_steps")
    schedule = schedules[cfg.optim.schedule]
    if history is None or not 0 < cfg.optim.plateau_factor < 1:
        return schedule
    factor = cfg.optim.plateau_factor
    seen: dict = {}  # (the history list, its length) -> cuts: LambdaLR asks at every step

    def on_plateau(step: int) -> float:
        records = history()
        key = (id(records), len(records))  # the history is appended to, or replaced on resume
        if key not in seen:
            seen.clear()
            seen[key] = plateau_reductions(records, cfg)
        return schedule(step) * factor ** seen[key]

    return on_plateau


def refresh_lr(optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Sets the rate of the next step to what the schedule says now, as LambdaLR.step computes it.

    LambdaLR computes the next step's rate when a step ends, before that step's validation; a
    plateau cut found at the validation must reach the next step, not the one after it.
    """
    for group, base, multiplier in zip(optimizer.param_groups, scheduler.base_lrs,
                                       scheduler.lr_lambdas, strict=True):
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam/AdamW with the fused kernel: one call for all parameters (on CPU 5x faster than the
    foreach one: 18 vs 94 ms a step for 41M parameters, 2 cores), and it can skip an update on the
    device's word (``found_inf``), so that a NaN loss costs no host sync (Trainer.train_step)."""
    kinds = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if cfg.optim.name not in kinds:
        raise ValueError(f"optim.name must be adam or adamw, got {cfg.optim.name!r}")
    trained = [p for p in model.parameters() if p.requires_grad]  # trainer.freeze leaves out
    return kinds[cfg.optim.name](trained, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                 eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay, fused=True)


def freeze(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Stops training the parameters whose names match one of ``patterns`` (``trainer.freeze``,
    shell-style: ``encoder_layers.*``), as Sockeye's ``--fixed-param-names``: fine-tuning to a
    domain may keep the encoder, or the embeddings, as they are.

    Returns:
        the names frozen. A pattern that matches no parameter is a typo, and patterns that
        match all of them leave nothing to train: ValueError naming them.
    """
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            groups = sorted({n.split(".")[0] for n in names})
            raise ValueError(f"trainer.freeze: {pattern!r} matches no parameter (they start with "
                             f"{', '.join(groups)}; e.g. encoder_layers.* or src_embed.weight)")
    frozen = []
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(names):
        raise ValueError(f"trainer.freeze: {', '.join(patterns)} freezes all {len(names)} "
                         "parameter tensors; nothing would be trained")
    return frozen


def take_optim_config(optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LambdaLR, cfg) -> list[str]:
    """Gives a resumed run's optimizer this run's ``optim.lr``, betas, eps and weight_decay, and
    its next step the rate that this run's schedule gives it.

    Loading the saved state brings back the saver's (and the scheduler's base rate), so the
    advice after a divergence, "lower optim.lr and run again in the run directory", would
    change nothing; and the saved rate of the next step was computed by the saver's schedule, so
    a resume that changes it (``optim.plateau_factor``, ``warmup_steps``...) would run one step
    at the old rate. Values equal to the saved ones leave the state untouched: the rate is
    recomputed by LambdaLR's own expression from the same step and the same history (call this
    after the history is loaded: the plateau cuts are part of the rate), the same float, so a
    resumed run with the same config continues exactly. A cosine over ``trainer.max_minutes``
    reads a clock that has moved on since the save: its rate is recomputed only when optim.lr
    changed.

    Returns:
        ``optim.KEY=NEW (was OLD)`` for each value changed, and the next step's rate where the
        schedule gives it another.
    """
    o = cfg.optim
    now = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    group = optimizer.param_groups[0]
    was = {"lr": scheduler.base_lrs[0], "betas": tuple(group["betas"]), "eps": group["eps"],
           "weight_decay": group["weight_decay"]}
    changed = [k for k in now if now[k] != was[k]]
    notes = [f"optim.{k}={now[k]} (was {was[k]})" for k in changed]
    if changed:
        scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group.update(initial_lr=o.lr, betas=now["betas"], eps=o.eps,
                         weight_decay=o.weight_decay)
    if changed or not (o.schedule == "cosine" and cfg.trainer.max_minutes):
        before = optimizer.param_groups[0]["lr"]
        refresh_lr(optimizer, scheduler)
        after = optimizer.param_groups[0]["lr"]
        if "lr" not in changed and after != before:
            notes.append(f"a learning rate of {after:.4g} for step {scheduler.last_epoch + 1} "
                         f"(was {before:.4g}): this run's schedule settings give it")
    return notes


def cut_on_plateau(optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LambdaLR, history: list[dict],
                   cfg) -> str:
    """After a validation is appended to ``history``: where it completes a plateau, gives the next
    step the reduced rate (``refresh_lr``) and returns a line for the log; else "".

    Every rank calls it with the same history, so that all keep the same rate under DDP.
    """
    cuts = plateau_reductions(history, cfg)
    if cuts == plateau_reductions(history[:-1], cfg):
        return ""
    refresh_lr(optimizer, scheduler)
    o, t = cfg.optim, cfg.trainer
    return (f"valid {t.best_metric} not better in {o.plateau_patience} validations "
            f"(optim.plateau_patience): learning rate x {o.plateau_factor:g} "
            f"(cut {cuts}, x {o.plateau_factor ** cuts:.4g} in all), "
            f"{optimizer.param_groups[0]['lr']:.3g} for step {scheduler.last_epoch + 1}")


class EMA:
    """An exponential moving average of the weights (Polyak averaging; Marian's
    ``--exponential-smoothing``, fairseq's ``--ema-decay``): ``trainer.ema_decay``.

    Late in training the weights wander around a minimum with the noise of each batch; their
    moving average sits nearer to it, and translates better than any single step's weights, at
    the cost of one float32 copy of the parameters. The decay starts low and rises to ``decay``
    (``min(decay, (1 + t) / (10 + t))`` after t updates, as TensorFlow's
    ExponentialMovingAverage), so the random initial weights do not linger in the average.

    Validation, best.pt, step_N.pt and the inference part of last.pt hold the average; last.pt
    keeps the trained weights beside it for the run to go on from.
    """

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.names, self.params = zip(*model.named_parameters(), strict=True)
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, taken: torch.Tensor | float = 1.0) -> None:
        """After each optimizer step: no host sync (one fused lerp over all parameters).

        Args:
            taken: 1 where the optimizer updated the weights, 0 where it skipped a NaN/inf step
                (a device tensor, read without a sync): a skipped step leaves the average as it
                is, instead of pulling it towards weights that did not move. It still counts
                towards the decay's warm-up, as it does for the learning-rate schedule.
        """
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.shadow, [p.float() for p in self.params], (1.0 - decay) * taken)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block, its trained weights again after."""
        trained = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(list(self.params), self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(list(self.params), trained)

    def load(self, average: dict[str, torch.Tensor], updates: int) -> None:
        """Takes the average from a checkpoint's model state (``applied`` wrote it there)."""
        self.updates = updates
        with torch.no_grad():
            for name, s in zip(self.names, self.shadow, strict=True):
                s.copy_(average[name])
