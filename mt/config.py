"""Typed configuration for every stage.

Each Hydra config group (``conf/model``, ``conf/data``, ``conf/optim``, ``conf/trainer``) fills one
of these dataclasses. The root schema is registered in Hydra's ConfigStore as ``train_schema`` and
is the first entry of ``conf/train.yaml``'s defaults list, so a misspelt key or a value of the wrong
type fails at start-up with the key's full name. ``OmegaConf.to_object`` is called once, in
``mt.train``; everything below it sees plain dataclasses.

A checkpoint carries the whole resolved config, for the record, and the model config apart (as a
dict): that one is the contract between a trained model and ``translate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def conf_dir() -> Path:
    """Hydra's configs: ``mt/conf`` in an installed wheel (pyproject.toml ships the repository's
    top-level ``conf/`` there), else ``conf/`` beside the package (a checkout, an editable
    install)."""
    package = Path(__file__).resolve().parent
    shipped = package / "conf"
    return shipped if (shipped / "train.yaml").is_file() else package.parent / "conf"


# Special token ids, fixed for every SentencePiece model that `mt` trains (see mt.tokenizer).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# SentencePiece's predefined normalization rules (data.tokenizer.normalization).
NORMALIZATIONS = ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity")
# Pieces that byte fallback adds to the vocabulary: one per byte value.
BYTE_PIECES = 256


@dataclass
class ModelConfig:
    """The Transformer's shape. ``name`` is informational (the conf/model file it came from).
    The defaults are conf/model/transformer_tiny.yaml's (a test holds them equal)."""

    name: str = "transformer_tiny"
    encoder_layers: int = 3
    decoder_layers: int = 3
    d_model: int = 128
    ffn_dim: int = 512
    heads: int = 4
    dropout: float = 0.1  # on residual branches and embeddings
    attention_dropout: float = 0.0  # on attention weights
    activation_dropout: float = 0.0  # after the FFN's activation
    activation: str = "relu"  # relu | gelu | silu
    norm: str = "post"  # post: LayerNorm(x + f(x)) as in Vaswani et al.; pre: x + f(LayerNorm(x))
    positions: str = "sinusoidal"  # sinusoidal | learned
    max_positions: int = 1024  # longest sequence (in subword tokens) the model is built for
    tie_embeddings: str = "all"  # all: src+tgt+output (joint vocab); decoder: tgt+output; none
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model)
    final_logits_bias: bool = False  # a bias on the output layer (Marian has one)
    src_vocab_size: int = 0  # filled in from the tokenizer at build time
    tgt_vocab_size: int = 0


@dataclass
class FilterConfig:
    """Cleaning rules applied to training pairs; each reports how many pairs it dropped."""

    min_tokens: int = 1  # in subword tokens, per side (empty sides are always dropped)
    max_tokens: int = 250
    max_ratio: float = 3.0  # longer side / shorter side, in subword tokens; 0 disables
    dedup: bool = True  # drop exact duplicate (source, target) pairs


@dataclass
class TokenizerConfig:
    """How to train the SentencePiece model(s) when the run has none."""

    path: str | None = None  # reused if complete, else trained there; None: run_dir/tokenizer
    model_type: str = "unigram"  # unigram | bpe
    vocab_size: int = 8000
    joint: bool = True  # one vocabulary for both languages (needed for tie_embeddings=all)
    character_coverage: float = 1.0
    input_sentence_size: int = 2_000_000  # sample this many sentences from a huge corpus
    # always one source piece where a word starts (SentencePiece user_defined_symbols, given as
    # '▁' + symbol so that "<BT> Hello" is <BT> ▁Hello, not ▁ <BT> ▁Hello); mt-train adds data.tag
    # here when data.tagged is set
    user_symbols: list[str] = field(default_factory=list)
    # a character without a piece becomes its UTF-8 bytes (pieces <0x00>..<0xFF>), not <unk>: €,
    # emoji and rare CJK survive encoding and come back on decoding (SentencePiece byte_fallback).
    # Off by default: at character_coverage=1.0 every character of the sample has a piece, so the
    # model never trains on a byte piece and an unseen character would meet untrained embeddings,
    # for 256 pieces of vocab_size. Worth it with a coverage below 1 (0.9995 for CJK-sized
    # character sets), where the sample's rarest characters are spelled, and learned, in bytes
    byte_fallback: bool = False
    # SentencePiece normalization_rule_name, applied before encoding and kept in the model:
    # nmt_nfkc (NFKC, e.g. ½ -> 1⁄2, ﬁ -> fi, ２ -> 2, and whitespace cleanup), nfkc, nmt_nfkc_cf
    # and nfkc_cf (the same, case-folded) or identity (the text as written)
    normalization: str = "nmt_nfkc"


@dataclass
class DataConfig:
    """Where the parallel text comes from.

    ``source`` picks the loader: ``demo`` (the generated corpus, written to ``dir``), ``files``
    (``{dir}/{split}.{lang}`` plain text, or TSV/JSONL via ``format``) or ``hub`` (a Hugging Face
    dataset in the ``translation`` format, e.g. ``wmt14`` / ``de-en``).
    """

    name: str = "demo"
    source: str = "demo"  # demo | files | hub
    dir: str = "data/demo"
    src_lang: str = "en"
    tgt_lang: str = "zz"
    format: str = "text"  # text | tsv | jsonl (files source only; .gz accepted)
    train: str = "train"  # several splits joined by '+': train+backtranslated
    valid: str = "valid"
    # more valid splits (each may join splits with '+'), scored at every validation beside
    # data.valid and logged as SPLIT/loss, SPLIT/bleu, ...: e.g. a second domain, watched while
    # fine-tuning. Only data.valid chooses best.pt, patience and the plateau cuts.
    extra_valid: list[str] = field(default_factory=list)
    test: str = "test"
    hub_name: str | None = None  # e.g. wmt14
    hub_config: str | None = None  # e.g. de-en
    # 0 = all; else validation uses only the first N valid pairs: its loss and perplexity as well
    # as BLEU and chrF, so best.pt, patience and plateau cuts (by any best_metric) too
    max_valid_sentences: int = 0
    # processes that encode the corpus; 0: 1 below 200k pairs, else one per core (at most 16)
    num_proc: int = 0
    # subword regularization (Kudo, 2018): each epoch, each side of each training pair takes one of
    # its subword_nbest best segmentations, with probability ~ P(segmentation)^subword_alpha.
    # 0 = off (the one best). Unigram tokenizers; the candidates are held in memory.
    subword_alpha: float = 0.0
    subword_nbest: int = 64
    # tagged back-translation (Caswell et al., 2019): the sources of these splits of data.train
    # (e.g. [bt] with train=train+bt) start with the token data.tag, so the model can tell
    # synthetic sources from real ones; valid, test and translate input are never tagged
    tagged: list[str] = field(default_factory=list)
    tag: str = "<BT>"
    # how often each pair of a split of data.train appears per epoch (fairseq's --upsample-primary,
    # OpenNMT-py's corpus weights), e.g. {train: 2} with train=train+bt: the real pairs twice,
    # the synthetic ones once. A fraction is the next share of a shuffled pass through the split
    # ({bt: 0.5}: half of bt, the other half in the next epoch; 1.5: every pair, and half of them
    # again, the other half the next epoch). Unnamed splits: 1.
    upsample: dict[str, float] = field(default_factory=dict)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)


@dataclass
class OptimConfig:
    """Adam(W) with a warmup schedule, as in Vaswani et al. (2017)."""

    name: str = "adam"  # adam | adamw
    lr: float = 7e-4  # peak learning rate, reached at the end of warmup
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    schedule: str = "inverse_sqrt"  # inverse_sqrt | cosine | constant
    warmup_steps: int = 4000
    min_lr: float = 0.0  # floor for the cosine schedule
    # reduce on plateau, on top of the schedule (fairseq's reduce_lr_on_plateau, Marian's
    # --lr-decay-strategy stalled): the rate is multiplied by plateau_factor each time
    # trainer.best_metric has not improved in plateau_patience validations; 0 or 1 = off
    plateau_factor: float = 0.0
    plateau_patience: int = 3
    clip_norm: float = 0.0  # 0 disables gradient clipping
    label_smoothing: float = 0.1


@dataclass
class TrainerConfig:
    """The training loop: batch size, length, validation, checkpoints and precision."""

    max_tokens: int = 4096  # tokens (source or target, whichever is larger) per batch per process
    accumulation: int = 1  # batches per optimizer step
    max_steps: int = 0  # optimizer steps; 0 = no limit
    max_epochs: int = 0  # 0 = no limit
    max_minutes: float = 0.0  # wall-clock budget for training, resumed runs included; 0 = none
    validate_every: int = 500  # optimizer steps
    save_every: int = 0  # also write last.pt every N steps between validations; 0 = only then
    log_every: int = 50
    patience: int = 0  # stop after this many validations without a better best_metric; 0 = never
    best_metric: str = "bleu"  # bleu | chrf | loss: picks best.pt, keep_best; drives patience
    # a validation is better only when it beats the best by more than this (BLEU or chrF points,
    # or loss per token), so that a gain within the valid set's noise neither replaces best.pt
    # nor resets patience and plateau counts; 0 = any gain
    min_improvement: float = 0.0
    keep_last: int = 2  # the last N step checkpoints are kept (besides last.pt and best.pt)
    keep_best: int = 0  # and the N best by best_metric (for `mt-average --best`)
    average_last: int = 0  # average the last N step checkpoints at the end (0 = off)
    # exponential moving average of the weights (e.g. 0.9999): what validation, best.pt and the
    # step checkpoints hold (mt.optim.EMA); 0 = off
    ema_decay: float = 0.0
    # parameters not trained (shell patterns of their names, e.g. [encoder_layers.*]: a fine-tuning
    # run that keeps the encoder)
    freeze: list[str] = field(default_factory=list)
    beam_size: int = 5  # for validation and test BLEU
    lenpen: float = 0.6
    save_valid_hyps: bool = True  # each validation's translations in run_dir/valid/step_N.hyp
    # auto: bf16 on CUDA GPUs with native bf16 (else fp16) and on AVX512-BF16/AMX CPUs (else fp32)
    precision: str = "auto"  # auto | bf16 | fp16 | fp32
    compile: bool = False
    seed: int = 1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    test_at_end: bool = True  # translate the test split with the best checkpoint and print BLEU
    max_bad_steps: int = 10  # stop after this many consecutive steps with a NaN/inf loss
    tensorboard: bool = True  # TensorBoard events in the run dir (if tensorboard is installed)


@dataclass
class TrainConfig:
    """The root config composed from conf/train.yaml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # a model to start from (fine-tuning): its weights, shape and tokenizer, not its optimizer state
    init_from: str | None = None


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Rebuilds a ModelConfig from a checkpoint, naming any key this version does not know."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"model config has unknown keys {unknown}: was it made by a newer mt?")
    return ModelConfig(**values)


# Model keys that are training choices, not the network's shape: a fine-tuning run takes them from
# its own config (fine-tuning on little data often wants more dropout than the model was trained
# with), every other key from the model it starts from.
REGULARIZATION_KEYS = ("dropout", "attention_dropout", "activation_dropout")


def finetune_model_config(config: ModelConfig, saved: dict[str, Any]) -> tuple[ModelConfig, str]:
    """The model config of a run that starts from a saved model (``init_from``).

    Its shape is the saved model's, whatever ``model=...`` the run's config composed (the weights
    fit nothing else); its dropouts are the run's.

    Returns:
        the config, and a note of the run's shape keys that the saved model overrides ("" if
        none), for the log.
    """
    model = model_config_from_dict(saved)
    for key in REGULARIZATION_KEYS:
        setattr(model, key, getattr(config, key))
    ignored = [f"model.{f.name}={getattr(config, f.name)} (model: {getattr(model, f.name)})"
               for f in dataclasses.fields(ModelConfig)
               if f.name not in ("name", "src_vocab_size", "tgt_vocab_size")
               and getattr(config, f.name) != getattr(model, f.name)]
    return model, ", ".join(ignored)


def start_tokenizer_config(config: TokenizerConfig, saved: dict | None, made: dict,
                           asked: dict | None = None) -> tuple[TokenizerConfig, str]:
    """The tokenizer config of a run that starts from a checkpoint (a resume, or ``init_from``):
    the settings its tokenizer has (``made``, read from its SentencePiece models by
    ``mt.spm_spec.tokenizer_settings``; for the rest, the checkpoint's ``config``), whatever
    ``data.tokenizer`` says now, as the tokenizer itself is the checkpoint's (its pieces are the
    model's rows). Not the checkpoint's config alone: an ``mt-import``'ed model has none, and one
    fine-tuned from it recorded the run's defaults (joint, 8000, nmt_nfkc) for a tokenizer of two
    vocabularies that folds case. Recorded so, a new ``vocab_size`` on the command line is
    neither listed as a change that took effect nor saved into the next checkpoints. ``path``
    (where this run keeps the tokenizer) and ``user_symbols`` (which the tokenizer is checked to
    have: ``data.tag``) stay this run's. ``asked``: a resumed last.pt's record of what its run's
    command line asked (``data.tokenizer`` before this replaced it); a key asked as then was
    noted when that run started, and is not noted again at every resume (a vocab_size that
    SentencePiece shrank to what the text holds, said when the tokenizer was trained).

    Returns:
        the config, and a note of the keys the command line set otherwise ("" if none).
    """
    old = {**(((saved or {}).get("data") or {}).get("tokenizer") or {}), **made}
    names = [f.name for f in dataclasses.fields(TokenizerConfig)
             if f.name not in ("path", "user_symbols")]
    kept = dataclasses.replace(config, **{k: v for k, v in old.items() if k in names})
    ignored = [f"data.tokenizer.{n}={getattr(config, n)} (tokenizer: {getattr(kept, n)})"
               for n in names if getattr(config, n) != getattr(kept, n)
               and not (asked and n in asked and asked[n] == getattr(config, n))]
    return kept, ", ".join(ignored)


def config_changes(saved: dict, now: dict, prefix: str = "", defaults: dict | None = None
                   ) -> list[str]:
    """``key=new (was old)`` for every leaf of the config that differs from a checkpoint's,
    so that a resumed run says what it does differently (a budget raised, a batch size
    changed) instead of doing it silently. ``defaults``: the schema's, which a key added to it
    since the checkpoint was saved had then (``data.extra_valid=[]`` is no change)."""
    out, defaults = [], defaults or {}
    for key in sorted(saved.keys() | now.keys()):
        a, b = saved.get(key, defaults.get(key)), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{key}.", defaults.get(key))
        elif a != b and not (isinstance(a, list | tuple) and isinstance(b, list | tuple)
                             and list(a) == list(b)):
            out.append(f"{prefix}{key}={b} (was {a})")
    return out


def is_user_symbol(text: str) -> bool:
    """Whether SentencePiece can take ``text`` as a user symbol (``data.tag``): one non-empty word
    (it cuts at spaces, '▁' once encoded), no ',' (its trainer takes the list joined by
    commas), and unchanged by NFKC (its normalizer would rewrite the text, not the symbol)."""
    import unicodedata

    return (bool(text) and not any(c.isspace() or c in ",\u2581" for c in text)
            and unicodedata.normalize("NFKC", text) == text)


# What trainer.best_metric names: the validation record's key, and +1 where higher is better.
BEST_METRICS = {"bleu": ("valid_bleu", 1), "chrf": ("valid_chrf", 1), "loss": ("valid_loss", -1)}


def improves(value: float, best: float | None, best_metric: str, min_improvement: float) -> bool:
    """Whether a validation score ``value`` counts as better than ``best`` (None: the first one).

    Better means by more than ``min_improvement`` (trainer.min_improvement), so that a gain within
    the noise of a small valid set neither replaces best.pt nor resets patience; best.pt, patience
    and the plateau schedule (mt.optim) all ask this one question.
    """
    if best is None:
        return True
    sign = BEST_METRICS[best_metric][1]
    return sign * (value - best) > min_improvement


def replay(history: list[dict], best_metric: str,
           min_improvement: float) -> Iterator[tuple[float, bool]]:
    """Each validation record's score and whether it counted as better than the best before it
    (``improves``), in order; records older than the metric (without its key) are left out."""
    key = BEST_METRICS[best_metric][0]
    best = None
    for record in history:
        if key in record:
            better = improves(record[key], best, best_metric, min_improvement)
            best = record[key] if better else best
            yield record[key], better


def best_so_far(history: list[dict], best_metric: str,
                min_improvement: float) -> tuple[float | None, int]:
    """(best score, validations since it) replayed from a run's validation records, as the
    trainer keeps them: a resumed run that now asks for another metric or threshold compares
    like with like, and agrees with the plateau cuts, which are replayed the same way."""
    best, bad = None, 0
    for value, better in replay(history, best_metric, min_improvement):
        best, bad = (value, 0) if better else (best, bad + 1)
    return best, bad


# The largest GNMT alpha taken: past it, a length penalty of ((5 + length) / 6) ** alpha
# overflowed (--lenpen 1000: an OverflowError traceback), and at 10 a token more already weighs
# (16 / 15) ** 10 = 1.9x at length 10.
MAX_LENPEN = 10.0

# The most a count flag takes (--beam, --batch-tokens, --chunk-lines, ...): far past any use,
# and inside what torch's sizes and itertools.islice hold (--beam 2**62 failed on a negative
# padding size, --chunk-lines 10**20 in islice, both as tracebacks).
COUNT_MAX = 2**31 - 1


def positive_int(text: str) -> int:
    """An argparse type for counts such as ``--workers``: an integer of at least 1."""
    return _int_from(text, 1)


def count_or_off(text: str) -> int:
    """An argparse type for sizes where 0 means off (``--no-repeat-ngram-size``)."""
    return _int_from(text, 0)


def resamples(text: str) -> int:
    """An argparse type for bootstrap resamples: sacreBLEU takes 1 to mean no bootstrap at all,
    so ``--confidence-n 1`` printed no interval and said nothing."""
    return _int_from(text, 2)


def _int_from(text: str, least: int) -> int:
    import argparse

    value = int(text)
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    if value > COUNT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {COUNT_MAX}, got {value}")
    return value


def register_configs() -> None:
    """Registers the root schema so conf/train.yaml can name it in its defaults list."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
