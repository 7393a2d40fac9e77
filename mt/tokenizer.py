"""SentencePiece tokenization: train, save, load, encode, decode.

A tokenizer is one SentencePiece model (joint vocabulary, needed to tie source and target
embeddings) or two (separate vocabularies). Every model `mt` trains uses the same special ids, so
the model code can rely on them: pad=0, unk=1, bos=2, eos=3 (see ``mt.config``).

The serialized models travel inside every checkpoint (``Tokenizer.to_state`` /
``Tokenizer.from_state``): a trained model cannot meet the wrong vocabulary. This module knows
nothing of torch.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TokenizerConfig

log = logging.getLogger(__name__)

META_FILE = "tokenizer.json"


class Tokenizer:
    """Source and target SentencePiece processors (the same object when the vocabulary is joint)."""

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None = None) -> None:
        self.src_proto = src_proto
        self.tgt_proto = tgt_proto
        self.src = spm.SentencePieceProcessor(model_proto=src_proto)
        self.tgt = self.src if tgt_proto is None else spm.SentencePieceProcessor(model_proto=tgt_proto)
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

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids end with EOS so that every sentence, even an empty one, has a real token."""
        return [ids + [EOS_ID] for ids in self.src.encode(texts)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids without BOS/EOS; the data collator adds them (BOS for input, EOS for output)."""
        return self.tgt.encode(texts)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        return self.tgt.decode(ids)

    def to_state(self) -> dict:
        return {"src": self.src_proto, "tgt": self.tgt_proto}

    @classmethod
    def from_state(cls, state: dict) -> Tokenizer:
        return cls(state["src"], state.get("tgt"))

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.joint:
            (directory / "spm.model").write_bytes(self.src_proto)
        else:
            (directory / "src.model").write_bytes(self.src_proto)
            (directory / "tgt.model").write_bytes(self.tgt_proto)
        meta = {"joint": self.joint, "src_vocab_size": self.src_vocab_size,
                "tgt_vocab_size": self.tgt_vocab_size}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        directory = Path(directory)
        if (directory / "spm.model").exists():
            return cls((directory / "spm.model").read_bytes())
        if (directory / "src.model").exists() and (directory / "tgt.model").exists():
            return cls((directory / "src.model").read_bytes(), (directory / "tgt.model").read_bytes())
        raise FileNotFoundError(
            f"{directory}: no SentencePiece model (expected spm.model, or src.model and tgt.model)"
        )


def _sample(texts: Iterable[str], size: int, seed: int) -> Iterator[str]:
    """Reservoir sample of ``size`` non-empty lines, so huge corpora train in bounded memory."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    for i, line in enumerate(t for t in texts if t.strip()):
        if len(reservoir) < size:
            reservoir.append(line)
        else:
            j = rng.randint(0, i)
            if j < size:
                reservoir[j] = line
    return iter(reservoir)


def _train_one(texts: Iterable[str], cfg: TokenizerConfig, vocab_size: int, seed: int) -> bytes:
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sample(texts, cfg.input_sentence_size, seed),
        model_writer=model,
        model_type=cfg.model_type,
        vocab_size=vocab_size,
        character_coverage=cfg.character_coverage,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        # An 8k vocabulary on a small corpus may be more than the text supports; shrink instead of
        # failing (SentencePiece picks the largest size it can).
        hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return model.getvalue()


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
    if cfg.model_type not in ("unigram", "bpe"):
        raise ValueError(f"data.tokenizer.model_type must be unigram or bpe, got {cfg.model_type!r}")
    if cfg.joint:
        def both() -> Iterator[str]:
            yield from src_texts
            yield from tgt_texts

        return Tokenizer(_train_one(both(), cfg, cfg.vocab_size, seed))
    return Tokenizer(
        _train_one(src_texts, cfg, cfg.vocab_size, seed),
        _train_one(tgt_texts, cfg, cfg.vocab_size, seed),
    )
