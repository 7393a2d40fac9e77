"""The training loop: ``Trainer`` builds the tokenizer, corpus, model and optimizer of a run,
takes optimizer steps, validates, and writes checkpoints; ``mt.train`` is its command line.

Under ``torchrun`` each process takes its share of every optimizer step (DistributedDataParallel,
gloo on CPU, NCCL on GPU); only rank 0 writes. One optimizer step consumes ``accumulation *
world_size`` consecutive batches of the epoch's shuffled batch list, rank r taking micro-batches
``r * accumulation ...`` (an epoch's last step takes the batches left, fewer); the loss is the
sum of token losses divided by the number of target tokens in the whole step. So the same
product ``accumulation * world_size`` gives the same update, whatever the split.

A run directory started again resumes by itself from ``checkpoints/last.pt``: model, optimizer,
schedule, RNG states and the position in the data (epoch, step within the epoch).
"""

from __future__ import annotations

import logging
import random
import sys
import time
import uuid
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mt import checkpoint, resume, startup
from mt.batching import epoch_steps, step_batches
from mt.config import BEST_METRICS, TrainConfig, improves
from mt.corpus import Corpus
from mt.distributed import (
    SigtermWatch,
    Terminated,
    ValidationCut,
    barrier,
    rank_seed,
    setup_distributed,
)
from mt.divergence import BadSteps, check_weights
from mt.loss import label_smoothed_nll
from mt.model import avoid_cudnn_attention
from mt.optim import autocast_dtype, cut_on_plateau
from mt.runlog import Metrics, UnreadStderr, Window, bleu_language, validate
from mt.stopping import budget_spent

log = logging.getLogger("mt.train")


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
        if self.rank == 0:  # what writes killed by SIGKILL left: temporaries, half checkpoints
            resume.remove_killed_writes(run_dir)
        last = self.ckpt_dir / "last.pt"
        resuming = last.exists()
        init = cfg.init_from and checkpoint.resolved(cfg.init_from)  # else _start says why
        if not resuming and init and self.ckpt_dir.resolve() in init.resolve().parents:
            raise ValueError(f"init_from={cfg.init_from}: in this run's own checkpoints/, which "
                             "a fresh run sets aside and fills anew; copy it elsewhere, or "
                             "start in another run directory")
        start, origin = self._start(last if resuming else None)
        self.started_from = None if resuming or not start else str(Path(start["path"]).resolve())
        # its weights too: the same model moved or copied under another name is no other model
        self.started_digest = (checkpoint.weights_digest(start["model"])
                               if self.started_from and self.rank == 0 else None)
        if not resuming and self.rank == 0:
            resume.set_aside(run_dir)
        self.corpus = self._corpus(start, origin)
        self.bleu_lang = bleu_language(cfg.data.tgt_lang)  # zh, ja, ko: their BLEU tokenizer
        self.model = self._model(None if resuming else start)
        del start
        self._optimization()  # optimizer, ema, scheduler, scaler, net, the clocks, history
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.epoch_batches = 0  # the epoch's batches, once it has begun (resume: last.pt)
        self.best, self.bad_validations = None, 0
        self.bad_steps = BadSteps(self.device, cfg.trainer.max_bad_steps)
        self.sigterm = SigtermWatch(self.world, self.device, cfg.trainer.log_every)
        self.validated_step = -1
        self.window = Window(self.device)  # the loss and speed since the last log line
        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
        self.run_id = uuid.uuid4().hex  # a new run's; a resume takes its last.pt's
        if resuming:
            resume.restore(self, last)
            if self.history and self.history[-1]["step"] == self.step:
                self.validated_step = self.step  # a finished run restarted: do not validate again
        self.metrics = (Metrics(run_dir, cfg.trainer.tensorboard, self.step) if self.rank == 0
                        else None)

    # -- set-up: mt.startup (its functions, as methods a test can replace)

    def _start(self, last: Path | None) -> tuple[dict | None, str]:
        return startup.load_start(self, last)

    def _corpus(self, start: dict | None, origin: str) -> Corpus:
        return startup.make_corpus(self, start, origin)

    def _model(self, init: dict | None) -> torch.nn.Module:
        return startup.make_model(self, init)

    def _optimization(self) -> None:
        startup.make_optimization(self)

    # -- checkpoints

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
                                               self.config_dict, self.run_id)
        # last.pt comes after the files of this validation: a run killed between them resumes
        # from the last.pt before, validates this step again and writes them again. Written
        # first, it would hold this validation as done, and its best.pt never came.
        t = self.cfg.trainer
        steps = step_checkpoint and (t.keep_last > 0 or t.keep_best > 0 or t.average_last > 0)
        if steps:
            checkpoint.save_atomic(inference, self.ckpt_dir / f"step_{self.step}.pt")
        if improved:
            checkpoint.save_atomic(inference, self.ckpt_dir / "best.pt")
        checkpoint.save_atomic({**inference, "trainer": resume.trainer_state(self, rng)},
                               self.ckpt_dir / "last.pt")
        if steps:
            checkpoint.prune_step_checkpoints(self.ckpt_dir, self.history,
                                              max(t.keep_last, t.average_last),
                                              t.keep_best, t.best_metric)

    # -- validation

    def _averaged(self):
        """The EMA's weights in the model (trainer.ema_decay), or the model as it is."""
        return self.ema.applied() if self.ema is not None else nullcontext()

    def validate(self) -> dict | None:
        """The scores on data.valid (valid_loss, ...) and on each of data.extra_valid's splits
        (SPLIT/loss, ...); the translations in valid/step_N.hyp and valid/SPLIT/step_N.hyp.
        None where a SIGTERM or SIGHUP cut it short (``SigtermWatch.between_batches``)."""
        self.model.eval()
        c, metrics, t = self.corpus, {}, self.cfg.trainer
        try:
            with self._averaged(), torch.inference_mode(), self._autocast():
                for split, (src, tgt) in c.valid.items():
                    extra = split != self.cfg.data.valid
                    folder = self.run_dir / "valid" / (split if extra else "")
                    hyps = folder / f"step_{self.step}.hyp"
                    scores = validate(self.model, c.tokenizer, src, tgt, t, self.device,
                                      hyps if t.save_valid_hyps else None, split, self.bleu_lang,
                                      self.sigterm.between_batches)
                    metrics.update({f"{split}/{key.removeprefix('valid_')}": v
                                    for key, v in scores.items()} if extra else scores)
        except ValidationCut:
            return None
        finally:
            self.model.train()
        return metrics

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # -- the loop

    def train_step(self, micro_batches: list[list[int]], step_tokens: int,
                   weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro-batches.

        ``weight`` 0: a rank without a batch in an epoch's last, partial step runs another
        rank's through (DDP needs every rank's backward) and adds nothing to the update or loss.

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
                self.scaler.scale(loss * (self.world * weight / step_tokens)).backward()
            loss_total += torch.stack([loss.detach(), nll.detach()]).float() * weight
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
        """Why training ends now, "" while it goes on (``mt.stopping.budget_spent``)."""
        return budget_spent(self)

    def fit(self) -> float | None:
        t = self.cfg.trainer
        if not (t.max_steps or t.max_epochs or t.max_minutes or t.patience) and self.rank == 0:
            log.warning("no budget (trainer.max_steps, max_epochs, max_minutes and patience are "
                        "all 0): training goes on until you stop it; the same command with %s "
                        "resumes it", resume.resume_override(self.run_dir))
        o = self.cfg.optim  # cosine refuses this (mt.optim.lr_lambda); the others only ramp up
        # step warmup_steps runs at optim.lr: a run of exactly that many steps reaches it
        if t.max_steps and o.warmup_steps > t.max_steps and self.rank == 0:
            log.warning("optim.warmup_steps=%d is above trainer.max_steps=%d: the learning "
                        "rate rises all run and never reaches optim.lr=%g (%.3g at the last "
                        "step); lower optim.warmup_steps", o.warmup_steps, t.max_steps, o.lr,
                        o.lr * t.max_steps / o.warmup_steps)
        per_step = t.accumulation * self.world
        self.fit_start = time.perf_counter()
        self.model.train()
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps or None, initial=self.step, unit="step",
                       file=UnreadStderr(sys.stderr), dynamic_ncols=True, mininterval=1.0)
        window = self.window
        window.restart_clock()
        # and through the final validation: a SIGTERM there cuts it, saves last.pt, as in the loop
        with self.sigterm.watching():
            try:
                stopped = self._epochs(bar, per_step)
            finally:
                if bar is not None:
                    bar.close()
            if self.sigterm.agreed(self.step, now=True):  # one after the loop's last look
                self._stop_for_sigterm()
            if self.rank == 0:
                log.info("training stopped at step %d: %s", self.step, stopped)
            self.bad_steps.check(self.step, self.ckpt_dir / "last.pt")
            if self.validated_step != self.step:
                self._validate_and_save()
                if self.sigterm.agreed(self.step, now=True):  # last.pt holds this step
                    raise Terminated(self.step, self.sigterm.signal)
        return self.best

    def _stop_for_sigterm(self) -> None:
        """last.pt at this step (as trainer.save_every writes it), then Terminated: a resume
        loses nothing."""
        self.bad_steps.check(self.step, self.ckpt_dir / "last.pt")
        self.save(improved=False, step_checkpoint=False)
        barrier(self.world)
        raise Terminated(self.step, self.sigterm.signal)

    def _epochs(self, bar, per_step: int) -> str:
        """The training loop, until a budget ends it (its reason) or a SIGTERM (Terminated)."""
        t = self.cfg.trainer
        window = self.window
        stopped = self.stop_reason()
        if (not stopped and self.step and self.step % t.validate_every == 0
                and self.validated_step != self.step):
            self._validate_and_save()  # resumed after a stop signal cut the validation of this step
            window.restart_clock()
            stopped = self.stop_reason()  # trainer.patience may have run out at it
        while not stopped:
            batches = self.corpus.batches(t.max_tokens, t.seed, self.epoch)
            self.epoch_batches = len(batches)
            steps_in_epoch = epoch_steps(len(batches), t.accumulation, self.world)
            if steps_in_epoch == 0:
                shrunk = {s: f for s, f in self.cfg.data.upsample.items() if f < 1}
                why = (f" (data.upsample {', '.join(f'{s}={f:g}' for s, f in shrunk.items())} "
                       "trains the next share of a shuffled pass each epoch: here too few)"
                       if shrunk else "")
                raise ValueError(f"epoch {self.epoch} has no batch to train on{why}")
            ends = steps_in_epoch * t.max_epochs  # about: a drawn share or segmentation varies
            if (self.step == 0 and self.rank == 0 and self.cfg.optim.schedule == "cosine"
                    and t.max_epochs and 0 < ends < t.max_steps):
                log.warning("trainer.max_epochs=%d ends the run at about step %d, before "
                            "optim.schedule=cosine decays to optim.min_lr at trainer.max_steps=%d "
                            "(the schedule counts steps, not epochs): set trainer.max_steps=%d",
                            t.max_epochs, ends, t.max_steps, ends)
            while self.step_in_epoch < steps_in_epoch:
                shares = step_batches(batches, self.step_in_epoch, t.accumulation, self.world)
                step_tokens = sum(self.corpus.tgt_lens[i] + 1
                                  for share in shares for b in share for i in b)
                mine = shares[self.rank]  # none: a partial step's rank (train_step)
                loss, finite = self.train_step(mine or shares[0][:1], step_tokens,
                                               1.0 if mine else 0.0)
                self.step += 1
                self.step_in_epoch += 1
                self.bad_steps.count(finite)
                # rank 0's estimate of the step's sum: its loss per token over all the step's
                # tokens (x world overstated an epoch's last step, where rank 0 may hold them all)
                if self.world > 1:  # one process holds the step's tokens: its own sum
                    own = sum(self.corpus.tgt_lens[i] + 1 for b in mine for i in b)
                    loss = loss * (step_tokens / max(own, 1))
                window.add(loss, step_tokens, finite)
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
                if self.sigterm.agreed(self.step):
                    self._stop_for_sigterm()
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
        improved, record = False, None
        if self.rank == 0 and (metrics := self.validate()) is not None:  # None: cut short
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
        if self.world > 1:  # early stopping, the plateau cuts and a cut must agree on every rank
            state = [self.bad_validations, self.best, record, self.sigterm.signal]
            dist.broadcast_object_list(state, src=0)
            self.bad_validations, self.best, record, signum = state
            self.sigterm.signal = self.sigterm.signal or signum
        if record is None:  # a stop signal cut it: last.pt at this step, which a resume validates
            self._stop_for_sigterm()
        self.validated_step = self.step
        self.history.append(record)
        cut = cut_on_plateau(self.optimizer, self.scheduler, self.history, self.cfg)
        if cut and self.rank == 0:
            log.info("step %d: %s", self.step, cut)
        self.save(improved)
        barrier(self.world)

