"""The training corpus as ``mt-train`` uses it: text read (``mt.data``), a tokenizer trained or
reused (``mt.tokenizer``), pairs encoded once into cached Arrow files, filtered, and cut into
token batches (``mt.batching``); under ``torchrun`` rank 0 does each of these first and the other
ranks find the caches it wrote.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from array import array
from pathlib import Path

import numpy as np
import torch

from mt.batching import EncodedPairs, encode_split, has_text_pair, token_batches
from mt.config import TokenizerConfig, TrainConfig
from mt.config_checks import SetupRefused
from mt.data import (
    data_identity,
    load_split,
    load_train,
    sample_texts,
    tokenizer_config,
    tokenizer_dir,
)
from mt.distributed import barrier
from mt.tokenizer import Tokenizer, load_or_train, place, require_symbols

log = logging.getLogger("mt.train")


class Corpus:
    """Training pairs encoded once into cached Arrow files, and raw valid text.

    Rank 0 reads the text, trains (or reuses) the tokenizer and encodes first; the other ranks then
    find all of it in the caches. Only per-pair lengths live in memory (``src_lens`` with EOS,
    ``tgt_lens`` without BOS/EOS, both ``array('i')``); ``collate`` gathers a batch's ids from the
    memory-mapped Arrow table: 4.5M WMT-sized pairs hold about 110 MB (docs/benchmarks.md).
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, rank: int, world: int,
                 tokenizer: Tokenizer | None = None, origin: str = "") -> None:
        """``tokenizer``: the one the run's model was made with (``origin`` names that model: a
        resumed run's last.pt or ``init_from``), instead of one found or trained by the config."""
        from dataclasses import replace

        from mt.subwords import SampledPairs, candidate_processes

        data = cfg.data
        if rank != 0:
            barrier(world)  # rank 0 fills the caches first
        if data.source == "demo" and rank == 0:
            from mt.demo import write_demo_corpus

            write_demo_corpus(data.dir)
        tok_cfg = tokenizer_config(data)
        train, sizes = load_train(data, sizes=True)
        self.tokenizer = self._tokenizer(cfg, tok_cfg, run_dir, train, tokenizer, origin, rank)
        rules = data.filter
        if rules.max_tokens >= cfg.model.max_positions:  # longer pairs would not fit the model
            rules = replace(rules, max_tokens=cfg.model.max_positions - 1)
        start = time.perf_counter()
        tag_id = self.tokenizer.symbol_id(data.tag) if data.tagged else None
        encoded = encode_split(train, self.tokenizer, data.num_proc or None, tag_id)
        self.pairs = EncodedPairs(encoded, rules)
        if rank == 0:
            log.info("training data %s: %s (encoded and filtered in %.1f s)",
                     data.hub_name if data.source == "hub" else data.dir, self.pairs.report,
                     time.perf_counter() - start)
            if tag_id is not None:  # of the pairs kept: counted before the filters, it was not
                # the number trained on
                log.info("data.tagged: %s of the %s training pairs kept have sources tagged %s "
                         "(splits %s)", f"{count_tagged(encoded, self.pairs.rows, tag_id):,}",
                         f"{len(self.pairs):,}", data.tag, ", ".join(data.tagged))
            barrier(world)
        if not len(self.pairs):
            capped = rules.max_tokens < data.filter.max_tokens and self.pairs.report.too_long
            name = data.hub_name if data.source == "hub" else data.dir
            raise SetupRefused(f"no training pair of {name} survived filtering "
                             f"({self.pairs.report}); see data.filter" + (
                                 f" and model.max_positions={cfg.model.max_positions}, which "
                                 f"lets no pair be longer than {rules.max_tokens} tokens"
                                 if capped else ""))
        if data.subword_alpha > 0:
            start, kept = time.perf_counter(), train.select(self.pairs.rows)
            symbols = [self.tokenizer.symbol_id(u) for u in tok_cfg.user_symbols]
            self.pairs = SampledPairs(self.pairs, kept["src"], kept["tgt"], self.tokenizer,
                                      data.subword_alpha, data.subword_nbest, rules.max_tokens,
                                      symbols, candidate_processes(data.num_proc, world))
            if rank == 0:
                log.info("subword regularization: alpha %g over the %d best segmentations, "
                         "%.1f candidates per sentence on average (found in %.1f s)",
                         data.subword_alpha, data.subword_nbest,
                         len(self.pairs.src.scores) / len(self.pairs), time.perf_counter() - start)
        self.digest = pairs_digest(self.pairs)
        self.mix = None
        if data.upsample:
            names = data.train.split("+")
            self.mix = Mix(self.pairs.rows, sizes, [data.upsample.get(s, 1.0) for s in names])
            if rank == 0:
                log.info("data.upsample: %s; %s", ", ".join(
                    f"{s} x{f:g} ({n:,} pairs)" for s, f, n in zip(
                        names, self.mix.factors, self.mix.kept, strict=True)),
                    self.mix.describe_size())
        # (sources, targets) of data.valid, then of each of data.extra_valid's splits
        self.valid: dict[str, tuple[list[str], list[str]]] = {}
        for split in [data.valid, *data.extra_valid]:
            valid = load_split(data, split)
            n = data.max_valid_sentences or len(valid)
            self.valid[split] = list(valid["src"][:n]), list(valid["tgt"][:n])
            if not has_text_pair(self.tokenizer, *self.valid[split]):
                # else a BLEU of 0 at every validation, and trainer.patience ends the run
                key = "data.valid" if split == data.valid else "data.extra_valid"
                raise SetupRefused(f"{key}: split {split!r} has no pair with text on both "
                                   f"sides (of {len(self.valid[split][0])}), so nothing to "
                                   "validate on")

    @staticmethod
    def _tokenizer(cfg: TrainConfig, tok_cfg: TokenizerConfig, run_dir: Path, train,
                   given: Tokenizer | None, origin: str, rank: int = 0) -> Tokenizer:
        """data.tokenizer.path (trained there if empty) or run_dir/tokenizer, reused if complete;
        ``given`` is written there instead (or checked against the one there)."""
        seed = cfg.trainer.seed
        directory = tokenizer_dir(tok_cfg, run_dir)
        if given is not None:  # checked before it is placed, so that a mistake leaves nothing
            require_symbols(given, tok_cfg.user_symbols, f"the tokenizer of {origin}",
                            "the model was trained without it")
            return place(directory, given, origin, shared=bool(tok_cfg.path))
        return load_or_train(
            directory,
            lambda: sample_texts(train, tok_cfg.input_sentence_size, seed, tok_cfg.joint),
            tok_cfg, seed, data_identity(cfg.data), loud=rank == 0, shared=bool(tok_cfg.path))

    @property
    def src_lens(self) -> array:
        """Source lengths (with EOS) of the pairs that ``batches`` last indexed (see tgt_lens)."""
        return self._src_lens if self.mix is not None else self.pairs.src_lens

    @property
    def tgt_lens(self) -> array:
        """Target lengths (without BOS/EOS) of the pairs that ``batches`` last indexed: with
        subword regularization, of that epoch's segmentations; with ``data.upsample``, of that
        epoch's mix."""
        return self._tgt_lens if self.mix is not None else self.pairs.tgt_lens

    def batches(self, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        """The epoch's batches of pair indices (deterministic for seed and epoch)."""
        if self.mix is None:
            return self.pairs.batches(max_tokens, seed, epoch)
        self.pairs.draw(seed, epoch)
        self._index = self.mix.epoch(seed, epoch)
        src = np.frombuffer(self.pairs.src_lens, np.int32)[self._index]
        tgt = np.frombuffer(self.pairs.tgt_lens, np.int32)[self._index]
        # array('i'), as without a mix: indexing gives plain ints
        self._src_lens, self._tgt_lens = array("i", src.tobytes()), array("i", tgt.tobytes())
        return token_batches(src, tgt, max_tokens, seed, epoch)

    def collate(self, batch: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pairs.collate(batch if self.mix is None else self._index[batch])


def count_tagged(encoded, rows: np.ndarray, tag_id: int) -> int:
    """How many of the pairs ``rows`` of an encoded split (``encode_split``) have a source that
    starts with the token ``tag_id``: one pass over the first ids in Arrow."""
    import pyarrow.compute as pc

    first = pc.list_element(encoded.data.column("src_ids"), 0).to_numpy()
    return int(np.count_nonzero(first[rows] == tag_id))


def pairs_digest(pairs) -> str:
    """A hash of which rows were kept and their (best-segmentation) lengths: what an epoch's
    batches are cut from. A resumed run compares it with its last.pt's, since a position in the
    middle of an epoch means nothing in a list cut from other pairs (a training file edited
    since, say): the rest of the epoch would repeat some pairs and skip others."""
    digest = hashlib.blake2b(digest_size=16)
    for values in (pairs.rows, pairs.src_lens, pairs.tgt_lens):
        digest.update(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return digest.hexdigest()


class Mix:
    """The pairs of an epoch when ``data.upsample`` weighs the splits of ``data.train``.

    A split's factor f puts each of its kept pairs int(f) times in the epoch, and an
    (f - int(f)) share of them once more: the epoch's stretch of an endless stream of shuffled
    passes through the split, so that every pair of it comes once before any comes twice (0.25:
    the whole split over 4 epochs, as a quarter a time). Independent draws each epoch left a
    third of it unseen after those 4 epochs and gave another third twice. Each epoch takes
    floor((e + 1) x share x n) - floor(e x share x n) of the n pairs: f pairs per epoch on
    average, even where that is below one pair. Everything follows from (seed, epoch), so a
    resumed run sees the mix it would have seen. Indices are those of the filtered pairs
    (``EncodedPairs``).
    """

    def __init__(self, rows: np.ndarray, sizes: list[int], factors: list[float]) -> None:
        """``rows``: each kept pair's row in the joined splits, whose sizes are ``sizes``."""
        split = np.searchsorted(np.cumsum(sizes), rows, side="right")
        self.groups = [np.flatnonzero(split == s) for s in range(len(sizes))]
        self.factors = factors
        self.kept = [len(g) for g in self.groups]

    @staticmethod
    def _share(group: np.ndarray, factor: float) -> float:
        """Pairs of ``group`` an epoch's fractional share takes on average; rounded, as 2.3 - 2
        is 0.2999...: 2 pairs of 10, not 3, in the first epoch."""
        return round((factor - int(factor)) * len(group), 9)

    def describe_size(self) -> str:
        """The pairs an epoch holds, for the log: a fractional factor's share takes the floor or
        the ceiling of its average, so the count varies by epoch; epoch 0's, which the log gave,
        was not the count of the others."""
        whole = sum(int(f) * len(g) for g, f in zip(self.groups, self.factors, strict=True))
        shares = [self._share(g, f) for g, f in zip(self.groups, self.factors, strict=True)]
        low = whole + sum(math.floor(s) for s in shares)
        high = whole + sum(math.ceil(s) for s in shares)
        if low == high:
            return f"{low:,} pairs an epoch"
        return (f"{whole + sum(shares):,.2f} pairs an epoch on average (between {low:,} and "
                f"{high:,})")

    def epoch(self, seed: int, epoch: int) -> np.ndarray:
        """(N,) pair indices of the epoch, a pair repeated as its split's factor says."""
        parts = []
        for index, (group, factor) in enumerate(zip(self.groups, self.factors, strict=True)):
            parts += [group] * int(factor)
            per_epoch = self._share(group, factor)
            start, stop = (math.floor(e * per_epoch) for e in (epoch, epoch + 1))
            if stop > start:
                parts.append(np.sort(self._passes(group, seed, index, start, stop)))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @staticmethod
    def _passes(group: np.ndarray, seed: int, split: int, start: int, stop: int) -> np.ndarray:
        """Items ``start:stop`` of the stream of shuffled passes through ``group``: pass k is a
        permutation drawn from (seed, split, k), apart from token_batches' stream."""
        n, out = len(group), []
        for k in range(start // n, (stop - 1) // n + 1):
            order = np.random.default_rng([abs(seed), 2, split, k]).permutation(n)
            out.append(group[order[max(start - k * n, 0) : min(stop - k * n, n)]])
        return np.concatenate(out)
