"""Encoding, filtering and batching: token ids once, cleaning rules, token-budget batches.

Training pairs are encoded once with ``Dataset.map`` (batched, several processes) into cached Arrow
columns of token ids; the cache key is the text's fingerprint plus the tokenizer's, so a second run
reads them back. Only per-pair lengths stay in memory; a batch's ids are gathered from the
memory-mapped table when it is collated (``EncodedPairs``). Reading the text is ``mt.data``'s job;
sampling other segmentations each epoch (subword regularization) is ``mt.subwords``'.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, FilterConfig
from mt.data import stable_hash

# bump when the encoded columns change, to invalidate old caches (2: ``empty`` is also a side
# that encodes to nothing, or a source to the tag alone)
ENCODE_VERSION = "mt-encode-2"


# ----------------------------------------------------------------------------- encoding


def pair_hash(src: str, tgt: str) -> int:
    """A 64-bit hash of a pair, the same in every process (unlike ``hash``), for deduplication."""
    key = f"{len(src)}:{src}\t{tgt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


def _filter_keys(src: list[str], tgt: list[str], src_ids: list[list[int]],
                 tgt_ids: list[list[int]], tag_id: int | None = None) -> dict[str, list]:
    """What the filters need of a pair: ``empty`` and ``pair_hash``.

    Empty is a side without a token of text: blank, or whatever the tokenizer's normalization
    removes (a zero-width space, U+200B, which ``str.strip`` keeps), or a source that is the
    back-translation tag ``tag_id`` alone ("<BT> " + such a text). Each was counted by no rule or
    as too short, and the tagged one passed ``data.filter.min_tokens=1`` as one token: a pair
    that taught the model to translate the tag into the target.
    """
    return {"empty": _empty(src, tgt, src_ids, tgt_ids, tag_id),
            "pair_hash": [pair_hash(s, t) for s, t in zip(src, tgt, strict=True)]}


def _empty(src: list[str], tgt: list[str], src_ids: list[list[int]], tgt_ids: list[list[int]],
           tag_id: int | None = None) -> list[bool]:
    """``_filter_keys``' ``empty``: which pairs have a side without a token of text."""
    def blank(ids: list[int], tagged: bool) -> bool:  # ids without EOS
        return not ids or (tagged and len(ids) == 1 and ids[0] == tag_id)

    return [not s.strip() or not t.strip() or blank(si[:-1], tag_id is not None)
            or blank(ti, False) for s, t, si, ti in zip(src, tgt, src_ids, tgt_ids, strict=True)]


def has_text_pair(tokenizer, src: list[str], tgt: list[str]) -> bool:
    """Whether some pair has a token of text on both sides, as the encoding finds them
    (``_filter_keys``): data.valid checks this, since a split of zero-width spaces passed
    ``str.strip`` and validated a BLEU of 0 every time. Pairs are encoded a few at a time (more
    each round) up to the first with text: all of a 100k-pair split, encoded to answer, cost
    3 to 13 s at every start."""
    texts = [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s.strip() and t.strip()]
    start, size = 0, 64
    while start < len(texts):
        chunk = texts[start:start + size]
        s, t = [src[i] for i in chunk], [tgt[i] for i in chunk]
        if not all(_empty(s, t, tokenizer.encode_src(s), tokenizer.encode_tgt(t))):
            return True
        start, size = start + size, min(size * 4, 16_384)
    return False


class EncodeBatch:
    """``Dataset.map`` function: text to ids, plus what the filters need.

    Picklable for worker processes: it carries the serialized SentencePiece models and builds the
    processors lazily in each worker (a ``SentencePieceProcessor`` itself does not pickle).
    ``threads`` is SentencePiece's own parallelism per call (-1: all cores); with several worker
    processes, one each avoids oversubscribing the cores. ``tag_id``: the back-translation tag's
    id where ``data.tagged`` is set: a source of it alone is empty (``_filter_keys``).
    """

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None, threads: int = -1,
                 tag_id: int | None = None) -> None:
        self.protos = (src_proto, tgt_proto)
        self.threads = threads
        self.tag_id = tag_id
        self._tokenizer = None

    def __getstate__(self) -> dict:
        return {"protos": self.protos, "threads": self.threads, "tag_id": self.tag_id,
                "_tokenizer": None}

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list]:
        if self._tokenizer is None:
            from mt.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(*self.protos)
        src, tgt = batch["src"], batch["tgt"]
        tok = self._tokenizer
        src_ids = tok.src.encode(src, add_eos=True, num_threads=self.threads)
        tgt_ids = tok.tgt.encode(tgt, num_threads=self.threads)
        return {"src_ids": src_ids, "tgt_ids": tgt_ids,
                **_filter_keys(src, tgt, src_ids, tgt_ids, self.tag_id)}


def default_num_proc(rows: int) -> int:
    """Encoding processes: one for small corpora (start-up would dominate), else the cores."""
    if rows < 200_000:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 16))


def encode_split(ds, tokenizer, num_proc: int | None = None, tag_id: int | None = None):
    """Encodes a src/tgt dataset into cached columns src_ids, tgt_ids, empty, pair_hash.

    The text columns are dropped (the filters only need the lengths, the empty flags and the
    hashes). Ids are stored as uint16 when the vocabulary allows, else int32. The cache key is
    derived from the input's fingerprint, the tokenizer's and ``tag_id`` (the back-translation
    tag's id where ``data.tagged`` is set: a source of it alone is empty), so the same text and
    tokenizer are encoded once, in whatever run comes first.
    """
    import datasets

    vocab = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    id_type = datasets.Value("uint16" if vocab <= 1 << 16 else "int32")
    features = datasets.Features({"src_ids": datasets.List(id_type),
                                  "tgt_ids": datasets.List(id_type),
                                  "empty": datasets.Value("bool"),
                                  "pair_hash": datasets.Value("int64")})
    num_proc = default_num_proc(len(ds)) if num_proc is None else num_proc
    return ds.map(
        EncodeBatch(tokenizer.src_proto, tokenizer.tgt_proto, threads=1 if num_proc > 1 else -1,
                    tag_id=tag_id),
        batched=True,
        batch_size=2000,
        writer_batch_size=10_000,  # fewer, larger record batches: faster row gathers later
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=stable_hash([ds._fingerprint, tokenizer.fingerprint, ENCODE_VERSION,
                                     tag_id]),
        desc="encoding",
    )

# ----------------------------------------------------------------------------- filtering


@dataclass
class FilterReport:
    """How many pairs each cleaning rule dropped (in the order the rules are applied)."""

    total: int = 0
    empty: int = 0
    too_short: int = 0
    too_long: int = 0
    ratio: int = 0
    duplicate: int = 0
    # the limits the counts are of, said beside them: data.filter.max_tokens is lowered to
    # model.max_positions - 1 where that is less, which "too long 1" alone did not say
    min_tokens: int | None = None
    max_tokens: int | None = None
    max_ratio: float | None = None

    @property
    def kept(self) -> int:
        dropped = self.empty + self.too_short + self.too_long + self.ratio + self.duplicate
        return self.total - dropped

    def __str__(self) -> str:
        short = "" if self.min_tokens is None else f" (< {self.min_tokens} tokens)"
        long_ = "" if self.max_tokens is None else f" (> {self.max_tokens} tokens)"
        ratio = ("" if self.max_ratio is None else " (off)" if self.max_ratio <= 0
                 else f" (> {self.max_ratio:g})")
        return (f"kept {self.kept:,} of {self.total:,} pairs (dropped: empty {self.empty:,}, "
                f"too short{short} {self.too_short:,}, too long{long_} {self.too_long:,}, "
                f"length ratio{ratio} {self.ratio:,}, duplicate {self.duplicate:,})")


def filter_lengths(src_lens: np.ndarray, tgt_lens: np.ndarray, empty: np.ndarray,
                   hashes: np.ndarray | None, cfg: FilterConfig) -> tuple[np.ndarray, FilterReport]:
    """Indices (ascending) of the pairs that pass every rule, and the count each rule dropped.

    Args:
        src_lens: (N,) source lengths in subword tokens, without EOS.
        tgt_lens: (N,) target lengths in subword tokens.
        empty: (N,) True where either side has no token of text (``_filter_keys``).
        hashes: (N,) ``pair_hash`` of each pair; None skips deduplication.
        cfg: the rules. They apply in order (empty side, min length, max length, length ratio,
            exact duplicate); a pair is counted by the first rule that drops it, and of duplicates
            the first occurrence is kept.
    """
    ls, lt = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
    empty = np.asarray(empty, bool)
    short, long_ = np.minimum(ls, lt), np.maximum(ls, lt)
    report = FilterReport(total=len(ls), min_tokens=cfg.min_tokens, max_tokens=cfg.max_tokens,
                          max_ratio=cfg.max_ratio)
    alive = ~empty
    report.empty = int(empty.sum())
    for name, bad in (("too_short", short < cfg.min_tokens), ("too_long", long_ > cfg.max_tokens),
                      # divided, not multiplied: long / short is rounded once, so a ratio of
                      # exactly max_ratio (115 / 100 at 1.15) is kept, as the config says
                      ("ratio", (long_ / np.maximum(short, 1) > cfg.max_ratio)
                       if cfg.max_ratio > 0 else np.zeros_like(alive))):
        dropped = alive & bad
        setattr(report, name, int(dropped.sum()))
        alive &= ~dropped
    keep = np.flatnonzero(alive)
    if cfg.dedup and hashes is not None and len(keep):
        _, first = np.unique(np.asarray(hashes)[keep], return_index=True)
        report.duplicate = len(keep) - len(first)
        keep = keep[np.sort(first)]
    return keep, report


def filter_pairs(src: list[str], tgt: list[str], src_ids: list[list[int]],
                 tgt_ids: list[list[int]], cfg: FilterConfig) -> tuple[list[int], FilterReport]:
    """``filter_lengths`` for pairs held in memory (source ids end with EOS)."""
    keys = _filter_keys(src, tgt, src_ids, tgt_ids)
    keep, report = filter_lengths(
        np.array([len(s) - 1 for s in src_ids], np.int64),
        np.array([len(t) for t in tgt_ids], np.int64),
        np.array(keys["empty"], bool),
        np.array(keys["pair_hash"], np.int64),
        cfg,
    )
    return keep.tolist(), report


class EncodedPairs:
    """The kept pairs of an encoded split: lengths in memory, ids on disk (memory-mapped Arrow).

    Pair ``i`` (0 <= i < len) is row ``rows[i]`` of the encoded dataset. ``src_lens`` (with EOS)
    and ``tgt_lens`` (without BOS/EOS) are ``array('i')``: compact, and indexing them gives plain
    Python ints.
    """

    def __init__(self, encoded, cfg: FilterConfig) -> None:
        table = encoded.with_format("arrow")
        src_all = _list_lens(encoded.data.column("src_ids")).astype(np.int32)
        tgt_all = _list_lens(encoded.data.column("tgt_ids")).astype(np.int32)
        empty = encoded.data.column("empty").to_numpy()
        hashes = encoded.data.column("pair_hash").to_numpy() if cfg.dedup else None
        keep, self.report = filter_lengths(src_all - 1, tgt_all, empty, hashes, cfg)
        del empty, hashes
        self.rows = keep.astype(np.int64)
        self.src_lens = array("i", src_all[keep].tobytes())
        self.tgt_lens = array("i", tgt_all[keep].tobytes())
        self._table = table.select_columns(["src_ids", "tgt_ids"])

    def __len__(self) -> int:
        return len(self.rows)

    def draw(self, seed: int, epoch: int) -> None:
        """Nothing to draw: one segmentation for every epoch (``SampledPairs`` draws one)."""

    def batches(self, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        return token_batches(self.src_lens, self.tgt_lens, max_tokens, seed, epoch)

    def collate(self, batch: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(src (B, S), tgt_in (B, T), tgt_out (B, T)) for pair indices ``batch``."""
        import pyarrow.compute as pc

        sub = self._table[self.rows[np.asarray(batch, dtype=np.int64)]]  # a pyarrow Table
        src, tgt = sub.column("src_ids"), sub.column("tgt_ids")
        return collate_flat(pc.list_flatten(src).to_numpy(), _list_lens(src),
                            pc.list_flatten(tgt).to_numpy(), _list_lens(tgt))


def collate_flat(src_ids: np.ndarray, src_lens: np.ndarray, tgt_ids: np.ndarray,
                 tgt_lens: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """(src, tgt_in = BOS + y, tgt_out = y + EOS) from flat ids and per-sentence lengths."""
    src = _padded(src_ids, src_lens, 0, 0)
    tgt_in = _padded(tgt_ids, tgt_lens, 1, 0)
    tgt_out = _padded(tgt_ids, tgt_lens, 0, 1)
    tgt_in[:, 0] = BOS_ID
    tgt_out[np.arange(len(tgt_out)), tgt_lens] = EOS_ID
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


def _list_lens(column) -> np.ndarray:
    """(B,) lengths of a pyarrow list column."""
    import pyarrow.compute as pc

    return pc.list_value_length(column).to_numpy()


def _padded(values: np.ndarray, lens: np.ndarray, left: int, right: int) -> np.ndarray:
    """Flat ids as (B, left + longest + right) int64, each row's ids after ``left`` PAD slots."""
    lens = np.asarray(lens, np.int64)
    out = np.full((len(lens), left + int(lens.max(initial=0)) + right), PAD_ID, dtype=np.int64)
    cols = np.arange(out.shape[1] - left - right)
    out[:, left : out.shape[1] - right][cols < lens[:, None]] = values
    return out


# ----------------------------------------------------------------------------- batching


def token_batches(src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int, seed: int,
                  epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Length-bucketed batches whose padded size stays under ``max_tokens``.

    A pair's size is ``max(src_len, tgt_len + 1)`` (+1: BOS on the input / EOS on the output).
    Pairs are sorted by size, then by ``src_len - tgt_len`` (ascending for even sizes, descending
    for odd ones, so that neighbours across a size step also have similar source *and* target
    lengths: about half the padding of sorting by source length), ties broken at random. The sorted
    list is cut greedily into batches where ``batch_size * largest size <= max_tokens`` (a pair
    larger than the budget gets a batch of its own), and the batch order is shuffled.
    Deterministic for (seed, epoch); numpy throughout, so millions of pairs take seconds.

    Returns:
        lists of pair indices.
    """
    src, tgt = _int64(src_lens), _int64(tgt_lens)
    size = np.maximum(src, tgt + 1)
    diff = np.where(size % 2 == 0, src - tgt, tgt - src)
    span = int(np.abs(diff).max(initial=0))
    key = size * (2 * span + 1) + diff + span
    rng = np.random.default_rng([abs(seed), epoch])
    if shuffle:
        perm = rng.permutation(len(key))
        order = perm[np.argsort(key[perm], kind="stable")]
    else:
        order = np.argsort(key, kind="stable")
    sizes = size[order]
    bounds, start, n = [0], 0, len(order)
    while start < n:
        # sizes are sorted, so the k-th pair of a batch is its largest: the k pairs fit while
        # k * sizes[start + k - 1] <= max_tokens, a condition that holds for a prefix of k.
        window = sizes[start : start + max(1, max_tokens // int(sizes[start]))]
        fits = np.count_nonzero(np.arange(1, len(window) + 1) * window <= max_tokens)
        start += max(1, int(fits))
        bounds.append(start)
    batches = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _int64(lens: Sequence[int]) -> np.ndarray:
    """Lengths as an int64 array; an ``array('i')`` is viewed without a Python-level copy."""
    lens = np.frombuffer(lens, np.int32) if isinstance(lens, array) else np.asarray(lens)
    return lens.astype(np.int64)


def step_batches(batches: list[list[int]], step: int, accumulation: int,
                 world: int) -> list[list[list[int]]]:
    """The batches of an epoch's optimizer step ``step`` (from 0), one list per rank: the step
    takes the next ``accumulation x world`` batches and rank r the r-th ``accumulation`` of them.
    An epoch has ``epoch_steps`` steps: its last one takes the tail that cannot fill a step (fewer
    batches than that), where a rank may get none (``Trainer.train_step`` then steps with the
    others, adding nothing), so that every pair of the epoch is trained on."""
    per_step = accumulation * world
    group = batches[step * per_step : (step + 1) * per_step]
    return [group[r * accumulation : (r + 1) * accumulation] for r in range(world)]


def epoch_steps(batches: int, accumulation: int, world: int) -> int:
    """Optimizer steps in an epoch of ``batches`` batches: the last may be partial. Leaving out
    the tail (as mt did) skipped up to ``accumulation x world - 1`` batches of every epoch, a
    share of the corpus that is large where the corpus is small and the steps large."""
    return -(-batches // (accumulation * world))


def budget_batches(lengths: Sequence[int], order: Sequence[int], budget: int
                   ) -> Iterator[list[int]]:
    """Consecutive items of ``order`` (sorted by length, longest first) in batches of at most
    ``budget`` tokens, padding included (count x the batch's longest). How decoding batches
    (translate, alignments, scoring); training uses ``token_batches``."""
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * max(lengths[i], lengths[batch[0]]) > budget:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def pad(seqs: list[list[int]]) -> Tensor:
    """Right-pads to (B, L) with PAD."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """(src (B, S) ending in EOS, tgt_in (B, T) = BOS + y, tgt_out (B, T) = y + EOS)."""
    def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
        return np.fromiter((i for s in seqs for i in s), np.int64, int(lens.sum())), lens

    return collate_flat(*flat(src_ids), *flat(tgt_ids))
