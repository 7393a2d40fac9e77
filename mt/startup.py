"""How a training run starts: the checkpoint it starts from (a resume's ``last.pt``, or
``init_from``), its tokenizer and encoded corpus, the model and the optimizer with its schedule.
``mt.trainer.Trainer`` runs them in this order as it is made; the loop, validation and saving are
its own.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import OmegaConf

from mt import checkpoint
from mt.config import TrainConfig, finetune_model_config, start_tokenizer_config
from mt.config_checks import SetupRefused
from mt.corpus import Corpus
from mt.data import DataError, check_splits, tokenizer_config, tokenizer_dir
from mt.model import build_model, count_parameters
from mt.optim import EMA, build_optimizer, freeze, lr_lambda
from mt.runlog import fitting
from mt.spm_spec import tokenizer_settings
from mt.subwords import sampling_mistake
from mt.tokenizer import META_FILE, Tokenizer, TokenizerMismatch, placed_by_hand

log = logging.getLogger("mt.train")


class Run(Protocol):
    """What the set-up reads and sets: ``mt.trainer.Trainer``'s attributes, named here rather
    than imported (``mt.trainer`` imports this module)."""

    cfg: TrainConfig
    run_dir: Path
    rank: int
    world: int
    device: torch.device
    amp_dtype: torch.dtype | None
    model: torch.nn.Module
    # data.tokenizer as the command line gave it, kept in last.pt (set by load_start)
    tokenizer_asked: dict
    # set by make_optimization
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    seconds_before: float
    fit_start: float | None
    elapsed: float
    history: list[dict]
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step_lr: float
    scaler: torch.amp.GradScaler
    net: torch.nn.Module


TIED_NEEDS_JOINT = ("model.tie_embeddings=all needs a joint vocabulary: set "
                    "data.tokenizer.joint=true, or model.tie_embeddings=decoder")


def check_setup(cfg: TrainConfig) -> None:
    """Builds the model, freezes trainer.freeze's parameters and makes the optimizer and the
    schedule on the meta device (no memory, no draw from the random streams), so that a value
    only they check (model.norm=Pre, a d_model that model.heads does not divide, a freeze
    pattern that matches nothing, optim.schedule=linear) stops the run now, not after the
    tokenizer and the corpus, which can take many minutes, are built."""
    try:
        with torch.device("meta"):  # any vocabulary size: the tokenizer's comes later
            model = build_model(replace(cfg.model, src_vocab_size=8, tgt_vocab_size=8))
        if cfg.trainer.freeze:
            freeze(model, cfg.trainer.freeze)
        build_optimizer(model, cfg)
        lr_lambda(cfg)
    except ValueError as err:
        raise SetupRefused(str(err)) from err


def load_start(run: Run, last: Path | None) -> tuple[dict | None, str]:
    """The checkpoint the run starts from (``last``: the run's own, resumed; else
    init_from's, fine-tuned; else none) and its name, with the model's shape and tokenizer
    settings taken from it into the config (whatever model=... says now), as are those of a
    SentencePiece model put in data.tokenizer.path by hand. Mistakes only the model and
    optimizer show, and those of the tokenizer the run takes or reuses (``check_tied``,
    ``check_sampling``), are refused here (``SetupRefused``), before the tokenizer and corpus
    are built."""
    cfg, start, origin = run.cfg, None, ""
    if last is not None:
        start, origin = checkpoint.load(last, mmap=True), str(last)
    elif cfg.init_from:
        try:
            start = checkpoint.load_setting("init_from", cfg.init_from)
        except (FileNotFoundError, ValueError) as err:  # no model there: a typo, a wrong file
            raise SetupRefused(str(err)) from err
        origin = f"init_from={cfg.init_from}"
    if start is not None:
        cfg.model, replaced = finetune_model_config(cfg.model, start["model_config"])
        if replaced:
            log.info("%s: the model's shape replaces %s", origin, replaced)
    check_setup(cfg)
    cfg.data.tokenizer = tokenizer_config(cfg.data)  # recorded as used: data.tag a symbol
    run.tokenizer_asked = asdict(cfg.data.tokenizer)
    try:  # the tokenizer the run takes or reuses, refused where the config does not fit it
        _take_tokenizer(cfg, run.run_dir, start, origin, last is not None)
    except ValueError as err:  # the command's mistake: the run directory it made goes
        raise SetupRefused(str(err)) from err
    return start, origin


def _take_tokenizer(cfg: TrainConfig, run_dir: Path, start: dict | None, origin: str,
                    resumed: bool) -> None:
    """data.tokenizer set to the settings of the tokenizer the run takes (``start``'s) or
    reuses (one put in data.tokenizer.path by hand), and the checks of it that need no corpus:
    ``check_tied``, ``check_sampling``."""
    if start is not None:
        asked = (start.get("trainer") or {}).get("tokenizer_asked") if resumed else None
        cfg.data.tokenizer, ignored = start_tokenizer_config(
            cfg.data.tokenizer, start.get("config"), tokenizer_settings(start["tokenizer"]),
            asked)
        if ignored:
            log.info("%s: the tokenizer is the checkpoint's; ignored %s", origin, ignored)
    elif cfg.data.tokenizer.path and placed_by_hand(directory := Path(cfg.data.tokenizer.path)):
        # A model put in data.tokenizer.path by hand is used as it is (mt.tokenizer.load_or_train),
        # and the corpus is read before it is loaded: data.tagged's check of a tag written in
        # another case needs its normalization, not the command line's (a resume reads it so)
        cfg.data.tokenizer = replace(cfg.data.tokenizer,
                                     **tokenizer_settings(Tokenizer.load(directory).to_state()))
    if start is None and cfg.model.tie_embeddings == "all":
        # a checkpoint's tokenizer came with its tie (mt-import: one vocabulary)
        check_tied(cfg, run_dir)
    check_sampling(cfg, run_dir, start, origin)


def check_tied(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuses model.tie_embeddings=all over two vocabularies, before the corpus is read: two
    of one size pass the model's size check, but id 11 would be "▁The" in one, "s" in the
    other. The vocabularies are the tokenizer's that the run reuses (data.tokenizer.path, the
    run's own ``tokenizer/``), whatever data.tokenizer.joint says: a joint model put in
    data.tokenizer.path by hand was refused for the command line's joint=false; else those
    that it will train."""
    directory, shared = tokenizer_dir(cfg.data.tokenizer, run_dir), bool(cfg.data.tokenizer.path)
    if (directory / META_FILE).exists() or shared and placed_by_hand(directory):
        if Tokenizer.load(directory).joint:
            return
        where, fix = ((f"data.tokenizer.path={directory}", "point data.tokenizer.path at a "
                       "joint one, or at a new directory to train one") if shared else
                      (f"{directory} (an earlier attempt's in this run directory)",
                       "start in another run directory"))
        raise ValueError(f"model.tie_embeddings=all needs a joint vocabulary, but the tokenizer "
                         f"reused from {where} has two (src.model, tgt.model): set "
                         f"model.tie_embeddings=decoder, or {fix}")
    if not cfg.data.tokenizer.joint:
        raise ValueError(TIED_NEEDS_JOINT)


def check_sampling(cfg: TrainConfig, run_dir: Path, start: dict | None, origin: str) -> None:
    """Refuses data.subword_alpha with a BPE tokenizer that the run takes rather than trains
    (``start``'s, from ``origin``; or one reused from data.tokenizer.path or the run's own
    ``tokenizer/``), now: refused after the corpus was read, the run had made the user wait
    through that, and had written the checkpoint's tokenizer into the run directory, where it
    then refused the corrected command's other tokenizer. One this run trains is data.tokenizer's
    model_type, checked already (``mt.config_checks``)."""
    if cfg.data.subword_alpha <= 0:
        return
    directory, shared = tokenizer_dir(cfg.data.tokenizer, run_dir), bool(cfg.data.tokenizer.path)
    if start is not None:
        state = start["tokenizer"]
    elif (directory / META_FILE).exists() or shared and placed_by_hand(directory):
        state = Tokenizer.load(directory).to_state()  # the one load_or_train will reuse
    else:
        return
    if mistake := sampling_mistake(state, origin, directory, shared):
        raise ValueError(mistake)


def make_corpus(run: Run, start: dict | None, origin: str) -> Corpus:
    """The tokenizer (``start``'s, or trained or loaded as data.tokenizer says) and the
    encoded corpus, with the model's vocabulary sizes set from the tokenizer. Refuses a
    mistake in a split before, and after, a trainer.best_metric=loss that no valid pair can
    give (tied embeddings over two vocabularies: ``check_tied``, before)."""
    cfg = run.cfg
    try:
        check_splits(cfg.data, test=cfg.trainer.test_at_end)
    except (ValueError, OSError) as err:
        # a data.* mistake (a missing file: a typo in data.dir), found before the run wrote
        # anything: said as the command's mistake, and the run directory it made goes
        raise SetupRefused(str(err)) from err
    try:
        corpus = Corpus(cfg, run.run_dir, run.rank, run.world,
                        Tokenizer.from_state(start["tokenizer"]) if start else None, origin)
    except (DataError, TokenizerMismatch) as err:
        # a bad line in a training file (file:line), a tokenizer that does not fit the config:
        # the command's mistake too, said so; the run directory goes where it holds nothing of
        # the run's yet (as for the SetupRefused of a corpus that leaves nothing to train on)
        raise SetupRefused(str(err)) from err
    tok = corpus.tokenizer
    cfg.model.src_vocab_size, cfg.model.tgt_vocab_size = tok.src_vocab_size, tok.tgt_vocab_size
    # recorded as it is: one reused from data.tokenizer.path may be made otherwise, by hand
    cfg.data.tokenizer = replace(cfg.data.tokenizer, **tokenizer_settings(tok.to_state()))
    if cfg.trainer.best_metric == "loss":  # a loss over no pair would be NaN at every check
        src, tgt = corpus.valid[cfg.data.valid]
        if not fitting(tok.encode_src(src), tok.encode_tgt(tgt), cfg.model.max_positions):
            raise SetupRefused(f"trainer.best_metric=loss: no pair of data.valid="
                             f"{cfg.data.valid} fits model.max_positions="
                             f"{cfg.model.max_positions}, so it has no valid loss; raise "
                             "model.max_positions or choose trainer.best_metric=bleu")
    return corpus


def make_model(run: Run, init: dict | None) -> torch.nn.Module:
    """The model on the device, with ``init``'s weights (fine-tuning) and trainer.freeze's
    parameters frozen; a resumed run's weights come later, with the rest of its state."""
    cfg = run.cfg
    model = build_model(cfg.model).to(run.device)
    if init is not None:
        model.load_state_dict(init["model"])  # its own config: every key fits
        log.info("initialised weights from %s", init["path"])
    log.info("model %s: %s parameters\n%s", cfg.model.name, f"{count_parameters(model):,}",
             OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
    if cfg.trainer.freeze:
        log.info("trainer.freeze: %d parameter tensors kept as they are",
                 len(freeze(model, cfg.trainer.freeze)))
    return model


def make_optimization(run: Run) -> None:
    """The optimizer, its schedule, the loss scaler and moving average, and the network that
    the steps run (``net``: the model under DDP and torch.compile, as configured)."""
    cfg = run.cfg
    run.optimizer = build_optimizer(run.model, cfg)
    run.ema = EMA(run.model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
    # Training seconds of earlier runs (resumed) and this one's start; `elapsed` is the clock
    # every rank agrees on, read by the time-budgeted schedule.
    run.seconds_before, run.fit_start, run.elapsed = 0.0, None, 0.0
    # LambdaLR counts the steps taken (0 before the first); lr_lambda counts from 1, so
    # step k runs at lr_lambda(k): the peak at step warmup_steps, min_lr at the last step.
    run.history = []  # the validations so far: the plateau cuts are read from them
    multiplier = lr_lambda(cfg, seconds=lambda: run.elapsed, history=lambda: run.history)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(
        run.optimizer, lambda taken: multiplier(taken + 1))
    run.step_lr = cfg.optim.lr * multiplier(1)  # the learning rate of the last step taken
    run.scaler = torch.amp.GradScaler(run.device.type,
                                      enabled=run.amp_dtype == torch.float16)
    log.info("precision: %s on %s, %d process(es)",
             run.amp_dtype or torch.float32, run.device, run.world)
    run.net = run.model
    if run.world > 1:
        run.net = torch.nn.parallel.DistributedDataParallel(
            run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    if cfg.trainer.compile:
        run.net = torch.compile(run.net)
