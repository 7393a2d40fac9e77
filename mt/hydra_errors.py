"""Hydra's refusals of a command line, in one line that names the override.

Hydra prints a misspelt key, a value of the wrong type or a config group option that does not
exist in five to twelve lines (the OmegaConf node's types, the config search path), and its advice
for an unknown key, "To append to your config use +trainer.max_step=5", is wrong here: the schema
has no such key, so ``+`` only adds one that nothing reads (``mt.config_checks.check_keys``
refuses it a step later). ``one_line_refusals`` puts these in words, with the nearest name where
there is one (and the same mistakes in a config file, a recipe of the user's own, with its
name), as it does an override that is not ``key=value`` at all (Hydra's grammar report, two or
three lines, or a traceback for ``=3``), under ``--help`` too, and a value that
``--cfg job --resolve`` cannot resolve (OmegaConf's traceback); anything else (a bug, or an
error this module does not know) keeps Hydra's report, and ``HYDRA_FULL_ERROR=1`` keeps
Hydra's full traceback for everything.

Which file a mistake is in, and which folders a config group has, come from Hydra's config
repository (its search path: ``conf/``, ``--config-dir``, ``hydra.searchpath``), found among the
locals of Hydra's frames in the error's traceback; should a later Hydra lack them, the lines fall
back to ``conf/``.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from mt.config import conf_dir
from mt.hydra_dirs import REFUSALS, unmade_on_refusal

# conf/testsets/ is a folder of conf/, hence a group to Hydra, but its files are mt-eval's
TESTSETS = ("conf/testsets/ holds mt-eval's named test sets (mt-eval --test NAME), not a config "
            "group of mt-train")


def in_words(err: BaseException) -> str | None:
    """The one line for a command-line override, or a config file, that Hydra refused; None for
    any other error."""
    if isinstance(err, OverrideParseException):
        return _not_an_override(err.override)
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if isinstance(err, ValueError) and str(err).startswith("Config group override must be"):
        # +extra=null for a group of a --config-dir (mt.train._null_group knows conf/'s only):
        # Hydra's traceback ended in "must be a string or a list. Got NoneType"
        from hydra.core.override_parser.types import Override

        given = _hydra_local(err, Override)
        if given is None or not given.key_or_group:
            return None
        group = given.key_or_group
        return (f"{given.input_line}: a config group takes one of its names "
                f"({' or '.join(_folders(_repository(err), group))}); '~{group}' drops it")
    if isinstance(err, InterpolationResolutionError):
        # --cfg job --resolve (or --help --resolve) with 'trainer.max_steps=${oc.env:NOPE}':
        # OmegaConf's traceback; said as a run says it (mt.train._in_words). --cfg's resolve
        # does not name the key (OmegaConf.resolve leaves it out); the message names the value.
        said = str(err.msg or err).splitlines()[0]
        if not err.full_key and getattr(_hydra_args(), "cfg", None) == "hydra":
            # hydra.run.dir names ${data.name}: not there in Hydra's settings shown alone
            said += ("; --cfg hydra shows Hydra's settings without mt-train's config, which "
                     "they name: --cfg all --resolve shows both")
        return f"{err.full_key or '--resolve'}: {said}"
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
        repo = _repository(err)
        shown = _file(repo, within.group(1))
        where = f"{shown}: "
        group, top = within.group(1).rpartition("/")[0], str(merging.full_key)
        if group == "testsets":  # +testsets=x: no package line would make it one of mt-train's
            return f"+{group}={within.group(1).partition('/')[2]}: {TESTSETS}"
        if isinstance(merging, ConfigAttributeError | ConfigKeyError):
            # The file's keys put under its package, which is its group's path (with '.' for
            # '/') or a part of it: experiment=sub/x reads conf/experiment/sub/x.yaml into
            # 'experiment.'; the schema then lacks the first key of the package.
            if group and f"{group.replace('/', '.')}.".startswith(f"{top}."):
                return (f"{where}Hydra put its keys under '{top}.', which is not a config "
                        f"key: a file of {shown.rpartition('/')[0]}/ that sets the config's "
                        "own keys starts with the line '# @package _global_' (as "
                        "conf/experiment/demo.yaml)")
            return where + _unknown_key(top, merging).partition(": ")[2]
        return f"{where}{top}: {str(merging.msg or merging).splitlines()[0]}"
    gone = re.match(r"Could not delete from config\. '([^']+)' does not exist", text)
    if gone:  # ~foo
        key = gone.group(1)
        parent, _, last = key.rpartition(".")
        cfg = _hydra_local(err, DictConfig)  # the config Hydra applied the overrides to
        node = OmegaConf.select(cfg, parent) if cfg is not None and parent else cfg
        if isinstance(node, DictConfig) and last in node:
            # Hydra takes a null value for no key: ~init_from, with init_from null by default
            return f"~{key}: {key} is null (unset) already; there is nothing to drop"
        return f"~{key}: the config has no {key} to drop"
    unlisted = re.match(r"Could not (override|delete) '([^']+)'\. No match in the defaults list"
                        r"(?:\.\nTo append to your default list use \+(\S*))?", text)
    if unlisted and unlisted.group(2):  # a group that the root config's defaults do not choose
        how, group, given = unlisted.groups()
        if group == "testsets":  # '+testsets=x adds it' would not help: see TESTSETS
            return f"{given or '~' + group}: {TESTSETS}"
        if how == "delete":
            return (f"~{group}: {group} is not in the defaults list (conf/train.yaml's), so there "
                    "is nothing to drop")
        return (f"{given}: {group} is not in the defaults list (conf/train.yaml's); +{given} "
                "adds it")
    there = re.match(r"Could not append to config\. An item is already at '([^']+)'\.\n"
                     r"Either remove \+ prefix: '([^']*)'", text)
    if there:  # +trainer.max_steps=5
        key, given = there.groups()
        return f"+{given}: {key} is a key already; without the '+', {given} sets it"
    ambiguous = re.match(r"Ambiguous value for argument '(([^=']+)=([^']*))'", text)
    if ambiguous:  # trainer.max_steps=1,2 without -m
        given, key, values = ambiguous.groups()
        group = key.lstrip("+")
        repo = _repository(err)
        if "/" in group or (repo.group_exists(group) if repo else (conf_dir() / group).is_dir()):
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
        if not any(o.startswith("+") and o.lstrip("+").partition("=")[0] == group
                   for o in _overrides()):
            # a recipe's "- /model: transformer_base" (Hydra's text is the same): the user
            # wrote no '+' to take away
            return (f"{group}: {value}: a config file's defaults list chooses {group}, which "
                    f"conf/train.yaml chooses already; in a recipe, 'override /{group}: "
                    f"{value}' replaces the choice (as conf/experiment/demo.yaml's)")
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
    """A config group option (model=transformer_bas, experiment=nope) with no file for it; where
    a config file chose it (a recipe's "override /model: nope"), that file is named first:
    Hydra's report named the root config ('In train') for a recipe's override."""
    found = re.search(r"Available options in '([^']+)'", str(err))
    if not found or not err.options:
        return None
    group = found.group(1)
    name = str(err.missing_cfg_file).removeprefix(f"{group}/")
    repo = _repository(err)
    chooser = _chosen_in(err, group, name)
    # a file writes "group: name" in its defaults list; the command line, group=name
    given = f"{group}: {name}" if chooser else f"{group}={name}"
    # Hydra's options are the group's own files; those of its subfolders are options too
    # (experiment=sub/x: conf/experiment/sub/x.yaml), and were neither listed nor suggested
    options = (list(err.options) if group.startswith("hydra/")
               else _options_below(repo, group, list(err.options)))
    # the same file name in another folder first (experiment=conf/experiment/x.yaml, a recipe's
    # name without its folder or with another), then the nearest path, then the nearest name
    base = {o.rpartition("/")[2]: o for o in reversed(options)}  # the shallowest wins
    file = name.rpartition("/")[2].removesuffix(".yaml")
    near = ([base[file]] if file in base else
            difflib.get_close_matches(name.removesuffix(".yaml"), options, n=1) or
            [base[b] for b in difflib.get_close_matches(file, list(base), n=1)])
    hint = (f"did you mean {near[0] if chooser else f'{group}={near[0]}'}? " if near else "")
    folder = name.rpartition("/")[0]
    if group.startswith("hydra/"):  # Hydra's own groups (hydra/launcher=...) have no folder
        missing = f"{group} has no {name}"
    elif folder and not (repo and repo.group_exists(f"{group}/{folder}")):
        # (experiment=sub/x is a file of a subfolder, conf/experiment/sub/: an option too)
        places = " or ".join(_folders(repo, group))
        missing = (f"{places} has no folder {folder}/" if any("/" in o for o in options) else
                   f"an option of {group} is the name of a file in {places}, without folder "
                   "or .yaml")
    else:
        places = _folders(repo, group)
        missing = (f"there is no {places[0]}{name}.yaml" if len(places) == 1
                   else f"there is no {name}.yaml in {' or '.join(places)}")
    where = f"{_file(repo, chooser)}: " if chooser else ""
    return f"{where}{given}: {missing}; {hint}the options are {', '.join(options)}"


def _options_below(repo: Any | None, group: str, options: list[str]) -> list[str]:
    """``options`` (the group's own files) and, after them, each file of its subfolders as the
    option that names it (``sub/x``); only ``options`` where the repository is not known or
    cannot list a folder's folders (a later Hydra)."""
    try:
        from hydra.core.object_type import ObjectType

        folders = sorted(repo.get_group_options(group, results_filter=ObjectType.GROUP))
    except Exception:  # no repository, or not the interface this was written for
        return options
    found = list(options)
    for sub in folders:
        below = f"{group}/{sub}"
        found += [f"{sub}/{o}" for o in _options_below(repo, below, sorted(
            repo.get_group_options(below)))]
    return found


def _chosen_in(err: MissingConfigException, group: str, name: str) -> str | None:
    """The config (its path in the search path: 'experiment/x', 'train') whose defaults list
    chose ``group``'s missing option ``name``; None where the command line chose it, or where
    Hydra's state does not say."""
    try:
        from hydra._internal.defaults_list import Overrides
    except ImportError:  # a later Hydra: the line names no file
        return None
    overrides = _hydra_local(err, Overrides)
    if overrides is None:
        return None
    for key, meta in overrides.override_metadata.items():
        if key.partition("@")[0] == group and overrides.override_choices.get(key) == name:
            return None if meta.external_override else meta.containing_config_path
    if any(d.group == group for d in overrides.append_group_defaults):  # +group=name
        return None
    parent = re.match(r"In '([^']+)': ", str(err))  # a plain default of that config's own
    return parent.group(1) if parent else None


def _hydra_local(err: BaseException, kind: type) -> Any | None:
    """The innermost local variable of type ``kind`` among the frames of ``err``'s traceback
    (Hydra's config repository, its overrides): what Hydra knew where it raised."""
    found, tb = None, err.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, kind):
                found = value
        tb = tb.tb_next
    return found


def _repository(err: BaseException) -> Any | None:
    """Hydra's config repository (the search path's sources) where ``err`` was raised."""
    try:
        from hydra._internal.config_repository import IConfigRepository
    except ImportError:
        return None
    return _hydra_local(err, IConfigRepository)


def _shown(path: Path) -> str:
    """A file of the search path as a user finds it: conf/... for mt's own, else relative to
    the working directory where it is under it, else absolute."""
    for base, prefix in ((conf_dir(), "conf/"), (Path.cwd(), "")):
        try:
            return prefix + path.relative_to(base).as_posix()
        except ValueError:
            continue
    return str(path)


def _file(repo: Any | None, config_path: str) -> str:
    """The file of a config ('experiment/x'): in conf/, a --config-dir or hydra.searchpath."""
    for source in repo.get_sources() if repo else []:
        if source.scheme() == "file" and source.is_config(config_path):
            return _shown(Path(source.path) / f"{config_path}.yaml")
    return f"conf/{config_path}.yaml"


def _folders(repo: Any | None, group: str) -> list[str]:
    """The folders of a config group in the search path: ['conf/model/'], or with a
    --config-dir that has a model/ folder too, ['conf/model/', 'mine/model/']."""
    found = [_shown(Path(source.path) / group) + "/"
             for source in (repo.get_sources() if repo else [])
             if source.scheme() == "file" and source.is_group(group)]
    return found or [f"conf/{group}/"]


def _not_an_override(given: str) -> str:
    """An argument that Hydra's override grammar cannot read, said as what is expected: Hydra
    printed its parser's words ("no viable alternative at input '[1,'", "missing EQUAL at
    '<EOF>'") and a link, over two or three lines."""
    key, eq, value = given.partition("=")
    if not eq:
        return (f"{given}: an override is key=value ({given}=...), or +key=value to add a key, "
                "~key to drop one")
    if re.search(r"[^\w.@/+~-]", key):
        return (f"{given}: '{key}' is not a key (letters, digits and _ - . / @, no spaces); an "
                "override is key=value")
    for opens, closes, example in (("[", "]", f" ({key}=[a,b] for a list)"),
                                   ("{", "}", f" ({key}={{a:1}} for a dict)"), ("(", ")", "")):
        if value.count(opens) != value.count(closes):
            wrong = (f"its '{opens}' is not closed" if value.count(opens) > value.count(closes)
                     else f"its '{closes}' closes nothing")
            return f"{given}: {wrong}; an override is key=value{example}"
    for quote in "'\"":
        if value.count(quote) % 2:
            return f"{given}: its quote ({quote}) is not closed; an override is key=value"
    return (f"{given}: not key=value as Hydra reads it: a value with spaces, brackets, commas or "
            f"'=' in it is quoted (\"{key}='...'\")")


def _no_key(overrides: list[str]) -> str | None:
    """The first override without a key ('=3', '+=3', '@pkg=1', '~'), in words: Hydra took the
    empty key for the root config group and failed with a traceback ('Config group override
    must be a string or a list. Got int') or a line about the defaults list."""
    for i, given in enumerate(overrides):
        key = given.lstrip("+~").partition("=")[0].partition("@")[0]
        if not key:
            split = ""
            if given.lstrip("+").startswith("="):
                # 'trainer.max_steps =3': the word before is the key; the line says the fix
                before = overrides[i - 1] if i else ""
                meant = (f": did you mean {before}{given.lstrip('+')}?"
                         if before.lstrip("+") and "=" not in before else "")
                split = f" (the shell splits 'key =value' into two words{meant})"
            return f"{given}: an override is key=value, and this one has no key{split}"
    return None


@contextmanager
def one_line_refusals(prog: str) -> Iterator[None]:
    """Within it, Hydra's command-line refusals that ``in_words`` knows end the program with
    ``prog: <the line>`` (exit status 1, as Hydra's own) instead of Hydra's report, and a refused
    command leaves no directory it made behind (``mt.hydra_dirs``: a ``-m`` sweep's that Hydra
    refuses, a run's whose config mt's checks refuse).

    Hydra prints its errors inside ``hydra._internal.utils.run_and_report``, which wraps each
    stage of a run (composing the config, ``--cfg``, a sweep); the wrapper is put in its place for
    the duration. Should a later Hydra lack that function, its own reports stay as they are.
    ``--help`` and ``--hydra-help`` compose the config outside it: their refusals reach this
    block as exceptions (a traceback), and are said here in the same words.
    """
    from hydra._internal import utils

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return

    def one_line(err: BaseException) -> str | None:
        line = _no_key(_overrides()) or in_words(err)
        return None if line is None else f"{prog}: {line}"

    with unmade_on_refusal():
        original: Callable[[Any], Any] | None = getattr(utils, "run_and_report", None)

        def run_and_report(func: Callable[[], Any]) -> Any:
            def said() -> Any:
                try:
                    return func()
                except (*REFUSALS, ValueError) as err:
                    if (line := one_line(err)) is None:
                        raise
                    raise SystemExit(line) from None
            return original(said)  # type: ignore[misc]

        if original is not None:
            utils.run_and_report = run_and_report
        try:
            yield
        except (*REFUSALS, ValueError) as err:  # --help's, --hydra-help's
            # (a run's errors never get here: Hydra reports them, and exits, inside the run)
            if (line := one_line(err)) is None:
                raise
            if "--hydra-help" in sys.argv[1:] and isinstance(err, ConfigCompositionException):
                # Hydra composes its help without the app's config: every key of it is unknown
                given = line.removeprefix(f"{prog}: ").partition(": ")[0]
                line = (f"{prog}: {given}: --hydra-help shows Hydra's own options and reads "
                        f"no {prog} config; leave the override out (--help takes it)")
            args = _hydra_args()
            if getattr(args, "multirun", False) and "Ambiguous value for argument" in str(err):
                # -m was given: 'sweeps only under -m' told the user to give what they gave
                given = line.removeprefix(f"{prog}: ").partition(": ")[0]
                line = (f"{prog}: {given}: --help shows one job's config, not a sweep's; give "
                        f"{given.partition('=')[0]} one value there")
            raise SystemExit(line) from None
        finally:
            if original is not None:
                utils.run_and_report = original


def _overrides() -> list[str]:
    """The overrides as Hydra's main() read them, from the same sys.argv (none where its parser
    refuses sys.argv: a caller's own, under a test runner)."""
    return list(getattr(_hydra_args(), "overrides", []))


def _hydra_args() -> Any | None:
    """sys.argv as Hydra's main() read it; None where its parser refuses it."""
    from hydra._internal import utils

    try:
        with redirect_stderr(io.StringIO()):  # its usage lines: Hydra's main() said them first
            return utils.get_args_parser().parse_args()
    except SystemExit:
        return None
