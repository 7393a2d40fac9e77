"""What a run's ``last.pt`` keeps of its training beside the model (``trainer_state``), how a
run started again takes it back (``restore``), in one file so that the two stay key for key
alike, and the override that names the run to resume (``resume_override``).

With the same number of processes and ``trainer.accumulation``, a resume is exact: the same
weights, optimizer and schedule, loss scaler, data position (epoch, step within it),
validations (best so far, patience, plateau cuts), training seconds (the clock of a time budget)
and each rank's random streams, so a killed run continues the same curve. With another number
of batches per step the epoch goes on from the same batch, with new random streams.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import OmegaConf

from mt import checkpoint
from mt.batching import ENCODE_VERSION, epoch_steps
from mt.config import TrainConfig, best_so_far, config_changes
from mt.data import data_identity
from mt.divergence import BadSteps
from mt.optim import EMA, take_optim_config
from mt.runlog import Window
from mt.spm_spec import tokenizer_settings

log = logging.getLogger("mt.train")


class Run(Protocol):
    """What ``trainer_state`` reads and ``restore`` sets: ``mt.trainer.Trainer``'s attributes,
    named here rather than imported (``mt.trainer`` imports this module)."""

    cfg: TrainConfig
    config_dict: dict  # the run's config as plain data, compared with the saved one
    rank: int
    world: int
    model: torch.nn.Module
    ema: EMA | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    step: int
    epoch: int
    step_in_epoch: int
    epoch_batches: int
    best: float | None
    bad_validations: int
    history: list[dict]
    bad_steps: BadSteps
    window: Window
    seconds_before: float
    elapsed: float
    corpus: object  # mt.corpus.Corpus: its ``digest`` of the pairs an epoch is cut from
    # the init_from file the run started from (absolute; as written where an older last.pt's
    # init_from names no file now), or None: no init_from
    started_from: str | None
    tokenizer_asked: dict  # data.tokenizer as the command line gave it (mt.startup.load_start)
    started_digest: str | None  # its weights' digest (checkpoint.weights_digest); None: unknown
    run_id: str  # written into every checkpoint the run saves (mt-average compares them)

    def seconds(self) -> float: ...


def trained(model: torch.nn.Module) -> list[str]:
    """The parameters a run trains (all but trainer.freeze's), by name: the optimizer's state
    is matched to them by position, so a resume must train the same ones."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def trainer_state(trainer: Run, rng: list[dict]) -> dict:
    """What last.pt holds beside the model for ``restore``: optimizer, schedule, loss scaler, the
    position in the data, the validations so far, every rank's random streams (``rng``).
    With an EMA, the checkpoint's "model" is the average; the trained weights go here."""
    ema = ({"weights": checkpoint.weights(trainer.model), "ema_updates": trainer.ema.updates}
           if trainer.ema is not None else {})
    return {
        **ema,
        "trained": trained(trainer.model),
        "data": data_identity(trainer.cfg.data),
        "pairs": trainer.corpus.digest,
        "encoding": ENCODE_VERSION,  # how the pairs digested were encoded and filtered
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "step": trainer.step, "epoch": trainer.epoch, "step_in_epoch": trainer.step_in_epoch,
        "epoch_batches": trainer.epoch_batches,
        "best": trainer.best, "bad_validations": trainer.bad_validations,
        "history": trainer.history,
        "skipped_steps": trainer.bad_steps.skipped,
        "seconds": trainer.seconds(),
        "rng": rng[0], "rng_ranks": rng,  # "rng": rank 0's, as checkpoints before rng_ranks
        "world_size": trainer.world,
        "window": trainer.window.state(),
        "started_from": trainer.started_from,
        # a resume notes the keys the tokenizer overrules only where they are asked otherwise
        "tokenizer_asked": trainer.tokenizer_asked,
        "started_digest": trainer.started_digest,
    }


def mix_changes(saved: dict, data, digested: bool) -> list[str]:
    """What changed since the save in the epoch's list of pairs (data.upsample) or their lengths
    (data.subword_alpha, data.subword_nbest), which the kept pairs' digest does not see: the
    batches are cut from them. ``digested``: the last.pt is one of a run that drew a fractional
    share as the next stretch of shuffled passes (it holds a digest); before, at random."""
    def weights(upsample) -> dict[str, float]:  # an unnamed split is 1
        return {name: float(f) for name, f in dict(upsample or {}).items() if float(f) != 1.0}

    now, was = weights(data.upsample), weights(saved.get("upsample"))
    changes = [] if now == was else [f"data.upsample={now} (was {was})"]
    changes += [f"data.{k}={getattr(data, k)} (was {saved[k]})"
                for k in ("subword_alpha", "subword_nbest")
                if saved.get(k) is not None and saved[k] != getattr(data, k)
                and (k == "subword_alpha" or data.subword_alpha > 0)]
    if not changes and not digested and any(f % 1 for f in now.values()):
        changes.append("data.upsample's fractional shares drawn otherwise than by the version "
                       "that saved it (a stretch of shuffled passes now, a random draw then)")
    return changes


def _other_pairs_cause(state: dict) -> str:
    """What may have changed the kept pairs since ``state`` (a last.pt's) was saved. An mt that
    encodes or filters them otherwise changes them too, with no file or setting changed (since
    mt-encode-2, a source without text is dropped as empty): the warning named only those two,
    and sent a user who had only updated mt looking for an edit that was never made."""
    saved = state.get("encoding")
    if saved == ENCODE_VERSION:
        return "a training file changed since, or a data setting"
    return ("a training file changed since, a data setting, or an mt update since the save ("
            + (f"{saved} then, {ENCODE_VERSION} now" if saved else
               f"this one encodes and filters them as {ENCODE_VERSION}") + ")")


def _tokenizer_as_made(config: dict, tokenizer: dict | None) -> dict:
    """``config`` (a last.pt's) with the settings its ``tokenizer`` has, as this run records them
    (``mt.spm_spec``): a last.pt saved before they were read from the models recorded the command
    line's (vocab_size=8000 for a reused tokenizer of 200 pieces), which is no change made now."""
    data = config.get("data")
    if not tokenizer or not isinstance(data, dict) or not isinstance(data.get("tokenizer"), dict):
        return config
    made = {**data["tokenizer"], **tokenizer_settings(tokenizer)}
    return {**config, "data": {**data, "tokenizer": made}}


def restore(trainer: Run, path: Path) -> None:
    """Puts the run that ``path`` (a last.pt) holds back into ``trainer``, built from this run's
    config: what changed since is said, what cannot change (the parameters trained) refused."""
    ckpt = checkpoint.load(path)
    saved_config = ckpt.get("config") or {}
    if trainer.rank == 0:
        schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
        changed = config_changes(_tokenizer_as_made(saved_config, ckpt.get("tokenizer")),
                                 trainer.config_dict, defaults=schema)
        if changed:
            log.info("resuming with settings changed since %s: %s", path, ", ".join(changed))
    if "trainer" not in ckpt:
        raise ValueError(f"{path} holds weights only, no training state (an average or an "
                         "imported model?), so the run cannot resume from it; move it away "
                         "and give it as init_from=... to start from its weights")
    state = ckpt["trainer"]
    # the same run: its step files go on averaging with those before (a last.pt saved before
    # runs had an id keeps the new one, which its older files, having none, do not contradict)
    trainer.run_id = ckpt.get("run_id") or trainer.run_id
    trainer.started_digest = state.get("started_digest")
    trainer.started_from = _check_init_from(trainer, state, saved_config, path)
    was, now = state.get("data"), data_identity(trainer.cfg.data)
    if trainer.rank == 0 and was is not None and was != now:  # louder than the settings above
        # a mistaken data=... went on training the same weights on another corpus unnoticed
        log.warning("resuming %s on other data than it trained on: %s; a model carried on to "
                    "new data is init_from=%s in a new run directory", path,
                    ", ".join(f"{k}={now.get(k)!r} (was {was.get(k)!r})"
                              for k in sorted(was.keys() | now.keys()) if was.get(k) != now.get(k)),
                    path)
    # "model" is what translates: with an EMA, the average; the trained weights are beside it
    trainer.model.load_state_dict(state.get("weights") or ckpt["model"])
    if trainer.ema is not None and "weights" in state:
        trainer.ema.load(ckpt["model"], state["ema_updates"])
    elif trainer.ema is not None:  # trained without one so far: the average starts here
        trainer.ema = EMA(trainer.model, trainer.cfg.trainer.ema_decay)
    # The kernel is this run's choice, not the saver's; so is AdamW's decoupled weight decay
    # (optim.name): the saved group's flag would keep an adamw run resumed as adam an AdamW.
    for saved, group in zip(state["optimizer"]["param_groups"], trainer.optimizer.param_groups,
                            strict=True):
        saved.update({k: group[k] for k in ("fused", "foreach", "decoupled_weight_decay")
                      if k in group})
    # The optimizer's state is matched to parameters by position: the same ones must train.
    saved_freeze = (saved_config.get("trainer") or {}).get("freeze", [])
    if state.get("trained", trained(trainer.model)) != trained(trainer.model) or (
            "trained" not in state and list(saved_freeze) != list(trainer.cfg.trainer.freeze)):
        raise ValueError(f"{path}: the run trained another set of parameters (its "
                         f"trainer.freeze={list(saved_freeze)}, now "
                         f"{list(trainer.cfg.trainer.freeze)}); resume with its trainer.freeze, "
                         "or start a new run with init_from")
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.history = state["history"]  # before take_optim_config: its rate has the cuts
    # and the seconds trained: a time-budgeted schedule's rate depends on them
    trainer.seconds_before = trainer.elapsed = state.get("seconds", 0.0)
    changed = take_optim_config(trainer.optimizer, trainer.scheduler, trainer.cfg)
    if changed and trainer.rank == 0:  # every rank takes them; one says so
        log.warning("resuming with %s", ", ".join(changed))
    if state["scaler"]:  # {} from a run without fp16: an enabled scaler refused it; starts anew
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step, trainer.epoch = state["step"], state["epoch"]
    trainer.step_in_epoch = state["step_in_epoch"]
    # The position in the epoch is counted in steps; a step is accumulation x processes
    # batches. Another count per step would start the epoch again at another batch.
    saved_acc = (saved_config.get("trainer") or {}).get("accumulation", 1)
    saved_per_step = saved_acc * state["world_size"]
    per_step = trainer.cfg.trainer.accumulation * trainer.world
    if saved_per_step != per_step:
        seen, batches = trainer.step_in_epoch * saved_per_step, state.get("epoch_batches", 0)
        if batches and seen >= batches:
            # the epoch's last, partial step was taken: all its batches are, none again (an
            # older last.pt knows no count, and counts a partial step whole)
            seen, again = batches, 0
            trainer.step_in_epoch = epoch_steps(batches, trainer.cfg.trainer.accumulation,
                                                trainer.world)
        else:
            trainer.step_in_epoch = seen // per_step
            again = seen - trainer.step_in_epoch * per_step
        if trainer.rank == 0:
            log.warning("resuming with %d batches per step (trainer.accumulation x processes) "
                        "where the run took %d: each update changes size, and the epoch goes "
                        "on from its batch %d%s", per_step, saved_per_step, seen - again,
                        f" ({again} of its batches trained again)" if again else "")
    # The epoch's batches are cut by max_tokens and shuffled by the seed: either one new cuts
    # the rest of the epoch from another list than the one the position counts in.
    saver = saved_config.get("trainer") or {}
    cutting = {k: getattr(trainer.cfg.trainer, k) for k in ("max_tokens", "seed")}
    cut = [f"trainer.{k}={v} (was {saver[k]})" for k, v in cutting.items()
           if saver.get(k) is not None and saver[k] != v]
    if state.get("pairs", trainer.corpus.digest) != trainer.corpus.digest:
        cut.append(f"other training pairs than the saved run's ({_other_pairs_cause(state)})")
    cut += mix_changes(saved_config.get("data") or {}, trainer.cfg.data, "pairs" in state)
    if trainer.rank == 0 and trainer.step_in_epoch and cut:
        log.warning("resuming in the middle of epoch %d with %s: its batches are cut anew, so "
                    "the rest of it is not the rest of the saved one (some pairs come twice, "
                    "some not at all); the next epoch is whole", trainer.epoch, ", ".join(cut))
    t = trainer.cfg.trainer  # replayed: the metric or threshold may differ from the saver's
    trainer.best, trainer.bad_validations = best_so_far(trainer.history, t.best_metric,
                                                        t.min_improvement)
    if (trainer.best, trainer.bad_validations) != (state["best"], state["bad_validations"]):
        log.info("resuming with trainer.best_metric=%s: best valid %s %s so far, %d "
                 "validations without a better one", t.best_metric, t.best_metric,
                 trainer.best, trainer.bad_validations)
    trainer.bad_steps.skipped = state.get("skipped_steps", 0)
    if "window" in state:
        trainer.window.load(state["window"])
    # Each rank's streams go on where they stopped. Else they stay new ones (another world
    # size, or a checkpoint older than rng_ranks, which held rank 0's alone): no exact resume.
    ranks = state.get("rng_ranks", [state["rng"]])
    if state["world_size"] == trainer.world and trainer.rank < len(ranks):
        checkpoint.set_rng_state(ranks[trainer.rank])
    log.info("resumed %s at step %d (epoch %d, step %d of it)", path, trainer.step, trainer.epoch,
             trainer.step_in_epoch)
    if (trainer.rank == 0 and trainer.step and trainer.step % t.validate_every == 0
            and not any(r["step"] == trainer.step for r in trainer.history)):
        log.info("step %d is not validated yet (a SIGTERM or SIGHUP cut its validation short, "
                 "or trainer.validate_every is new): it is validated first", trainer.step)


def _check_init_from(trainer: Run, state: dict, saved_config: dict, path: Path) -> str | None:
    """The init_from file the resumed run started from, with a warning where this run's
    ``init_from`` names another model: a run directory with a last.pt resumes it, and the
    model named went unused, said only among the changed settings ('init_from=new.pt (was
    base.pt)'): a fine-tuning run started in a folder reused by mistake went on training the
    old run's model, of another shape even. A last.pt saved before ``started_from`` names its
    origin by its config's init_from, relative to a directory not known here; where that names
    no file now, it is kept as written (None would tell the next resume 'no init_from')."""
    saved_init = saved_config.get("init_from")
    if "started_from" in state:
        started, known = state["started_from"], True
    else:
        found = checkpoint.resolved(saved_init) if saved_init else None
        started, known = (str(found.resolve()) if found else saved_init), not saved_init or found
    asked = trainer.cfg.init_from
    if not asked or not known or trainer.rank != 0:
        return started
    # Not skipped where the last.pt's config names the same: after one resume with another
    # init_from it does, and the same command run again (a job requeued) went on unwarned.
    found = checkpoint.resolved(asked)
    # the run's own model, deleted or moved since; or as an older last.pt named it, kept as written
    if (found is None and asked == saved_init) or asked == started:
        return started
    if found is not None and str(found.resolve()) != started and _same_weights(
            found, state.get("started_digest")):
        # Moved or renamed since: its new name is the one to tell (a later warning named the
        # old path, where no file was), and the one the next resume compares.
        log.info("init_from=%s holds the weights this run started from (as %s; the same by "
                 "their digest): the run goes on, and names it so from now on", asked, started)
        return str(found.resolve())
    if found is None or str(found.resolve()) != started:
        gone = " (no file there now)" if started and not os.path.exists(started) else ""
        log.warning("init_from=%s is not used: %s resumes the run of %s, which started from %s%s;"
                    " to start from %s, give the run another directory (hydra.run.dir)", asked,
                    path.parent.parent, path, started or "no model (no init_from)", gone, asked)
    return started


def _same_weights(found: Path, digest: str | None) -> bool:
    """Whether the checkpoint ``found`` holds the weights of ``digest`` (the run's starting
    model, moved or copied under another name since); False where either is unknown."""
    if digest is None:  # a last.pt saved before runs kept it: the paths decide
        return False
    try:
        ckpt = checkpoint.load(found, mmap=True)
    except (OSError, ValueError):  # not a checkpoint: another model, as far as one can tell
        return False
    return "model" in ckpt and checkpoint.weights_digest(ckpt["model"]) == digest


def resume_override(run_dir: Path) -> str:
    """``hydra.run.dir=RUN`` as a shell command line must spell it for Hydra to read back RUN;
    for a job of a ``-m`` sweep, ``hydra.sweep.dir=`` the sweep's folder, which the same ``-m``
    command resumes job by job (``hydra.run.dir`` with ``-m`` is not read at all).

    Hydra's own grammar refuses a bare value with a space, a comma, parentheses or ``=`` in it
    (``shlex.quote`` alone gave ``'hydra.run.dir=/runs/a b'``, which Hydra cannot parse), so such
    a directory is quoted for Hydra inside the shell's quotes. Plain paths stay as they are."""
    key, sweep = "hydra.run.dir", _sweep_dir(run_dir)
    if sweep is not None:
        key, run_dir = "hydra.sweep.dir", sweep
    text = str(run_dir)
    if not re.fullmatch(r"[\w./:+@%-]+", text):
        # Inside Hydra's quotes a backslash is literal, except in a run of them before a quote
        # or at the end, which is doubled (and the quote escaped).
        text = "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""),
                            text) + "'"
    override = f"{key}={text}"
    if not re.search(r'["$`\\!]', override):  # the shell's double quotes read more easily
        return f'"{override}"' if override != shlex.quote(override) else override
    return shlex.quote(override)


def _sweep_dir(run_dir: Path) -> Path | None:
    """The sweep folder that holds ``run_dir``, a ``-m`` job's (``hydra.sweep.subdir`` under it,
    the job's number by default); None outside a sweep. Read off the job's own folder:
    ``hydra.sweep.dir`` read again would resolve its ``${now:...}`` to another time."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    sub = Path(HydraConfig.get().sweep.subdir).parts
    return Path(*run_dir.parts[: -len(sub)]) if run_dir.parts[-len(sub):] == sub else None


def set_aside(run_dir: Path) -> None:
    """Moves what an earlier run left in ``run_dir`` without a last.pt (deleted to start over,
    or a kill between the first validation's step_N.pt and last.pt) into
    ``run_dir/earlier/TIME/`` (with its metrics, test scores and translations), before this run
    starts afresh. Left in place, an earlier run's
    step_N.pt counted among this run's: pruning kept it and deleted this run's, averaging took
    it in; metrics.jsonl was cut to nothing, and its TensorBoard events hidden by the new
    writer's purge. Nothing is deleted."""
    ckpt_dir = run_dir / "checkpoints"
    found = sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else []
    if not found:  # a run stopped before its first checkpoint: its log lines go, as before
        return
    found += [p for p in (run_dir / "metrics.jsonl", run_dir / "curves.png", run_dir / "test.json",
                          run_dir / "tensorboard", run_dir / "valid",
                          *sorted(run_dir.glob("*.hyp"))) if p.exists()]
    earlier = run_dir / "earlier" / time.strftime("%Y-%m-%d_%H-%M-%S")
    while earlier.exists():  # two fresh starts within a second
        earlier = earlier.with_name(earlier.name + "+")
    earlier.mkdir(parents=True)
    for path in found:  # shutil: a checkpoints/ linked to scratch space is another file system
        shutil.move(path, earlier / path.name)
    log.warning("%s held %s but no last.pt: moved to %s, and this run starts afresh",
                ckpt_dir, ", ".join(p.name for p in found), earlier)


# mt.textio.replace_file's temporary name: the file's, between a dot and the writer's process id
_TEMPORARY = re.compile(r"\..+\.(\d+)\.tmp")


def remove_killed_writes(run_dir: Path) -> None:
    """Deletes what writes killed by SIGKILL (or a machine that went down) left in ``run_dir``,
    which nothing else removes: the unfinished checkpoints (``checkpoint.remove_unfinished``)
    and the hidden temporaries of ``replace_file`` (``valid/.step_N.hyp.PID.tmp``,
    ``tokenizer/.spm.model.PID.tmp``, ``.metrics.jsonl.PID.tmp``, ...) whose process has
    ended. For rank 0 as the run starts, holding the directory (``run_dir_lock``): the other
    ranks write nothing there, and a temporary of a process still running stays all the same.
    Only the folders mt-train writes are looked in (``hydra.run.dir=.`` makes the run directory
    a folder of the user's; a tokenizer folder that other runs share lies outside it)."""
    ckpt_dir = run_dir / "checkpoints"
    if removed := checkpoint.remove_unfinished(ckpt_dir):
        log.info("removed %d unfinished checkpoint write(s) from %s (a killed run's)",
                 removed, ckpt_dir)
    valid = run_dir / "valid"  # and a folder per data.extra_valid split in it
    folders = [run_dir, run_dir / "tokenizer", run_dir / "data", valid,
               *(valid.iterdir() if valid.is_dir() else [])]
    stale = [path for folder in folders if folder.is_dir() for path in folder.glob(".*.tmp")
             if (m := _TEMPORARY.fullmatch(path.name)) and not _running(int(m[1]))]
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temporary file(s) of killed writes from %s: %s", len(stale),
                 run_dir, ", ".join(str(p.relative_to(run_dir)) for p in stale[:5])
                 + (", ..." if len(stale) > 5 else ""))


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (this one included; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # another user's, or past asking: kept
        return True
    return True
