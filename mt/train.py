"""``mt-train``: the Hydra entry point. It checks the config, runs ``mt.trainer.Trainer`` under
the run directory's lock, tests the best checkpoint at the end, and turns the failures a user can
mend (a config value, a data file, a budget, a divergence, a batch too large for the device,
Ctrl-C, SIGTERM) into one line on stderr.

``mt-train`` with no arguments trains ``transformer_tiny`` on the generated demo corpus;
``torchrun --nproc_per_node N -m mt.train ...`` trains under DDP (``mt.trainer`` says how a step
is shared).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mt import checkpoint, version_line
from mt.config import TrainConfig, conf_dir, register_configs
from mt.config_checks import SetupRefused, check_keys, check_values
from mt.distributed import (
    STOP_SIGNALS,
    PeerFailed,
    Terminated,
    peer_gone,
    setup_distributed,
    share_run,
)
from mt.divergence import Diverged
from mt.hydra_dirs import ConfigRefused
from mt.hydra_errors import one_line_refusals
from mt.inference import cap_kernel_caches
from mt.interrupts import terminate_as_interrupt
from mt.resume import resume_override
from mt.runlog import finish
from mt.textio import fill_closed_descriptors, nearest_existing, reader_left
from mt.trainer import Trainer

log = logging.getLogger("mt.train")

CONF_DIR = str(conf_dir())


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def hydra_main(dcfg: DictConfig) -> float | None:
    """The run, with the mistakes a user can fix (a config value, a data file, a budget, a
    divergence, a batch too large for the device) said in one line on stderr; the traceback
    goes to train.log only, or to stderr too with HYDRA_FULL_ERROR=1, as Hydra's own errors."""
    try:
        # SIGTERM (or SIGHUP) while the data is prepared or the final test runs ends as Ctrl-C
        # does, in words (it killed the process without one); the training loop has a handler
        # of its own, which saves the step it stops at
        with terminate_as_interrupt(STOP_SIGNALS):
            try:
                cfg = _checked(dcfg)
            except (ValueError, OmegaConfBaseException) as err:
                said = _in_words(err)
                if said is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                return _refused(said)
            return _run(cfg)
    except (KeyboardInterrupt, Exception) as err:
        if signum := _ctrl_c_within(err):  # how to go on, not a traceback from inside torch
            raise SystemExit(_interrupted(signum)) from None
        if isinstance(err, Terminated):
            if int(os.environ.get("RANK", "0")) == 0:
                run_dir = Path(HydraConfig.get().runtime.output_dir)
                log.warning("terminated (%s) after step %d, which %s holds: the same "
                            "command with %s resumes it", signal.Signals(err.signal).name,
                            err.step, run_dir / "checkpoints" / "last.pt",
                            resume_override(run_dir))
            raise SystemExit(128 + err.signal) from None
        said = _in_words(err)
        if said is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(err, SetupRefused):  # model.heads=3: refused under the run's lock
            return _refused(_in_words(err.__cause__) or said, leaves=(checkpoint.LOCK,))
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
    if isinstance(err, FloatingPointError):  # mt.search.NOT_A_NUMBER, in a validation or test
        return (f"{err} in a validation or the final test: with trainer.precision=fp16, bf16 or "
                "fp32 keeps activations finite; else the model diverged (lower optim.lr)")
    if isinstance(err, OSError) and err.filename and err.strerror:  # name the file, not errno
        return f"{err.filename}: {err.strerror}"
    if isinstance(err, OmegaConfBaseException) and isinstance(err, ValueError) and err.full_key:
        # optim.lr='${foo}', resolved as the run starts: the key, not OmegaConf's 3 type lines
        return f"{err.full_key}: {str(err.msg or err).splitlines()[0]}"
    if gone := peer_gone(err):  # a rank killed outright: gloo's traceback, else
        return str(gone)
    return str(err) if isinstance(err, ValueError | OSError | Diverged | PeerFailed) else None


_failed_jobs: list[str] = []  # the sweep's jobs that failed, by number and directory (hydra_main)


def _checked(dcfg: DictConfig) -> TrainConfig:
    """The config as dataclasses, once mt's checks have passed it: its keys (a ``+key`` the
    schema lacks), its types and interpolations, the ranges of its values."""
    check_keys(dcfg)
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    check_values(cfg)
    return cfg


def _refused(said: str, leaves: tuple[str, ...] = ()) -> None:
    """A config that mt's checks refused (``_checked``, or ``check_setup``'s ``SetupRefused``):
    a mistake in the command, not a crash, so no traceback and nothing that points at one. The
    line goes to train.log too (for a run directory that stays: one that was there before, or
    a sweep's job); a run ends with
    ``ConfigRefused``, on which ``mt.hydra_dirs`` takes away the run directory this command made
    (with ``leaves``, the files the run wrote there before the refusal); a sweep goes on to its
    next job."""
    line = f"mt-train: {said}"
    record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    if _in_sweep():
        print(line, file=sys.stderr, flush=True)
        job = HydraConfig.get()
        _failed_jobs.append(f"#{job.job.num} in {job.runtime.output_dir}")
        return None
    raise ConfigRefused(line, leaves)


def _in_sweep() -> bool:
    """Whether this job is one of a ``-m`` sweep's. One job's mistake (a value out of range, a
    diverging learning rate) must not cost the jobs after it, as a SystemExit would."""
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _ctrl_c_within(err: BaseException) -> int:
    """The signal (SIGINT, or SIGTERM or SIGHUP outside the training loop) that set off this
    error, 0 if none: one that lands inside torch.save makes the zip writer's cleanup raise a
    RuntimeError of its own, with the KeyboardInterrupt only as its context (the atomic write
    has kept the last checkpoint whole all the same)."""
    seen: BaseException | None = err
    walked: set[int] = set()  # a chain can loop: an error re-raised from its own handler
    while seen is not None and id(seen) not in walked:
        if isinstance(seen, KeyboardInterrupt):
            return getattr(seen, "signal", signal.SIGINT)
        walked.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return 0


def _interrupted(signum: int) -> int:
    """Says (on rank 0) what an interrupted run keeps and the override that resumes it, and
    gives the exit status of the signal (130 for Ctrl-C), so that a shell loop or a sweep
    stops too."""
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        last = run_dir / "checkpoints" / "last.pt"
        how = ("interrupted" if signum == signal.SIGINT
               else f"terminated ({signal.Signals(signum).name})")
        if last.exists():
            log.warning("%s; %s holds the run as of its last validation or save: the "
                        "same command with %s resumes it", how, last, resume_override(run_dir))
        else:
            log.warning("%s before the first checkpoint; nothing to resume", how)
    return 128 + signum


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


def _run(cfg: TrainConfig) -> float | None:
    _one_line_per_record()
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
        # The Trainer sits in reference cycles (its schedule's lambdas), so its DDP wrapper, which
        # holds the process group, would be freed only as the interpreter exits: gloo's threads
        # torn down then can abort the process (rank 1 died with "terminate called without an
        # active exception" once in 12 runs of a two-process test; that cause is inferred, not
        # reproduced on demand). Freed now, while Python runs.
        del trainer
        gc.collect()
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


# Hydra's modes, of which a command takes one ("Only one of --run, --multirun, --cfg, --info and
# --shell_completion can be specified", a ValueError that Hydra raises outside its error report)
_MODES = {"-r": "--run", "--run": "--run", "-m": "--multirun", "--multirun": "--multirun",
          "-c": "--cfg", "--cfg": "--cfg", "-i": "--info", "--info": "--info",
          "-sc": "--shell-completion", "--shell-completion": "--shell-completion"}


def _two_modes(argv: list[str]) -> str | None:
    """Two of Hydra's modes on one command line, in words: ``mt-train -m ... --cfg job`` (to see
    a sweep's config) was a traceback. ``--help`` goes before them all, as Hydra takes it."""
    if {"-h", "--help", "--hydra-help"} & set(argv):
        return None
    given = {_MODES[a.partition("=")[0]]: a.partition("=")[0] for a in argv
             if a.partition("=")[0] in _MODES}
    if len(given) < 2:
        return None
    first, second = list(given.values())[:2]
    hint = ("--cfg and --info show one job's config: leave -m out and give one value per key"
            if "--multirun" in given and {"--cfg", "--info"} & given.keys()
            else "give one of them")
    return f"mt-train: {first} and {second} cannot be given together; {hint}"


# Hydra's flags that print and make no run directory: they work from any folder.
_NO_RUN = {"-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
           "--shell-completion", "--version"}


def _unwritable_run_dir(argv: list[str]) -> str | None:
    """A run directory that cannot be made, in words. Hydra makes it (with .hydra/ and
    train.log) before mt's code runs, and said so in a traceback: ``mt-train`` started from a
    read-only checkout, or ``hydra.run.dir`` under a file. Only the part of the path before its
    first ``${...}`` is checked, against the nearest folder that exists."""
    if _NO_RUN & set(argv):
        return None
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    given = [a.partition("=")[2] for a in argv if a.lstrip("+").startswith(f"{key}=")]
    text = given[-1].strip("'\"") if given else "multirun" if key == "hydra.sweep.dir" else "runs"
    if given and not text.strip():  # `hydra.run.dir=$RUN`, RUN unset: Hydra would run in cwd
        return (f"mt-train: {key}= is empty (an unset shell variable?): the run would write "
                f"into {Path.cwd()} itself; give a folder for it")
    prefix = text.split("${")[0]
    if not prefix:  # ${oc.env:HOME}/runs: where it goes is Hydra's to resolve
        return None
    place = nearest_existing(Path(prefix).absolute())
    said = f"{key}={text}" if given else f"the run directory ({text}/... under {Path.cwd()})"
    if not place.is_dir():
        return f"mt-train: {said}: {place} is a file, not a folder"
    if not os.access(place, os.W_OK | os.X_OK):
        return (f"mt-train: {said}: cannot write in {place} (permission denied); start mt-train "
                "in a folder of yours, or give hydra.run.dir=DIR")
    return None


def main() -> None:
    fill_closed_descriptors(quiet_stdout=True)  # `mt-train 2>&-` died silently inside Hydra
    if "--version" in sys.argv[1:]:  # Hydra's own names Hydra's version only
        print(version_line())
        return
    if mistake := (_null_group(sys.argv[1:]) or _two_modes(sys.argv[1:])
                   or _unwritable_run_dir(sys.argv[1:])):
        raise SystemExit(mistake)
    cap_kernel_caches()  # before the first product: see its docstring
    register_configs()
    with one_line_refusals("mt-train"):  # a misspelt key or group option: one line, not ten
        hydra_main()
    if _failed_jobs:
        raise SystemExit(f"mt-train: {len(_failed_jobs)} job(s) of the sweep failed (said above): "
                         + "; ".join(_failed_jobs))


if __name__ == "__main__":
    # Hydra's usage and errors name the program by sys.argv[0]: "train.py", which is no command
    sys.argv[0] = "python -m mt.train"
    main()
