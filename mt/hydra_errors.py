"""Hydra's refusals of a command line, in one line that names the override.

Hydra prints a misspelt key, a value of the wrong type or a config group option that does not
exist in five to twelve lines (the OmegaConf node's types, the config search path), and its advice
for an unknown key, "To append to your config use +trainer.max_step=5", is wrong here: the schema
has no such key, so ``+`` only adds one that nothing reads (``mt.config_checks.check_keys``
refuses it a step later). ``one_line_refusals`` puts these in words, with the nearest name where
there is one (and the same mistakes in a config file, a recipe of the user's own, with its
name); anything else (a bug, or an error this module does not know) keeps Hydra's report, and
``HYDRA_FULL_ERROR=1`` keeps Hydra's full traceback for everything.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from mt.config import conf_dir


def in_words(err: BaseException) -> str | None:
    """The one line for a command-line override that Hydra refused; None for any other error."""
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if not isinstance(err, ConfigCompositionException):
        return None
    text, cause = str(err), err.__cause__
    if text.startswith("Could not override") and isinstance(cause, ConfigAttributeError
                                                            | ConfigKeyError):
        given = re.search(r"use \+(.*)\Z", text, re.S)
        return _unknown_key(given.group(1) if given else str(cause.full_key), cause)
    if text.startswith("Error merging override ") and isinstance(cause, OmegaConfBaseException):
        given = text.removeprefix("Error merging override ")
        said = str(cause.msg or cause).splitlines()[0]
        key, _, value = given.partition("=")
        if "is not a ListConfig, list or tuple" in said:  # data.extra_valid=test
            # quoted: [bt] is a glob pattern to the shell, which zsh refuses unquoted
            return f"{given}: {key} takes a list: '{key}=[{value}]'"
        if given.startswith("~") and "does not support deletion" in said:
            return (f"{given}: {key[1:]} is a key of the schema, which cannot be dropped; "
                    f"give it a value ({key[1:]}=...)")
        return f"{given}: {said}"
    within = re.match(r"In '([^']+)': \w+ raised while composing config", text)
    merging = err.__context__  # Hydra raises this one without 'from'
    if within and isinstance(merging, OmegaConfBaseException) and merging.full_key:
        # a key or value of a config file (a recipe of the user's own in conf/experiment/)
        where = f"conf/{within.group(1)}.yaml: "
        group = within.group(1).rpartition("/")[0]
        if isinstance(merging, ConfigAttributeError | ConfigKeyError):
            if group and str(merging.full_key) == group:  # no '# @package _global_' line
                return (f"{where}Hydra put its keys under '{group}.', which is not a config "
                        f"key: a file of conf/{group}/ that sets the config's own keys starts "
                        "with the line '# @package _global_' (as conf/experiment/demo.yaml)")
            return where + _unknown_key(str(merging.full_key), merging).partition(": ")[2]
        return f"{where}{merging.full_key}: {str(merging.msg or merging).splitlines()[0]}"
    there = re.match(r"Could not append to config\. An item is already at '([^']+)'\.\n"
                     r"Either remove \+ prefix: '([^']*)'", text)
    if there:  # +trainer.max_steps=5
        key, given = there.groups()
        return f"+{given}: {key} is a key already; without the '+', {given} sets it"
    ambiguous = re.match(r"Ambiguous value for argument '(([^=']+)=([^']*))'", text)
    if ambiguous:  # trainer.max_steps=1,2 without -m
        given, key, values = ambiguous.groups()
        group = key.lstrip("+")
        if "/" in group or (conf_dir() / group).is_dir():
            # a list of a group's options merges them all into one config (the last wins),
            # silently; a quoted text names an option that is not there
            return (f"{given}: several options of a config group are a sweep, which runs only "
                    "under -m (--multirun); without it, give one")
        return (f"{given}: several values sweep only under -m (--multirun); a list is written "
                f"'{key}=[{values}]', a text with a comma quoted: '{key}=\"{values}\"'")
    twice = re.match(r"Multiple values for (\S+)\. To override a value use 'override \1: (.*)'",
                     text)
    if twice:  # +model=transformer_base: the group has its choice in conf/train.yaml
        group, value = twice.groups()
        return (f"+{group}={value}: {group} is chosen already (conf/train.yaml); without the "
                f"'+', {group}={value} replaces the choice")
    return None


def _unknown_key(given: str, cause: OmegaConfBaseException) -> str:
    """A key that the schema lacks, with the nearest of the keys there are; or, in a dict
    (data.upsample), how to add one: there, and only there, Hydra's ``+`` is the way."""
    full_key = str(cause.full_key)
    parent, _, key = full_key.rpartition(".")
    if not dataclasses.is_dataclass(cause.object_type):
        # data.upsample={train:2} too is refused key by key: each one is added apart
        named, _, value = given.lstrip("+").partition("=")
        add = f"+{full_key}={value if named == full_key else '...'}"
        return f"{given}: {parent or 'the config'} has no key {key} yet; {add} adds it"
    keys = sorted(f.name for f in dataclasses.fields(cause.object_type))
    near = difflib.get_close_matches(key, keys, n=1)
    if near:
        hint = f"did you mean {parent + '.' if parent else ''}{near[0]}?"
    else:
        hint = f"{parent or 'the config'} has {', '.join(keys)}"
    return f"{given}: {full_key} is not a config key; {hint}"


def _missing_option(err: MissingConfigException) -> str | None:
    """A config group option (model=transformer_bas, experiment=nope) with no file in conf/."""
    found = re.search(r"Available options in '([^']+)'", str(err))
    if not found or not err.options:
        return None
    group = found.group(1)
    name = str(err.missing_cfg_file).removeprefix(f"{group}/")
    # experiment=conf/experiment/x.yaml: an option is a file's name without folder or .yaml
    near = difflib.get_close_matches(name.rpartition("/")[2].removesuffix(".yaml"), err.options,
                                     n=1)
    hint = f"did you mean {group}={near[0]}? " if near else ""
    # Hydra's own groups (hydra/launcher=...) have no folder in conf/. The choice may come from
    # a config file (an experiment's "override /model: ..."): Hydra's report does not say which
    # either, and the file is found by the name.
    if group.startswith("hydra/"):
        missing = f"{group} has no {name}"
    elif "/" in name:
        missing = (f"an option of {group} is the name of a file in conf/{group}/, without "
                   "folder or .yaml")
    else:
        missing = f"there is no conf/{group}/{name}.yaml"
    return f"{group}={name}: {missing}; {hint}the options are {', '.join(err.options)}"


@contextmanager
def one_line_refusals(prog: str) -> Iterator[None]:
    """Within it, Hydra's command-line refusals that ``in_words`` knows end the program with
    ``prog: <the line>`` (exit status 1, as Hydra's own) instead of Hydra's report.

    Hydra prints its errors inside ``hydra._internal.utils.run_and_report``, which wraps each
    stage of a run (composing the config, ``--cfg``, a sweep); the wrapper is put in its place for
    the duration. Should a later Hydra lack that function, its own reports stay as they are.
    """
    from hydra._internal import utils

    original: Callable[[Any], Any] | None = getattr(utils, "run_and_report", None)
    if original is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def said() -> Any:
            try:
                return func()
            except (ConfigCompositionException, MissingConfigException) as err:
                line = in_words(err)
                if line is None:
                    raise
                raise SystemExit(f"{prog}: {line}") from None
        return original(said)

    utils.run_and_report = run_and_report
    try:
        yield
    finally:
        utils.run_and_report = original
