"""SentencePiece tokenization: train, save, load, encode, decode.

A tokenizer is one SentencePiece model (joint vocabulary, needed to tie source and target
embeddings) or two (separate vocabularies). Every model `mt` trains uses the same special ids, so
the model code can rely on them: pad=0, unk=1, bos=2, eos=3 (see ``mt.config``).

A tokenizer directory holds ``spm.model`` (joint) or ``src.model`` and ``tgt.model``, plus
``tokenizer.json``: vocabulary sizes, a hash of the models and, when ``load_or_train`` made it, the
settings and seed it was trained with and how long that took. ``tokenizer.json`` is written
last, so its presence means the directory is complete; ``load_or_train`` reuses such a directory
instead of training again.

The serialized models travel inside every checkpoint (``Tokenizer.to_state`` /
``Tokenizer.from_state``): a trained model cannot meet the wrong vocabulary. This module knows
nothing of torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from mt.config import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    TokenizerConfig,
    is_user_symbol,
)
from mt.config_checks import check_tokenizer
from mt.spmtrain import train_one
from mt.textio import first_line, json_object, replace_file

log = logging.getLogger(__name__)

META_FILE = "tokenizer.json"
# The SentencePiece model files a tokenizer directory may hold (joint; separate).
MODEL_FILES = ("spm.model", "src.model", "tgt.model")


class TokenizerMismatch(ValueError):
    """A tokenizer that the run reuses or takes (data.tokenizer.path's, a checkpoint's) and that
    does not fit what the config asks of it: the command's mistake, which ``mt-train`` says in
    one line, taking away the run directory it made (``mt.startup.make_corpus``)."""


# Closing quotes and brackets that may follow a sentence's final punctuation.
_CLOSERS = "\"'\u00bb\u201d\u2019)]\u300d\u300f\uff09"


@dataclasses.dataclass
class Boundaries:
    """Per source id, what its piece says about cutting a line before or after it.

    starts: the piece starts a word (a '▁' piece), so a cut before it falls between words.
    ends: the piece ends a sentence: ., !, ?, an ellipsis or 。 (then closing quotes or brackets).
    closes: the piece is closing quotes or brackets alone (a sentence may end before it).
    unspaced: the piece ends with 。, after which a sentence starts without a space.
    inside: the piece is a UTF-8 continuation byte (<0x80>..<0xBF>, byte fallback): a cut before
        it would split a character.
    """

    starts: list[bool]
    ends: list[bool]
    closes: list[bool]
    unspaced: list[bool]
    inside: list[bool]


def _proto(path: Path) -> bytes:
    """The SentencePiece model in ``path``, checked to parse: SentencePiece's own error, a
    RuntimeError, names its C++ source, not the file (it is kept after the file's name)."""
    proto = path.read_bytes()
    try:
        pieces = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    except RuntimeError as err:
        raise ValueError(f"{path}: not a SentencePiece model ({first_line(err)})") from None
    if not pieces:  # an empty file parses, as a model of no pieces
        raise ValueError(f"{path}: not a SentencePiece model (no pieces; an empty file?)")
    return proto


class Tokenizer:
    """Source and target SentencePiece processors (the same object when the vocabulary is joint)."""

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None = None) -> None:
        self.src_proto = src_proto
        self.tgt_proto = tgt_proto
        self.src = spm.SentencePieceProcessor(model_proto=src_proto)
        self.tgt = (self.src if tgt_proto is None
                    else spm.SentencePieceProcessor(model_proto=tgt_proto))
        for name, sp in (("source", self.src), ("target", self.tgt)):
            ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
            if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
                raise ValueError(
                    f"{name} SentencePiece model has special ids (pad, unk, bos, eos) = {ids}; "
                    f"mt needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}"
                )

    @property
    def joint(self) -> bool:
        return self.tgt_proto is None

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    @property
    def fingerprint(self) -> str:
        """A hash of the model(s): part of the cache key of every corpus encoded with them."""
        digest = hashlib.sha256(self.src_proto)
        digest.update(b"joint" if self.tgt_proto is None else self.tgt_proto)
        return digest.hexdigest()[:16]

    @functools.cached_property
    def src_boundaries(self) -> Boundaries:
        """Where ``translate`` may cut a source line longer than the model (``Boundaries``)."""
        sp = self.src
        marks = Boundaries([], [], [], [], [])
        for i in range(sp.get_piece_size()):
            control = sp.is_control(i)
            piece = "" if control else sp.id_to_piece(i)
            marks.inside.append(sp.is_byte(i) and 0x80 <= int(piece[1:-1], 16) < 0xC0)
            marks.starts.append(piece.startswith("\u2581"))  # not <unk>: it may be mid-word
            text = piece.rstrip(_CLOSERS)
            marks.ends.append(text[-1:] in (".", "!", "?", "\u2026", "\u3002"))
            marks.closes.append(bool(piece) and not text.lstrip("\u2581"))
            marks.unspaced.append(text[-1:] == "\u3002")
        return marks

    def symbol_id(self, symbol: str) -> int | None:
        """The source id of ``symbol`` if it encodes to one known piece (a user symbol such as
        the back-translation tag does), else None."""
        ids = self.src.encode(symbol)
        return ids[0] if len(ids) == 1 and ids[0] != UNK_ID else None

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids end with EOS so that every sentence, even an empty one, has a real token."""
        return self.src.encode(texts, add_eos=True)

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids without BOS/EOS; the collator adds them (BOS for input, EOS for output)."""
        return self.tgt.encode(texts)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        return self.tgt.decode(ids)

    def to_state(self) -> dict:
        return {"src": self.src_proto, "tgt": self.tgt_proto}

    @classmethod
    def from_state(cls, state: dict) -> Tokenizer:
        return cls(state["src"], state.get("tgt"))

    def save(self, directory: str | os.PathLike, info: dict | None = None) -> None:
        """Writes the model(s), then ``tokenizer.json`` (sizes, hash and ``info``) last."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # Each model file whole or absent: a save cut short leaves no torn model, which a
        # data.tokenizer.path without tokenizer.json would be taken as (``placed_by_hand``).
        if self.joint:
            replace_file(directory / "spm.model", self.src_proto)
        else:
            replace_file(directory / "src.model", self.src_proto)
            replace_file(directory / "tgt.model", self.tgt_proto)
        meta = {"joint": self.joint, "src_vocab_size": self.src_vocab_size,
                "tgt_vocab_size": self.tgt_vocab_size, "fingerprint": self.fingerprint,
                **(info or {})}
        replace_file(directory / META_FILE, json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        directory = Path(directory)
        if (directory / "spm.model").exists():
            protos = [_proto(directory / "spm.model")]
        elif (directory / "src.model").exists() and (directory / "tgt.model").exists():
            protos = [_proto(directory / "src.model"), _proto(directory / "tgt.model")]
        else:
            raise FileNotFoundError(f"{directory}: no SentencePiece model (expected spm.model, or "
                                    "src.model and tgt.model)")
        try:
            return cls(*protos)
        except ValueError as err:  # a model from elsewhere, with SentencePiece's default ids
            raise ValueError(f"{directory}: {err} (SentencePiece's --pad_id=0 --unk_id=1 "
                             "--bos_id=2 --eos_id=3)") from None


def _sample(texts: Iterable[str], size: int, seed: int) -> list[str]:
    """Up to ``size`` non-empty lines, so huge corpora train in bounded memory.

    A list no longer than ``size`` is taken whole (callers that can index their corpus sample it
    themselves, see ``mt.data.sample_texts``); anything else gets a reservoir sample.
    """
    if isinstance(texts, list) and len(texts) <= size:
        return [t for t in texts if t.strip()]
    rng = random.Random(seed)
    reservoir: list[str] = []
    for i, line in enumerate(t for t in texts if t.strip()):
        if len(reservoir) < size:
            reservoir.append(line)
        else:
            j = rng.randint(0, i)
            if j < size:
                reservoir[j] = line
    return reservoir


def train_tokenizer(
    src_texts: Iterable[str], tgt_texts: Iterable[str], cfg: TokenizerConfig, seed: int = 0
) -> Tokenizer:
    """Trains a joint or a separate-vocabulary tokenizer on training text.

    Args:
        src_texts: source sentences (any iterable; sampled to ``cfg.input_sentence_size``).
        tgt_texts: target sentences.
        cfg: model type, vocabulary size, coverage, joint or not.
        seed: makes the sample and the model reproducible.
    """
    check_tokenizer(cfg)
    for symbol in cfg.user_symbols:
        if not is_user_symbol(symbol):
            raise ValueError("data.tokenizer.user_symbols: each must be non-empty, without "
                             f"whitespace, ',' or '\u2581', unchanged by NFKC, got {symbol!r}")
        if cfg.normalization.endswith("_cf") and symbol != symbol.casefold():  # else folded
            raise ValueError(f"data.tokenizer.normalization={cfg.normalization} folds the case of "
                             f"{symbol!r} (data.tag or data.tokenizer.user_symbols): write it in "
                             "lower case")
    if cfg.joint:
        if isinstance(src_texts, list) and isinstance(tgt_texts, list):
            sentences = _sample(src_texts + tgt_texts, cfg.input_sentence_size, seed)
        else:
            sentences = _sample(itertools.chain(src_texts, tgt_texts), cfg.input_sentence_size,
                                seed)
        tok = Tokenizer(train_one(sentences, cfg, seed, cfg.user_symbols))
    else:
        tok = Tokenizer(  # user symbols mark sources: the target vocabulary has no use for them
            train_one(_sample(src_texts, cfg.input_sentence_size, seed), cfg, seed,
                       cfg.user_symbols, side="source "),
            train_one(_sample(tgt_texts, cfg.input_sentence_size, seed), cfg, seed,
                       side="target "),
        )
    sizes = {tok.src_vocab_size, tok.tgt_vocab_size}
    if min(sizes) < cfg.vocab_size:  # hard_vocab_limit=False shrank it to what the text holds
        log.warning("data.tokenizer.vocab_size=%d: the text holds %s pieces, which SentencePiece "
                    "trained instead", cfg.vocab_size,
                    " and ".join(str(n) for n in sorted(sizes)))
    return tok


def _release_memory() -> None:
    """Hands freed heap back to the OS.

    glibc keeps what the sampled sentences held (SentencePiece's own heap, about 1 GB for 2M
    sentences, goes with its process: ``mt.spmtrain``); the encoding workers forked next would
    each inherit it and look that much larger.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def placed_by_hand(directory: Path) -> bool:
    """Whether ``directory`` holds a SentencePiece model but no ``tokenizer.json``. In the run's
    own ``tokenizer/`` that is a save cut short, trained again; in ``data.tokenizer.path`` it is
    a model put there by hand (tokenizers/README.md), which training would write over."""
    return (not (directory / META_FILE).exists()
            and any((directory / name).exists() for name in MODEL_FILES))


def require_symbols(tok: Tokenizer, symbols: Sequence[str], which: str, fix: str) -> None:
    """Stops a run whose tokenizer cannot give a user symbol (the back-translation tag) as one
    piece: the model could not tell tagged sources from others."""
    for symbol in symbols:
        if tok.symbol_id(symbol) is None:
            raise TokenizerMismatch(f"data.tagged / data.tokenizer.user_symbols: {which} has "
                                    f"no single piece for {symbol!r}; {fix}")


def place(directory: str | os.PathLike, tokenizer: Tokenizer, origin: str,
          shared: bool = False) -> Tokenizer:
    """Puts a model's own tokenizer in a run's tokenizer directory, or checks the one there.

    A model fine-tuned with another segmentation would see ids that mean other pieces: its
    embeddings would be noise. So the directory must be empty (the tokenizer is written there)
    or hold this very tokenizer (a resumed run, or a rank that came second).

    Args:
        directory: the run's tokenizer directory.
        tokenizer: the model's tokenizer.
        origin: where it came from, for the error and ``tokenizer.json`` (``init_from=...``).
        shared: the directory is data.tokenizer.path, not the run's own: the error's advice.
    """
    directory = Path(directory)
    if (directory / META_FILE).exists() or shared and placed_by_hand(directory):
        there = Tokenizer.load(directory)
        if there.fingerprint != tokenizer.fingerprint:
            raise TokenizerMismatch(
                f"{origin}: the model's tokenizer is not the one in {directory}; "
                "a model keeps its own: " + (
                    "unset data.tokenizer.path" if shared else
                    "start in another run directory (that one is an earlier "
                    "attempt's, made from other data or settings)"))
        return there
    tokenizer.save(directory, {"from": origin})
    log.info("tokenizer of %s -> %s", origin, directory)
    return tokenizer


# How mt trained tokenizers before these keys existed: a tokenizer.json without one means this.
SPELLING_BEFORE = {"byte_fallback": False, "normalization": "nmt_nfkc"}


def check_spelling(made: dict | None, cfg: TokenizerConfig, directory: str | os.PathLike) -> None:
    """Refuses a reused tokenizer that spells text otherwise than ``cfg`` asks.

    A vocabulary size that differs only warns (the text is still spelled, in other pieces), but
    a tokenizer without the byte fallback a run asked for turns €, emoji and rare CJK into <unk>,
    and another normalization rewrites text the run means to keep: the run would train a model
    that cannot write what its config promises. ``made`` is the ``config`` in ``tokenizer.json``
    (the TokenizerConfig ``load_or_train`` trained with); None, as for a model's tokenizer that
    ``place`` wrote or one put together by hand, records nothing, and the tokenizer is taken as
    it is.
    """
    if made is None:
        return
    asked = {"byte_fallback": cfg.byte_fallback, "normalization": cfg.normalization}
    trained = {k: made.get(k, before) for k, before in SPELLING_BEFORE.items()}
    differ = [k for k in asked if trained[k] != asked[k]]
    if differ:
        def show(v: bool | str) -> str:
            return str(v).lower() if isinstance(v, bool) else v

        was = " ".join(f"data.tokenizer.{k}={show(trained[k])}" for k in differ)
        now = " ".join(show(asked[k]) for k in differ)
        raise TokenizerMismatch(f"{directory}: its tokenizer was trained with {was}, this run "
                                f"asks for {now}: set {was} to use it, or point "
                                "data.tokenizer.path at a new directory to train one")


def load_or_train(
    directory: str | os.PathLike,
    texts: Callable[[], tuple[Iterable[str], Iterable[str]]],
    cfg: TokenizerConfig,
    seed: int = 0,
    trained_on: dict | None = None,
    loud: bool = True,
    shared: bool = False,
) -> Tokenizer:
    """The tokenizer in ``directory`` if it is complete, else one trained and saved there.

    Args:
        directory: where the model(s) and ``tokenizer.json`` live.
        texts: called only when training is needed; returns (source, target) sentences.
        cfg: training settings; if a reused directory was made with others, a warning says which.
            A reused tokenizer without one of ``cfg.user_symbols`` as a piece, or trained with
            another ``byte_fallback`` or ``normalization`` (``check_spelling``), is an error.
        seed: for the sentence sample and SentencePiece.
        trained_on: what names the training data (``data.data_identity``), kept beside the
            tokenizer; a reused one made from other data gets a warning saying how: a run
            directory's tokenizer left by an attempt interrupted before its first checkpoint
            was reused by the next attempt, with other data, without a word.
        loud: False on the processes of a run but its first, which read the tokenizer the
            first made: its warnings, once, are the first's.
        shared: ``directory`` is data.tokenizer.path, not the run's own: a SentencePiece model
            there without ``tokenizer.json`` (``placed_by_hand``) is used as it is, never
            trained over.
    """
    warn = log.warning if loud else log.debug
    directory = Path(directory)
    wanted = {"config": dataclasses.asdict(cfg), "seed": seed,
              **({"trained_on": trained_on} if trained_on else {})}
    if (directory / META_FILE).exists():
        meta = json_object(directory / META_FILE)
        was = meta.get("trained_on")
        if trained_on and isinstance(was, dict) and was != trained_on:
            warn("reusing the tokenizer in %s, trained on other data: %s; a new "
                 "data.tokenizer.path (or run directory) trains one on this data",
                 directory, ", ".join(f"{k}={was.get(k)!r} (now {v!r})"
                                      for k, v in trained_on.items() if was.get(k) != v))
        made = meta.get("config")
        check_spelling(made, cfg, directory)
        made = made or {}
        # path says where the tokenizer lives, not how it was made: pointing at it is no change;
        # nor are user symbols the tokenizer has and this run does not use
        differ = sorted(k for k, v in wanted["config"].items()
                        if k in made and made[k] != v and k != "path"
                        and not (k == "user_symbols" and set(v) <= set(made[k])))
        if differ:
            changes = ", ".join(f"{k}={made[k]!r} (now {wanted['config'][k]!r})" for k in differ)
            warn("reusing the tokenizer in %s, trained with different settings: %s",
                 directory, changes)
        tok = Tokenizer.load(directory)
        require_symbols(tok, cfg.user_symbols,
                        f"the tokenizer in {directory} (data.tokenizer.path, or the run's own)",
                        "retrain it: set data.tokenizer.path to a new directory")
        log.info("reusing the tokenizer in %s (%s, %s pieces)", directory,
                 "joint" if tok.joint else "separate",
                 tok.src_vocab_size if tok.joint else f"{tok.src_vocab_size}/{tok.tgt_vocab_size}")
        return tok
    if shared and placed_by_hand(directory):
        tok = Tokenizer.load(directory)
        require_symbols(tok, cfg.user_symbols, f"the SentencePiece model in {directory} "
                        "(data.tokenizer.path)", "give a model that has it, or a new "
                        "data.tokenizer.path to train one")
        log.info("using the SentencePiece model in %s as it is (no %s: the settings it was "
                 "trained with are not known; %s pieces)", directory, META_FILE,
                 tok.src_vocab_size if tok.joint else f"{tok.src_vocab_size}/{tok.tgt_vocab_size}")
        return tok
    start = time.perf_counter()
    src, tgt = texts()
    tok = train_tokenizer(src, tgt, cfg, seed)
    require_symbols(tok, cfg.user_symbols, "the tokenizer just trained",
                    "choose another data.tag")  # the normalizer may have rewritten one
    del src, tgt
    _release_memory()
    seconds = time.perf_counter() - start
    tok.save(directory, {**wanted, "seconds": round(seconds, 1)})
    log.info("trained SentencePiece %s (%s, %d pieces) in %.1f s -> %s", cfg.model_type,
             "joint" if tok.joint else "separate", tok.src_vocab_size, seconds, directory)
    return tok
