"""Training: typed configs, exact resume after SIGKILL, DDP equivalence, schedules, NaN handling."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO, cli_env, compose, tiny_train_args

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    from mt.config import TrainConfig

    cfg = compose([f"experiment={experiment}"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.d_model % cfg.model.heads == 0


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_model_on_the_command_line_replaces_every_experiments_model(experiment):
    """A recipe that set its model's shape keys in its own body kept them over `model=...`
    (the CPU recipes trained their d256 4+4 model whatever model the command line named)."""
    base = compose(["model=transformer_base"]).model
    model = compose([f"experiment={experiment}", "model=transformer_base"]).model
    shape = ("name", "encoder_layers", "decoder_layers", "d_model", "ffn_dim", "heads")
    assert [getattr(model, k) for k in shape] == [getattr(base, k) for k in shape]


def test_a_key_added_since_a_checkpoint_is_no_change_at_its_default():
    """Resuming a run saved before data.extra_valid existed logged 'settings changed:
    data.extra_valid=[] (was None)'; a key the checkpoint lacks had the schema's default."""
    from omegaconf import OmegaConf

    from mt.config import TrainConfig, config_changes

    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    now = OmegaConf.to_container(OmegaConf.structured(TrainConfig()))
    saved = copy.deepcopy(now)
    del saved["data"]["extra_valid"]
    assert config_changes(saved, now, defaults=schema) == []
    now["data"]["extra_valid"], now["trainer"]["max_steps"] = ["dev2"], 7
    assert config_changes(saved, now, defaults=schema) == [
        "data.extra_valid=['dev2'] (was [])", "trainer.max_steps=7 (was 0)"]


def test_default_config_is_the_demo():
    cfg = compose([])
    assert (cfg.model.name, cfg.data.source) == ("transformer_tiny", "demo")


@pytest.mark.parametrize("schema, path", [("ModelConfig", "model/transformer_tiny"),
                                          ("TrainerConfig", "trainer/default"),
                                          ("OptimConfig", "optim/adam_inverse_sqrt")])
def test_the_dataclass_defaults_are_the_default_group_files(schema, path):
    """Python users (ModelConfig()) get the model that mt-train builds by default."""
    import dataclasses

    from omegaconf import OmegaConf

    import mt.config

    defaults = dataclasses.asdict(getattr(mt.config, schema)())
    values = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / f"{path}.yaml"))
    assert {k: v for k, v in values.items()
            if defaults[k] != v and not (isinstance(v, list) and list(defaults[k]) == v)} == {}


def test_misspelt_key_fails_with_its_name():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose(["optim.lrr=1e-3"])


@pytest.mark.parametrize("override, name", [("+optim.lrr=1e-3", "optim.lrr"),
                                            ("+trainer.max_step=3", "trainer.max_step"),
                                            ("+data.filter.max_tokenz=9", "data.filter.max_tokenz"),
                                            ("+epochs=3", "epochs")])
def test_a_misspelt_key_added_with_plus_fails_with_its_name(override, name):
    """Hydra lets '+' add a key the schema lacks (its own error message suggests it); mt-train
    refuses it instead of training with the default."""
    with pytest.raises(ValueError, match=f"unknown config key {name}: "):
        compose([override])


def test_two_of_hydras_modes_are_one_line(tmp_path):
    """``mt-train -m ... --cfg job`` (a sweep's config, asked to see) was Hydra's traceback
    'ValueError: Only one of --run, --multirun, --cfg, --info and --shell_completion can be
    specified'; --help with -m still prints the help."""
    from mt import train

    assert train._two_modes(["-m", "trainer.max_steps=1,2", "--cfg", "job"]) == (
        "mt-train: -m and --cfg cannot be given together; --cfg and --info show one job's "
        "config: leave -m out and give one value per key")
    assert train._two_modes(["--run", "-sc=install=bash"]) == (
        "mt-train: --run and -sc cannot be given together; give one of them")
    for alone in (["-m", "trainer.max_steps=1,2"], ["--cfg", "job"], ["-m", "--help"]):
        assert train._two_modes(alone) is None, alone
    said = subprocess.run([PYTHON, "-m", "mt.train", "-m", "trainer.max_steps=1,2", "--cfg",
                           "job"], env=cli_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert said.returncode == 1 and said.stderr.startswith("mt-train: -m and --cfg"), said.stderr
    assert "Traceback" not in said.stderr


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    """Hydra makes the run directory before mt's code runs, and said why it could not in a
    traceback: a read-only working folder (a shared checkout), or a path under a file."""
    from mt import train

    (tmp_path / "afile").write_text("")
    assert train._unwritable_run_dir([f"hydra.run.dir={tmp_path}/afile/run"]) == (
        f"mt-train: hydra.run.dir={tmp_path}/afile/run: {tmp_path}/afile is a file, not a folder")
    said = train._unwritable_run_dir(["-m", f"hydra.sweep.dir='{tmp_path}/afile/${{now:%H}}'"])
    assert said.endswith(f": {tmp_path}/afile is a file, not a folder")  # and quotes dropped
    assert train._unwritable_run_dir([f"hydra.run.dir={tmp_path}/new/run/${{now:%H}}"]) is None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)  # (root: any)
    assert train._unwritable_run_dir(["trainer.max_steps=1"]) == (
        f"mt-train: the run directory (runs/... under {tmp_path}): cannot write in {tmp_path} "
        "(permission denied); start mt-train in a folder of yours, or give hydra.run.dir=DIR")
    assert train._unwritable_run_dir([f"hydra.run.dir={tmp_path}/afile2"]) is not None
    assert train._unwritable_run_dir(["hydra.run.dir=/somewhere/else"]) is None
    assert train._unwritable_run_dir(["hydra.run.dir=${oc.env:HOME}/runs"]) is None
    assert train._unwritable_run_dir(["--help"]) is None  # prints only: works from any folder
    assert train._unwritable_run_dir(["--cfg", "job"]) is None
    # `hydra.run.dir=$RUN` with RUN unset: Hydra ran in cwd, where the demo overwrote data/.
    assert train._unwritable_run_dir(["hydra.run.dir="]) == (
        f"mt-train: hydra.run.dir= is empty (an unset shell variable?): the run would write into "
        f"{tmp_path} itself; give a folder for it")
    assert "hydra.sweep.dir= is empty" in train._unwritable_run_dir(["-m", "hydra.sweep.dir=''"])


@pytest.mark.parametrize("override", ["experiment=null", "model=", "+data=~"])
def test_a_group_set_to_nothing_is_one_line_naming_it(override, monkeypatch):
    """Hydra refuses GROUP=null with a traceback ('Config group override must be a string');
    mt-train says what to write instead, and a key that is not a group is left to Hydra."""
    from mt import train

    monkeypatch.setattr(sys, "argv", ["mt-train", "trainer.seed=1", override])
    group = override.lstrip("+").split("=")[0]
    with pytest.raises(SystemExit, match=f"mt-train: {re.escape(override)}: a config group "
                                         f"takes one of its names .*'~{group}' drops it"):
        train.main()
    assert train._null_group(["data.tokenizer.path=null", "hydra.run.dir=null"]) is None


@pytest.mark.parametrize("override, message", [
    ("trainer.log_every=0", "trainer.log_every must be at least 1, got 0"),
    ("trainer.accumulation=0", "trainer.accumulation must be at least 1"),
    ("trainer.validate_every=0", "trainer.validate_every must be at least 1"),
    ("trainer.patience=-1", "trainer.patience must be at least 0"),
    ("trainer.seed=-5", "trainer.seed must be at least 0"),
    ("trainer.best_metric=ter", "trainer.best_metric must be one of bleu, chrf, loss, got 'ter'"),
    ("trainer.min_improvement=-0.5", "trainer.min_improvement must be at least 0, got -0.5"),
    ("optim.plateau_factor=1.5", r"optim.plateau_factor must be in \[0, 1\]"),
    ("optim.plateau_patience=0", "optim.plateau_patience must be at least 1, got 0"),
    ("optim.plateau_factor=0.5 optim.plateau_patience=4 trainer.patience=4",
     "optim.plateau_patience=4 must be below trainer.patience=4: the run would stop before"),
    ("optim.label_smoothing=1.5", r"optim.label_smoothing must be in \[0, 1\), got 1.5"),
    ("optim.betas=[0.9,0.98,0.5]", "optim.betas must be two numbers"),
    ("optim.betas=[0.9,1.0]", r"optim.betas\[1\] must be in \[0, 1\)"),
    ("optim.lr=-1e-3", "optim.lr must be at least 0, got -0.001"),
    ("optim.lr=nan", "optim.lr must be at least 0"),
    ("optim.eps=0", "optim.eps must be above 0"),
    ("optim.lr=inf", "optim.lr must be finite"),  # NaN weights, then a crash in validation
    ("optim.lr=0 optim.schedule=cosine", "optim.lr must be above 0 and at least optim.min_lr"),
    ("optim.lr=5e-4 optim.min_lr=5e-3 optim.schedule=cosine",  # a "decay" that rose 10x
     "optim.lr must be above 0 and at least optim.min_lr"),
    ("trainer.seed=4294967296", r"trainer.seed must be below 2\*\*32"),
    ("trainer.average_last=1", "trainer.average_last=1 would average one checkpoint"),
    ("+data.upsample.train=inf", "data.upsample.train must be above 0 and finite"),
    ("data.subword_alpha=-1", "data.subword_alpha must be at least 0"),
    ("data.subword_alpha=0.5 data.tokenizer.model_type=bpe",
     "data.subword_alpha samples among a unigram model's segmentations: set "
     "data.tokenizer.model_type=unigram"),
    ("trainer.ema_decay=1.0", r"trainer.ema_decay must be in \[0, 1\)"),
    ("data.filter.max_tokens=0", "data.filter.max_tokens=0 is below data.filter.min_tokens=1"),
    ("model.dropout=1.0", r"model.dropout must be in \[0, 1\)"),
    ("data.extra_valid=[valid]", r"data.extra_valid\[0\]='valid' is data.valid already"),
    ("data.extra_valid=[test,test]", r"data.extra_valid\[1\]='test' is named twice"),
    ("data.extra_valid=['']", r"data.extra_valid\[0\]='' is empty"),
    ("data.valid=''", "data.valid is empty: name a split"),
    ("model.max_positions=1", "model.max_positions must be at least 2, got 1"),
    # no pair is ever kept (longer / shorter >= 1); said only after the tokenizer and encoding
    ("data.filter.max_ratio=0.5", r"data.filter.max_ratio must be 0 \(off\) or at least 1 "
     r"\(the longer side over the shorter\), got 0.5"),
    ("data.tokenizer.vocab_size=0", "data.tokenizer.vocab_size must be at least 5 "),
    ("trainer.beam_size=4611686018427387904", "trainer.beam_size must be at most 2147483647"),
    ("data.tokenizer.vocab_size=3", r"data.tokenizer.vocab_size must be at least 5 \(4 special "
     r"ids and a piece of text\), got 3"),
    ("data.tokenizer.character_coverage=0.97",
     r"data.tokenizer.character_coverage must be in \[0.98, 1\], got 0.97"),
    ("data.tokenizer.model_type=char", "data.tokenizer.model_type must be unigram or bpe"),
    (f"data.tokenizer.path={REPO / 'README.md'}",
     f"data.tokenizer.path={REPO / 'README.md'} is a file: it names a directory"),
])
def test_a_value_out_of_range_fails_with_the_key(override, message):
    """The schema checks types; a count of 0 or a smoothing of 1.5 must stop the run at start-up,
    not with a ZeroDivisionError mid-run or as a silently different run."""
    with pytest.raises(ValueError, match=message):
        compose(override.split())


@pytest.mark.parametrize("override, message", [
    ("model.heads=3", "model.d_model=128 is not divisible by model.heads=3"),
    ("model.tie_embeddings=yes", "model.tie_embeddings must be all, decoder or none"),
    ("model.activation=tanh", "model.activation must be one of"),
    ("trainer.freeze=[encoder_layer.*]", "trainer.freeze: 'encoder_layer.*' matches no parameter"),
    ("trainer.freeze=[*]", "trainer.freeze: \\* freezes all"),
    ("optim.schedule=linear", "optim.schedule must be one of"),
    ("optim.name=sgd", "optim.name must be adam or adamw, got 'sgd'"),
    ("optim.schedule=cosine trainer.max_steps=0 trainer.max_minutes=0",
     "optim.schedule=cosine decays over a budget"),
    ("optim.schedule=cosine optim.warmup_steps=4000 trainer.max_steps=500",  # '~experiment's warmup
     "optim.warmup_steps=4000 is not below trainer.max_steps=500"),
])
def test_what_the_model_and_optimizer_refuse_is_refused_before_any_data(override, message):
    """check_setup builds them on the meta device before the tokenizer and the corpus."""
    from mt.startup import check_setup

    cfg = compose(override.split())
    with pytest.raises(ValueError, match=message):
        check_setup(cfg)


def test_wrong_type_fails_with_the_key():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="max_steps"):
        compose(["trainer.max_steps=many"])


def test_inverse_sqrt_schedule_peaks_at_warmup():
    from mt.optim import lr_lambda

    cfg = compose(["optim.warmup_steps=100", "optim.schedule=inverse_sqrt"])
    f = lr_lambda(cfg)
    assert f(50) == pytest.approx(0.5)
    assert f(100) == pytest.approx(1.0)
    assert f(400) == pytest.approx(0.5)  # sqrt(100 / 400)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_optimizer_skips_a_nan_step_on_the_device_without_touching_its_state(name):
    """train_step never asks the host whether a loss was finite: it hands the optimizer a
    found_inf tensor. The update must then leave weights and every moment bitwise unchanged."""
    from mt.optim import build_optimizer

    cfg = compose([f"optim.name={name}", "optim.weight_decay=0.1"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = build_optimizer(model, cfg)

    def step(found_inf: float, grad: float | None = None) -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p) if grad is None else torch.full_like(p, grad)
        opt.found_inf = torch.tensor(found_inf)
        opt.step()

    step(0.0)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()["state"]))
    step(1.0, grad=float("nan"))
    after = (model.state_dict(), opt.state_dict()["state"])
    for a, b in zip(before[0].values(), after[0].values(), strict=True):
        assert torch.equal(a, b)
    for i, state in before[1].items():
        for key, value in state.items():
            assert torch.equal(value, after[1][i][key]), (i, key)
    step(0.0)  # a finite step after it updates again
    assert not torch.equal(before[0]["0.weight"], model.state_dict()["0.weight"])


def test_cosine_schedule_reaches_min_lr():
    from mt.optim import lr_lambda

    cfg = compose(["optim.schedule=cosine", "optim.warmup_steps=10", "trainer.max_steps=110",
                   "optim.lr=1e-3", "optim.min_lr=1e-4"])
    f = lr_lambda(cfg)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)


def test_cosine_schedule_anneals_over_a_time_budget():
    """With trainer.max_minutes the decay ends when the time does, at the pace measured so far."""
    import math

    from mt.optim import lr_lambda

    cfg = compose(["optim.schedule=cosine", "optim.warmup_steps=10", "trainer.max_minutes=1",
                   "optim.lr=1e-3", "optim.min_lr=1e-4"])
    clock = {"s": 30.0}
    f = lr_lambda(cfg, seconds=lambda: clock["s"])
    assert f(5) == pytest.approx(0.5)  # warmup ignores the clock
    # step 60 after 30 of 60 s: the budget is 120 steps, so 50 of the 110 decay steps are done
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 110)))
    clock["s"] = 60.0
    assert f(60) == pytest.approx(0.1)  # time is up: min_lr
    cfg.trainer.max_steps = 35  # the step budget ends first
    clock["s"] = 1.0
    assert f(35) == pytest.approx(0.1)


def test_cosine_schedule_needs_a_budget():
    from mt.optim import lr_lambda

    with pytest.raises(ValueError, match="trainer.max_steps or trainer.max_minutes"):
        lr_lambda(compose(["optim.schedule=cosine", "trainer.max_steps=0",
                           "trainer.max_minutes=0"]))


def history_of(metric: str, values: list[float]) -> list[dict]:
    """Validation records as last.pt keeps them, every 10 steps; the other scores move against
    ``metric``'s, so that reading the wrong key gives another answer."""
    return [{"step": 10 * (i + 1), "valid_loss": 5.0 + v if metric != "loss" else v,
             "valid_bleu": -v, "valid_chrf": -v, f"valid_{metric}": v}
            for i, v in enumerate(values)]


def test_the_best_score_is_replayed_from_the_history_for_the_metric_asked():
    """A resumed run that asks for another best_metric (or min_improvement) compares like with
    like: its best and patience count come from the records, not from the saver's metric."""
    from mt.config import best_so_far

    history = [{"step": 1, "valid_bleu": 10.0, "valid_loss": 5.0},
               {"step": 2, "valid_bleu": 9.0, "valid_loss": 4.0},
               {"step": 3, "valid_bleu": 10.5, "valid_loss": 3.9},
               {"step": 4, "valid_bleu": 10.2, "valid_loss": 3.95}]
    assert best_so_far(history, "bleu", 0.0) == (10.5, 1)
    assert best_so_far(history, "loss", 0.0) == (3.9, 1)
    assert best_so_far(history, "bleu", 1.0) == (10.0, 3)  # +0.5 is within the threshold
    assert best_so_far(history, "loss", 0.5) == (4.0, 2)
    assert best_so_far(history, "chrf", 0.0) == (None, 0)  # records without chrF


def test_ema_is_the_moving_average_of_the_weights_and_applied_only_inside_its_block():
    from mt.optim import EMA

    net = torch.nn.Linear(3, 2)
    ema = EMA(net, decay=0.9)
    expected = [p.detach().clone() for p in net.parameters()]
    for t in range(1, 30):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        decay = min(0.9, (1 + t) / (10 + t))  # low at first: the initial weights fade fast
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(
            expected, net.parameters(), strict=True)]
    trained = [p.detach().clone() for p in net.parameters()]
    with ema.applied():
        for p, e in zip(net.parameters(), expected, strict=True):
            assert torch.allclose(p, e, atol=1e-6)
    for p, w in zip(net.parameters(), trained, strict=True):
        assert torch.equal(p, w)  # the trained weights are back, bit for bit
    again = EMA(net, decay=0.9)
    again.load(dict(zip(ema.names, ema.shadow, strict=True)), ema.updates)
    assert again.updates == 29 and all(
        torch.equal(a, b) for a, b in zip(again.shadow, ema.shadow, strict=True))


@pytest.mark.parametrize("metric, values, min_improvement, cuts", [
    # 12 best; 11, 11.5 bad: a cut; 11 bad; 13 best; 12, 12 bad: a cut; 12 bad
    ("bleu", [10, 12, 11, 11.5, 11, 13, 12, 12, 12], 0.0, [0, 0, 0, 1, 1, 1, 1, 2, 2]),
    # 13 is only 1 above 12: bad with min_improvement 1.5, so the second cut comes early
    ("bleu", [10, 12, 11, 11.5, 11, 13, 12, 12, 12], 1.5, [0, 0, 0, 1, 1, 2, 2, 3, 3]),
    ("chrf", [40, 41, 41, 41, 45, 44, 46, 40, 40], 0.0, [0, 0, 0, 1, 1, 1, 1, 1, 2]),
    ("loss", [3.0, 2.5, 2.6, 2.5, 2.4, 2.4, 2.45, 2.3, 2.31], 0.0, [0, 0, 0, 1, 1, 1, 2, 2, 2]),
])
def test_plateau_multiplier_is_the_factor_to_the_number_of_plateaus_in_the_history(
        metric, values, min_improvement, cuts):
    """The cuts are read from the validation history alone (what last.pt saves), so a resumed
    run knows them; each plateau_patience bad validations in a row is one cut."""
    from mt.optim import lr_lambda, plateau_reductions

    cfg = compose(["optim.warmup_steps=10", "optim.plateau_factor=0.5", "optim.plateau_patience=2",
                   f"trainer.best_metric={metric}", f"trainer.min_improvement={min_improvement}"])
    plain = lr_lambda(compose(["optim.warmup_steps=10"]))
    full = history_of(metric, values)
    history: list[dict] = []
    f = lr_lambda(cfg, history=lambda: history)
    for n, expected in enumerate(cuts, 1):
        history[:] = full[:n]
        assert plateau_reductions(history, cfg) == expected, n
        for step in (5, 10, 400):  # on top of the schedule, in warmup and after it
            assert f(step) == pytest.approx(plain(step) * 0.5 ** expected), (n, step)
    for factor in (0, 1):  # off
        cfg.optim.plateau_factor = factor
        assert plateau_reductions(full, cfg) == 0
        assert lr_lambda(cfg, history=lambda: full)(400) == plain(400)


def test_a_resume_gives_the_next_step_the_rate_of_this_runs_schedule():
    """LambdaLR saved the next step's rate under the saver's settings; a resume with the same
    settings leaves it bit for bit, one that turns the plateau cut on applies it at once."""
    from mt.optim import build_optimizer, lr_lambda, take_optim_config

    history = history_of("bleu", [10, 9, 9])  # one plateau at patience 2

    def resumed(overrides: list[str]) -> tuple[list[str], float]:
        cfg = compose(["optim.warmup_steps=10", "optim.lr=1e-3", *overrides])
        model = torch.nn.Linear(2, 2)
        opt = build_optimizer(model, cfg)
        f = lr_lambda(cfg, history=lambda: history)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda taken: f(taken + 1))
        opt.load_state_dict(saved_opt)
        sched.load_state_dict(saved_sched)
        return take_optim_config(opt, sched, cfg), opt.param_groups[0]["lr"]

    saver = compose(["optim.warmup_steps=10", "optim.lr=1e-3"])
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, saver)
    f = lr_lambda(saver, history=lambda: history)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda taken: f(taken + 1))
    for _ in range(30):
        opt.step()
        sched.step()
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    rate = saved_opt["param_groups"][0]["lr"]
    assert resumed([]) == ([], rate)
    notes, cut = resumed(["optim.plateau_factor=0.5", "optim.plateau_patience=2"])
    assert cut == pytest.approx(rate / 2)
    assert notes == [f"a learning rate of {cut:.4g} for step 31 (was {rate:.4g}): this run's "
                     "schedule settings give it"]


def test_empty_valid_or_test_files_are_refused_at_start_naming_them(trainer_factory, tmp_path,
                                                                    corpus_dir):
    """datasets said 'Instruction "train" corresponds to no data!' (no file, and the wrong
    split), for the test split only after all the training."""
    from mt.data import DataError

    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    for split in ("valid", "test"):
        for lang in ("en", "zz"):
            (data / f"{split}.{lang}").write_text("")
        with pytest.raises(ValueError, match=f"^{data}/{split}.en and {data}/{split}.zz: no "
                                             f"sentence pairs in them \\(the split "
                                             f"'{split}'\\)$") as caught:
            trainer_factory(f"empty_{split}", f"data.dir={data}", "trainer.test_at_end=true")
        # a SetupRefused (the command's mistake: no traceback, the new run directory goes)
        assert isinstance(caught.value.__cause__, DataError)
        shutil.copy(corpus_dir / f"{split}.en", data / f"{split}.en")
        shutil.copy(corpus_dir / f"{split}.zz", data / f"{split}.zz")
    # lines, but blank on one side or the other: a BLEU of 0 at every validation
    (data / "valid.zz").write_text("\n" * len((data / "valid.en").read_text().splitlines()))
    with pytest.raises(ValueError, match=r"^data.valid: split 'valid' has no pair with text "
                                         r"on both sides \(of \d+\), so nothing to "
                                         r"validate on$"):
        trainer_factory("blank_valid", f"data.dir={data}")
    # or only what the tokenizer's normalization removes (a zero-width space): as blank
    (data / "valid.zz").write_text("\u200b\n" * len((data / "valid.en").read_text().splitlines()))
    with pytest.raises(ValueError, match=r"^data.valid: split 'valid' has no pair with text "):
        trainer_factory("invisible_valid", f"data.dir={data}")
    shutil.copy(corpus_dir / "valid.zz", data / "valid.zz")
    # an empty data.test means no test at the end (it was a path '.en' beside the data)
    trainer_factory("no_test", "trainer.test_at_end=true", "data.test=")
    # and a bad line in the test set is found now, not after the training
    lines = (corpus_dir / "test.zz").read_bytes().splitlines(keepends=True)
    (data / "test.zz").write_bytes(b"".join(lines[:2] + [b"caf\xe9\n"] + lines[3:]))
    with pytest.raises(ValueError, match=f"^{data}/test.zz:3: invalid UTF-8") as caught:
        trainer_factory("bad_test", f"data.dir={data}", "trainer.test_at_end=true")
    assert isinstance(caught.value.__cause__, DataError)


@pytest.mark.parametrize("layout", ["save_to_disk", "data_files"])
def test_a_split_the_hub_dataset_lacks_is_refused_at_start_naming_its_key(
        trainer_factory, tmp_path, corpus_dir, layout):
    """A hub dataset without the split data.test names was found out only after the whole
    training, and one without data.valid's after the tokenizer and the encoding."""
    import datasets

    from mt.data import read_lines

    hub = tmp_path / "hub"
    columns = {split: {"en": read_lines(corpus_dir / f"{name}.en"),
                       "zz": read_lines(corpus_dir / f"{name}.zz")}
               for split, name in (("train", "train"), ("dev", "valid"))}
    if layout == "save_to_disk":
        datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in columns.items()}
                             ).save_to_disk(hub)
        valid = "dev"
    else:  # files in a repository's layout: datasets names dev.jsonl's split "validation"
        hub.mkdir()
        for split, cols in columns.items():
            with open(hub / f"{split}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"en": s, "zz": t}) + "\n"
                             for s, t in zip(cols["en"], cols["zz"], strict=True))
        valid = "validation"
    names = sorted(["train", valid])
    hub_args = ["data.source=hub", f"data.hub_name={hub}", "data.src_lang=en"]
    for n, (override, key) in enumerate([("data.test=test", "data.test=test"),
                                         ("data.valid=valid", "data.valid=valid"),
                                         ("data.extra_valid=[tst]", "data.extra_valid")]):
        with pytest.raises(ValueError, match=re.escape(f"{key}: {hub} has splits {names}, not '")):
            trainer_factory(f"lacks{n}", *hub_args, f"data.valid={valid}", override,
                            "trainer.test_at_end=true")
    trainer = trainer_factory("has_all", *hub_args, f"data.valid={valid}", f"data.test={valid}",
                              "trainer.test_at_end=true")
    assert len(trainer.corpus.pairs) > 0


def test_a_model_too_short_for_every_pair_names_model_max_positions(trainer_factory):
    """Every pair dropped as too long because model.max_positions caps the length was said as
    "see data.filter", a key that was not the cause."""
    from mt.config_checks import SetupRefused

    with pytest.raises(SetupRefused, match=r"survived filtering \(.*\); see data.filter and "
                                           r"model.max_positions=4, which lets no pair be longer "
                                           r"than 3 tokens$"):
        trainer_factory("short", "model.max_positions=4")


def test_no_valid_loss_is_nan_and_best_metric_loss_is_refused_for_it(trainer_factory, tmp_path,
                                                                    corpus_dir):
    """With no valid pair within model.max_positions the valid loss was a perfect 0.000, which
    trainer.best_metric=loss would keep as the best for ever."""
    from mt.runlog import validate

    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    for lang in ("en", "zz"):  # every valid pair far longer than model.max_positions=128
        lines = (corpus_dir / f"valid.{lang}").read_text().splitlines()
        (data / f"valid.{lang}").write_text("".join(" ".join([line] * 40) + "\n"
                                                    for line in lines))
    trainer = trainer_factory("long", f"data.dir={data}")
    src, tgt = trainer.corpus.valid[trainer.cfg.data.valid]
    scores = validate(trainer.model.eval(), trainer.corpus.tokenizer, src[:2], tgt[:2],
                      trainer.cfg.trainer, trainer.device)
    assert math.isnan(scores["valid_loss"]) and math.isnan(scores["valid_ppl"])
    # metrics.jsonl stays strict JSON: null, not Python's bare NaN
    trainer.metrics.write({"step": 1, "epoch": 0, **scores})
    line = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1]
    assert "NaN" not in line and json.loads(line)["valid_loss"] is None
    # the command's mistake (mt-train: one line, no traceback; the new run directory goes)
    from mt.config_checks import SetupRefused

    with pytest.raises(SetupRefused, match="^trainer.best_metric=loss: no pair of data.valid="
                                           "valid fits model.max_positions=128"):
        trainer_factory("long_loss", f"data.dir={data}", "trainer.best_metric=loss")


def test_a_resume_with_a_new_lr_under_a_time_budget_takes_the_cosines_decayed_rate(
        trainer_factory, tmp_path, corpus_dir, tokenizer_dir):
    """The resumed run recomputed the rate before it had read the seconds trained: a cosine
    over trainer.max_minutes saw none and ran its first step at the peak."""
    from mt.optim import lr_lambda
    from mt.trainer import Trainer

    budget = ["optim.schedule=cosine", "trainer.max_steps=0", "trainer.max_minutes=1",
              "optim.min_lr=0"]
    first = trainer_factory("run", *budget)
    first.elapsed = 30.0
    for _ in range(20):
        first.optimizer.step()  # (no gradients: nothing changes)
        first.scheduler.step()
    first.step, first.seconds_before = 20, 30.0  # half the budget: 40 steps in all at this pace
    first.save(improved=False, step_checkpoint=False)
    cfg = compose([*tiny_train_args(corpus_dir, tokenizer_dir), *budget, "optim.lr=5e-4"])
    resumed = Trainer(cfg, tmp_path / "run")
    want = 5e-4 * lr_lambda(cfg, seconds=lambda: 30.0)(21)
    assert want < 5e-4 * 0.9  # decayed well below the peak
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)


# (BLEU, chrF) of five validations: BLEU peaks at the 3rd, chrF at the 4th (by 0.5 only)
SCORES = [(20.0, 40.0), (25.0, 45.0), (28.0, 44.0), (22.0, 45.5), (21.0, 43.0)]


def validate_with(trainer, scores: list[tuple[float, float]]) -> list[str]:
    """Validates at steps 1, 2, ... with the given scores, each step's weights stamped with its
    number; returns the stop reason after each."""
    stamp = next(trainer.model.parameters())  # also the first weight in the checkpoint
    reasons = []
    for step, (bleu, chrf) in enumerate(scores, 1):
        trainer.step = step
        with torch.no_grad():
            stamp.fill_(step)
        trainer.validate = lambda b=bleu, c=chrf: {"valid_loss": 2.0, "valid_ppl": math.exp(2),
                                                   "valid_bleu": b, "valid_chrf": c}
        trainer._validate_and_save()
        reasons.append(trainer.stop_reason())
    return reasons


def stamp_of(path: Path) -> float:
    """The step whose weights ``path`` holds (``validate_with``'s stamp)."""
    weights = torch.load(path, weights_only=True)["model"]
    return weights[next(iter(weights))].flatten()[0].item()


def test_best_metric_chrf_picks_best_pt_and_keep_best_by_chrf(trainer_factory):
    trainer = trainer_factory("chrf", "trainer.best_metric=chrf", "trainer.keep_last=0",
                              "trainer.keep_best=2")
    validate_with(trainer, SCORES)
    ckpts = trainer.ckpt_dir
    assert stamp_of(ckpts / "best.pt") == 4  # the best chrF, not the best BLEU (step 3)
    assert trainer.best == 45.5 and trainer.bad_validations == 1
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_2.pt", "step_4.pt"]
    bleu = trainer_factory("bleu", "trainer.keep_last=0", "trainer.keep_best=2")
    validate_with(bleu, SCORES)
    assert stamp_of(bleu.ckpt_dir / "best.pt") == 3
    assert sorted(p.name for p in bleu.ckpt_dir.glob("step_*.pt")) == ["step_2.pt", "step_3.pt"]


def test_subword_sampling_with_a_checkpoints_bpe_tokenizer_stops_before_the_corpus(
        trainer_factory, tmp_path, monkeypatch):
    """data.subword_alpha with init_from a BPE model: refused only after the corpus was read,
    and after the checkpoint's tokenizer was written into the run directory, which then refused
    the corrected command (init_from a unigram model: "the model's tokenizer is not the one in
    .../tokenizer"). Refused at start-up now, leaving nothing behind. Both are the command's
    mistakes (``SetupRefused``: mt-train says them in one line, and the run directory it made
    goes), not crashes whose traceback train.log keeps."""
    import mt.corpus
    from mt.config_checks import SetupRefused
    from mt.tokenizer import TokenizerMismatch

    bpe = trainer_factory("bpe", "data.tokenizer.path=null", "data.tokenizer.model_type=bpe",
                          "data.tokenizer.vocab_size=150")
    validate_with(bpe, SCORES[:1])
    # the checkpoint's tokenizer is not the one in data.tokenizer.path (found as the corpus is
    # read)
    with pytest.raises(SetupRefused, match=r"^init_from=\S+best.pt: the model's tokenizer is "
                                           r"not the one in \S+; a model keeps its own: unset "
                                           r"data.tokenizer.path$") as caught:
        trainer_factory("other", f"init_from={bpe.ckpt_dir / 'best.pt'}")
    assert isinstance(caught.value.__cause__, TokenizerMismatch)

    def read(*args, **kwargs):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(mt.corpus, "load_train", read)
    with pytest.raises(SetupRefused, match=r"^data.subword_alpha samples among a unigram "
                                           r"model's segmentations, but the tokenizer is the one "
                                           r"of init_from=\S+best.pt, a BPE model"):
        trainer_factory("ft", f"init_from={bpe.ckpt_dir / 'best.pt'}", "data.subword_alpha=0.5",
                        "data.tokenizer.path=null")
    assert not (tmp_path / "ft" / "tokenizer").exists()


def test_a_fresh_start_beside_an_earlier_runs_files_sets_them_aside(trainer_factory, tmp_path,
                                                                     caplog):
    """last.pt deleted, the run started again in its folder: the earlier run's step_9.pt was
    the 'last' step file, so pruning kept it and deleted this run's, and averaging took it in;
    its metrics.jsonl was cut to nothing. They are moved aside now, and nothing is lost."""
    from mt import checkpoint
    from mt.runlog import finish

    old = trainer_factory("old", "trainer.keep_last=0", "trainer.keep_best=0")
    validate_with(old, SCORES[:1])  # writes best.pt and last.pt, with no step files
    run = tmp_path / "again"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    for name in ("step_9.pt", "best.pt"):  # another run's: step 9 is past every step below
        (ckpts / name).write_bytes((old.ckpt_dir / "best.pt").read_bytes())
    (run / "metrics.jsonl").write_text('{"step": 9, "loss": 1.0}\n')
    (run / "test.json").write_text("{}")
    (run / "valid").mkdir()
    (run / "tensorboard").mkdir()  # its events, which the new writer's purge would hide
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"events")
    # its own checkpoints/ as init_from: loaded, then set aside, then missing on a restart
    with pytest.raises(ValueError, match=r"init_from=.*best\.pt: in this run's own checkpoints/"):
        trainer_factory("again", f"init_from={ckpts / 'best.pt'}")
    with caplog.at_level("WARNING", logger="mt.train"):
        trainer = trainer_factory("again", "trainer.keep_last=2", "trainer.average_last=2")
    [earlier] = (run / "earlier").iterdir()
    assert (f"{ckpts} held best.pt, step_9.pt, metrics.jsonl, test.json, tensorboard, valid but "
            f"no last.pt: moved to {earlier}, and this run starts afresh") in caplog.text
    assert sorted(p.name for p in earlier.iterdir()) == ["best.pt", "metrics.jsonl", "step_9.pt",
                                                         "tensorboard", "test.json", "valid"]
    validate_with(trainer, SCORES[:3])
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_2.pt", "step_3.pt"]
    assert stamp_of(ckpts / "best.pt") == 3
    finish(trainer.cfg, trainer.run_dir, trainer.device, None, "en")
    averaged = checkpoint.load(ckpts / "averaged.pt")
    assert [Path(p).name for p in averaged["averaged_from"]] == ["step_2.pt", "step_3.pt"]
    assert stamp_of(ckpts / "averaged.pt") == 2.5
    (ckpts / "best.pt").unlink()  # a run resumed from a copied last.pt: its test, skipped unsaid
    with caplog.at_level("WARNING", logger="mt.train"):
        finish(trainer.cfg, trainer.run_dir, trainer.device, None, "en")
    assert f"{ckpts / 'best.pt'} is missing (a run resumed from a copied last.pt?)" in caplog.text


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_disk_under_metrics_jsonl_names_the_file(tmp_path, monkeypatch):
    """A write to metrics.jsonl that the disk refuses said "mt-train: [Errno 28] No space left
    on device", naming no file (the checkpoints' writes name theirs)."""
    import mt.runlog
    from mt.runlog import Metrics
    from mt.train import _in_words

    metrics = Metrics(tmp_path, tensorboard=False)
    # /dev/full: every write fails as on a full disk
    monkeypatch.setattr(mt.runlog, "open", lambda path, mode: open("/dev/full", mode),
                        raising=False)
    with pytest.raises(OSError) as caught:
        metrics.write({"step": 1, "loss": 2.0})
    assert _in_words(caught.value) == f"{tmp_path / 'metrics.jsonl'}: No space left on device"


def test_a_log_window_without_a_finite_step_reads_nan_not_zero():
    from mt.runlog import Window

    window = Window(torch.device("cpu"))
    window.add(torch.tensor([float("nan"), float("nan")]), 100, torch.tensor(False))
    assert all(math.isnan(window.read()[key]) for key in ("loss", "nll", "ppl"))
    window.add(torch.tensor([30.0, 20.0]), 10, torch.tensor(True))
    assert window.read()["loss"] == 3.0  # (30 over 10 tokens: the NaN window is gone)


def test_a_validation_records_the_epoch_its_last_step_trained_in(trainer_factory):
    """After an epoch's last step the trainer already counts the next epoch (where a resume
    starts): the final validation of trainer.max_epochs=1 was recorded as epoch 1."""
    trainer = trainer_factory("epochs")
    trainer.validate = lambda: {"valid_loss": 2.0, "valid_ppl": math.exp(2), "valid_bleu": 1.0,
                                "valid_chrf": 1.0}
    for step, epoch, in_epoch in [(10, 1, 0), (13, 1, 3)]:
        trainer.step, trainer.epoch, trainer.step_in_epoch = step, epoch, in_epoch
        trainer._validate_and_save()
    records = [json.loads(line) for line in
               (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records if "valid_loss" in r] == [(10, 0), (13, 1)]


def test_min_improvement_keeps_the_earlier_best_and_stops_sooner(trainer_factory):
    """chrF 45.5 beats 45 by 0.5: not better with min_improvement 1, so best.pt stays step 2's
    and the validations from step 3 on all count against patience."""
    plain = trainer_factory("plain", "trainer.best_metric=chrf", "trainer.patience=3")
    strict = trainer_factory("strict", "trainer.best_metric=chrf", "trainer.patience=3",
                             "trainer.min_improvement=1")
    assert validate_with(plain, SCORES)[-1] == ""  # step 4 reset the count: 1 bad so far
    reasons = validate_with(strict, SCORES)
    assert reasons[:4] == ["", "", "", ""]
    assert reasons[4] == ("trainer.patience=3: no better valid chrf (by more than "
                          "trainer.min_improvement=1) in 3 validations")
    assert stamp_of(strict.ckpt_dir / "best.pt") == 2 and strict.best == 45.0
    assert stamp_of(plain.ckpt_dir / "best.pt") == 4


def test_label_smoothed_loss_matches_its_definition():
    from mt.loss import label_smoothed_nll

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    target = torch.tensor([[4, 5, 0], [6, 0, 0]])  # 0 = PAD, ignored
    loss, nll = label_smoothed_nll(logits, target, 0.1)
    lp = logits.log_softmax(-1)
    mask = target != 0
    expect_nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[mask].sum()
    expect = 0.9 * expect_nll + 0.1 * (-lp.mean(-1))[mask].sum()
    assert nll.item() == pytest.approx(expect_nll.item(), rel=1e-5)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)


def test_an_accumulated_step_equals_one_batch_of_its_pairs(trainer_factory):
    """trainer.accumulation: two micro-batches give the loss and gradient of one batch holding
    both (the loss is divided by the step's target tokens, not averaged per micro-batch)."""
    trainer = trainer_factory("run", "model.dropout=0.0")
    first, second = trainer.corpus.batches(300, 1, 0)[:2]
    tokens = sum(trainer.corpus.tgt_lens[i] + 1 for i in first + second)
    start = copy.deepcopy(trainer.model.state_dict())
    runs = []
    for micro_batches in ([first, second], [first + second]):
        trainer.model.load_state_dict(start)
        loss, _ = trainer.train_step(micro_batches, tokens)
        runs.append((loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    (loss_a, grad_a), (loss_b, grad_b) = runs
    torch.testing.assert_close(loss_a, loss_b)
    for name in grad_a:
        torch.testing.assert_close(grad_a[name], grad_b[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_smoothed_loss_gradient_equals_cross_entropy(dtype):
    """The hand-written backward gives autograd's gradient of F.cross_entropy."""
    from mt.loss import label_smoothed_nll

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11).to(dtype).requires_grad_()
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0
    target[2, 1:] = 0
    loss, _ = label_smoothed_nll(logits, target, 0.2)
    (2.5 * loss).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = torch.nn.functional.cross_entropy(logits.float().view(-1, 11), target.view(-1),
                                            ignore_index=0, reduction="sum", label_smoothing=0.2)
    (2.5 * ref).backward()
    assert ours.dtype == dtype
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), logits.grad.float(), rtol=tol, atol=tol)
    assert ours[0, 3:].abs().sum() == 0  # padded positions get no gradient


def run_train(tmp_path: Path, run_dir: Path, corpus_dir, tokenizer_dir, *overrides,
              torchrun: int = 0) -> subprocess.CompletedProcess:
    launcher = [PYTHON, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={torchrun}"] if torchrun else [PYTHON]
    cmd = [*launcher, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", *overrides]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


@pytest.mark.parametrize("name", ["plain-run_1.2", "my runs", "a (copy), x=y", "it's", 'q"uote',
                                  "back\\slash", "end\\", "a\\'b", "cost$5", "~home", "[x]"])
def test_the_resume_hint_reads_back_as_the_run_directory(tmp_path, name):
    """The override that the interrupt and no-budget lines print, split by a shell and parsed by
    Hydra, names the run directory itself (shlex.quote alone gave text Hydra refuses for a
    directory with a space, a comma, parentheses or '=')."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mt.resume import resume_override

    run_dir = tmp_path / name
    text = resume_override(run_dir)
    [override] = OverridesParser.create().parse_overrides(shlex.split(text))
    assert override.key_or_group == "hydra.run.dir" and override.value() == str(run_dir)
    if name.startswith("plain"):
        assert text == f"hydra.run.dir={run_dir}"


def test_a_sweep_jobs_resume_hint_names_the_sweep_folder(tmp_path, monkeypatch):
    """Under -m, Hydra reads hydra.sweep.dir, not hydra.run.dir: the hint named the job's folder
    as hydra.run.dir, and the same -m command with it started a new sweep from scratch."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mt.resume import resume_override

    job = SimpleNamespace(mode=RunMode.MULTIRUN, sweep=SimpleNamespace(subdir="3"))
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: job))
    assert resume_override(tmp_path / "sweep" / "3") == f"hydra.sweep.dir={tmp_path}/sweep"
    job.sweep.subdir = "lr=3e-4/3"  # a subdir of several parts
    assert resume_override(tmp_path / "sw" / "lr=3e-4" / "3") == f"hydra.sweep.dir={tmp_path}/sw"
    job.mode = RunMode.RUN
    assert resume_override(tmp_path / "sweep" / "3") == f"hydra.run.dir={tmp_path}/sweep/3"


def ctrl_c_as_in_a_terminal() -> None:
    """A child's SIGINT at its default, which Python turns into KeyboardInterrupt: a background
    job of a script (CI's, maybe) ignores SIGINT, and its children inherit that, so a test's
    Ctrl-C did nothing there and the test passed without looking."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A test run under nohup (SIGHUP ignored, which children inherit and mt-train respects) would
# see the SIGHUP tests' signal ignored: the child hears it as a terminal's user's mt-train does.
HANG_UP_HEARD = ("import signal\nsignal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
                 if hasattr(signal, "SIGHUP") else "")


def patched_train(tmp_path: Path, corpus_dir, tokenizer_dir, patch: str, *overrides: str,
                  run_dir: Path | None = None, timeout: float = 300,
                  **popen) -> subprocess.CompletedProcess:
    """mt-train in a process of its own, ``patch`` (Python source) run first: a failure or a
    signal planted where a test needs it, and the command line's handling of it seen whole."""
    script = (f"{HANG_UP_HEARD}import sys\n{patch}sys.argv[0] = 'mt-train'\n"
              "from mt.train import main\nmain()\n")
    cmd = [PYTHON, "-c", script, *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir or tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, **popen)


def test_a_library_warning_is_printed_once_and_kept_in_the_log(tmp_path, corpus_dir,
                                                               tokenizer_dir):
    """datasets and huggingface_hub print through handlers of their own and pass each record
    on to Hydra's as well: every hub retry line came out twice on stderr."""
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir,
                           "import logging, mt.train as t\n"
                           "def fit(self):\n"
                           "    logging.getLogger('huggingface_hub').warning('retrying in 1s "
                           "(probe)')\n"
                           "    logging.getLogger('datasets').warning('a datasets warning "
                           "(probe)')\n"
                           "    raise SystemExit(0)\n"
                           "t.Trainer.fit = fit\n")
    run_dir = tmp_path / "run"
    assert result.returncode == 0, result.stderr[-2000:]
    for said in ("retrying in 1s (probe)", "a datasets warning (probe)"):
        assert result.stderr.count(said) == 1, result.stderr
        assert said in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_sigterm_while_the_data_is_prepared_is_said(tmp_path, corpus_dir, tokenizer_dir, sig):
    """Before the training loop (a tokenizer trained, a corpus encoded: minutes on WMT) a
    SIGTERM killed mt-train without a word; now it ends as Ctrl-C does, with the signal's
    status. A SIGHUP (the terminal closed) likewise."""
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir,
                           "import os, signal, time, mt.train as t\n"
                           "def corpus(self, *args):\n"
                           f"    os.kill(os.getpid(), signal.{sig})\n"
                           "    time.sleep(30)\n"
                           "t.Trainer._corpus = corpus\n")
    assert result.returncode == 128 + getattr(signal, sig), result.stderr[-2000:]
    assert f"terminated ({sig}) before the first checkpoint; nothing to resume" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")
def test_a_sighup_in_the_loop_saves_the_step_it_stops_at(tmp_path, corpus_dir, tokenizer_dir):
    """A closed terminal or a dropped ssh session (SIGHUP) killed mt-train at once: every step
    since the last save was lost. It now stops as a SIGTERM does: last.pt at the step, exit
    129, the resume hint; the same command goes on from there."""
    hang_up = ("import os, signal, mt.trainer as t\n"
               "step = t.Trainer.train_step\n"
               "def train_step(self, *args, **kwargs):\n"
               "    if self.step == 2:  # in the third step\n"
               "        os.kill(os.getpid(), signal.SIGHUP)\n"
               "    return step(self, *args, **kwargs)\n"
               "t.Trainer.train_step = train_step\n")
    run_dir = tmp_path / "run"
    budget = ("trainer.max_steps=6", "trainer.validate_every=100", "optim.warmup_steps=2")
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, hang_up, *budget)
    assert result.returncode == 129, result.stderr[-2000:]
    assert (f"terminated (SIGHUP) after step 3, which {run_dir}/checkpoints/last.pt holds"
            in result.stderr), result.stderr[-2000:]
    assert torch.load(run_dir / "checkpoints" / "last.pt",
                      weights_only=False)["trainer"]["step"] == 3
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP here")
def test_a_sighup_under_tee_saves_the_step_it_stops_at(tmp_path, corpus_dir, tokenizer_dir):
    """`mt-train ... 2>&1 | tee log` in a terminal that closes: tee dies of the SIGHUP too, and
    the progress bar's next write to the pipe raised BrokenPipeError in the training loop, so
    the run ended in a traceback instead of saving the step it stopped at."""
    marker = tmp_path / "marker"
    patch = ("import os, time, mt.trainer as t\n"
             "step = t.Trainer.train_step\n"
             "def train_step(self, *args, **kwargs):\n"
             "    if self.step == 2:  # in the third step: the terminal closes\n"
             f"        open({str(marker)!r}, 'w').close()\n"
             "        time.sleep(3)\n"
             "    return step(self, *args, **kwargs)\n"
             "t.Trainer.train_step = train_step\n")
    script = (f"{HANG_UP_HEARD}import sys\n{patch}sys.argv[0] = 'mt-train'\n"
              "from mt.train import main\nmain()\n")
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-c", script, *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=6", "trainer.validate_every=100",
           "optim.warmup_steps=2"]
    proc = subprocess.Popen(cmd, env=cli_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read().decode()[-2000:]
        proc.stderr.close()  # tee is gone: the pipe has no reader
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 129, (run_dir / "train.log").read_text()[-2000:]
    finally:
        proc.kill()
    log = (run_dir / "train.log").read_text()
    assert "terminated (SIGHUP) after step 3" in log and "Traceback" not in log, log[-2000:]
    assert torch.load(run_dir / "checkpoints" / "last.pt",
                      weights_only=False)["trainer"]["step"] == 3


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_worker_processes_encode_the_corpus_is_one_line(tmp_path, corpus_dir,
                                                                       tokenizer_dir, sig):
    """data.num_proc > 1 (the default above 200k pairs) encodes in a pool of forked workers,
    which inherited mt-train's SIGTERM handler: the pool's SIGTERM to its workers became an
    error they caught, and mt-train hung after `kill`, `timeout` or a scheduler's SIGTERM until
    a SIGKILL. A terminal's Ctrl-C, which reaches every process of the group, printed each
    worker's traceback before mt-train's line. Here a worker signals in the middle of its
    share, as `kill PID` (SIGTERM, to mt-train alone) or Ctrl-C (SIGINT, to the group) would."""
    to = "os.getppid()" if sig == "SIGTERM" else "-os.getpgid(0)"
    patch = ("import os, signal, time, mt.batching as b\n"
             "parent, encode = os.getpid(), b.EncodeBatch.__call__\n"
             "def slow(self, *args, **kwargs):\n"
             "    if os.getpid() != parent:  # a worker: the signal, then a long share\n"
             f"        os.kill({to}, signal.{sig})\n"
             "        time.sleep(60)\n"
             "    return encode(self, *args, **kwargs)\n"
             "b.EncodeBatch.__call__ = slow\n")
    try:
        result = patched_train(tmp_path, corpus_dir, tokenizer_dir, patch, "data.num_proc=2",
                               timeout=50, start_new_session=True,
                               preexec_fn=ctrl_c_as_in_a_terminal)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"mt-train still ran 50 s after the {sig}") from err
    assert result.returncode == 128 + getattr(signal, sig), result.stderr[-3000:]
    how = "terminated (SIGTERM)" if sig == "SIGTERM" else "interrupted"
    assert f"{how} before the first checkpoint; nothing to resume" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_under_the_sigterm_handler_dies_of_sigterm_even_before_its_reset():
    """The reset in a forked child (mt.interrupts._forked) runs after threading's own after-fork
    hook: a SIGTERM to the whole group (a scheduler's) could reach a child just forked before
    it, and the parent's handler raised there into the "exception ignored" of that hook, so the
    child lived on. The handler itself now lets a child die of it, as by default."""
    from mt import interrupts

    with interrupts.terminate_as_interrupt():
        pid = os.fork()
        if pid == 0:  # the child: what it was set to, then the handler run as the signal would
            if not (signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
                    and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
                os._exit(4)
            signal.signal(signal.SIGTERM, interrupts._raise_terminated)
            try:
                interrupts._raise_terminated(signal.SIGTERM, None)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_a_sigterm_after_the_loops_last_look_stops_before_the_final_test(tmp_path, corpus_dir,
                                                                         tokenizer_dir):
    """A SIGTERM in the last steps (under DDP the ranks agree only every trainer.log_every
    steps) was dropped once the loop ended: the final validation, average and test ran into the
    scheduler's SIGKILL, and the steps since the last save were lost. Now last.pt is saved at
    the last step and the run stops; the same command finishes it."""
    stop_at_end = ("import os, signal, mt.trainer as t\n"
                   "reason = t.Trainer.stop_reason\n"
                   "def stop_reason(self):\n"
                   "    said = reason(self)\n"
                   "    if said:\n"
                   "        os.kill(os.getpid(), signal.SIGTERM)\n"
                   "    return said\n"
                   "t.Trainer.stop_reason = stop_reason\n")
    run_dir = tmp_path / "run"
    budget = ("trainer.max_steps=3", "trainer.validate_every=100")
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, stop_at_end, *budget)
    assert result.returncode == 143, result.stderr[-2000:]
    assert "terminated (SIGTERM) after step 3" in result.stderr
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert last["trainer"]["step"] == 3
    assert not (run_dir / "test.json").exists()
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, "", *budget)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bleu" in json.loads((run_dir / "test.json").read_text())


def test_a_sigterm_in_the_final_validation_saves_its_step(tmp_path, corpus_dir, tokenizer_dir):
    """A budget that ends between validations (trainer.max_minutes, max_epochs) validates once
    more after the loop. A SIGTERM there was a KeyboardInterrupt: last.pt stayed at the last
    save and the steps since were lost. Now the validation stops at its next batch, last.pt
    holds its step (not the unfinished validation), and the same command validates that step
    and goes on to the test."""
    term_in_final = ("import os, signal, mt.trainer as t\n"
                     "validate = t.Trainer.validate\n"
                     "def validate_once_more(self):\n"
                     "    if self.step == 3:  # the loop validated at 2 and stopped at 3\n"
                     "        os.kill(os.getpid(), signal.SIGTERM)\n"
                     "    return validate(self)\n"
                     "t.Trainer.validate = validate_once_more\n")
    run_dir = tmp_path / "run"
    budget = ("trainer.max_steps=3", "trainer.validate_every=2")
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, term_in_final, *budget)
    assert result.returncode == 143, result.stderr[-2000:]
    assert (f"terminated (SIGTERM) after step 3, which {run_dir}/checkpoints/last.pt holds"
            in result.stderr), result.stderr[-2000:]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["trainer"]
    assert state["step"] == 3 and [r["step"] for r in state["history"]] == [2]
    assert not (run_dir / "test.json").exists()
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, "", *budget)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed" in result.stderr and "step 3: valid loss" in result.stderr
    assert "bleu" in json.loads((run_dir / "test.json").read_text())


# mt-train with a validation search of many small batches, as a large valid set has, each
# counted in the file $SEARCHES (by rank 0, which validates) and taking 4 s while the file $SLOW
# exists: a validation of minutes, in a test of seconds.
SLOW_VALIDATION = """\
import os, sys, time
import mt.lines, mt.options
options = mt.options.SearchOptions
mt.options.SearchOptions = lambda **kw: options(**{"batch_tokens": 40, **kw})
greedy = mt.lines.greedy_search
def counted(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["SEARCHES"], "a") as f:
            f.write("batch\\n")
        if os.path.exists(os.environ["SLOW"]):
            time.sleep(4)
    return greedy(*args, **kwargs)
mt.lines.greedy_search = counted
sys.argv[0] = "mt-train"
from mt.train import main
main()
"""


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process", "torchrun"])
def test_a_sigterm_in_a_long_validation_stops_within_a_batch_and_resumes_exactly(
        tmp_path, corpus_dir, tokenizer_dir, processes):
    """A SIGTERM waited for the validation under way to end: on a large valid set minutes, past
    the 30 s a scheduler (SLURM's KillWait, torchrun's own) waits before its SIGKILL, which then
    lost every step since the last save. The validation now ends at its next batch: last.pt
    holds the step, without the unfinished validation, which the resumed run does first; it
    ends as a run never stopped does, weights and curves alike. Under torchrun the launcher
    passes the SIGTERM on; rank 1, waiting for rank 0's scores, learns of the cut from them."""
    script = tmp_path / "slow_validation.py"
    script.write_text(SLOW_VALIDATION)
    searches, slow = tmp_path / "searches", tmp_path / "slow"
    env = {**cli_env(tmp_path), "SEARCHES": str(searches), "SLOW": str(slow)}
    launcher = ([PYTHON, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={processes}"] if processes > 1 else [PYTHON])
    steps = ["trainer.max_steps=5", "trainer.validate_every=3", "trainer.test_at_end=false",
             "data.max_valid_sentences=30", "trainer.log_every=1"]

    def command(run_dir: Path) -> list[str]:
        return [*launcher, str(script), *tiny_train_args(corpus_dir, tokenizer_dir),
                f"hydra.run.dir={run_dir}", *steps]

    full, killed = tmp_path / "full", tmp_path / "killed"
    done = subprocess.run(command(full), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    per_validation = len(searches.read_text().splitlines()) // 2  # steps 3 and 5
    assert per_validation >= 10  # slowed: 40 s or more, 4 s per batch
    searches.unlink()

    slow.touch()
    err = open(tmp_path / "killed.err", "w+")  # noqa: SIM115 (read after the process ends)
    proc = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not searches.exists():
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its validation"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    took = time.monotonic() - sent
    err.seek(0)
    said = err.read()
    err.close()
    assert proc.returncode != 0 and "terminated (SIGTERM) after step 3" in said, said[-3000:]
    # the batch under way, last.pt and the exit (Python's and torchrun's take seconds on a busy
    # machine), not the 36 s and more left
    assert took < 20, (took, said[-3000:])
    assert len(searches.read_text().splitlines()) < per_validation
    state = torch.load(killed / "checkpoints" / "last.pt", weights_only=False)["trainer"]
    assert state["step"] == 3 and state["history"] == []  # step 3 not validated
    slow.unlink()

    resumed = subprocess.run(command(killed), env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr and "step 3: valid loss" in resumed.stderr
    assert ("step 3 is not validated yet (a SIGTERM or SIGHUP cut its validation short, or "
            "trainer.validate_every is new): it is validated first") in resumed.stderr
    a, b = weights(full), weights(killed)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    def records(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")}
                for x in lines]

    assert records(killed) == records(full)
    assert [r["step"] for r in records(full) if "valid_loss" in r] == [3, 5]


def test_the_validation_a_sigterm_cut_is_done_first_on_resume_and_can_end_the_run(
        trainer_factory, monkeypatch):
    """The resumed run validates the step whose validation a SIGTERM cut short before it trains
    on, and stops there if that validation ends trainer.patience, as the run never stopped
    does (it trained on to the next validation first)."""
    from mt.distributed import Terminated
    from mt.trainer import Trainer

    bleu = {3: 5.0}  # worse after step 3 (1.0): trainer.patience=1 ends the run at step 6
    real, cut = Trainer.validate, []

    def validate(self):
        if self.step == 6 and not cut:  # the real validation, a SIGTERM come as it starts
            cut.append(os.kill(os.getpid(), signal.SIGTERM))
            return real(self)
        return {"valid_loss": 2.0, "valid_ppl": math.exp(2),
                "valid_bleu": bleu.get(self.step, 1.0), "valid_chrf": 1.0}

    monkeypatch.setattr(Trainer, "validate", validate)
    args = ("trainer.max_steps=12", "trainer.validate_every=3", "trainer.patience=1")
    with pytest.raises(Terminated) as stopped:
        trainer_factory("run", *args).fit()
    assert stopped.value.step == 6 and cut
    resumed = trainer_factory("run", *args)
    assert resumed.step == 6 and [r["step"] for r in resumed.history] == [3]
    resumed.fit()
    assert resumed.step == 6 and [r["step"] for r in resumed.history] == [3, 6]
    assert resumed.stop_reason().startswith("trainer.patience=1")


def test_a_run_with_stderr_closed_trains_and_logs_to_its_file(tmp_path, corpus_dir,
                                                             tokenizer_dir):
    """`mt-train ... 2>&-` (a service, a cron line) died silently inside Hydra, exit status 1:
    stderr is /dev/null now, and train.log has the run."""
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=2", "trainer.test_at_end=false"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), stdout=subprocess.PIPE, text=True,
                            timeout=300, preexec_fn=lambda: os.close(2))
    assert result.returncode == 0
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert "training stopped at step 2" in (run_dir / "train.log").read_text()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_after_the_run_is_one_line_and_keeps_the_test_scores(tmp_path, corpus_dir,
                                                                           tokenizer_dir):
    """`mt-train > /dev/full` said "[Errno 28] No space left on device" (no word of stdout)
    after the whole run, and lost test.json, which was written after the printing."""
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=2", "trainer.test_at_end=true"]
    with open("/dev/full", "w") as full:
        result = subprocess.run(cmd, env=cli_env(tmp_path), stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "mt-train: cannot write the results to stdout (No space left on device); the run is "
        f"complete in {run_dir}")
    assert "bleu" in json.loads((run_dir / "test.json").read_text())


def test_the_translate_hint_runs_as_printed_with_spaces_in_its_paths(tmp_path, corpus_dir,
                                                                     tokenizer_dir):
    """The `try: translate ...` line printed its paths unquoted: with a space in the run
    directory or in data.dir, the command pasted into a shell split each into two arguments."""
    data = tmp_path / "my data"
    shutil.copytree(corpus_dir, data)
    run_dir = tmp_path / "my runs" / "a"
    result = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, f"data.dir='{data}'",
                       "trainer.max_steps=1", "trainer.test_at_end=true")
    [hint] = [x for x in result.stdout.splitlines() if x.startswith("try: ")]
    assert shlex.split(hint[len("try: "):]) == ["translate", "-m", str(run_dir),
                                               "-i", str(data / "test.en")]


def test_a_finished_run_started_again_keeps_its_test_scores(tmp_path, corpus_dir, tokenizer_dir):
    """The same command again on a finished run (a sweep resumed after a Ctrl-C runs every
    job's) decoded the test set anew each time. The scores of the same weights, texts and
    search are kept; another beam, or an edited reference, is decoded again."""
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    run_dir = tmp_path / "run"
    args = (f"data.dir={data}", "trainer.max_steps=2", "trainer.test_at_end=true")
    run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, *args)
    first = json.loads((run_dir / "test.json").read_text())
    hyp = run_dir / "test.hyp"
    written = hyp.stat().st_mtime_ns
    again = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, *args)
    kept = "are of these weights, texts and search: kept"
    assert kept in again.stderr
    assert json.loads((run_dir / "test.json").read_text()) == first
    assert hyp.stat().st_mtime_ns == written
    assert f"test BLEU = {first['bleu']:.2f}" in again.stdout
    beam = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, *args, "trainer.beam_size=2")
    assert kept not in beam.stderr
    assert json.loads((run_dir / "test.json").read_text())["tested_with"]["search"]["beam"] == 2
    # a later finish cut short after writing its .hyp (here: by hand) leaves another beside the
    # old test.json: decoded again, not kept
    hyp.write_text("other\n" * len(hyp.read_text().splitlines()))
    touched = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, *args, "trainer.beam_size=2")
    assert kept not in touched.stderr and "other" not in hyp.read_text()
    refs = (data / "test.zz").read_text().splitlines()
    (data / "test.zz").write_text("\n".join(["x", *refs[1:]]) + "\n")
    edited = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, *args, "trainer.beam_size=2")
    assert kept not in edited.stderr


def test_a_second_run_on_a_busy_run_directory_is_refused_in_one_line(tmp_path, corpus_dir,
                                                                     tokenizer_dir):
    """Two mt-train on one directory would interleave their checkpoints and metrics: while one
    holds it, the other stops before writing anything of its own, and names the holder."""
    from mt.checkpoint import run_dir_lock

    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=2"]
    with run_dir_lock(run_dir):
        busy = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                              timeout=300)
    assert busy.returncode == 1
    said = busy.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"mt-train: {re.escape(str(run_dir))}: another mt-train \(process "
                        rf"{os.getpid()}\) is training in this directory; .*", said), said
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "tokenizer").exists()
    free = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                          timeout=300)  # the lock went with its holder
    assert free.returncode == 0, free.stderr[-2000:]
    assert (run_dir / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("data", [[], ["data.subword_alpha=0.5", "data.subword_nbest=8"],
                                  ["+data.upsample.train=0.5"], ["trainer.ema_decay=0.9"]],
                         ids=["one-segmentation", "subword-sampling", "upsample", "ema"])
def test_sigkill_then_resume_gives_bitwise_identical_weights(tmp_path, corpus_dir, tokenizer_dir,
                                                             data, fit_here):
    # Log lines every 3 steps and saves every 2: the kill lands inside a log window, after lines
    # of steps that the last checkpoint does not hold.
    steps = ["trainer.max_steps=20", "trainer.validate_every=7", "trainer.save_every=2",
             "trainer.log_every=3", "trainer.test_at_end=false", *data]
    full = tmp_path / "full"
    fit_here("full", *steps)  # in this process: the killed run's are mt-train's

    # The same run, killed without warning once step 9 is logged (after the validation of step 7;
    # its checkpoint is step 8's, or 10's), 11 steps before the end, which even a slow machine
    # does not reach first (at 14 steps, 5 left 1.4 s). One variant gets a Ctrl-C instead: the
    # same checkpoint, and one line on how to resume. Another gets a SIGTERM (a scheduler's
    # preemption notice): the step in progress ends and last.pt holds it, so nothing is lost.
    killed = tmp_path / "killed"
    kill_at = 9
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={killed}", *steps]
    ctrl_c = "upsample" in " ".join(data)
    sigterm = "ema" in " ".join(data)
    err = open(tmp_path / "killed.err", "w+")  # noqa: SIM115 (read after the process ends)
    proc = subprocess.Popen(cmd, env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=err,
                            preexec_fn=ctrl_c_as_in_a_terminal)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists():
            seen = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x]
            if seen and max(seen) >= kill_at:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGINT if ctrl_c else signal.SIGTERM if sigterm else signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "last.pt").exists()
    err.seek(0)
    said = err.read()
    # A signal sent just as the 20 steps end can land in the interpreter's teardown, after
    # mt-train is done: nothing of the run is lost then, and no resume hint is due.
    if ctrl_c and "trainer.max_steps=20 reached" not in said:
        assert proc.returncode == 130 and "Traceback" not in said, said
        assert f"the same command with hydra.run.dir={killed} resumes it" in said
    if sigterm:  # its handler runs to the end of training: the step after the signal stops it
        assert proc.returncode == 143 and "Traceback" not in said, said[-3000:]
        last = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["trainer"]
        assert last["step"] >= kill_at  # the step it stopped at, past every save before it
        assert (f"terminated (SIGTERM) after step {last['step']}, which {killed}/checkpoints/"
                f"last.pt holds: the same command with hydra.run.dir={killed} resumes it") in said
    err.close()

    resumed = run_train(tmp_path, killed, corpus_dir, tokenizer_dir, *steps)
    assert "resumed" in resumed.stderr
    assert "settings changed" not in resumed.stderr  # the same command: nothing to report
    assert ("subword regularization" in resumed.stderr) == ("subword" in " ".join(data))
    assert ("pairs an epoch" in resumed.stderr) == ("upsample" in " ".join(data))
    a, b = weights(full), weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    full_state = torch.load(full / "checkpoints" / "last.pt", weights_only=True)["trainer"]
    killed_state = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["trainer"]
    assert full_state["step"] == killed_state["step"] == 20
    if "ema" in " ".join(data):  # "model" is the average; the trained weights are beside it
        assert killed_state["ema_updates"] == 20
        for name, w in full_state["weights"].items():
            assert torch.equal(w, killed_state["weights"][name]), name
        assert not all(torch.equal(w, a[n]) for n, w in full_state["weights"].items())

    # The curves too: each step once, every loss and learning rate as in the run never killed.
    def records(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")}
                for x in lines]

    assert [r["step"] for r in records(full)] == [3, 6, 7, 9, 12, 14, 15, 18, 20]
    assert records(killed) == records(full)


def test_extra_valid_splits_are_scored_beside_valid_and_change_nothing_else(
        tmp_path, corpus_dir, fit_here):
    """data.extra_valid scores more splits at each validation, but only data.valid chooses: the
    weights and the valid scores are those of a run without them. A copy of the valid split
    scores exactly as the valid split does (the same pairs, the same search)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    for lang in ("en", "zz"):
        shutil.copy(corpus / f"valid.{lang}", corpus / f"dev2.{lang}")
    steps = ["trainer.max_steps=8", "trainer.validate_every=4", "trainer.test_at_end=false"]
    plain, extra = tmp_path / "plain", tmp_path / "extra"
    fit_here("plain", *steps, corpus=corpus)
    said = fit_here("extra", *steps, "data.extra_valid=[dev2,test]", corpus=corpus)
    assert re.search(r"step 8: valid loss .*; dev2: loss [\d.]+, BLEU [\d.]+, chrF [\d.]+; "
                     r"test: loss", said), said[-2000:]

    def validations(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "valid_loss" in r]

    with_extra = validations(extra)
    assert [r["step"] for r in with_extra] == [4, 8]
    for r in with_extra:
        for key in ("loss", "ppl", "bleu", "chrf"):
            assert r[f"dev2/{key}"] == r[f"valid_{key}"], key
        assert r["test/loss"] != r["valid_loss"]  # other pairs
    assert [{k: v for k, v in r.items() if "/" not in k} for r in with_extra] == validations(plain)
    a, b = weights(plain), weights(extra)
    assert all(torch.equal(a[name], b[name]) for name in a)
    for step in (4, 8):
        hyps = (extra / "valid" / f"step_{step}.hyp").read_text()
        assert (extra / "valid" / "dev2" / f"step_{step}.hyp").read_text() == hyps
        test = (extra / "valid" / "test" / f"step_{step}.hyp").read_text().splitlines()
        assert len(test) == 8  # data.max_valid_sentences cuts each split alike


def test_a_run_removes_the_temporaries_of_killed_writes_but_not_a_running_writers(
        trainer_factory, tmp_path, caplog):
    """A SIGKILL in the middle of a small file's write (a valid/step_N.hyp, the tokenizer,
    metrics.jsonl) left its hidden .NAME.PID.tmp in the run directory for good; checkpoints'
    were removed at the next start, these never. Now those of a process that has ended go
    when the run starts or resumes; one of a process still running stays, as do other files."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    run_dir = tmp_path / "run"
    killed = [run_dir / "valid" / f".step_4.hyp.{ended.pid}.tmp",
              run_dir / "valid" / "dev2" / f".step_4.hyp.{ended.pid}.tmp",
              run_dir / "tokenizer" / f".spm.model.{ended.pid}.tmp",
              run_dir / f".metrics.jsonl.{ended.pid}.tmp"]
    kept = [run_dir / "valid" / f".step_8.hyp.{running.pid}.tmp",
            run_dir / f".test.json.{os.getpid()}.tmp", run_dir / "notes.123.tmp",
            run_dir / "valid" / "step_4.hyp",
            run_dir / "src" / f".mine.{ended.pid}.tmp"]  # a folder mt-train does not write
    try:
        for path in killed + kept:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("x\n")
        with caplog.at_level(logging.INFO, logger="mt.train"):
            trainer_factory("run")
    finally:
        running.kill()
        running.wait()
    assert [p for p in killed if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert f"removed 4 temporary file(s) of killed writes from {run_dir}: " in caplog.text


@pytest.mark.parametrize("victim", ["best.pt", "last.pt"])
def test_a_kill_between_the_files_of_a_validation_loses_none_of_them(tmp_path, corpus_dir,
                                                                     tokenizer_dir, victim,
                                                                     fit_here):
    """A validation writes step_N.pt, best.pt and last.pt, each atomically. last.pt was written
    first: a kill before best.pt resumed past this validation, and its best.pt never came. A
    kill in best.pt's write (or in last.pt's, the last) now leaves a run that ends with the same
    files and weights as one never stopped, and the resumed run deletes the killed write's
    temporary file."""
    steps = ["trainer.max_steps=14", "trainer.validate_every=7", "trainer.test_at_end=false"]
    full = tmp_path / "full"
    fit_here("full", *steps)
    killer = tmp_path / "kill_at_write.py"  # SIGKILL half-way through the victim's first write
    killer.write_text(textwrap.dedent(f"""
        import os, signal, sys, torch
        real = torch.save
        def save(obj, path, *args, **kwargs):
            if os.path.basename(path).startswith(".{victim}."):  # save_atomic's temporary file
                with open(path, "wb") as f:
                    f.write(b"half a checkpoint")
                os.kill(os.getpid(), signal.SIGKILL)
            real(obj, path, *args, **kwargs)
        torch.save = save
        sys.argv = ["mt-train", *sys.argv[1:]]
        from mt.train import main
        main()
    """))
    killed = tmp_path / "killed"
    cmd = [PYTHON, str(killer), *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={killed}", *steps]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert len(list((killed / "checkpoints").glob(".*.tmp"))) == 1
    resumed = run_train(tmp_path, killed, corpus_dir, tokenizer_dir, *steps)
    assert "removed 1 unfinished checkpoint write(s)" in resumed.stderr
    names = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == names
    assert "best.pt" in names and "step_7.pt" in names
    for name in names:
        a = torch.load(full / "checkpoints" / name, weights_only=True)["model"]
        b = torch.load(killed / "checkpoints" / name, weights_only=True)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_ctrl_c_inside_a_checkpoint_write_still_says_how_to_resume(tmp_path, corpus_dir,
                                                                     tokenizer_dir):
    """A Ctrl-C that lands inside torch.save reaches mt-train as the zip writer's RuntimeError
    ("unexpected pos"), with the KeyboardInterrupt only as its context (seen once in CI): it is
    a Ctrl-C all the same, and the last whole checkpoint is kept."""
    run_dir = tmp_path / "run"
    patch = (  # the third save is interrupted as CI saw it: KeyboardInterrupt, then cleanup fails
        "import torch\n"
        "saves, real = [], torch.save\n"
        "def save(obj, f):\n"
        "    saves.append(1)\n"
        "    if len(saves) < 3:\n"
        "        return real(obj, f)\n"
        "    try:\n"
        "        raise KeyboardInterrupt\n"
        "    finally:\n"
        "        raise RuntimeError('[enforce fail at inline_container.cc:672] unexpected pos')\n"
        "torch.save = save\n")
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir, patch, "trainer.max_steps=8",
                           "trainer.save_every=2", "trainer.validate_every=100",
                           "trainer.test_at_end=false", run_dir=run_dir)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"the same command with hydra.run.dir={run_dir} resumes it" in result.stderr
    kept = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert kept["trainer"]["step"] in (2, 4)
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_every_checkpoint_of_a_run_carries_its_id_across_resumes(tmp_path, fit_here):
    """Step files carried no run identity: mt-average of two runs' step files, of one config,
    wrote a broken model without a word. A run's id is made at its start, kept in last.pt, and
    written into every checkpoint it saves, before and after a resume; another run has its own."""
    from mt.average import average

    common = ["trainer.validate_every=1", "trainer.keep_last=9", "trainer.test_at_end=false",
              "trainer.average_last=0"]
    fit_here("one", *common, "trainer.max_steps=2")
    fit_here("one", *common, "trainer.max_steps=4")  # resumed
    fit_here("two", *common, "trainer.max_steps=2", "trainer.seed=2")

    def ids(run: str) -> set[str]:
        return {torch.load(p, weights_only=True)["run_id"]
                for p in (tmp_path / run / "checkpoints").glob("*.pt")}

    assert len(ids("one")) == 1 and len(ids("two")) == 1 and ids("one") != ids("two")
    one = tmp_path / "one" / "checkpoints"
    assert average([one / "step_1.pt", one / "step_4.pt"])  # one run, resumed between them
    with pytest.raises(ValueError, match="from another training run"):
        average([one / "step_2.pt", tmp_path / "two" / "checkpoints" / "step_2.pt"])


def test_a_resumed_run_logs_each_step_once_with_the_losses_of_a_run_never_stopped(
        tmp_path, fit_here):
    """A kill between two saves leaves log lines of steps the checkpoint does not hold (and may
    cut one short); the resumed run drops them and carries the open log window's loss over, so
    metrics.jsonl reads as if the run had never stopped. Deterministic: the "kill" is written."""
    common = ["trainer.validate_every=5", "trainer.log_every=3", "trainer.test_at_end=false"]
    full, split = tmp_path / "full", tmp_path / "split"
    fit_here("full", *common, "trainer.max_steps=15")
    fit_here("split", *common, "trainer.max_steps=10")
    with open(split / "metrics.jsonl", "a") as f:  # saved at step 10; logged 12, then killed
        f.write('{"step": 12, "epoch": 0, "loss": 9.0, "lr": 0.1}\n{"step": 15, "ep')
    fit_here("split", *common, "trainer.max_steps=15")

    def records(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")}
                for x in lines]

    assert [r["step"] for r in records(full)] == [3, 5, 6, 9, 10, 12, 15, 15]
    assert records(split) == records(full)  # step 12's window holds steps 10-12
    train = [r for r in records(full) if "loss" in r]
    # the NLL beside the label-smoothed loss (0.1 here), on the valid loss's scale
    assert all(0 < r["nll"] < r["loss"] and r["ppl"] == pytest.approx(math.exp(r["nll"]))
               for r in train)


def test_a_tokenizer_smaller_than_asked_is_said_once_not_at_every_resume(fit_here):
    """data.tokenizer.vocab_size above what the text holds: SentencePiece trains fewer pieces,
    and the training run warns. Every resume of the same command said again "the tokenizer is
    the checkpoint's; ignored data.tokenizer.vocab_size=5000 (tokenizer: N)"; only a value asked
    otherwise than the run before asked it is noted now."""
    common = ["data.tokenizer.path=null", "trainer.test_at_end=false"]
    trained = fit_here("run", *common, "data.tokenizer.vocab_size=5000", "trainer.max_steps=2")
    assert "data.tokenizer.vocab_size=5000: the text holds " in trained
    same = fit_here("run", *common, "data.tokenizer.vocab_size=5000", "trainer.max_steps=3")
    assert "resumed" in same and "the tokenizer is the checkpoint's" not in same
    other = fit_here("run", *common, "data.tokenizer.vocab_size=6000", "trainer.max_steps=4")
    assert "the tokenizer is the checkpoint's; ignored data.tokenizer.vocab_size=6000 " in other
    again = fit_here("run", *common, "data.tokenizer.vocab_size=6000", "trainer.max_steps=5")
    assert "resumed" in again and "the tokenizer is the checkpoint's" not in again


def test_step_k_runs_at_the_schedules_kth_rate_and_a_resume_takes_a_new_optim_lr(
        tmp_path, fit_here, corpus_dir):
    """Step 1 ran at the rate of step 0 (so steps 1 and 2 shared one, and the peak came a step
    late); and a resumed run kept the saved optim.lr, whatever the command line said, although
    the advice after a divergence is to lower it and run again."""
    import math

    run_dir = tmp_path / "run"
    common = ["trainer.validate_every=6", "trainer.test_at_end=false"]  # warmup 5, lr 1e-3
    fit_here("run", *common, "trainer.max_steps=6")
    resumed = fit_here("run", *common, "trainer.max_steps=9", "optim.lr=5e-4",
                       "data.tokenizer.vocab_size=150", "model.heads=4",
                       "data.tokenizer.path=null")
    assert "resuming with optim.lr=0.0005 (was 0.001)" in resumed
    # The model's shape and the tokenizer are the run's own: said, neither listed as changed
    # settings nor recorded as the config of the next checkpoints.
    assert "the model's shape replaces model.heads=4 (model: 2)" in resumed
    assert "the tokenizer is the checkpoint's; ignored data.tokenizer.vocab_size=150 " in resumed
    assert (run_dir / "tokenizer" / "tokenizer.json").exists()  # data.tokenizer.path is this run's
    changed = next(x for x in resumed.splitlines() if "settings changed" in x)
    assert "vocab_size" not in changed and "heads" not in changed
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["config"]
    assert saved["data"]["tokenizer"]["vocab_size"] != 150 and saved["model"]["heads"] == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    assert sorted(lr) == list(range(1, 10))
    for step, rate in lr.items():
        peak = 1e-3 if step <= 6 else 5e-4
        assert rate == pytest.approx(peak * min(step / 5, math.sqrt(5 / step)), rel=1e-12), step
    assert lr[5] == pytest.approx(1e-3)  # the peak, at the last warmup step
    assert "on other data" not in resumed
    # Another corpus (a mistaken data=... or data.dir): said in a warning, not among the info.
    import shutil

    other = shutil.copytree(corpus_dir, tmp_path / "other")
    moved = fit_here("run", *common, "trainer.max_steps=10", corpus=other)
    assert re.search(r"WARNING .*resuming \S+last.pt on other data than it trained on: "
                     rf"dir='{other}' \(was '\S+'\); a model carried on to new data is "
                     r"init_from=\S+last.pt in a new run directory", moved), moved


def test_plateau_cuts_the_rate_and_a_killed_run_resumes_with_the_same_rates(
        tmp_path, corpus_dir, tokenizer_dir, fit_here):
    """trainer.min_improvement=100 makes every validation after the first a bad one, so with
    plateau_patience 1 each cuts the rate in half from the next step on. A run killed between
    saves (a save_every checkpoint, or a validation's) resumes at the same rates: the cuts are
    read from the history in last.pt. Each validation's translations are on disk."""
    steps = ["trainer.max_steps=18", "trainer.validate_every=3", "trainer.save_every=2",
             "trainer.test_at_end=false", "trainer.best_metric=loss",
             "trainer.min_improvement=100", "optim.plateau_factor=0.5",
             "optim.plateau_patience=1"]
    full = tmp_path / "full"
    said = fit_here("full", *steps)
    assert "step 6: valid loss not better in 1 validations (optim.plateau_patience): learning " \
           "rate x 0.5 (cut 1, x 0.5 in all)" in said
    lines = (full / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    for step, rate in lr.items():  # cuts at the validations of steps 6, 9, 12 and 15 (and 18)
        cuts = sum(step > v for v in (6, 9, 12, 15))
        assert rate == pytest.approx(1e-3 * min(step / 5, math.sqrt(5 / step)) * 0.5 ** cuts,
                                     rel=1e-12), step

    killed = tmp_path / "killed"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={killed}", *steps]
    proc = subprocess.Popen(cmd, env=cli_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # killed after the cuts of steps 6 and 9 (and 10 steps before the end, which even a slow
    # machine does not reach first)
    metrics, deadline = killed / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(x)["step"] >= 8 for x in
                                    metrics.read_text().splitlines() if x.endswith("}")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_train(tmp_path, killed, corpus_dir, tokenizer_dir, *steps)
    assert "resumed" in resumed.stderr and "learning rate of" not in resumed.stderr

    def records(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")}
                for x in lines]

    assert records(killed) == records(full)
    a, b = weights(full), weights(killed)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    # valid/step_N.hyp: one line per valid pair (data.max_valid_sentences=8), what was scored
    from mt.evaluate import score

    refs = (corpus_dir / "valid.zz").read_text().splitlines()[:8]
    assert sorted(p.name for p in (full / "valid").iterdir()) == [
        f"step_{n}.hyp" for n in (12, 15, 18, 3, 6, 9)]  # and no temporary file left
    history = {r["step"]: r for r in records(full) if "valid_bleu" in r}
    for step, record in history.items():
        hyps = (full / "valid" / f"step_{step}.hyp").read_text(encoding="utf-8").split("\n")
        assert len(hyps) == 9 and hyps[-1] == ""  # 8 lines, each ended
        assert score(hyps[:-1], refs)["chrf"] == pytest.approx(record["valid_chrf"]), step


def test_averaged_pt_is_scored_on_the_valid_split_beside_best_pt(tmp_path, corpus_dir,
                                                                 tokenizer_dir):
    """Choosing between best.pt and averaged.pt needs their valid scores (test.json had test
    scores only); best.pt's, decoded again in float32, is its score in the history."""
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, run_dir, corpus_dir, tokenizer_dir, "trainer.max_steps=6",
                       "trainer.validate_every=2", "trainer.average_last=2",
                       "trainer.save_valid_hyps=false")
    report = json.loads((run_dir / "test.json").read_text())
    history = torch.load(run_dir / "checkpoints" / "last.pt",
                         weights_only=True)["trainer"]["history"]
    assert report["valid"]["bleu"] == pytest.approx(max(r["valid_bleu"] for r in history))
    assert report["valid"]["sentences"] == report["averaged"]["valid"]["sentences"] == 8
    valid = report["averaged"]["valid"]
    assert (f"averaged.pt {valid['bleu']:.2f} / {valid['chrf']:.2f}"
            in result.stdout.splitlines()[0])  # the line to choose by comes first
    assert result.stdout.splitlines()[0].startswith("valid BLEU / chrF (8 sentences")
    assert not (run_dir / "valid").exists()  # trainer.save_valid_hyps=false


def test_a_run_says_which_budget_ended_it(trainer_factory, caplog):
    """A run that stops before the progress bar's total (patience, a time budget) said nothing:
    the quick start seemed to end at step 429 of 500 for no reason."""
    common = ["trainer.test_at_end=false", "trainer.log_every=50"]
    for name, overrides, said in [
        # lr 0: the valid loss never improves after the first validation
        ("patience", ["trainer.max_steps=60", "trainer.validate_every=5", "trainer.patience=2",
                      "trainer.best_metric=loss", "optim.lr=0"],
         "training stopped at step 15: trainer.patience=2: no better valid loss in 2 "
         "validations"),
        ("minutes", ["trainer.max_steps=100000", "trainer.max_minutes=0.0001"],
         r"training stopped at step \d+: trainer.max_minutes=0.0001 reached"),
        ("steps", ["trainer.max_steps=3"], "training stopped at step 3: trainer.max_steps=3 "
         "reached"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mt.train"):
            trainer_factory(name, *common, *overrides).fit()
        assert any(re.match(said, r.getMessage()) for r in caplog.records), caplog.text


def test_a_run_shorter_than_its_warmup_says_it_never_reaches_optim_lr(fit_here):
    """'~experiment' keeps 4,000 warmup steps: a shorter run trained at a fraction of optim.lr
    all along, unsaid. A run exactly as long as its warmup reaches optim.lr at its last step; it
    was told it never did ("never reaches optim.lr=0.001 (0.001 at the last step)")."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false", "optim.lr=1e-3"]
    said = fit_here("short", *common, "trainer.max_steps=2", "optim.warmup_steps=4")
    assert ("optim.warmup_steps=4 is above trainer.max_steps=2: the learning rate rises all "
            "run and never reaches optim.lr=0.001 (0.0005 at the last step)") in said
    assert "never reaches" not in fit_here("long", *common, "trainer.max_steps=2",
                                           "optim.warmup_steps=2")


def test_an_epoch_budget_that_ends_a_cosine_before_its_decay_is_said(fit_here):
    """optim.schedule=cosine decays over trainer.max_steps; trainer.max_epochs ended the run
    first, at a rate near optim.lr, unsaid."""
    common = ["trainer.validate_every=1000", "trainer.test_at_end=false", "optim.schedule=cosine",
              "optim.warmup_steps=2", "trainer.max_epochs=1"]
    said = fit_here("epochs", *common, "trainer.max_steps=1000")
    assert re.search(r"trainer.max_epochs=1 ends the run at about step (\d+), before "
                     r"optim.schedule=cosine decays to optim.min_lr at trainer.max_steps=1000 "
                     r"\(the schedule counts steps, not epochs\): set trainer.max_steps=\1$",
                     said, re.M), said
    assert "ends the run at about" not in fit_here("steps", *common, "trainer.max_steps=5")


def test_a_resume_with_another_accumulation_goes_on_from_the_same_batch(tmp_path, fit_here):
    """The position in the epoch is kept in steps; 3 steps of 2 batches are 6 batches, so a
    resume at 1 batch per step (fewer processes, or accumulation 1) goes on from batch 6, not 3,
    and says what changed."""
    run_dir = tmp_path / "run"
    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    fit_here("run", *common, "trainer.max_steps=3", "trainer.accumulation=2")
    resumed = fit_here("run", *common, "trainer.max_steps=5", "trainer.accumulation=1")
    assert "resuming with 1 batches per step (trainer.accumulation x processes) where the run " \
           "took 2" in resumed
    assert "trainer.accumulation=1 (was 2)" in resumed  # the settings that changed
    assert "trainer.max_steps=5 (was 3)" in resumed
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["trainer"]
    assert (state["epoch"], state["step_in_epoch"], state["step"]) == (0, 8, 5)


def test_a_resume_with_another_accumulation_after_an_epochs_partial_step_trains_none_again(
        tmp_path, trainer_factory, caplog):
    """An epoch's last step takes the batches left, fewer than a step's: counted whole, a resume
    at another accumulation after it went back into the epoch and trained one of them again
    (5 batches, 3 steps of 2 saved as 6 batches; at 4 a step, batch 4 again)."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false", "trainer.max_tokens=3000"]
    first = trainer_factory("run", *common, "trainer.max_steps=3", "trainer.accumulation=2")
    assert len(first.corpus.batches(3000, first.cfg.trainer.seed, 0)) == 5  # 2 + 2 + 1
    first.fit()
    resumed = trainer_factory("run", *common, "trainer.max_steps=5", "trainer.accumulation=4")
    steps, train_step = [], resumed.train_step

    def recorded(micro_batches, step_tokens, *weight):
        steps.append((resumed.epoch, len(micro_batches)))
        return train_step(micro_batches, step_tokens, *weight)

    resumed.train_step = recorded
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert "trained again" not in caplog.text
    assert steps[0] == (1, 4)  # the next epoch's first step: epoch 0 is done


@pytest.mark.parametrize("before, after", [("adamw", "adam"), ("adam", "adamw")])
def test_a_resume_with_another_optim_name_takes_its_weight_decay(trainer_factory, before, after):
    """Adam and AdamW keep the same state; they differ in the group's decoupled_weight_decay,
    which loading the saved groups put back: an adamw run resumed as adam went on as AdamW."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false", "optim.weight_decay=0.1"]
    trainer_factory("run", *common, "trainer.max_steps=2", f"optim.name={before}").fit()
    resumed = trainer_factory("run", *common, "trainer.max_steps=4", f"optim.name={after}")
    fresh = trainer_factory("fresh", *common, "trainer.max_steps=4", f"optim.name={after}")
    assert resumed.step == 2
    assert (resumed.optimizer.param_groups[0]["decoupled_weight_decay"]
            == fresh.optimizer.param_groups[0]["decoupled_weight_decay"] == (after == "adamw"))


def test_a_run_without_a_loss_scaler_resumes_with_one(trainer_factory, monkeypatch):
    """A run trained in fp32 or bf16 saves a disabled GradScaler's empty state; resumed in fp16
    (trainer.precision=fp16, or auto on a GPU without bf16) its enabled scaler refused that state
    with a RuntimeError traceback. It starts at a fresh scaler's scale, as a new fp16 run does."""
    import mt.trainer

    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    trainer_factory("run", *common, "trainer.max_steps=2").fit()
    monkeypatch.setattr(mt.trainer, "autocast_dtype", lambda *_: torch.float16)  # CUDA's fp16
    resumed = trainer_factory("run", *common, "trainer.max_steps=4")
    assert resumed.step == 2 and resumed.scaler.is_enabled()
    assert resumed.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()


def test_a_resume_mid_epoch_with_another_max_tokens_says_the_epoch_is_cut_anew(fit_here):
    """The position in the epoch is a count of steps over the epoch's batches, which
    trainer.max_tokens cuts: with another value the rest of the epoch is not the saved one's."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    fit_here("run", *common, "trainer.max_steps=2", "trainer.max_tokens=400")
    resumed = fit_here("run", *common, "trainer.max_steps=3", "trainer.max_tokens=300")
    assert ("resuming in the middle of epoch 0 with trainer.max_tokens=300 (was 400): its "
            "batches are cut anew") in resumed
    again = fit_here("run", *common, "trainer.max_steps=4", "trainer.max_tokens=300")
    assert "cut anew" not in again
    reseeded = fit_here("run", *common, "trainer.max_steps=5", "trainer.max_tokens=300",
                        "trainer.seed=2")  # another shuffle of the epoch's batches
    assert ("resuming in the middle of epoch 0 with trainer.seed=2 (was 1): its batches are cut "
            "anew") in reseeded


def test_a_resume_mid_epoch_on_an_edited_training_file_says_the_epoch_is_cut_anew(
        fit_here, corpus_dir, tmp_path):
    """The batches an epoch's position counts in are cut from the kept pairs: a training file
    edited since the save (lines added, removed) made the rest of the epoch repeat some pairs
    and skip others, and nothing said so. An edit that keeps them (and their lengths) is none."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    fit_here("run", *common, "trainer.max_steps=2", corpus=data)
    again = fit_here("run", *common, "trainer.max_steps=3", corpus=data)
    assert "cut anew" not in again
    for lang in ("en", "zz"):  # one pair fewer
        lines = (data / f"train.{lang}").read_text().splitlines(keepends=True)
        (data / f"train.{lang}").write_text("".join(lines[1:]))
    edited = fit_here("run", *common, "trainer.max_steps=4", corpus=data)
    assert ("resuming in the middle of epoch 0 with other training pairs than the saved run's "
            "(a training file changed since, or a data setting): its batches are cut anew"
            ) in edited


def test_a_resume_mid_epoch_across_an_mt_update_names_it_among_the_causes(fit_here, tmp_path):
    """An mt that encodes or filters the pairs otherwise (since mt-encode-2, a source without text
    is dropped as empty) keeps other pairs from the same files and settings: the warning named
    only those two, and sent a user who had updated mt looking for an edit never made."""
    from mt.batching import ENCODE_VERSION

    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    fit_here("run", *common, "trainer.max_steps=2")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert torch.load(last, weights_only=True)["trainer"]["encoding"] == ENCODE_VERSION
    for step, saved, said in (
            (3, None, f"an mt update since the save (this one encodes and filters them as "
                      f"{ENCODE_VERSION})"),  # a last.pt from before it was recorded
            (4, "mt-encode-1", f"an mt update since the save (mt-encode-1 then, {ENCODE_VERSION} "
                               "now)")):
        ckpt = torch.load(last, weights_only=True)
        ckpt["trainer"]["pairs"] = "0" * 32  # the digest of the pairs as that mt kept them
        ckpt["trainer"].pop("encoding")
        if saved:
            ckpt["trainer"]["encoding"] = saved
        torch.save(ckpt, last)
        resumed = fit_here("run", *common, f"trainer.max_steps={step}")
        assert ("with other training pairs than the saved run's (a training file changed since, "
                f"a data setting, or {said}): its batches are cut anew") in resumed


def test_two_process_ddp_equals_one_process_with_double_accumulation(tmp_path, corpus_dir,
                                                                     tokenizer_dir):
    # 5 batches an epoch: its third step is partial, one batch that rank 1 has no share of
    common = ["trainer.max_steps=4", "trainer.validate_every=4", "trainer.test_at_end=false",
              "model.dropout=0.0", "trainer.max_tokens=3000", "trainer.log_every=1"]
    single = tmp_path / "single"
    run_train(tmp_path, single, corpus_dir, tokenizer_dir, *common, "trainer.accumulation=2")
    # Each process names the run directory by its own clock (to the microsecond here, so they
    # always differ): the run must still write one directory, rank 0's, and nothing beside it.
    runs = tmp_path / "ddp"
    run_train(tmp_path, runs / "${now:%H-%M-%S-%f}", corpus_dir, tokenizer_dir, *common,
              "trainer.accumulation=1", torchrun=2)
    [ddp] = runs.iterdir()
    assert (ddp / "train.log").read_text().count("step") > 0
    a, b = weights(single), weights(ddp)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    # The logged loss is rank 0's estimate; at the partial step rank 0 holds every token, so it
    # is the step's loss itself (it was logged twice over: rank 0's sum x 2 processes)
    logged = [{r["step"]: r for line in (d / "metrics.jsonl").read_text().splitlines()
               if "loss" in (r := json.loads(line))} for d in (single, ddp)]
    assert logged[1][3]["loss"] == pytest.approx(logged[0][3]["loss"], rel=1e-4)


def test_a_rank_leaves_only_a_directory_that_hydra_alone_wrote(tmp_path, monkeypatch):
    import logging

    from mt.distributed import leave_run_dir

    shared = tmp_path / "rank0"
    dirs = {name: tmp_path / name for name in ("stray", "twice", "notes", "older-run")}
    for d in dirs.values():
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text("a: 1\n")
    (dirs["notes"] / "my-notes.log").write_text("mine\n")
    (dirs["older-run"] / "checkpoints").mkdir()
    root = logging.getLogger()
    for name, d in dirs.items():  # as Hydra does: this process's log, open in its directory
        root.addHandler(logging.FileHandler(d / "train.log"))
        leave_run_dir(d, shared, remove=True)
        assert not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == d
                       for h in root.handlers), name
    leave_run_dir(dirs["twice"], shared, remove=True)  # already gone: nothing to do, no error
    assert not dirs["stray"].exists() and not dirs["twice"].exists()
    assert (dirs["notes"] / "my-notes.log").exists()  # a log this process did not write
    assert (dirs["older-run"] / "checkpoints").is_dir()
    assert (dirs["older-run"] / ".hydra" / "config.yaml").exists()
    # Past midnight the second rank's date folder was made for it alone; rank 0's path stays.
    shared, own = tmp_path / "runs" / "day1" / "23-59-59", tmp_path / "runs" / "day2" / "00-00-00"
    for d in (shared, own / ".hydra"):
        d.mkdir(parents=True)
    leave_run_dir(own, shared, remove=True)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["day1"] and shared.is_dir()
    # hydra.job.chdir=true put the process in its own directory: it moves to rank 0's.
    own = tmp_path / "chdir"
    (own / ".hydra").mkdir(parents=True)
    monkeypatch.chdir(own)
    leave_run_dir(own, shared, remove=True)
    assert Path.cwd() == shared.resolve() and not own.exists()


def test_a_rank_keeps_links_and_folders_other_than_hydra_output_subdir(tmp_path, monkeypatch,
                                                                       caplog):
    """What leave_run_dir counts as Hydra's: no link (a log linked elsewhere, a linked .hydra or
    run directory is someone's), the saved configs only in hydra.output_subdir (``meta``, which
    may be another name or null); and a directory that will not go is a warning, not an error."""
    from mt.distributed import leave_run_dir

    shared, elsewhere = tmp_path / "rank0", tmp_path / "elsewhere"
    (elsewhere / "saved").mkdir(parents=True)
    (elsewhere / "saved" / "config.yaml").write_text("a: 1\n")
    (elsewhere / "mine.log").write_text("mine\n")
    (elsewhere / "run" / ".hydra").mkdir(parents=True)  # another run's, reached by a link
    (elsewhere / "run" / ".hydra" / "config.yaml").write_text("b: 2\n")

    def made(name: str, *files: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).write_text("x\n")
        return d

    linked_log = made("linked-log", ".hydra/config.yaml")
    (linked_log / "train.log").symlink_to(elsewhere / "mine.log")
    linked_meta = made("linked-meta")
    (linked_meta / ".hydra").symlink_to(elsewhere / "saved")
    (tmp_path / "linked-run").symlink_to(elsewhere / "run")
    root = logging.getLogger()
    root.addHandler(logging.FileHandler(linked_log / "train.log"))  # this process's log, linked
    for d in (linked_log, linked_meta, tmp_path / "linked-run"):
        leave_run_dir(d, shared, remove=True)
        assert d.is_symlink() or d.is_dir(), d.name
    assert (elsewhere / "saved" / "config.yaml").exists() and (elsewhere / "mine.log").exists()
    assert (elsewhere / "run" / ".hydra" / "config.yaml").exists()
    # hydra.output_subdir=null: a .hydra folder is not Hydra's; =meta: meta/ is
    kept, gone = made("no-meta", ".hydra/config.yaml"), made("no-meta-log", "train.log")
    gone_too = made("other-meta", "meta/config.yaml", "meta/hydra.yaml", "meta/overrides.yaml")
    handler = logging.FileHandler(gone / "train.log")
    root.addHandler(handler)
    leave_run_dir(kept, shared, remove=True, meta=None)
    leave_run_dir(gone, shared, remove=True, meta=None)
    leave_run_dir(gone_too, shared, remove=True, meta="meta")
    assert handler not in root.handlers
    assert (kept / ".hydra" / "config.yaml").exists() and not gone.exists()
    assert not gone_too.exists()
    # a directory that cannot be removed (here: rmdir refused) is said, and the run goes on
    stuck = made("stuck", ".hydra/config.yaml")
    rmdir = Path.rmdir

    def refused(self: Path) -> None:
        if self == stuck:
            raise PermissionError(13, "Permission denied", str(self))
        rmdir(self)

    monkeypatch.setattr(Path, "rmdir", refused)
    with caplog.at_level(logging.WARNING, logger="mt.distributed"):
        leave_run_dir(stuck, shared, remove=True)
    assert stuck.is_dir() and f"could not remove {stuck}" in caplog.text
    assert "Permission denied" in caplog.text


def test_a_rank_says_a_date_folder_made_for_it_that_will_not_go(tmp_path, monkeypatch, caplog):
    """Past midnight the second rank's date folder was made for it alone and is removed with
    its run directory; one that would not go (permissions) was left without a word once the
    removal moved to hydra_dirs.remove_made, where it had been a warning. One holding something
    else stays, unsaid: it is not this process's."""
    from mt.distributed import leave_run_dir

    shared, own = tmp_path / "runs" / "day1" / "23-59-59", tmp_path / "runs" / "day2" / "00-00-00"
    for d in (shared, own / ".hydra"):
        d.mkdir(parents=True)
    (own / ".hydra" / "config.yaml").write_text("a: 1\n")
    rmdir = Path.rmdir

    def refused(self: Path) -> None:
        if self.name == "day2":
            raise PermissionError(13, "Permission denied", str(self))
        rmdir(self)

    monkeypatch.setattr(Path, "rmdir", refused)
    with caplog.at_level(logging.WARNING, logger="mt.distributed"):
        leave_run_dir(own, shared, remove=True)
    assert not own.exists() and own.parent.is_dir()
    assert f"could not remove {own}" in caplog.text and "Permission denied" in caplog.text
    assert str(own.parent) in caplog.text
    # a date folder with another run in it by now is not this rank's: no warning
    (own / ".hydra").mkdir(parents=True)
    (own.parent / "other-run").mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.distributed"):
        leave_run_dir(own, shared, remove=True)
    assert not own.exists() and (own.parent / "other-run").is_dir() and not caplog.text
    # one that the other rank's leave_run_dir emptied and removed meanwhile is gone, as
    # wanted: no warning
    (own / ".hydra").mkdir(parents=True)
    iterdir = Path.iterdir

    def raced(self: Path):
        if self.name == "day2":  # the other rank, between this one's rmdir and its look
            (self / "other-run").rmdir()
            rmdir(self)
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", raced)
    with caplog.at_level(logging.WARNING, logger="mt.distributed"):
        leave_run_dir(own, shared, remove=True)
    assert not own.parent.exists() and not caplog.text


def test_two_process_ddp_with_dropout_resumes_exactly(tmp_path, corpus_dir, tokenizer_dir):
    """Each rank draws its own dropout masks, and a resumed run draws on from where each stopped."""
    common = ["trainer.validate_every=3", "trainer.test_at_end=false", "model.dropout=0.3"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_train(tmp_path, full, corpus_dir, tokenizer_dir, *common, "trainer.max_steps=6",
              torchrun=2)
    run_train(tmp_path, split, corpus_dir, tokenizer_dir, *common, "trainer.max_steps=3",
              torchrun=2)
    resumed = run_train(tmp_path, split, corpus_dir, tokenizer_dir, *common,
                        "trainer.max_steps=6", torchrun=2)
    assert "resumed" in resumed.stderr
    a, b = weights(full), weights(split)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_sigterm_to_one_rank_in_the_last_steps_stops_every_rank(tmp_path, corpus_dir,
                                                                 tokenizer_dir):
    """Under DDP the ranks agree on a SIGTERM at log steps only; one that reached rank 1 after
    the last of them was dropped, and the run went on into its final validation and test. The
    ranks agree once more when the loop ends: both stop, last.pt holds the last step."""
    script = tmp_path / "train_script.py"
    script.write_text("import os, signal, sys, mt.trainer as t\n"
                      "reason = t.Trainer.stop_reason\n"
                      "def stop_reason(self):\n"
                      "    said = reason(self)\n"
                      "    if said and os.environ['RANK'] == '1':\n"
                      "        os.kill(os.getpid(), signal.SIGTERM)\n"
                      "    return said\n"
                      "t.Trainer.stop_reason = stop_reason\n"
                      "sys.argv[0] = 'mt-train'\n"
                      "from mt.train import main\n"
                      "main()\n")
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), *tiny_train_args(corpus_dir, tokenizer_dir), f"hydra.run.dir={run_dir}",
           "trainer.max_steps=4", "trainer.log_every=3", "trainer.validate_every=100"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "terminated (SIGTERM) after step 4" in result.stderr, result.stderr[-3000:]
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert last["trainer"]["step"] == 4
    assert not (run_dir / "test.json").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_the_sigterm_watch_keeps_an_ignored_sigterm_ignored(sig):
    """A parent that ignores SIGTERM (as terminate_as_interrupt respects), or SIGHUP (nohup), is
    obeyed in the training loop too; otherwise the watch notes the signal, says which, and puts
    the handler back."""
    from mt.distributed import SigtermWatch

    if not hasattr(signal, sig):
        pytest.skip(f"no {sig} here")
    signum = getattr(signal, sig)
    watch = SigtermWatch(1, torch.device("cpu"), 1)
    before = signal.signal(signum, signal.SIG_IGN)
    try:
        with watch.watching():
            assert signal.getsignal(signum) is signal.SIG_IGN
            os.kill(os.getpid(), signum)
        assert not watch.agreed(1)
        signal.signal(signum, signal.SIG_DFL)
        with watch.watching():
            os.kill(os.getpid(), signum)
        assert watch.agreed(1) and watch.signal == signum
        assert signal.getsignal(signum) is signal.SIG_DFL
    finally:
        signal.signal(signum, before)


def test_a_data_error_under_torchrun_is_one_line_on_every_rank(tmp_path, corpus_dir,
                                                               tokenizer_dir):
    """Rank 0 says what is wrong with the data; rank 1, waiting for it at a barrier, printed
    gloo's 'Connection closed by peer' traceback beside that line. The bad line is the
    command's mistake, no crash: no traceback to point at, and the run directory it made goes."""
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    lines = (corpus_dir / "train.zz").read_bytes().splitlines(keepends=True)
    (data / "train.zz").write_bytes(b"".join(lines[:4] + [b"caf\xe9\n"] + lines[5:]))
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir), f"data.dir={data}",
           f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    ours = [line for line in result.stderr.splitlines() if line.startswith("mt-train: ")]
    assert result.returncode != 0 and sorted(ours) == sorted([
        f"mt-train: {data}/train.zz:5: invalid UTF-8 (unexpected end of data at byte 3)",
        "mt-train: rank 1 stopped: another process of the run ended or did not answer while it "
        "waited (that process's error says why)"]), result.stderr[-3000:]
    assert "Connection closed by peer" not in result.stderr
    assert not (tmp_path / "run").exists()


KILLED_RANK = """
import os, signal, sys
import mt.trainer as t
step = t.Trainer.train_step
calls = [0]
def train_step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 3 and os.environ["RANK"] == "1":  # as the OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)
t.Trainer.train_step = train_step
sys.argv[0] = "mt-train"
from mt.train import main
main()
"""


def test_a_rank_killed_outright_is_one_line_on_the_others(tmp_path, corpus_dir, tokenizer_dir):
    """A rank killed mid-training (SIGKILL, the kernel's OOM killer) left rank 0 in DDP's
    gradient all-reduce with gloo's 'Connection closed by peer' traceback under Hydra's report;
    it says the one line a barrier's wait gives, the traceback in train.log. The ranks are
    started as a cluster's launcher (srun) does, without torchrun, which would SIGTERM rank 0
    at once and race its words."""
    import socket

    script = tmp_path / "killed_rank.py"
    script.write_text(KILLED_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    cmd = [PYTHON, str(script), *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=50", "trainer.validate_every=100"]
    procs = [subprocess.Popen(cmd, env={**cli_env(tmp_path), "RANK": str(rank),
                                        "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        said = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 1, said[0][-3000:]
    assert said[0].strip().splitlines()[-1] == (
        "mt-train: rank 0 stopped: another process of the run ended or did not answer while it "
        f"waited (that process's error says why) (traceback in {run_dir / 'train.log'})"), \
        said[0][-3000:]
    assert "Traceback" not in said[0] and "by peer" not in said[0]
    # gloo's words vary with where rank 0 was: 'closed by peer', 'reset by peer'
    assert "/gloo/transport/" in (run_dir / "train.log").read_text()


def test_tied_embeddings_refuse_two_vocabularies_of_one_size(tmp_path, corpus_dir, tokenizer_dir):
    """Two SentencePiece models trained to one size pass the model's size check; tying their
    embeddings would make one vector mean unrelated pieces."""
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={tmp_path / 'run'}", f"data.tokenizer.path={tmp_path / 'tok'}",
           "data.tokenizer.joint=false", "data.tokenizer.vocab_size=120",
           "model.tie_embeddings=all", "trainer.max_steps=1"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    # one line, the traceback in train.log only
    assert result.stderr.strip().splitlines()[-1].startswith(
        "mt-train: model.tie_embeddings=all needs a joint vocabulary")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tied_embeddings_take_the_jointness_of_a_tokenizer_put_in_its_path_by_hand(
        trainer_factory, tmp_path, tokenizer_dir, monkeypatch):
    """A joint SentencePiece model put in data.tokenizer.path by hand is used as it is, yet
    model.tie_embeddings=all with the command line's data.tokenizer.joint=false was refused
    ("needs a joint vocabulary: set data.tokenizer.joint=true"), the check run before the model
    was read. Two models reused there are refused before the corpus is read, saying where
    they are (the advice to set data.tokenizer.joint=true could not help)."""
    import shutil

    import mt.corpus
    from mt.config import TokenizerConfig
    from mt.tokenizer import train_tokenizer

    hand = tmp_path / "hand"
    hand.mkdir()
    shutil.copy(tokenizer_dir / "spm.model", hand)
    run = trainer_factory("joint", "data.tokenizer.joint=false", f"data.tokenizer.path={hand}",
                          "model.tie_embeddings=all")
    assert run.corpus.tokenizer.joint and run.cfg.data.tokenizer.joint

    def read(*args, **kwargs):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(mt.corpus, "load_train", read)
    texts = ["a b c", "d e f"] * 20
    two = train_tokenizer(texts, texts, TokenizerConfig(vocab_size=30, joint=False))
    for name, proto in (("src.model", two.src_proto), ("tgt.model", two.tgt_proto)):
        (tmp_path / "two" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "two" / name).write_bytes(proto)
    with pytest.raises(ValueError, match=re.escape(
            "model.tie_embeddings=all needs a joint vocabulary, but the tokenizer reused from "
            f"data.tokenizer.path={tmp_path / 'two'} has two (src.model, tgt.model): set "
            "model.tie_embeddings=decoder")):
        trainer_factory("two", f"data.tokenizer.path={tmp_path / 'two'}",
                        "model.tie_embeddings=all")


def test_a_last_pt_without_training_state_is_refused_in_one_line(tmp_path, corpus_dir,
                                                                 tokenizer_dir, fit_here):
    """An average or an imported model saved as last.pt (a review had mt-average write one
    there) cannot be resumed: one line says so, not a KeyError from inside the trainer."""
    run_dir = tmp_path / "run"
    steps = ["trainer.max_steps=2", "trainer.validate_every=2", "trainer.test_at_end=false"]
    fit_here("run", *steps)
    last = run_dir / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    del state["trainer"]
    torch.save(state, last)
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", *steps]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "holds weights only, no training state" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("mistake, message", [
    ("utf8", "train.en:3: invalid UTF-8"), ("count", "train.zz")])
def test_a_bad_line_in_the_corpus_is_one_line_not_a_hang(tmp_path, corpus_dir, tokenizer_dir,
                                                          mistake, message):
    """A corpus mistake (mt.data.DataError, raised through datasets' generator) ended as an
    exception chain that loops; mt-train's walk of the chain for a Ctrl-C spun forever at 100%
    CPU instead of saying the file and line."""
    bad = tmp_path / "corpus"
    shutil.copytree(corpus_dir, bad)
    if mistake == "utf8":
        lines = (bad / "train.en").read_bytes().split(b"\n")
        lines[2] += b" \xff"
        (bad / "train.en").write_bytes(b"\n".join(lines))
    else:
        with open(bad / "train.zz", "a") as f:
            f.write("one line too many\n")
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(bad, tokenizer_dir),
           f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mt-train: ") and message in last, last


@pytest.mark.parametrize("override, message", [
    ("data.test=tst", "tst.en: no such file"), ("data.valid=tst", "tst.en: no such file"),
    ("data.extra_valid=[test,tst]", "tst.en: no such file"),
    ("model.norm=Pre", "model.norm must be post or pre, got 'Pre'"),
    ("trainer.lenpen=inf", "trainer.lenpen must be at most 10, got inf")])
def test_a_mistake_found_late_fails_before_training(tmp_path, corpus_dir, tokenizer_dir,
                                                    override, message):
    """The test split is read after the last step: a typo in data.test cost the whole run; the
    valid split after the tokenizer and the whole corpus, and so did a value only the model,
    the optimizer or trainer.freeze check (check_setup)."""
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={tmp_path / 'run'}", override, "trainer.max_steps=3",
           "data.tokenizer.path=null"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "tokenizer").exists()  # nothing trained before the check


def test_a_failed_job_of_a_sweep_leaves_the_next_jobs_running(tmp_path, corpus_dir,
                                                               tokenizer_dir):
    """A job's one-line error was a SystemExit, which Hydra's sweep does not catch: the first
    job with a bad value (or a diverging learning rate) ended the whole sweep. Now each job's
    error is said as it fails, the others run, and the end names the failed jobs (exit 1)."""
    sweep = tmp_path / "sweep"
    cmd = [PYTHON, "-m", "mt.train", "-m", *tiny_train_args(corpus_dir, tokenizer_dir),
           "optim.lr=-1,1e-3", f"hydra.sweep.dir={sweep}", "trainer.max_steps=2",
           "trainer.validate_every=2", "trainer.test_at_end=false"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = result.stderr.strip().splitlines()
    assert any(line.startswith("mt-train: optim.lr must be at least 0") for line in said)
    assert said[-1] == f"mt-train: 1 job(s) of the sweep failed (said above): #0 in {sweep / '0'}"
    assert not (sweep / "0" / "checkpoints").exists()
    assert (sweep / "1" / "checkpoints" / "last.pt").exists()


@pytest.mark.parametrize("error, said", [
    ("torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 79.10 GiB of which 1.20 GiB is free.')",
     "CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("RuntimeError('[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can\\'t "
     "allocate memory: you tried to allocate 104857600 bytes.')", "out of memory"),
    ("MemoryError()", "out of memory"),
], ids=["cuda", "cpu-allocator", "python"])
def test_out_of_memory_is_one_line_that_says_what_to_lower(tmp_path, corpus_dir, tokenizer_dir,
                                                           error, said):
    """A batch too large for the GPU (or for the CPU's memory) was a traceback of some 40 lines
    from inside torch (and ended a sweep); it is one line now, with the key to lower."""
    result = patched_train(tmp_path, corpus_dir, tokenizer_dir,
                           "import torch, mt.train as t\n"
                           "def fit(self):\n"
                           f"    raise {error}\n"
                           "t.Trainer.fit = fit\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"mt-train: {said}: lower trainer.max_tokens (a larger trainer.accumulation keeps the "
        "batch as large) (traceback in ")


def test_nan_loss_skips_the_step_and_stops_a_diverging_run(tmp_path, corpus_dir, tokenizer_dir):
    # lr = 1e30 makes the weights huge after the first update, so every later loss is NaN:
    # the run must stop with a clear message instead of saving NaN weights.
    run_dir = tmp_path / "nan"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "optim.lr=1e30", "optim.schedule=constant",
           "optim.warmup_steps=1", "trainer.max_steps=30", "trainer.max_bad_steps=3",
           "trainer.validate_every=100", "trainer.log_every=50"]  # checks every 3 steps only
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    # Read every max_bad_steps steps (no host sync per step): stops within 2 x max_bad_steps.
    assert re.search(r"training diverged: [3-6] steps in a row with a NaN/inf loss",
                     result.stderr), result.stderr[-2000:]
    assert "update skipped" in result.stderr
    assert "no checkpoint was saved yet" in result.stderr


def test_trainer_device_is_read_whole():
    """`trainer.device=cuda:1` means that GPU (it once fell back to the CPU unnoticed), and a
    value that names no device is refused with the key."""
    from mt.distributed import setup_distributed

    assert setup_distributed("cpu")[2] == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device"):
        setup_distributed("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda:1, but this torch sees no CUDA"):
            setup_distributed("cuda:1")


def test_valid_loss_leaves_out_a_pair_longer_than_the_model_and_bleu_keeps_it(tokenizer_dir):
    """A valid pair beyond model.max_positions stopped training at its first validation; now the
    teacher-forced loss leaves it out (it equals the loss of the pairs that fit) and the search,
    which translates a long source in pieces, still scores it."""
    from mt.config import ModelConfig, TrainerConfig
    from mt.model import build_model
    from mt.runlog import validate
    from mt.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, ffn_dim=64,
                                    heads=2, max_positions=24, src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    short = ["a short line", "another one"]
    long_ = " ".join(["a much longer line"] * 12)
    assert len(tok.encode_src([long_])[0]) > 24
    trainer = TrainerConfig(beam_size=1)
    with torch.inference_mode():
        fits = validate(model, tok, short, short, trainer, torch.device("cpu"))
        both = validate(model, tok, [*short, long_], [*short, long_], trainer,
                        torch.device("cpu"))
    assert both["valid_loss"] == pytest.approx(fits["valid_loss"], rel=1e-6)
    assert both["valid_chrf"] != fits["valid_chrf"]  # the long pair is in BLEU and chrF


def test_training_bleu_tokenizes_as_its_target_language(tokenizer_dir, monkeypatch, caplog):
    """Validation BLEU used 13a whatever the target: a Chinese line was one token (BLEU 0 where
    mt-eval and sacrebleu -l en-zh gave 74). Now sacrebleu's tokenizer for data.tgt_lang; one
    that cannot load (ja-mecab without sacrebleu[ja]) is a warning and 13a."""
    import importlib.util

    from sacrebleu.metrics import BLEU

    from mt import lines
    from mt.config import ModelConfig, TrainerConfig
    from mt.model import build_model
    from mt.runlog import bleu_language, validate
    from mt.tokenizer import Tokenizer

    hyps, refs = ["我爱你们。", "今天天气很好"], ["我爱你们。", "今天天气不好"]
    monkeypatch.setattr(lines, "best_translations", lambda *args, **kwargs: hyps)
    tok = Tokenizer.load(tokenizer_dir)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, ffn_dim=64,
                                    heads=2, src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    with torch.inference_mode():
        zh = validate(model, tok, ["a", "b"], refs, TrainerConfig(beam_size=1),
                      torch.device("cpu"), trg_lang=bleu_language("zh"))
    assert zh["valid_bleu"] == pytest.approx(BLEU(trg_lang="zh").corpus_score(hyps, [refs]).score)
    assert zh["valid_bleu"] > 50 > BLEU().corpus_score(hyps, [refs]).score
    # a region, a script, capitals or OPUS's three letters went to 13a: BLEU near 0
    for code in ("zh-CN", "zh_Hant", "ZH", "zho"):
        with torch.inference_mode():
            as_coded = validate(model, tok, ["a", "b"], refs, TrainerConfig(beam_size=1),
                                torch.device("cpu"), trg_lang=bleu_language(code))
        assert as_coded["valid_bleu"] == zh["valid_bleu"], code
    assert bleu_language("de") == "de"
    if importlib.util.find_spec("MeCab") is None:
        assert bleu_language("ja") == ""
        assert "valid and test BLEU use the 13a tokenizer" in caplog.text


def test_a_sweep_keeps_stdout_for_results(tmp_path, corpus_dir, tokenizer_dir):
    """Hydra's launcher lines ("Launching 2 jobs locally") went to stdout, which carries results
    only; each job trains in a directory of its own."""
    cmd = [PYTHON, "-m", "mt.train", "-m", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.sweep.dir={tmp_path / 'sweep'}", "trainer.max_steps=1",
           "trainer.test_at_end=false", "trainer.seed=1,2"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Launching 2 jobs" in result.stderr
    assert result.stdout.splitlines() == [f"run directory: {tmp_path / 'sweep' / n}"
                                          for n in ("0", "1")]


def test_a_skipped_nan_step_leaves_the_moving_average_as_it_is(trainer_factory, monkeypatch):
    """The optimizer skips a step whose loss is NaN; the EMA used to be pulled towards the
    unmoved weights all the same (and its decay warm-up counted the step, which it still does,
    as the schedule does)."""
    import mt.trainer

    trainer = trainer_factory("ema_nan", "trainer.ema_decay=0.5")
    batch, tokens = [0, 1], trainer.corpus.tgt_lens[0] + trainer.corpus.tgt_lens[1] + 2
    trainer.train_step([batch], tokens)  # a real step: weights and average move apart
    weights = [p.detach().clone() for p in trainer.ema.params]
    shadow = [s.clone() for s in trainer.ema.shadow]
    assert any(not torch.equal(w.float(), s) for w, s in zip(weights, shadow, strict=True))
    real = mt.trainer.label_smoothed_nll
    monkeypatch.setattr(mt.trainer, "label_smoothed_nll",
                        lambda *a: tuple(x * float("nan") for x in real(*a)))
    _, finite = trainer.train_step([batch], tokens)
    assert not finite
    assert all(torch.equal(p, w) for p, w in zip(trainer.ema.params, weights, strict=True))
    assert all(torch.equal(s, b) for s, b in zip(trainer.ema.shadow, shadow, strict=True))
    assert trainer.ema.updates == 2


def test_non_finite_weights_at_a_validation_stop_as_a_divergence(trainer_factory):
    """optim.lr=5e4 (for 5e-4) blew the weights up within trainer.max_bad_steps of a validation,
    whose search then died with an IndexError traceback."""
    from mt.divergence import Diverged

    trainer = trainer_factory("nan_weights")
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))

    def validate():
        raise AssertionError("searched with NaN weights")

    trainer.validate = validate
    with pytest.raises(Diverged, match="non-finite weights"):
        trainer._validate_and_save()


def test_an_epoch_trains_every_pair_once_its_last_partial_step_included(trainer_factory):
    """45 batches an epoch under trainer.accumulation=7 made 6 steps and left the last 3 batches
    (about 27 of the 400 pairs, other ones each epoch) untrained; a last step takes them, an
    update of its own tokens' mean loss, as fairseq's last accumulation at an epoch's end."""
    trainer = trainer_factory("run", "trainer.accumulation=7", "trainer.max_epochs=1",
                              "trainer.validate_every=1000", "trainer.test_at_end=false")
    batches = trainer.corpus.batches(300, 1, 0)
    assert len(batches) % 7  # a tail to take
    steps, train_step = [], trainer.train_step

    def recorded(micro_batches, step_tokens, *weight):
        steps.append(([i for b in micro_batches for i in b], step_tokens))
        return train_step(micro_batches, step_tokens, *weight)

    trainer.train_step = recorded
    trainer.fit()
    assert trainer.step == len(steps) == -(-len(batches) // 7)
    trained = sorted(i for pairs, _ in steps for i in pairs)
    assert trained == list(range(len(trainer.corpus.tgt_lens)))
    tail, tokens = steps[-1]
    assert tokens == sum(trainer.corpus.tgt_lens[i] + 1 for i in tail)  # its own tokens' mean


def test_an_epoch_too_small_for_a_step_names_the_upsample_that_shrank_it(fit_here):
    """data.upsample.train=0.001 trains a share of the pairs each epoch: an epoch without a batch
    stopped the run with a line that did not name data.upsample. The line said the share was
    drawn at random; it is the next stretch of a shuffled pass."""
    with pytest.raises(ValueError, match=r"^epoch \d+ has no batch to train on \(data.upsample "
                                         r"train=0.001 trains the next share of a shuffled pass "
                                         r"each epoch: here too few\)$"):
        fit_here("run", "+data.upsample.train=0.001", "trainer.max_steps=50")


def test_scores_that_are_not_numbers_in_a_validation_are_one_line():
    """A validation or the final test whose scores turned NaN (search.NOT_A_NUMBER) was a
    traceback that also stopped the rest of a sweep; it is one line with what to change."""
    from mt.search import NOT_A_NUMBER
    from mt.train import _in_words

    assert _in_words(FloatingPointError(NOT_A_NUMBER)) == (
        f"{NOT_A_NUMBER} in a validation or the final test: with trainer.precision=fp16, bf16 "
        "or fp32 keeps activations finite; else the model diverged (lower optim.lr)")


def test_a_resume_mid_epoch_with_another_upsample_or_sampling_says_the_epoch_is_cut_anew(
        fit_here):
    """data.upsample makes the epoch's list of pairs and data.subword_alpha their lengths, which
    the batches are cut from: either changed since the save keeps the kept pairs (their digest)
    the same, and the rest of the epoch repeated some pairs and skipped others unsaid."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false"]
    fit_here("run", *common, "trainer.max_steps=2", "+data.upsample.train=1.5")
    again = fit_here("run", *common, "trainer.max_steps=3", "+data.upsample.train=1.5")
    assert "cut anew" not in again
    more = fit_here("run", *common, "trainer.max_steps=4", "+data.upsample.train=2")
    assert ("resuming in the middle of epoch 0 with data.upsample={'train': 2.0} (was "
            "{'train': 1.5}): its batches are cut anew") in more
    sampled = fit_here("run", *common, "trainer.max_steps=5", "+data.upsample.train=2",
                       "data.subword_alpha=0.5")
    assert "with data.subword_alpha=0.5 (was 0.0)" in sampled


def test_a_resume_mid_epoch_from_before_the_passes_says_a_fractional_share_is_drawn_anew(
        fit_here, tmp_path):
    """A last.pt saved before a fractional share became a stretch of shuffled passes (it holds no
    digest of the pairs) drew its epoch's share at random: the rest of that epoch is not its."""
    common = ["trainer.validate_every=100", "trainer.test_at_end=false", "+data.upsample.train=1.5"]
    fit_here("run", *common, "trainer.max_steps=2")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    del ckpt["trainer"]["pairs"]
    torch.save(ckpt, last)
    resumed = fit_here("run", *common, "trainer.max_steps=3")
    assert ("with data.upsample's fractional shares drawn otherwise than by the version that "
            "saved it") in resumed
