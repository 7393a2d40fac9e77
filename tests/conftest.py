"""Shared fixtures: a small corpus from the demo language and a tokenizer trained on it.

Everything is made by the tests themselves; nothing is downloaded (HF_HUB_OFFLINE=1 is set for
this process and for every subprocess the tests start).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """train/valid/test .en/.zz files: 400/30/30 demo-language pairs."""
    from mt.demo import write_demo_corpus

    out = tmp_path_factory.mktemp("corpus")
    write_demo_corpus(out, n_train=400, n_valid=30, n_test=30, seed=7)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir, tmp_path_factory) -> Path:
    """A joint unigram SentencePiece model (vocabulary 200) trained on the corpus."""
    from mt.config import TokenizerConfig
    from mt.data import read_lines
    from mt.tokenizer import train_tokenizer

    tok = train_tokenizer(read_lines(corpus_dir / "train.en"), read_lines(corpus_dir / "train.zz"),
                          TokenizerConfig(vocab_size=200), seed=1)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save(out)
    return out


def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, a private datasets cache, small thread count."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def tiny_train_args(corpus_dir: Path, tokenizer_dir: Path) -> list[str]:
    """Overrides for a model small enough to train a few steps in seconds."""
    return [
        "model.d_model=32", "model.ffn_dim=64", "model.heads=2", "model.encoder_layers=1",
        "model.decoder_layers=1", "model.max_positions=128",
        "data.source=files", f"data.dir={corpus_dir}", "data.tgt_lang=zz",
        f"data.tokenizer.path={tokenizer_dir}", "data.max_valid_sentences=8",
        "trainer.max_tokens=300", "trainer.precision=fp32", "trainer.beam_size=1",
        "trainer.log_every=1", "trainer.num_threads=1", "trainer.tensorboard=false",
        "optim.warmup_steps=5", "optim.lr=1e-3",
    ]


PYTHON = sys.executable


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            continue
    return found


def alive(pid: int) -> bool:
    """Running or sleeping: not gone, and not a zombie that no one has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def compose(overrides: list[str]):
    """The TrainConfig that ``mt-train OVERRIDES`` would run, checked as it checks it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from mt.config import register_configs
    from mt.config_checks import check_keys, check_values

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = "/tmp/run"
        HydraConfig.instance().set_config(cfg)  # lets ${hydra:runtime.output_dir} resolve
        with open_dict(cfg):
            del cfg["hydra"]
        check_keys(cfg)  # as mt.train.hydra_main does
        cfg = OmegaConf.to_object(cfg)
        check_values(cfg)
        return cfg


@pytest.fixture()
def trainer_factory(tmp_path, corpus_dir, tokenizer_dir, monkeypatch):
    """A tiny Trainer in this process (its datasets cache in tmp_path, torch's thread count put
    back afterwards), to be given validation scores instead of decoding."""
    import datasets
    import torch

    from mt.trainer import Trainer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    threads = torch.get_num_threads()

    def make(name: str, *overrides: str, corpus: Path | None = None) -> Trainer:
        (tmp_path / name).mkdir(exist_ok=True)  # as Hydra does; there already: a resume
        return Trainer(compose([*tiny_train_args(corpus or corpus_dir, tokenizer_dir),
                                *overrides]), tmp_path / name)

    yield make
    torch.set_num_threads(threads)


@pytest.fixture()
def fit_here(trainer_factory, caplog):
    """Trains (or resumes) the run tmp_path/NAME in this process, as run_train does in another,
    and returns what it logged: a process's start-up costs ~3 s a run. The command line around
    the Trainer (the lock, one-line errors, the final test) is for run_train's tests."""
    def fit(name: str, *overrides: str, corpus: Path | None = None) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mt.train"):
            trainer_factory(name, *overrides, corpus=corpus).fit()
        return caplog.text

    return fit
