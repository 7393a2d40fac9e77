"""A typo on mt-train's command line is one line naming the override, not Hydra's report of five
to twelve lines, whose advice for an unknown key ('use +trainer.max_step=5') was wrong here."""

from __future__ import annotations

import re
import sys

import pytest


@pytest.fixture()
def fresh_hydra():
    """mt-train's main() in this process: Hydra's global state is left set by a failed start,
    and a sweep sets up logging (to this test's captured stderr) before it fails."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()
    root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize("args, line", [
    (["trainer.max_step=5"],
     "trainer.max_step=5: trainer.max_step is not a config key; did you mean trainer.max_steps?"),
    (["foo=1"], "foo=1: foo is not a config key; the config has data, init_from, model, optim, "
                "trainer"),
    (["hydra.run.dirr=x"], "hydra.run.dirr=x: hydra.run.dirr is not a config key; did you mean "
                           "hydra.run.dir?"),
    (["model=transformer_bas"],
     "model=transformer_bas: there is no conf/model/transformer_bas.yaml; did you mean "
     "model=transformer_base? the options are transformer_base, transformer_big, "
     "transformer_d256_4x4, transformer_small, transformer_tiny"),
    (["experiment=nope"], "experiment=nope: there is no conf/experiment/nope.yaml; the options "
                          "are demo, "),
    (["experiment=conf/experiment/demo.yaml"],
     "experiment=conf/experiment/demo.yaml: an option of experiment is the name of a file in "
     "conf/experiment/, without folder or .yaml; did you mean experiment=demo? "),
    (["data.upsample={train:2}"],  # Hydra's '+data.upsample={train:2}' is refused in turn
     "data.upsample={train:2}: data.upsample has no key train yet; +data.upsample.train=... "
     "adds it"),
    (["trainer.max_steps=abc"],
     "trainer.max_steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["+trainer.max_steps=5"], "+trainer.max_steps=5: trainer.max_steps is a key already; "
                               "without the '+', trainer.max_steps=5 sets it"),
    (["data.upsample.train=2"],  # a dict: here '+' is the way
     "data.upsample.train=2: data.upsample has no key train yet; +data.upsample.train=2 adds it"),
    (["+model=transformer_base"], "+model=transformer_base: model is chosen already "
                                  "(conf/train.yaml); without the '+', model=transformer_base"),
    (["data.extra_valid=test"],
     "data.extra_valid=test: data.extra_valid takes a list: 'data.extra_valid=[test]'"),
    (["~trainer.max_steps"], "~trainer.max_steps: trainer.max_steps is a key of the schema"),
    (["trainer.max_steps=1,2"],  # a sweep without -m
     "trainer.max_steps=1,2: several values sweep only under -m (--multirun); a list is written "
     "'trainer.max_steps=[1,2]', a text with a comma quoted: 'trainer.max_steps=\"1,2\"'"),
    (["model=transformer_tiny,transformer_base"],  # a group: a list merges both, silently
     "model=transformer_tiny,transformer_base: several options of a config group are a sweep, "
     "which runs only under -m (--multirun); without it, give one"),
    (["hydra/launcher=basic,basic"],
     "hydra/launcher=basic,basic: several options of a config group are a sweep, which runs "
     "only under -m (--multirun)"),
    (["-m", "trainer.max_steps=5,abc"],  # a sweep's bad value, before any of its jobs runs
     "trainer.max_steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["-m", "model=transformer_tiny,transformer_bas"], "model=transformer_bas: there is no "),
    # not key=value at all: Hydra's grammar report (2-3 lines) or, for '=3', a traceback
    (["model.name"], "model.name: an override is key=value (model.name=...)"),
    (["trainer.max_steps=[1,"], "trainer.max_steps=[1,: its '[' is not closed; an override is "
                                "key=value (trainer.max_steps=[a,b] for a list)"),
    (["=3"], "=3: an override is key=value, and this one has no key (the shell splits "
             "'key =value' into two words)"),
    (["=abc"], "=abc: an override is key=value, and this one has no key"),
    (["trainer.max_steps", "=3"],  # `trainer.max_steps =3`: the key is the word before
     "=3: an override is key=value, and this one has no key (the shell splits 'key =value' into "
     "two words: did you mean trainer.max_steps=3?)"),
    (["trainer.max_steps=3", "=4"], "=4: an override is key=value, and this one has no key "
                                    "(the shell splits 'key =value' into two words)"),
    (["~"], "~: an override is key=value, and this one has no key"),
    (["trainer.max_steps=1=2"], "trainer.max_steps=1=2: not key=value as Hydra reads it: a value "
                                "with spaces, brackets, commas or '=' in it is quoted"),
    (["trainer max_steps=2"], "trainer max_steps=2: 'trainer max_steps' is not a key"),
    (["-m", "trainer.max_steps=[1,"], "trainer.max_steps=[1,: its '[' is not closed"),
    (["~foo"], "~foo: the config has no foo to drop"),
    # a key of the schema whose default is null: Hydra takes null for no key ('has no
    # init_from to drop' was false)
    (["~init_from"], "~init_from: init_from is null (unset) already; there is nothing to drop"),
    (["~data.tokenizer.path"], "~data.tokenizer.path: data.tokenizer.path is null (unset) "
                               "already; there is nothing to drop"),
    (["~data.nope"], "~data.nope: the config has no data.nope to drop"),
    # conf/testsets/ is mt-eval's: Hydra's advice (+testsets=..., then '# @package _global_')
    # would make its files keys that mt-train refuses
    (["testsets=multi30k_valid"], "testsets=multi30k_valid: conf/testsets/ holds mt-eval's named "
                                  "test sets (mt-eval --test NAME), not a config group of "
                                  "mt-train"),
    (["+testsets=multi30k_valid"], "+testsets=multi30k_valid: conf/testsets/ holds mt-eval's"),
])
def test_a_typo_on_the_command_line_is_one_line_naming_it(args, line, fresh_hydra, tmp_path,
                                                          monkeypatch, capsys):
    from mt import train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run = ([f"hydra.sweep.dir={tmp_path}/sweep"] if "-m" in args
           else ["--cfg", "job"])  # prints only: no run directory
    monkeypatch.setattr(sys, "argv", ["mt-train", *args, *run])
    with pytest.raises(SystemExit, match="^" + re.escape(f"mt-train: {line}")) as stop:
        train.main()
    assert "\n" not in str(stop.value.code)
    assert capsys.readouterr().err == ""  # nothing of Hydra's report besides
    # a refused sweep leaves no sweep directory (the sweeper made it, multirun.yaml in it,
    # before it composed the jobs' configs)
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("args, line", [
    (["--help", "trainer.max_stepz=3"],
     "trainer.max_stepz=3: trainer.max_stepz is not a config key; did you mean trainer.max_steps?"),
    (["--help", "experiment=nope"], "experiment=nope: there is no conf/experiment/nope.yaml"),
    (["--help", "=3"], "=3: an override is key=value, and this one has no key"),
    (["--help", "trainer.max_steps=${oc.env:NOPE_NOT_SET}", "--resolve"],
     "trainer.max_steps: KeyError raised while resolving interpolation: \"Environment variable "
     "'NOPE_NOT_SET' not found\""),
    (["--cfg", "job", "trainer.max_steps=${oc.env:NOPE_NOT_SET}", "--resolve"],
     "--resolve: KeyError raised while resolving interpolation: \"Environment variable "
     "'NOPE_NOT_SET' not found\""),
    (["--cfg", "hydra", "--resolve"],  # hydra.run.dir names data.name, not in Hydra's part
     "--resolve: Interpolation key 'data.name' not found; --cfg hydra shows Hydra's settings "
     "without mt-train's config, which they name: --cfg all --resolve shows both"),
    (["-m", "--help", "trainer.max_steps=1,2"],  # not 'sweep only under -m': -m is there
     "trainer.max_steps=1,2: --help shows one job's config, not a sweep's; give "
     "trainer.max_steps one value there"),
    (["-m", "--help", "model=transformer_tiny,transformer_small"],
     "model=transformer_tiny,transformer_small: --help shows one job's config, not a sweep's; "
     "give model one value there"),
    (["--help", "trainer.max_steps=1,2"],  # without -m, as before
     "trainer.max_steps=1,2: several values sweep only under -m (--multirun)"),
    (["--hydra-help", "trainer.max_steps=3"],  # Hydra's help has no mt-train config to set
     "trainer.max_steps=3: --hydra-help shows Hydra's own options and reads no mt-train config; "
     "leave the override out (--help takes it)"),
])
def test_help_and_resolve_refusals_are_one_line(args, line, fresh_hydra, monkeypatch, capsys):
    """--help composes the config outside Hydra's error report, and --cfg --resolve's failure
    to resolve was not one mt knew: both printed a traceback of Hydra's or OmegaConf's."""
    from mt import train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("NOPE_NOT_SET", raising=False)
    monkeypatch.setattr(sys, "argv", ["mt-train", *args])
    with pytest.raises(SystemExit, match="^" + re.escape(f"mt-train: {line}")) as stop:
        train.main()
    assert "\n" not in str(stop.value.code)
    assert capsys.readouterr().err == ""


def test_help_still_helps(fresh_hydra, monkeypatch, capsys):
    from mt import train

    monkeypatch.setattr(sys, "argv", ["mt-train", "--help", "trainer.max_steps=3"])
    with pytest.raises(SystemExit) as stop:
        train.main()
    assert stop.value.code in (0, None)
    assert "max_steps: 3" in capsys.readouterr().out


def test_hydra_full_error_keeps_hydras_traceback(fresh_hydra, monkeypatch):
    from hydra.errors import ConfigCompositionException

    from mt import train

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["mt-train", "trainer.max_step=5", "--cfg", "job"])
    with pytest.raises(ConfigCompositionException, match="trainer.max_step"):
        train.main()


def test_a_bad_choice_inside_a_config_file_is_named(tmp_path, fresh_hydra, monkeypatch):
    """An experiment that names a missing model: the file that holds the choice is named (Hydra
    named the root config, 'In train'), and the choice as the file writes it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    from mt.hydra_errors import in_words

    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "model" / "small.yaml").write_text("width: 1\n")
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: smal\n")
    (conf / "train.yaml").write_text("defaults:\n  - model: small\n  - _self_\n")
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        with pytest.raises(MissingConfigException) as err:
            compose("train", overrides=["+experiment=mine"])
    assert in_words(err.value) == (
        "conf/experiment/mine.yaml: model: smal: there is no conf/model/smal.yaml; did you mean "
        "small? the options are small")
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        with pytest.raises(MissingConfigException) as err:  # the command line's: no file
            compose("train", overrides=["model=smal"])
    assert in_words(err.value).startswith("model=smal: there is no conf/model/smal.yaml; ")


def test_other_errors_keep_hydras_report(monkeypatch, capsys):
    """A bug (or an error the module does not know) is reported by Hydra as before, with its
    traceback; and Hydra's function is itself again after the block."""
    from hydra._internal import utils

    from mt.hydra_errors import one_line_refusals

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    original = utils.run_and_report

    def bug():
        raise RuntimeError("a bug of mt's")

    with one_line_refusals("mt-train"):
        assert utils.run_and_report is not original
        with pytest.raises(SystemExit) as stop:
            utils.run_and_report(bug)
    assert stop.value.code == 1
    assert "RuntimeError: a bug of mt's" in capsys.readouterr().err
    assert utils.run_and_report is original


@pytest.mark.parametrize("body, line", [
    ("trainer:\n  max_step: 5\n", "conf/experiment/mine.yaml: trainer.max_step is not a config "
                                  "key; did you mean trainer.max_steps?"),
    ("trainer:\n  max_steps: abc\n", "conf/experiment/mine.yaml: trainer.max_steps: Value 'abc' "
                                     "of type 'str' could not be converted to Integer")])
def test_a_typo_in_a_recipe_of_ones_own_names_the_file(body, line, tmp_path, fresh_hydra,
                                                       monkeypatch):
    """A recipe written into conf/experiment/: Hydra named the file, but in six lines."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from mt.config import register_configs
    from mt.hydra_errors import in_words

    register_configs()
    monkeypatch.chdir(tmp_path)  # the file is named as the user finds it: conf/experiment/...
    tmp_path = tmp_path / "conf"
    (tmp_path / "experiment").mkdir(parents=True)
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n" + body)
    (tmp_path / "train.yaml").write_text("defaults:\n  - train_schema\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        with pytest.raises(ConfigCompositionException) as err:
            compose("train", overrides=["+experiment=mine"])
    assert in_words(err.value) == line


def test_a_recipe_without_its_package_line_is_told_to_add_it(tmp_path, fresh_hydra, monkeypatch):
    """A recipe of one's own written without '# @package _global_' (conf/experiment/demo.yaml's
    first line): Hydra reads its keys under 'experiment.', and the one line said "experiment is
    not a config key; the config has data, ...", a key the user never wrote."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from mt.config import register_configs
    from mt.hydra_errors import in_words

    register_configs()
    monkeypatch.chdir(tmp_path)  # the file is named as the user finds it: conf/experiment/...
    tmp_path = tmp_path / "conf"
    (tmp_path / "experiment").mkdir(parents=True)
    (tmp_path / "experiment" / "mine.yaml").write_text("trainer:\n  max_steps: 5\n")
    (tmp_path / "train.yaml").write_text("defaults:\n  - train_schema\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        with pytest.raises(ConfigCompositionException) as err:
            compose("train", overrides=["+experiment=mine"])
    assert in_words(err.value) == (
        "conf/experiment/mine.yaml: Hydra put its keys under 'experiment.', which is not a "
        "config key: a file of conf/experiment/ that sets the config's own keys starts with the "
        "line '# @package _global_' (as conf/experiment/demo.yaml)")


@pytest.mark.parametrize("key, value, line", [
    ("optim.lr", "${foo}", "optim.lr: Interpolation key 'foo' not found"),
    ("data.dir", "${oc.env:NOPE_NOT_SET}", "data.dir: KeyError raised while resolving "
                                            "interpolation: \"Environment variable "
                                            "'NOPE_NOT_SET' not found\"")])
def test_an_interpolation_that_cannot_resolve_is_one_line(key, value, line, monkeypatch):
    """Resolved as the run starts (OmegaConf.to_object): the line went on with three lines of
    OmegaConf's node types."""
    from omegaconf import OmegaConf

    from mt import train
    from mt.config import TrainConfig

    monkeypatch.delenv("NOPE_NOT_SET", raising=False)
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ValueError) as err:
        OmegaConf.to_object(cfg)
    assert train._in_words(err.value) == line


def _own_config_dir(root):
    """A --config-dir of one's own: a group conf/ lacks, recipes in a subfolder, recipes that
    list other recipes."""
    files = {
        "extra/one.yaml": "a: 1\n", "extra/two.yaml": "a: 2\n", "model/mine.yaml": "name: m\n",
        "recipes/r.yaml": "trainer:\n  max_steps: 5\n",  # no '# @package _global_'
        "experiment/sub/x.yaml": "trainer:\n  max_steps: 5\n",
        "experiment/outer.yaml": "# @package _global_\ndefaults:\n  - /recipes/r\n",
        "experiment/inner.yaml": "# @package _global_\ndefaults:\n  - override /model: nope\n",
        "experiment/outer2.yaml": "# @package _global_\ndefaults:\n  - inner\n",
        "experiment/typo.yaml": "# @package _global_\ntrainer:\n  max_stepz: 5\n",
        "experiment/twice.yaml": "# @package _global_\ndefaults:\n  - /model: mine\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("arg, line", [
    # the group is mine/extra/, not conf/'s: its options are not values to write as a list
    ("extra=one,two", "extra=one,two: several options of a config group are a sweep"),
    ("experiment=sub/x", "mine/experiment/sub/x.yaml: Hydra put its keys under 'experiment.', "
                         "which is not a config key: a file of mine/experiment/sub/ that sets "
                         "the config's own keys starts with the line '# @package _global_'"),
    ("experiment=outer", "mine/recipes/r.yaml: Hydra put its keys under 'recipes.', which is "
                         "not a config key: a file of mine/recipes/ that sets"),
    ("experiment=outer2", "mine/experiment/inner.yaml: model: nope: there is no nope.yaml in "
                          "conf/model/ or mine/model/; the options are mine, transformer_base"),
    ("experiment=typo", "mine/experiment/typo.yaml: trainer.max_stepz is not a config key; did "
                        "you mean trainer.max_steps?"),
    ("experiment=sub/nope", "experiment=sub/nope: there is no sub/nope.yaml in "
                            "conf/experiment/ or mine/experiment/"),
    # a recipe of a subfolder is an option: it was neither suggested nor listed, and a folder
    # that is not there was said as "without folder", which the group's own options are not
    ("experiment=sub/y", "experiment=sub/y: there is no sub/y.yaml in conf/experiment/ or "
                         "mine/experiment/; did you mean experiment=sub/x? the options are "
                         "demo, inner, "),
    ("experiment=x", "experiment=x: there is no x.yaml in conf/experiment/ or mine/experiment/; "
                     "did you mean experiment=sub/x? "),
    ("experiment=other/x", "experiment=other/x: conf/experiment/ or mine/experiment/ has no "
                           "folder other/; did you mean experiment=sub/x? "),
    # a recipe choosing model without 'override': Hydra's text is the one for +model=mine,
    # and the line told the user to drop a '+' they never wrote
    ("experiment=twice", "model: mine: a config file's defaults list chooses model, which "
                         "conf/train.yaml chooses already; in a recipe, 'override /model: mine' "
                         "replaces the choice"),
    # a group that the defaults list does not choose: three lines of Hydra's
    ("extra=one", "extra=one: extra is not in the defaults list (conf/train.yaml's); +extra=one "
                  "adds it"),
    ("~extra", "~extra: extra is not in the defaults list (conf/train.yaml's), so there is "
               "nothing to drop"),
    # a traceback ("Config group override must be a string or a list. Got NoneType")
    ("+extra=null", "+extra=null: a config group takes one of its names (mine/extra/); '~extra' "
                    "drops it"),
])
def test_a_config_dir_of_ones_own_is_named(arg, line, tmp_path, fresh_hydra, monkeypatch,
                                           capsys):
    """Groups and recipes of a --config-dir (Hydra's search path): the lines named conf/ for
    every file, took its groups' options for values, and said that a recipe in a subfolder
    (experiment=sub/x) without its package line had an unknown key 'experiment'."""
    from mt import train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    _own_config_dir(tmp_path / "mine")
    monkeypatch.setattr(sys, "argv", ["mt-train", "--config-dir", "mine", arg, "--cfg", "job"])
    with pytest.raises(SystemExit, match="^" + re.escape(f"mt-train: {line}")) as stop:
        train.main()
    assert capsys.readouterr().err == ""
    if "did you mean experiment=sub/x" in line:
        assert str(stop.value.code).endswith(", wmt14_en_de_big, sub/x")


@pytest.mark.parametrize("arg, line", [
    ("+extra=nope", "unknown config key extra: the config has data, init_from, model, optim, "
                    "trainer"),
    ("trainer.log_every=0", "trainer.log_every must be at least 1, got 0"),
    # refused by the model built on the meta device, once the run holds its directory's lock
    ("model.heads=3", "model.d_model=128 is not divisible by model.heads=3"),
    # refused by the split check, the first read of data.dir (a typo in it)
    ("data=multi30k data.dir=/nonexistent/mt-data",
     "/nonexistent/mt-data/valid.en: no such file (nor valid.en.gz)"),
    # the training split, which the split check did not look for: found as the corpus was read
    ("{files} data.train=trian", "{corpus}/trian.en: no such file (nor trian.en.gz)"),
    # refused as the corpus was read (mt.data.DataError), or as its tokenizer was taken
    ("{files} data.dir={bad}", "{bad}/train.en:3: invalid UTF-8 (invalid start byte at byte 2)"),
    ("{files} data.tokenizer.path={tok} data.tokenizer.normalization=identity",
     "{tok}: its tokenizer was trained with data.tokenizer.normalization=nmt_nfkc, this run asks "
     "for identity: set data.tokenizer.normalization=nmt_nfkc to use it, or point "
     "data.tokenizer.path at a new directory to train one"),
    # found once the corpus is encoded: nothing to validate on, nothing to train on
    ("{files} data.tokenizer.path={tok} data.dir={blank}",
     "data.valid: split 'valid' has no pair with text on both sides (of 30), so nothing to "
     "validate on"),
    ("{files} data.tokenizer.path={tok} data.filter.max_tokens=1",
     "no training pair of {corpus} survived filtering (kept 0 of 400 pairs (dropped: empty 0, too "
     "short (< 1 tokens) 0, too long (> 1 tokens) 400, length ratio (> 3) 0, duplicate 0)); see "
     "data.filter"),
    # refused before the corpus is read: init_from names no model, tied embeddings over two
    # vocabularies (mt.startup.check_tied)
    ("init_from={corpus}/none.pt", "init_from={corpus}/none.pt: no such model file or run "
                                   "directory"),
    ("model.tie_embeddings=all data.tokenizer.joint=false",
     "model.tie_embeddings=all needs a joint vocabulary: set data.tokenizer.joint=true, or "
     "model.tie_embeddings=decoder"),
])
def test_a_config_mt_refuses_leaves_no_run_directory(arg, line, fresh_hydra, tmp_path,
                                                     monkeypatch, corpus_dir, tmp_path_factory):
    """Hydra makes the run directory (train.log, .hydra/) before mt's checks read the config: a
    refused config left it behind, and its line pointed at a traceback in train.log for what is
    no crash. A directory that was there before is left with all it had."""
    import logging
    import shutil

    import datasets
    from hydra.core.global_hydra import GlobalHydra

    from mt import train
    from mt.config import TokenizerConfig
    from mt.data import read_lines
    from mt.tokenizer import load_or_train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    if "{" in arg:  # data of its own, outside tmp_path (which must end with mine/ alone)
        outside = tmp_path_factory.mktemp("data")
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(outside / "hf"))
        bad = outside / "bad"
        shutil.copytree(corpus_dir, bad)
        lines = (bad / "train.en").read_bytes().split(b"\n")
        lines[2] = b"ab\xff"
        (bad / "train.en").write_bytes(b"\n".join(lines))
        blank = outside / "blank"
        shutil.copytree(corpus_dir, blank)
        (blank / "valid.zz").write_text("\n" * len(read_lines(blank / "valid.en")))
        tok = outside / "tok"  # trained as a run trains it: tokenizer.json says how
        load_or_train(tok, lambda: (read_lines(corpus_dir / "train.en"),
                                    read_lines(corpus_dir / "train.zz")),
                      TokenizerConfig(vocab_size=100))
        named = {"corpus": corpus_dir, "bad": bad, "tok": tok, "blank": blank,
                 "files": f"data.source=files data.dir={corpus_dir} data.tgt_lang=zz "
                          "data.tokenizer.vocab_size=100 trainer.device=cpu"}
        arg, line = arg.format(**named), line.format(**named)
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "todo.txt").write_text("a user's")
    # the configs Hydra saved for the run trained in it (overrides.yaml lost since): Hydra
    # wrote the refused command's over them, and .hydra/config.yaml no longer said the run's
    meta = {"config.yaml": b"the run's config\n", "hydra.yaml": b"the run's hydra\n"}
    (mine / ".hydra").mkdir()
    for name, data in meta.items():
        (mine / ".hydra" / name).write_bytes(data)
    for where in (["hydra.run.dir=new/deep/run"],  # parents made too: all go
                  ["hydra.run.dir=moved", "hydra.job.chdir=true"],  # run_job changes into it
                  ["hydra.run.dir=bare", "hydra.output_subdir=null"],  # no .hydra/
                  [f"hydra.run.dir={mine}"],
                  [f"hydra.run.dir={mine}", "hydra.output_subdir=meta/deep"]):  # made: it goes
        GlobalHydra.instance().clear()
        monkeypatch.setattr(sys, "argv", ["mt-train", *arg.split(), *where])
        with pytest.raises(SystemExit) as stop:
            train.main()
        assert stop.value.code == f"mt-train: {line}", where  # no '(traceback in ...)'
        for handler in logging.getLogger().handlers:
            handler.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (mine / "notes" / "todo.txt").read_text() == "a user's"
    # (and .lock, where the refusal came under the run's lock: a lock file stays, as after a run)
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")
                  if p.name != ".lock") == [
        ".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", "notes", "notes/todo.txt",
        "train.log"]
    assert {name: (mine / ".hydra" / name).read_bytes() for name in meta} == meta
    log = (mine / "train.log").read_text()
    assert f"mt-train: {line}" in log and "Traceback" not in log


def test_a_refusal_under_torchrun_puts_back_the_run_directorys_configs(tmp_path):
    """torchrun's processes all write their .hydra/ copy of the config into a run directory that
    hydra.run.dir names: one that read it after another had written the refused config over it
    put that back, and the run's own configs were lost as before 4fb411d."""
    import subprocess

    from conftest import PYTHON, cli_env

    run = tmp_path / "run"
    meta = {"config.yaml": b"the run's config\n", "hydra.yaml": b"the run's hydra\n",
            "overrides.yaml": b"- the run's overrides\n"}
    (run / ".hydra").mkdir(parents=True)
    for name, data in meta.items():
        (run / ".hydra" / name).write_bytes(data)
    result = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "mt.train", f"hydra.run.dir={run}", "trainer.log_every=0"],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "trainer.log_every must be at least 1, got 0" in result.stderr
    assert {name: (run / ".hydra" / name).read_bytes() for name in meta} == meta


def test_a_rank_above_0_leaves_the_run_directorys_configs_alone(fresh_hydra, tmp_path,
                                                                 monkeypatch):
    """What makes the torchrun test above hold whatever order the processes run in: a process
    above rank 0 neither writes its copy of the config into a shared run directory nor puts
    back what it read there (rank 0 does)."""
    import os

    from mt import train

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_bytes(b"the run's config\n")
    os.utime(run / ".hydra" / "config.yaml", ns=(10**18, 10**18))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mt-train", f"hydra.run.dir={run}", "trainer.log_every=0"])
    with pytest.raises(SystemExit, match="trainer.log_every must be at least 1"):
        train.main()
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml"]
    assert (run / ".hydra" / "config.yaml").stat().st_mtime_ns == 10**18  # not written at all
