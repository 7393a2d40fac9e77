"""``mt-train``: the Hydra entry point that trains a Transformer, validates it, writes checkpoints.

``mt-train`` with no arguments trains ``transformer_tiny`` on the generated demo corpus. Under
``torchrun`` each process takes its share of every optimizer step (DistributedDataParallel, gloo on
CPU, NCCL on GPU); only rank 0 writes.

One optimizer step consumes ``accumulation * world_size`` consecutive batches of the epoch's
shuffled batch list, rank r taking micro-batches ``r * accumulation ...``; the loss is the sum of
token losses divided by the number of target tokens in the whole step. So the same product
``accumulation * world_size`` gives the same update, whatever the split.

A run directory started again resumes by itself from ``checkpoints/last.pt``: model, optimizer,
schedule, RNG states and the position in the data (epoch, step within the epoch).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shlex
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mt import checkpoint
from mt.batching import step_batches
from mt.config import (
    BEST_METRICS,
    TrainConfig,
    best_so_far,
    check_keys,
    check_values,
    conf_dir,
    config_changes,
    finetune_model_config,
    improves,
    register_configs,
    start_tokenizer_config,
)
from mt.corpus import Corpus
from mt.data import check_hub_splits, check_split, tokenizer_config, tokenizer_dir
from mt.distributed import PeerFailed, barrier, rank_seed, setup_distributed, share_run
from mt.divergence import BadSteps, Diverged, check_weights
from mt.inference import cap_kernel_caches
from mt.loss import label_smoothed_nll
from mt.model import avoid_cudnn_attention, build_model, count_parameters
from mt.optim import (
    EMA,
    autocast_dtype,
    build_optimizer,
    cut_on_plateau,
    freeze,
    lr_lambda,
    take_optim_config,
)
from mt.runlog import Metrics, Window, bleu_language, finish, fitting, validate
from mt.textio import fill_closed_descriptors, reader_left
from mt.tokenizer import META_FILE, Tokenizer

log = logging.getLogger("mt.train")

CONF_DIR = str(conf_dir())

TIED_NEEDS_JOINT = ("model.tie_embeddings=all needs a joint vocabulary: set "
                    "data.tokenizer.joint=true, or model.tie_embeddings=decoder")


# ----------------------------------------------------------------------------- trainer


def check_setup(cfg: TrainConfig) -> None:
    """Builds the model, freezes trainer.freeze's parameters and makes the optimizer and the
    schedule on the meta device (no memory, no draw from the random streams), so that a value
    only they check (model.norm=Pre, a d_model that model.heads does not divide, a freeze
    pattern that matches nothing, optim.schedule=linear) stops the run now, not after the
    tokenizer and the corpus, which can take many minutes, are built."""
    with torch.device("meta"):  # any vocabulary size: the tokenizer's comes later
        model = build_model(replace(cfg.model, src_vocab_size=8, tgt_vocab_size=8))
    if cfg.trainer.freeze:
        freeze(model, cfg.trainer.freeze)
    build_optimizer(model, cfg)
    lr_lambda(cfg)


class Terminated(Exception):  # noqa: N818 - named for the signal, as KeyboardInterrupt is
    """A SIGTERM (a scheduler's preemption notice, ``kill``, ``timeout``) stopped the run at
    ``step``, which ``last.pt`` holds."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.rank, self.world, self.device = setup_distributed(cfg.trainer.device)
        avoid_cudnn_attention(self.device)
        # Settings that cannot work are refused before any SentencePiece training or encoding.
        self.amp_dtype = autocast_dtype(cfg.trainer.precision, self.device)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        # Rank 0 keeps the seed; other ranks draw dropout from streams of their own, not copies of
        # rank 0's. Data order and subword sampling do not use these.
        seed = rank_seed(cfg.trainer.seed, self.rank)
        torch.manual_seed(seed)
        random.seed(seed)
        self.ckpt_dir = run_dir / "checkpoints"
        if self.rank == 0 and (removed := checkpoint.remove_unfinished(self.ckpt_dir)):
            log.info("removed %d unfinished checkpoint write(s) from %s (a killed run's)",
                     removed, self.ckpt_dir)
        # The model's shape and tokenizer: a resumed run's own (whatever model=... says now), or
        # those of the model that a fine-tuning run starts from; else the config's.
        last = self.ckpt_dir / "last.pt"
        resuming = last.exists()
        start, origin = None, ""
        if resuming:
            start, origin = checkpoint.load(last, mmap=True), str(last)
        elif cfg.init_from:
            start, origin = checkpoint.load(cfg.init_from), f"init_from={cfg.init_from}"
        if start is not None:
            cfg.model, replaced = finetune_model_config(cfg.model, start["model_config"])
            if replaced:
                log.info("%s: the model's shape replaces %s", origin, replaced)
        elif cfg.model.tie_embeddings == "all" and not cfg.data.tokenizer.joint:
            # no tokenizer yet: it would be trained as two vocabularies
            if not (tokenizer_dir(cfg.data.tokenizer, run_dir) / META_FILE).exists():
                raise ValueError(TIED_NEEDS_JOINT)
        check_setup(cfg)
        cfg.data.tokenizer = tokenizer_config(cfg.data)  # recorded as used: data.tag a symbol
        if start is not None:
            cfg.data.tokenizer, ignored = start_tokenizer_config(cfg.data.tokenizer,
                                                                 start.get("config"))
            if ignored:
                log.info("%s: the tokenizer is the checkpoint's; ignored %s", origin, ignored)
        # A mistake in a split: said now, not after the tokenizer, the encoding or the training.
        tested = cfg.data.test.split("+") if cfg.trainer.test_at_end and cfg.data.test else []
        valid = [cfg.data.valid, *cfg.data.extra_valid]
        if cfg.data.source == "files":
            for split in [*"+".join(valid).split("+"), *tested]:
                check_split(cfg.data, split, whole=True)
        elif cfg.data.source == "hub":
            d = cfg.data
            check_hub_splits(d, {f"data.train={d.train}": d.train.split("+"),
                                 f"data.valid={d.valid}": d.valid.split("+"),
                                 "data.extra_valid": "+".join(d.extra_valid).split("+")
                                 if d.extra_valid else [],
                                 f"data.test={d.test}": tested})
        self.corpus = Corpus(cfg, run_dir, self.rank, self.world,
                             Tokenizer.from_state(start["tokenizer"]) if start else None, origin)
        self.bleu_lang = bleu_language(cfg.data.tgt_lang)  # zh, ja, ko: their BLEU tokenizer
        tok = self.corpus.tokenizer
        if cfg.model.tie_embeddings == "all" and not tok.joint:
            # Two vocabularies of one size pass the model's size check, but id 11 would be
            # "▁The" in one and "s" in the other, sharing one embedding.
            raise ValueError(TIED_NEEDS_JOINT)
        cfg.model.src_vocab_size, cfg.model.tgt_vocab_size = tok.src_vocab_size, tok.tgt_vocab_size
        if cfg.trainer.best_metric == "loss":  # a loss over no pair would be NaN at every check
            src, tgt = self.corpus.valid[cfg.data.valid]
            if not fitting(tok.encode_src(src), tok.encode_tgt(tgt), cfg.model.max_positions):
                raise ValueError(f"trainer.best_metric=loss: no pair of data.valid="
                                 f"{cfg.data.valid} fits model.max_positions="
                                 f"{cfg.model.max_positions}, so it has no valid loss; raise "
                                 "model.max_positions or choose trainer.best_metric=bleu")
        self.model = build_model(cfg.model).to(self.device)
        if start is not None and not resuming:
            self.model.load_state_dict(start["model"])  # its own config: every key fits
            log.info("initialised weights from %s", start["path"])
        del start
        log.info("model %s: %s parameters\n%s", cfg.model.name, f"{count_parameters(self.model):,}",
                 OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
        if cfg.trainer.freeze:
            log.info("trainer.freeze: %d parameter tensors kept as they are",
                     len(freeze(self.model, cfg.trainer.freeze)))
        self.optimizer = build_optimizer(self.model, cfg)
        self.ema = EMA(self.model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
        # Training seconds of earlier runs (resumed) and this one's start; `elapsed` is the clock
        # every rank agrees on, read by the time-budgeted schedule.
        self.seconds_before, self.fit_start, self.elapsed = 0.0, None, 0.0
        # LambdaLR counts the steps taken (0 before the first); lr_lambda counts from 1, so
        # step k runs at lr_lambda(k): the peak at step warmup_steps, min_lr at the last step.
        self.history = []  # the validations so far: the plateau cuts are read from them
        multiplier = lr_lambda(cfg, seconds=lambda: self.elapsed, history=lambda: self.history)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda taken: multiplier(taken + 1))
        self.step_lr = cfg.optim.lr * multiplier(1)  # the learning rate of the last step taken
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.amp_dtype == torch.float16)
        log.info("precision: %s on %s, %d process(es)",
                 self.amp_dtype or torch.float32, self.device, self.world)
        self.net = self.model
        if self.world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.trainer.compile:
            self.net = torch.compile(self.net)
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.best, self.bad_validations = None, 0
        self.bad_steps = BadSteps(self.device, cfg.trainer.max_bad_steps)
        self.validated_step = -1
        self.window = Window(self.device)  # the loss and speed since the last log line
        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
        if resuming:
            self._resume(last)
            if self.history and self.history[-1]["step"] == self.step:
                self.validated_step = self.step  # a finished run restarted: do not validate again
        self.metrics = (Metrics(run_dir, cfg.trainer.tensorboard, self.step) if self.rank == 0
                        else None)

    # -- checkpoints

    def _trainer_state(self, rng: list[dict]) -> dict:
        # With an EMA, the checkpoint's "model" is the average; the trained weights go on here.
        ema = ({"weights": checkpoint.weights(self.model), "ema_updates": self.ema.updates}
               if self.ema is not None else {})
        return {
            **ema,
            "trained": self._trained(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
            "best": self.best, "bad_validations": self.bad_validations, "history": self.history,
            "skipped_steps": self.bad_steps.skipped,
            "seconds": self.seconds(),
            "rng": rng[0], "rng_ranks": rng,  # "rng": rank 0's, as checkpoints before rng_ranks
            "world_size": self.world,
            "window": self.window.state(),
        }

    def _trained(self) -> list[str]:
        """The parameters this run trains (all but trainer.freeze's), by name."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _resume(self, path: Path) -> None:
        ckpt = checkpoint.load(path)
        saved_config = ckpt.get("config") or {}
        if self.rank == 0:
            schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
            changed = config_changes(saved_config, self.config_dict, defaults=schema)
            if changed:
                log.info("resuming with settings changed since %s: %s", path, ", ".join(changed))
        if "trainer" not in ckpt:
            raise ValueError(f"{path} holds weights only, no training state (an average or an "
                             "imported model?), so the run cannot resume from it; move it away "
                             "and give it as init_from=... to start from its weights")
        state = ckpt["trainer"]
        # "model" is what translates: with an EMA, the average; the trained weights are beside it
        self.model.load_state_dict(state.get("weights") or ckpt["model"])
        if self.ema is not None and "weights" in state:
            self.ema.load(ckpt["model"], state["ema_updates"])
        elif self.ema is not None:  # trained without one so far: the average starts here
            self.ema = EMA(self.model, self.cfg.trainer.ema_decay)
        for saved, group in zip(state["optimizer"]["param_groups"], self.optimizer.param_groups,
                                strict=True):  # the kernel is this run's choice, not the saver's
            saved["fused"], saved["foreach"] = group["fused"], group["foreach"]
        # The optimizer's state is matched to parameters by position: the same ones must train.
        saved_freeze = (saved_config.get("trainer") or {}).get("freeze", [])
        if state.get("trained", self._trained()) != self._trained() or (
                "trained" not in state and list(saved_freeze) != list(self.cfg.trainer.freeze)):
            raise ValueError(f"{path}: the run trained another set of parameters (its "
                             f"trainer.freeze={list(saved_freeze)}, now "
                             f"{list(self.cfg.trainer.freeze)}); resume with its trainer.freeze, "
                             "or start a new run with init_from")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.history = state["history"]  # before take_optim_config: its rate has the cuts
        # and the seconds trained: a time-budgeted schedule's rate depends on them
        self.seconds_before = self.elapsed = state.get("seconds", 0.0)
        changed = take_optim_config(self.optimizer, self.scheduler, self.cfg)
        if changed:
            log.warning("resuming with %s", ", ".join(changed))
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.step_in_epoch = (state["step"], state["epoch"],
                                                      state["step_in_epoch"])
        # The position in the epoch is counted in steps; a step is accumulation x processes
        # batches. Another count per step would start the epoch again at another batch.
        saved_acc = (saved_config.get("trainer") or {}).get("accumulation", 1)
        saved_per_step = saved_acc * state["world_size"]
        per_step = self.cfg.trainer.accumulation * self.world
        if saved_per_step != per_step:
            seen = self.step_in_epoch * saved_per_step
            self.step_in_epoch = seen // per_step
            again = seen - self.step_in_epoch * per_step
            log.warning("resuming with %d batches per step (trainer.accumulation x processes) "
                        "where the run took %d: each update changes size, and the epoch goes on "
                        "from its batch %d%s", per_step, saved_per_step, seen - again,
                        f" ({again} of its batches trained again)" if again else "")
        t = self.cfg.trainer  # replayed: the metric or threshold may differ from the saver's
        self.best, self.bad_validations = best_so_far(self.history, t.best_metric,
                                                      t.min_improvement)
        if (self.best, self.bad_validations) != (state["best"], state["bad_validations"]):
            log.info("resuming with trainer.best_metric=%s: best valid %s %s so far, %d "
                     "validations without a better one", t.best_metric, t.best_metric,
                     self.best, self.bad_validations)
        self.bad_steps.skipped = state.get("skipped_steps", 0)
        if "window" in state:
            self.window.load(state["window"])
        # Each rank's streams go on where they stopped. Else they stay new ones (another world
        # size, or a checkpoint older than rng_ranks, which held rank 0's alone): no exact resume.
        ranks = state.get("rng_ranks", [state["rng"]])
        if state["world_size"] == self.world and self.rank < len(ranks):
            checkpoint.set_rng_state(ranks[self.rank])
        log.info("resumed %s at step %d (epoch %d, step %d of it)", path, self.step, self.epoch,
                 self.step_in_epoch)

    def save(self, improved: bool, step_checkpoint: bool = True) -> None:
        """last.pt always; step_N.pt (for averaging) and best.pt at validations."""
        check_weights(self.model, self.ckpt_dir / "last.pt")  # on every rank
        mine = checkpoint.rng_state(self.device)
        rng = [mine] * self.world
        if self.world > 1:  # every rank's stream, so that each draws on after a resume as before
            dist.all_gather_object(rng, mine)
        if self.rank != 0:
            return
        with self._averaged():
            inference = checkpoint.model_state(self.model, self.corpus.tokenizer,
                                               self.config_dict)
        # last.pt comes after the files of this validation: a run killed between them resumes
        # from the last.pt before, validates this step again and writes them again. Written
        # first, it would hold this validation as done, and its best.pt never came.
        t = self.cfg.trainer
        steps = step_checkpoint and (t.keep_last > 0 or t.keep_best > 0 or t.average_last > 0)
        if steps:
            checkpoint.save_atomic(inference, self.ckpt_dir / f"step_{self.step}.pt")
        if improved:
            checkpoint.save_atomic(inference, self.ckpt_dir / "best.pt")
        checkpoint.save_atomic({**inference, "trainer": self._trainer_state(rng)},
                               self.ckpt_dir / "last.pt")
        if steps:
            checkpoint.prune_step_checkpoints(self.ckpt_dir, self.history,
                                              max(t.keep_last, t.average_last),
                                              t.keep_best, t.best_metric)

    # -- validation

    def _averaged(self):
        """The EMA's weights in the model (trainer.ema_decay), or the model as it is."""
        return self.ema.applied() if self.ema is not None else nullcontext()

    def validate(self) -> dict:
        """The scores on data.valid (valid_loss, ...) and on each of data.extra_valid's splits
        (SPLIT/loss, ...); the translations in valid/step_N.hyp and valid/SPLIT/step_N.hyp."""
        self.model.eval()
        c, metrics = self.corpus, {}
        with self._averaged(), torch.inference_mode(), self._autocast():
            for split, (src, tgt) in c.valid.items():
                extra = split != self.cfg.data.valid
                hyps = self.run_dir / "valid" / (split if extra else "") / f"step_{self.step}.hyp"
                scores = validate(self.model, c.tokenizer, src, tgt, self.cfg.trainer, self.device,
                                  hyps if self.cfg.trainer.save_valid_hyps else None, split,
                                  self.bleu_lang)
                metrics.update({f"{split}/{key.removeprefix('valid_')}": v
                                for key, v in scores.items()} if extra else scores)
        self.model.train()
        return metrics

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # -- the loop

    def train_step(self, micro_batches: list[list[int]],
                   step_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro-batches.

        Returns the summed label-smoothed loss and NLL (a (2,) tensor: the NLL is what the valid
        loss measures, so the two curves compare) and whether they are finite, device tensors:
        nothing here waits for the device. When the loss is NaN/inf the fused optimizer skips
        the update on the device (weights and optimizer state unchanged; the schedule moves on),
        and fit() reads the count every few steps (mt.divergence.BadSteps).
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros(2, device=self.device)
        for i, batch in enumerate(micro_batches):
            src, tgt_in, tgt_out = (t.to(self.device, non_blocking=True)
                                    for t in self.corpus.collate(batch))
            last = i == len(micro_batches) - 1
            sync = nullcontext() if last or self.world == 1 else self.net.no_sync()
            with sync:
                with self._autocast():
                    logits = self.net(src, tgt_in)
                loss, nll = label_smoothed_nll(logits, tgt_out, self.cfg.optim.label_smoothing)
                # DDP averages gradients over ranks; scale so the result is sum / step_tokens.
                self.scaler.scale(loss * self.world / step_tokens).backward()
            loss_total += torch.stack([loss.detach(), nll.detach()]).float()
        finite = torch.isfinite(loss_total).all().float()
        if self.world > 1:  # skip on every rank, or on none
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        self.scaler.unscale_(self.optimizer)
        if self.cfg.optim.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_norm)
        # The fused kernel skips the update where found_inf is 1 (a float16 GradScaler sets its
        # own, which a NaN loss trips as well).
        self.optimizer.found_inf = 1.0 - finite
        self.scaler.step(self.optimizer)
        self.optimizer.__dict__.pop("found_inf", None)  # no stale flag for any other caller
        if self.ema is not None:
            self.ema.update(finite)
        self.scaler.update()
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()  # the schedule follows the step counter, skipped steps included
        return loss_total, finite.bool()

    def seconds(self) -> float:
        """Wall-clock seconds spent in fit(), over every run that resumed this one: the budget of
        trainer.max_minutes, so a crashed run resumed does not start its clock again."""
        running = time.perf_counter() - self.fit_start if self.fit_start is not None else 0.0
        return self.seconds_before + running

    def stop_reason(self) -> str:
        """Why training ends now, for the log ("" while it goes on): a run that ends before the
        bar's total (a time budget, patience) says which budget ended it."""
        t = self.cfg.trainer
        if t.max_steps and self.step >= t.max_steps:
            return f"trainer.max_steps={t.max_steps} reached"
        if t.max_epochs and self.epoch >= t.max_epochs:
            return f"trainer.max_epochs={t.max_epochs} reached"
        if t.patience and self.bad_validations >= t.patience:
            by = (f" (by more than trainer.min_improvement={t.min_improvement:g})"
                  if t.min_improvement else "")
            return (f"trainer.patience={t.patience}: no better valid {t.best_metric}{by} in "
                    f"{self.bad_validations} validations")
        elapsed = self.seconds()
        if self.world > 1:  # every rank must see the same clock: same stop step, same lr
            clock = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            elapsed = clock.item()
        self.elapsed = elapsed
        if t.max_minutes and elapsed / 60 >= t.max_minutes:
            return (f"trainer.max_minutes={t.max_minutes:g} reached "
                    f"({elapsed / 60:.1f} minutes of training)")
        return ""

    def fit(self) -> float | None:
        t = self.cfg.trainer
        if not (t.max_steps or t.max_epochs or t.max_minutes or t.patience) and self.rank == 0:
            log.warning("no budget (trainer.max_steps, max_epochs, max_minutes and patience are "
                        "all 0): training goes on until you stop it; the same command with %s "
                        "resumes it", resume_override(self.run_dir))
        per_step = t.accumulation * self.world
        self.fit_start = time.perf_counter()
        self.model.train()
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps or None, initial=self.step, unit="step", file=sys.stderr,
                       dynamic_ncols=True, mininterval=1.0)
        window = self.window
        window.restart_clock()
        self.sigterm = False
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            stopped = self._epochs(bar, per_step)
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
        if self.rank == 0:
            log.info("training stopped at step %d: %s", self.step, stopped)
        self.bad_steps.check(self.step, self.ckpt_dir / "last.pt")
        if self.validated_step != self.step:
            self._validate_and_save()
        return self.best

    def _on_sigterm(self, signum, frame) -> None:
        """A SIGTERM ends the run after the step in progress, with last.pt saved there: a
        scheduler's preemption notice (SLURM waits 30 s by default before SIGKILL) costs no
        training, where the default action lost every step since the last save."""
        self.sigterm = True

    def _terminated(self) -> bool:
        """Whether a SIGTERM came; under DDP every rank must stop at the same step, so they
        agree at each log step (where the loss is read anyway)."""
        if self.world == 1:
            return self.sigterm
        if self.step % self.cfg.trainer.log_every:
            return False
        flag = torch.tensor([float(self.sigterm)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _epochs(self, bar, per_step: int) -> str:
        """The training loop, until a budget ends it (its reason) or a SIGTERM (Terminated)."""
        t = self.cfg.trainer
        window = self.window
        stopped = self.stop_reason()
        while not stopped:
            batches = self.corpus.batches(t.max_tokens, t.seed, self.epoch)
            steps_in_epoch = len(batches) // per_step
            if steps_in_epoch == 0:
                raise ValueError(f"one epoch has {len(batches)} batches, fewer than "
                                 f"trainer.accumulation x processes = {per_step}")
            while self.step_in_epoch < steps_in_epoch:
                shares = step_batches(batches, self.step_in_epoch, t.accumulation, self.world)
                step_tokens = sum(self.corpus.tgt_lens[i] + 1
                                  for share in shares for b in share for i in b)
                loss, finite = self.train_step(shares[self.rank], step_tokens)
                self.step += 1
                self.step_in_epoch += 1
                self.bad_steps.count(finite)
                window.add(loss * self.world, step_tokens, finite)  # rank 0's estimate of the sum
                if (self.step % t.log_every == 0 or self.bad_steps.due()
                        or self.step % t.validate_every == 0
                        or t.save_every and self.step % t.save_every == 0):
                    # before any save: never NaN weights on disk
                    self.bad_steps.check(self.step, self.ckpt_dir / "last.pt")
                if self.step % t.log_every == 0 and bar is not None:
                    record = {"step": self.step, "epoch": self.epoch, **window.read(),
                              "lr": self.step_lr}
                    self.metrics.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{record['tgt_tokens_per_s']:.0f}", refresh=False)
                if bar is not None:
                    bar.update(1)
                if self.step % t.validate_every == 0:
                    self._validate_and_save()
                    window.restart_clock()  # tokens/s measures training only
                elif t.save_every and self.step % t.save_every == 0:
                    self.save(improved=False, step_checkpoint=False)
                if self._terminated():
                    self.bad_steps.check(self.step, self.ckpt_dir / "last.pt")
                    self.save(improved=False, step_checkpoint=False)  # as trainer.save_every
                    barrier(self.world)
                    raise Terminated(self.step)
                stopped = self.stop_reason()
                if stopped:
                    break
            if not stopped:
                self.epoch += 1
                self.step_in_epoch = 0
                stopped = self.stop_reason()
        return stopped

    def _validate_and_save(self) -> None:
        # Non-finite weights (a blow-up fewer than trainer.max_bad_steps steps ago) stop the run
        # in the words of a divergence, not inside the search that validation runs.
        check_weights(self.model, self.ckpt_dir / "last.pt")  # on every rank
        self.validated_step = self.step
        improved, record = False, None
        if self.rank == 0:
            metrics = self.validate()
            t = self.cfg.trainer
            value = metrics[BEST_METRICS[t.best_metric][0]]
            improved = improves(value, self.best, t.best_metric, t.min_improvement)
            if improved:
                self.best, self.bad_validations = value, 0
            else:
                self.bad_validations += 1
            # the epoch the last step trained in (after an epoch's last step, self.epoch is
            # already the next one, where a resume starts)
            epoch = self.epoch - 1 if self.step_in_epoch == 0 and self.step > 0 else self.epoch
            record = {"step": self.step, "epoch": epoch, **metrics, "best": self.best}
            self.metrics.write(record)
            log.info("step %d: valid loss %.3f, ppl %.2f, BLEU %.2f, chrF %.2f%s%s", self.step,
                     metrics["valid_loss"], metrics["valid_ppl"], metrics["valid_bleu"],
                     metrics["valid_chrf"], " (best)" if improved else "", "".join(
                         f"; {split}: loss {metrics[f'{split}/loss']:.3f}, BLEU "
                         f"{metrics[f'{split}/bleu']:.2f}, chrF {metrics[f'{split}/chrf']:.2f}"
                         for split in self.cfg.data.extra_valid))
        if self.world > 1:  # early stopping and the plateau cuts must agree on every rank
            state = [self.bad_validations, self.best, record]
            dist.broadcast_object_list(state, src=0)
            self.bad_validations, self.best, record = state
        self.history.append(record)
        cut = cut_on_plateau(self.optimizer, self.scheduler, self.history, self.cfg)
        if cut and self.rank == 0:
            log.info("step %d: %s", self.step, cut)
        self.save(improved)
        barrier(self.world)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def hydra_main(dcfg: DictConfig) -> float | None:
    """The run, with the mistakes a user can fix (a config value, a data file, a budget, a
    divergence, a batch too large for the device) said in one line on stderr; the traceback
    goes to train.log only, or to stderr too with HYDRA_FULL_ERROR=1, as Hydra's own errors."""
    try:
        return _run(dcfg)
    except (KeyboardInterrupt, Exception) as err:
        if _ctrl_c_within(err):  # Ctrl-C: how to go on, not a traceback from inside torch
            raise SystemExit(_interrupted()) from None
        if isinstance(err, Terminated):
            if int(os.environ.get("RANK", "0")) == 0:
                run_dir = Path(HydraConfig.get().runtime.output_dir)
                log.warning("terminated (SIGTERM) after step %d, which %s holds: the same "
                            "command with %s resumes it", err.step,
                            run_dir / "checkpoints" / "last.pt", resume_override(run_dir))
            raise SystemExit(128 + signal.SIGTERM) from None
        said = _in_words(err)
        if said is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, "mt-train failed",
                                   None, sys.exc_info())
        logs = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        for handler in logs:
            handler.handle(record)
        where = f" (traceback in {logs[0].baseFilename})" if logs else ""
        if _in_sweep():  # the next job runs all the same; main() says at the end what failed
            print(f"mt-train: {said}{where}", file=sys.stderr, flush=True)
            job = HydraConfig.get()
            _failed_jobs.append(f"#{job.job.num} in {job.runtime.output_dir}")
            return None
        raise SystemExit(f"mt-train: {said}{where}") from None


def _in_words(err: BaseException) -> str | None:
    """The one line for a failure the user can mend; None for a bug, which keeps its traceback.
    Out of device memory is the likeliest failure of a sweep over model or batch sizes."""
    if checkpoint.out_of_memory(err):
        said = (". ".join(str(err).split(". ")[:2])  # "CUDA out of memory. Tried to allocate 2 GiB"
                if isinstance(err, torch.OutOfMemoryError) else "out of memory")
        return (f"{said}: lower trainer.max_tokens (a larger trainer.accumulation keeps the "
                "batch as large)")
    if isinstance(err, OSError) and err.filename and err.strerror:  # name the file, not errno
        return f"{err.filename}: {err.strerror}"
    return str(err) if isinstance(err, ValueError | OSError | Diverged | PeerFailed) else None


_failed_jobs: list[str] = []  # the sweep's jobs that failed, by number and directory (hydra_main)


def _in_sweep() -> bool:
    """Whether this job is one of a ``-m`` sweep's. One job's mistake (a value out of range, a
    diverging learning rate) must not cost the jobs after it, as a SystemExit would."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _ctrl_c_within(err: BaseException) -> bool:
    """Whether a Ctrl-C set off this error: one that lands inside torch.save makes the zip
    writer's cleanup raise a RuntimeError of its own, with the KeyboardInterrupt only as its
    context (the atomic write has kept the last checkpoint whole all the same)."""
    seen: BaseException | None = err
    walked: set[int] = set()  # a chain can loop: an error re-raised from its own handler
    while seen is not None and id(seen) not in walked:
        if isinstance(seen, KeyboardInterrupt):
            return True
        walked.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return False


def _interrupted() -> int:
    """Says (on rank 0) what an interrupted run keeps and the override that resumes it, and
    gives the exit status of a Ctrl-C (130), so that a shell loop or a sweep stops too."""
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        last = run_dir / "checkpoints" / "last.pt"
        if last.exists():
            log.warning("interrupted; %s holds the run as of its last validation or save: the "
                        "same command with %s resumes it", last,
                        resume_override(run_dir))
        else:
            log.warning("interrupted before the first checkpoint; nothing to resume")
    return 130


def resume_override(run_dir: Path) -> str:
    """``hydra.run.dir=RUN`` as a shell command line must spell it for Hydra to read back RUN.

    Hydra's own grammar refuses a bare value with a space, a comma, parentheses or ``=`` in it
    (``shlex.quote`` alone gave ``'hydra.run.dir=/runs/a b'``, which Hydra cannot parse), so such
    a directory is quoted for Hydra inside the shell's quotes. Plain paths stay as they are."""
    text = str(run_dir)
    if not re.fullmatch(r"[\w./:+@%-]+", text):
        # Inside Hydra's quotes a backslash is literal, except in a run of them before a quote
        # or at the end, which is doubled (and the quote escaped).
        text = "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""),
                            text) + "'"
    override = f"hydra.run.dir={text}"
    if not re.search(r'["$`\\!]', override):  # the shell's double quotes read more easily
        return f'"{override}"' if override != shlex.quote(override) else override
    return shlex.quote(override)


def _one_line_per_record() -> None:
    """``datasets`` and ``huggingface_hub`` log to stderr through handlers of their own and pass
    each record on to the root logger as well, where Hydra's handlers print it again: every
    hub retry line came out twice. Their own handlers go; Hydra's print each record once, with
    a time, and keep it in train.log."""
    import datasets  # noqa: F401 - its import adds the handlers

    for name in ("datasets", "huggingface_hub"):
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            if type(handler) is logging.StreamHandler:
                library.removeHandler(handler)


def _run(dcfg: DictConfig) -> float | None:
    check_keys(dcfg)
    _one_line_per_record()
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    check_values(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        setup_distributed(cfg.trainer.device)
        run_dir, cfg = share_run(run_dir, cfg, HydraConfig.get().output_subdir)
    rank = int(os.environ.get("RANK", "0"))
    with checkpoint.run_dir_lock(run_dir) if rank == 0 else nullcontext():
        trainer = Trainer(cfg, run_dir)
        best = trainer.fit()
        if trainer.rank == 0:
            try:
                finish(trainer.cfg, trainer.run_dir, trainer.device,
                       trainer.corpus.valid[cfg.data.valid], trainer.bleu_lang)
                sys.stdout.flush()  # a file or pipe buffers: its failure shows here, not at exit
            except BrokenPipeError:  # `mt-train | head`: the reader left; the run is whole
                raise reader_left() from None
            except OSError as err:
                if err.filename:  # a file of the run (test.json, a .hyp): said as such
                    raise
                raise reader_left(f"mt-train: cannot write the results to stdout "  # > /dev/full
                                  f"({err.strerror}); the run is complete in {run_dir}") from None
    if trainer.world > 1:
        dist.destroy_process_group()
    return best


def _null_group(argv: list[str]) -> str | None:
    """A command-line ``GROUP=null`` (or ``~``), which Hydra refuses with a traceback, in words."""
    groups = {d.name for d in Path(CONF_DIR).iterdir() if d.is_dir()}
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key in groups and value.strip().lower() in ("null", "~", ""):
            return (f"mt-train: {arg}: a config group takes one of its names "
                    f"(conf/{key}/); '~{key}' drops it")
    return None


def main() -> None:
    fill_closed_descriptors(quiet_stdout=True)  # `mt-train 2>&-` died silently inside Hydra
    if mistake := _null_group(sys.argv[1:]):
        raise SystemExit(mistake)
    cap_kernel_caches()  # before the first product: see its docstring
    register_configs()
    hydra_main()
    if _failed_jobs:
        raise SystemExit(f"mt-train: {len(_failed_jobs)} job(s) of the sweep failed (said above): "
                         + "; ".join(_failed_jobs))


if __name__ == "__main__":
    main()
