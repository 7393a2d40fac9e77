"""What a refused ``mt-train`` leaves on disk: nothing that it made itself.

Hydra makes a directory before the config it is for is known to be good: the sweeper makes the
sweep directory (multirun/DATE_TIME/, with multirun.yaml) before it composes the jobs' configs,
and a run makes its run directory (with train.log and .hydra/) before mt's own checks
(``mt.config_checks``) read the config. ``unmade_on_refusal`` takes such a directory away again
when the command is refused, where this command made it and it holds nothing but what Hydra
wrote in it; a directory that was there before is never removed, and the configs Hydra saved in
it (.hydra/config.yaml, ...) are put back as they were: they say the run trained there, not the
command refused. ``mt.hydra_errors`` says the refusal in words.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)

# Hydra's refusals of a command line (mt.hydra_errors.in_words says them in one line)
REFUSALS = (ConfigCompositionException, MissingConfigException, OverrideParseException)

# the files Hydra writes in a run's output subfolder (hydra.output_subdir, .hydra by default)
SAVED_CONFIGS = ("config.yaml", "hydra.yaml", "overrides.yaml")


class ConfigRefused(SystemExit):
    """A config that mt's own checks refused after Hydra made the run directory: ends the
    program with its one line, as a SystemExit does, and lets ``unmade_on_refusal`` take away
    the run directory, which holds nothing of the run's yet but the files named in ``leaves``
    (its lock, ``mt.checkpoint.LOCK``, where the run took it before the refusal)."""

    def __init__(self, line: str, leaves: tuple[str, ...] = ()) -> None:
        super().__init__(line)
        self.leaves = leaves


@contextmanager
def unmade_on_refusal() -> Iterator[None]:
    """Within this block, a refused command takes away the directory Hydra made for it: a sweep
    refused for a bad value (``-m trainer.max_steps=5,abc``) left an empty sweep behind at each
    try, and a run whose config mt's checks refuse (``+extra=nope``, a value out of range,
    ``ConfigRefused``) left a run directory with only train.log and .hydra/ in it."""
    with ExitStack() as patches:
        patches.enter_context(_unmade_sweep())
        patches.enter_context(_unmade_run())
        yield


@contextmanager
def _unmade_sweep() -> Iterator[None]:
    """The sweeper's directory, taken away where Hydra refused the sweep (``REFUSALS``) and it
    holds nothing but multirun.yaml."""
    from hydra.core.plugins import Plugins

    # Hydra loads its plugins anew from their files: the class it instantiates is its registry's,
    # not the one `import hydra._internal.core_plugins.basic_sweeper` gives.
    sweeper: Any = Plugins.instance().class_name_to_class.get(
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")
    if sweeper is None:  # a later Hydra: its sweeps as they are
        yield
        return
    original = sweeper.sweep

    def sweep(self: Any, arguments: list[str]) -> Any:
        folder = Path(self.config.hydra.sweep.dir)  # ${now:...} resolves once (cached)
        made = _to_make(folder)
        try:
            return original(self, arguments)
        except REFUSALS:
            # (refused before the sweeper made it, or with more in it by now: left as it is)
            if made and holds_only(folder, {"multirun.yaml"}):
                remove_made(folder, made, {"multirun.yaml"})
            raise

    sweeper.sweep = sweep
    try:
        yield
    finally:
        sweeper.sweep = original


@contextmanager
def _unmade_run() -> Iterator[None]:
    """The run directory of a run (not a sweep's job: its directory is named in the sweep's
    summary of failed jobs), taken away where the task refused its config (``ConfigRefused``),
    this command made the directory and it holds only train.log and Hydra's saved configs; in
    a directory that stays, the saved configs as they were before the command."""
    from hydra._internal import hydra as runner  # Hydra.run calls run_job by this name

    original: Any = getattr(runner, "run_job", None)
    if original is None:  # a later Hydra: its run directories as they are
        yield
        return

    def run_job(*args: Any, **kwargs: Any) -> Any:
        try:
            given = inspect.signature(original).bind(*args, **kwargs).arguments
            folder, subdir = _resolved_dir(given["config"], given["job_dir_key"])
            if int(os.environ.get("RANK", "0") or 0) > 0:
                _no_saved_configs(given["config"])
                saved, meta_made = {}, []
            else:
                saved, meta_made = _saved_configs(folder, subdir)
        except Exception:  # not the interface this was written for, or no folder to find
            return original(*args, **kwargs)
        made = _to_make(folder)
        try:
            return original(*args, **kwargs)
        except ConfigRefused as refused:
            logs = [h for h in logging.getLogger().handlers
                    if isinstance(h, logging.FileHandler)
                    and Path(h.baseFilename).parent == folder]
            expected = {Path(h.baseFilename).name for h in logs} | set(refused.leaves)
            if subdir is not None:
                expected |= {(Path(subdir) / name).as_posix() for name in SAVED_CONFIGS}
            if made and holds_only(folder, expected):
                for handler in logs:  # the log goes with its folder, and no later record
                    logging.getLogger().removeHandler(handler)  # makes it anew
                    handler.close()
                remove_made(folder, made, expected)
            else:  # a run directory that stays: its saved configs are its run's, not this one's
                _put_back(saved, meta_made)
            raise

    runner.run_job = run_job
    try:
        yield
    finally:
        runner.run_job = original


def _resolved_dir(config: Any, key: str) -> tuple[Path, str | None]:
    """The folder ``key`` (hydra.run.dir) names, as run_job resolves it: with Hydra's config set,
    for a ``${hydra:...}`` in it, and ``${now:...}`` cached in ``config`` for run_job's own
    reading. Absolute: with hydra.job.chdir=true, run_job changes into it. With it,
    hydra.output_subdir, where run_job saves the configs in it (None: nowhere)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        subdir = OmegaConf.select(config, "hydra.output_subdir")
        return (Path(str(OmegaConf.select(config, key))).absolute(),
                None if subdir is None else str(subdir))
    finally:
        HydraConfig.instance().cfg = before


def _no_saved_configs(config: Any) -> None:
    """hydra.output_subdir unset for this job: a torchrun process above rank 0 saves no configs.
    In a run directory that hydra.run.dir names for every rank, each wrote its copy over the
    others', and one that read the run's configs after another had written the refused
    command's over them (or had half written them: an empty config.yaml) put that back; rank 0
    alone saves and puts back. A rank's own directory (``${now}``) goes anyway
    (``mt.distributed.leave_run_dir``)."""
    from omegaconf import open_dict, read_write

    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None


def _saved_configs(folder: Path, subdir: str | None) -> tuple[dict[Path, bytes | None],
                                                              list[Path]]:
    """The bytes of the configs (``SAVED_CONFIGS``) that run_job is about to write over in
    ``folder``'s ``subdir``, None for one that is not there (an unreadable one is left out, to
    Hydra), and the folders under ``folder`` that it will make for them, deepest first. Read
    before every run: a command that runs (a resume) writes its own, as Hydra documents."""
    if subdir is None:
        return {}, []
    saved: dict[Path, bytes | None] = {}
    for name in SAVED_CONFIGS:
        path = folder / subdir / name
        try:
            saved[path] = path.read_bytes() if path.exists() else None
        except OSError:
            continue
    return saved, [d for d in _to_make(folder / subdir) if folder in d.parents]


def _put_back(saved: dict[Path, bytes | None], made: list[Path]) -> None:
    """The saved configs as ``_saved_configs`` read them (``saved``), in a run directory that a
    refused command leaves: Hydra had written the refused config over those of the run trained
    there (``mt-train hydra.run.dir=R trainer.log_every=0``), which users and tools read as the
    run's. One that was not there goes, and so do the folders made for it (``made``). A failure
    to put one back is a warning: the command's own refusal is what it says."""
    for path, data in saved.items():
        try:
            if data is None:
                path.unlink(missing_ok=True)
            elif not path.exists() or path.read_bytes() != data:
                path.write_bytes(data)
        except OSError as err:
            logging.getLogger(__name__).warning("could not put back %s as it was before this "
                                                "command: %s", path, err.strerror or err)
    for place in made:
        try:
            place.rmdir()
        except OSError:  # something else is in it now
            break


def _to_make(folder: Path) -> list[Path]:
    """The folders ``folder.mkdir(parents=True)`` would make, deepest first: none where it is
    there already."""
    chain = [folder, *folder.parents]
    return chain[:next(i for i, d in enumerate(chain) if d.exists())]


def holds_only(folder: Path, expected: set[str]) -> bool:
    """Whether ``folder`` is a folder whose files are all among ``expected`` (paths relative to
    it), with no folder in it but those they lie in."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    places = {p for e in expected for p in Path(e).parents} - {Path(".")}
    for root, dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        if any(here / d not in places or (Path(root) / d).is_symlink() for d in dirs):
            return False
        if any((here / f).as_posix() not in expected for f in files):
            return False
    return True


def remove_made(folder: Path, made: list[Path], expected: set[str]) -> None:
    """Removes ``expected``'s files in ``folder``, their folders and the folders this command
    made (``made``, deepest first), stopping at one that holds something else by now."""
    for name in expected:
        (folder / name).unlink(missing_ok=True)
    places = {folder / p for e in expected for p in Path(e).parents} - {folder}
    for place in [*sorted(places, key=lambda p: len(p.parts), reverse=True), *made]:
        try:
            place.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # something else is in it now
            break
