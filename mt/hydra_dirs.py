"""What a refused ``mt-train`` leaves on disk: nothing that it made itself.

Hydra makes a directory before the config it is for is known to be good: the sweeper makes the
sweep directory (multirun/DATE_TIME/, with multirun.yaml) before it composes the jobs' configs.
``unmade_on_refusal`` takes such a directory away again when the command is refused, where it
holds nothing but what Hydra wrote in it; ``mt.hydra_errors`` says the refusal in words.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)

# Hydra's refusals of a command line (mt.hydra_errors.in_words says them in one line)
REFUSALS = (ConfigCompositionException, MissingConfigException, OverrideParseException)


@contextmanager
def unmade_on_refusal() -> Iterator[None]:
    """Hydra's sweeper makes the sweep directory (multirun/DATE_TIME/, with multirun.yaml) before
    it composes the jobs' configs: a sweep refused for a bad value (``-m
    trainer.max_steps=5,abc``) left an empty sweep behind at each try. Within this block, such a
    refusal takes away what the sweeper made, where it holds nothing but multirun.yaml."""
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
        made = [folder, *folder.parents]
        made = made[:next(i for i, d in enumerate(made) if d.exists())]  # mkdir's, deepest first
        try:
            return original(self, arguments)
        except REFUSALS:
            # (refused before the sweeper made it, or with more in it by now: left as it is)
            if made and folder.is_dir() and sorted(os.listdir(folder)) == ["multirun.yaml"]:
                (folder / "multirun.yaml").unlink()
                for place in made:
                    try:
                        place.rmdir()
                    except OSError:  # something else is in it now
                        break
            raise

    sweeper.sweep = sweep
    try:
        yield
    finally:
        sweeper.sweep = original
