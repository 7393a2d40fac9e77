"""Range checks of a composed config, each error naming its key.

Hydra's schema (``mt.config``) checks types and names; these check what a type cannot: values in
their range (``trainer.log_every=0`` would stop a run with a ZeroDivisionError an hour in), keys
that ``+key=`` smuggles past struct mode, and tokenizer settings SentencePiece would refuse with a
traceback of its own after reading the training text. ``mt.train`` runs them once at start-up.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import get_type_hints

from mt.config import (
    BEST_METRICS,
    BYTE_PIECES,
    COUNT_MAX,
    MAX_LENPEN,
    NORMALIZATIONS,
    TokenizerConfig,
    TrainConfig,
)


class SetupRefused(ValueError):
    """A value that only the model and optimizer built from the config refuse
    (``mt.startup.check_setup``: model.heads=3, optim.schedule=linear), a split that the
    data.* keys name wrongly (``mt.data.check_splits``: a missing file), a bad line in a
    training file (``mt.data.DataError``), a tokenizer reused or taken that the config does
    not fit (``mt.startup.check_tied``, ``mt.tokenizer.TokenizerMismatch``), a corpus whose
    valid split or filtered training pairs leave nothing (``mt.corpus.Corpus``): a mistake in
    the command like those ``check_values`` finds, found once the run holds its directory, so
    ``mt.train`` says it without a traceback and takes away the directory it made where it holds
    nothing of the run's yet. Its cause, where it has one, is the error as raised."""


def check_keys(node, schema: type | None = None, prefix: str = "") -> None:
    """Raises ValueError naming the first key of a composed config that ``schema`` (default
    TrainConfig) does not have.

    Hydra's struct mode already refuses ``optim.lrr=1``, but ``+optim.lrr=1`` (which its own
    error message suggests) adds the key, and ``OmegaConf.to_object`` then sets it as a stray
    attribute that nothing reads: a typo that would silently train with the default.
    """
    schema = schema or TrainConfig
    hints = get_type_hints(schema)
    known = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        name = f"{prefix}{key}"
        if key not in known:
            where = f"{prefix[:-1]} has" if prefix else "the config has"
            raise ValueError(f"unknown config key {name}: {where} {', '.join(sorted(known))}")
        if dataclasses.is_dataclass(hints.get(key)):
            check_keys(node[key], hints[key], f"{name}.")


def check_values(cfg: TrainConfig) -> None:
    """Raises ValueError naming the first key whose value is out of its range.

    The schema checks types only: ``trainer.log_every=0`` would pass it and stop the run with a
    ZeroDivisionError an hour later, ``optim.label_smoothing=1.5`` would train on a negative NLL
    weight and ``trainer.best_metric=ter`` would silently keep the checkpoint of the best loss.
    """
    t, o, d, m = cfg.trainer, cfg.optim, cfg.data, cfg.model
    at_least = {
        2: {"model.max_positions": m.max_positions},  # a token and EOS
        1: {"trainer.max_tokens": t.max_tokens, "trainer.accumulation": t.accumulation,
            "trainer.validate_every": t.validate_every, "trainer.log_every": t.log_every,
            "trainer.beam_size": t.beam_size, "trainer.max_bad_steps": t.max_bad_steps,
            "data.subword_nbest": d.subword_nbest, "data.filter.min_tokens": d.filter.min_tokens,
            "optim.plateau_patience": o.plateau_patience,
            "model.encoder_layers": m.encoder_layers, "model.decoder_layers": m.decoder_layers,
            "model.d_model": m.d_model, "model.ffn_dim": m.ffn_dim, "model.heads": m.heads},
        0: {"trainer.max_steps": t.max_steps, "trainer.max_epochs": t.max_epochs,
            "trainer.max_minutes": t.max_minutes, "trainer.save_every": t.save_every,
            "trainer.patience": t.patience, "trainer.keep_last": t.keep_last,
            "trainer.keep_best": t.keep_best, "trainer.average_last": t.average_last,
            "trainer.lenpen": t.lenpen, "trainer.seed": t.seed,
            "trainer.min_improvement": t.min_improvement,
            "trainer.num_threads": t.num_threads, "optim.weight_decay": o.weight_decay,
            "optim.warmup_steps": o.warmup_steps, "optim.min_lr": o.min_lr,
            "optim.clip_norm": o.clip_norm, "optim.lr": o.lr,
            "data.max_valid_sentences": d.max_valid_sentences,
            "data.num_proc": d.num_proc, "data.subword_alpha": d.subword_alpha,
            "data.filter.max_ratio": d.filter.max_ratio},
    }
    for least, values in at_least.items():
        for key, value in values.items():
            if not value >= least:  # NaN fails too
                raise ValueError(f"{key} must be at least {least}, got {value}")
    if t.beam_size > COUNT_MAX:  # as translate's --beam (else refused in its words, hours in)
        raise ValueError(f"trainer.beam_size must be at most {COUNT_MAX}, got {t.beam_size}")
    if t.lenpen > MAX_LENPEN:
        raise ValueError(f"trainer.lenpen must be at most {MAX_LENPEN:g}, got {t.lenpen}")
    finite = {"optim.lr": o.lr, "optim.min_lr": o.min_lr}
    for key, value in finite.items():  # else found at a validation or a step, perhaps hours in
        if value == math.inf:
            raise ValueError(f"{key} must be finite, got {value}")
    if o.schedule == "cosine" and not o.min_lr <= o.lr > 0:
        raise ValueError(f"optim.schedule=cosine decays optim.lr={o.lr:g} to optim.min_lr="
                         f"{o.min_lr:g}: optim.lr must be above 0 and at least optim.min_lr")
    if t.seed >= 2**32:  # SentencePiece's and NumPy's seeds are 32-bit
        raise ValueError(f"trainer.seed must be below 2**32, got {t.seed}")
    if t.average_last == 1:
        raise ValueError("trainer.average_last=1 would average one checkpoint: 0 (off) or 2 "
                         "and more")
    below_one = {"optim.label_smoothing": o.label_smoothing, "model.dropout": m.dropout,
                 "model.attention_dropout": m.attention_dropout,
                 "model.activation_dropout": m.activation_dropout,
                 "trainer.ema_decay": t.ema_decay}
    if len(o.betas) == 2:
        below_one.update({"optim.betas[0]": o.betas[0], "optim.betas[1]": o.betas[1]})
    else:
        raise ValueError(f"optim.betas must be two numbers, got {list(o.betas)}")
    for key, value in below_one.items():
        if not 0 <= value < 1:
            raise ValueError(f"{key} must be in [0, 1), got {value}")
    if not 0 <= o.plateau_factor <= 1:
        raise ValueError(f"optim.plateau_factor must be in [0, 1] (0 or 1: off), "
                         f"got {o.plateau_factor}")
    if 0 < o.plateau_factor < 1 and t.patience and o.plateau_patience >= t.patience:
        raise ValueError(f"optim.plateau_patience={o.plateau_patience} must be below "
                         f"trainer.patience={t.patience}: the run would stop before the learning "
                         "rate is ever reduced")
    if not o.eps > 0:
        raise ValueError(f"optim.eps must be above 0, got {o.eps}")
    if 0 < d.filter.max_ratio < 1:  # then no pair is kept, found only after encoding the corpus
        raise ValueError(f"data.filter.max_ratio must be 0 (off) or at least 1 (the longer side "
                         f"over the shorter), got {d.filter.max_ratio:g}")
    if d.filter.max_tokens < d.filter.min_tokens:
        raise ValueError(f"data.filter.max_tokens={d.filter.max_tokens} is below "
                         f"data.filter.min_tokens={d.filter.min_tokens}")
    if d.subword_alpha > 0 and d.tokenizer.model_type != "unigram":
        raise ValueError("data.subword_alpha samples among a unigram model's segmentations: "
                         "set data.tokenizer.model_type=unigram, or data.subword_alpha=0 for "
                         f"{d.tokenizer.model_type}")
    if d.source == "hub" and not d.hub_name:  # else a TypeError traceback at the split check
        raise ValueError("data.source=hub needs data.hub_name: a dataset on the hub "
                         "(wmt/wmt14) or a folder (written by save_to_disk, or of data files)")
    if d.src_lang == d.tgt_lang and not (d.source == "files" and d.format == "tsv"):
        # One file, JSON key or translation field for both sides: a model trained to copy, said
        # nowhere; a hub dataset with a column per language failed with a KeyError traceback.
        raise ValueError(f"data.src_lang and data.tgt_lang are both {d.src_lang!r}: the source "
                         "and the target would be the same text; for a task within one language "
                         "give data.source=files data.format=tsv (source<TAB>target)")
    for key, split in (("data.train", d.train), ("data.valid", d.valid)):
        if not split:
            raise ValueError(f"{key} is empty: name a split")
    for i, split in enumerate(d.extra_valid):
        if not split or split == d.valid or split in d.extra_valid[:i]:
            why = ("is empty" if not split else "is data.valid already" if split == d.valid
                   else "is named twice")
            raise ValueError(f"data.extra_valid[{i}]={split!r} {why}")
    parts = d.train.split("+")
    twice = sorted({p for p in parts if p and parts.count(p) > 1})
    if twice:  # its second copy went as duplicates (data.filter.dedup), and data.upsample.X or
        # data.tagged=[X] could not tell the copies apart
        raise ValueError(f"data.train={d.train} names {', '.join(twice)} twice: to weigh a split, "
                         f"give +data.upsample.{twice[0]}=2 instead")
    for split, factor in d.upsample.items():
        if split not in parts:
            raise ValueError(f"data.upsample.{split}: not one of data.train's splits "
                             f"({', '.join(parts)})")
        if not 0 < factor < math.inf:
            raise ValueError(f"data.upsample.{split} must be above 0 and finite, got {factor}")
    if t.best_metric not in BEST_METRICS:
        raise ValueError(f"trainer.best_metric must be one of {', '.join(BEST_METRICS)}, "
                         f"got {t.best_metric!r}")
    # A file there gave "[Errno 17] File exists", after the tokenizer had been trained.
    tok_path = Path(d.tokenizer.path) if d.tokenizer.path else None
    if tok_path and tok_path.exists() and not tok_path.is_dir():
        raise ValueError(f"data.tokenizer.path={tok_path} is a file: it names a directory, which "
                         "holds (or is trained into) tokenizer.json and the SentencePiece model")
    check_tokenizer(d.tokenizer)


def check_tokenizer(tok: TokenizerConfig) -> None:
    """Raises ValueError naming the first data.tokenizer key whose value SentencePiece would
    refuse with a traceback of its own (``INTERNAL: ... character_coverage() >= 0.98``), and
    before the training text is read, which can take minutes."""
    if tok.model_type not in ("unigram", "bpe"):
        raise ValueError("data.tokenizer.model_type must be unigram or bpe, got "
                         f"{tok.model_type!r}")
    if tok.vocab_size < 5:  # 1 to 3 failed inside SentencePiece as it placed the special ids
        raise ValueError(f"data.tokenizer.vocab_size must be at least 5 (4 special ids and a "
                         f"piece of text), got {tok.vocab_size}")
    if tok.input_sentence_size < 1:
        raise ValueError(f"data.tokenizer.input_sentence_size must be at least 1, got "
                         f"{tok.input_sentence_size}")
    if not 0.98 <= tok.character_coverage <= 1:  # SentencePiece's own range
        raise ValueError("data.tokenizer.character_coverage must be in [0.98, 1], got "
                         f"{tok.character_coverage}")
    check_normalization(tok.normalization)
    if tok.byte_fallback and tok.vocab_size <= BYTE_PIECES + 4:  # SentencePiece names no key
        raise ValueError(f"data.tokenizer.vocab_size={tok.vocab_size} leaves no room for the "
                         f"{BYTE_PIECES} byte pieces of data.tokenizer.byte_fallback=true and 4 "
                         "special ids: raise it well above 260, or set byte_fallback=false")


def check_normalization(name: str) -> None:
    """Raises ValueError naming data.tokenizer.normalization unless SentencePiece has the rule."""
    if name not in NORMALIZATIONS:
        raise ValueError(f"data.tokenizer.normalization must be one of {', '.join(NORMALIZATIONS)}"
                         f", got {name!r}")
