"""Parallel corpora: read (hub or local files), check, encode once, filter, and batch by tokens.

Reading goes through Hugging Face ``datasets`` so that a corpus is turned into Arrow files once and
memory-mapped afterwards: local files become a dataset with ``Dataset.from_generator`` (cached,
keyed by the files' paths, sizes and modification times), hub corpora come from ``load_dataset``
(or ``load_from_disk`` when ``data.hub_name`` is a directory written by ``save_to_disk``).

Hub corpora (``data.source=hub``) are in the ``translation`` format (one struct column keyed by
language, e.g. ``wmt/wmt14`` with ``hub_config=de-en``; see ``conf/data/wmt14_en_de.yaml``) or have
one string column per language. The first run downloads into the ``datasets`` cache
(``HF_DATASETS_CACHE``); later runs, also with ``HF_HUB_OFFLINE=1``, read the cache. Offline and
uncached, loading stops with one sentence saying so (set ``HF_HUB_OFFLINE=1`` on a machine without
internet, or ``datasets`` waits on network timeouts first). A directory written by
``save_to_disk`` or a folder of data files also works as ``hub_name``.

Local layouts (``data.format``), each optionally gzip-compressed (``.gz``):
- ``text``: Moses-style ``{dir}/{split}.{src_lang}`` and ``{dir}/{split}.{tgt_lang}``, line by line;
- ``tsv``: ``{dir}/{split}.tsv``, ``source<TAB>target`` per line (exactly one tab);
- ``jsonl``: ``{dir}/{split}.jsonl``, ``{"translation": {src_lang: ..., tgt_lang: ...}}`` or
  ``{src_lang: ..., tgt_lang: ...}`` per line (blank lines are skipped).

Bad input stops with the file and line: line counts that differ, invalid UTF-8, a TSV line without
exactly one tab, a JSON line that does not parse or lacks a language.

Training pairs are encoded once with ``Dataset.map`` (batched, several processes) into cached Arrow
columns of token ids; the cache key is the text's fingerprint plus the tokenizer's, so a second run
reads them back. Only per-pair lengths stay in memory; a batch's ids are gathered from the
memory-mapped table when it is collated (``EncodedPairs``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import pickle
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, DataConfig, FilterConfig

log = logging.getLogger(__name__)

ENCODE_VERSION = "mt-encode-1"  # bump when the encoded columns change, to invalidate old caches


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


# ----------------------------------------------------------------------------- reading


def _open_text(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, "rb")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 ({err.reason} at byte {err.start})"
                        ) from None


def _find(path: Path) -> Path:
    """The path itself, or its .gz sibling."""
    if path.exists():
        return path
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return gz
    raise FileNotFoundError(f"{path}: no such file (nor {gz.name})")


def split_files(cfg: DataConfig, split: str) -> list[Path]:
    """The local file(s) that hold a split."""
    base = Path(cfg.dir) / split
    if cfg.format == "text":
        return [_find(base.with_name(f"{split}.{cfg.src_lang}")),
                _find(base.with_name(f"{split}.{cfg.tgt_lang}"))]
    if cfg.format in ("tsv", "jsonl"):
        return [_find(base.with_name(f"{split}.{cfg.format}"))]
    raise ValueError(f"data.format must be text, tsv or jsonl, got {cfg.format!r}")


def _lines(path: Path) -> Iterator[bytes]:
    """Raw lines; a broken gzip stream becomes a DataError naming the file."""
    with _open_text(path) as f:
        try:
            yield from f
        except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
            raise DataError(f"{path}: cannot read ({err})") from None


def read_pairs(files: str, fmt: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    """Yields {"src": str, "tgt": str} per line, checking every line (see the module docstring).

    ``files`` is one path, or the source and target paths joined by a newline (a string, because
    ``Dataset.from_generator`` would shard a list across workers).
    """
    paths = [Path(f) for f in files.split("\n")]
    if fmt == "text":
        src_path, tgt_path = paths
        pairs = zip_longest(_lines(src_path), _lines(tgt_path))
        for lineno, (s, t) in enumerate(pairs, start=1):
            if s is None or t is None:
                longer, shorter = (src_path, tgt_path) if t is None else (tgt_path, src_path)
                raise DataError(f"{longer}:{lineno}: line counts differ: {shorter} ends after "
                                f"{lineno - 1} lines, {longer} goes on")
            yield {"src": _decode(s, src_path, lineno), "tgt": _decode(t, tgt_path, lineno)}
        return
    (path,) = paths
    for lineno, raw in enumerate(_lines(path), start=1):
        line = _decode(raw, path, lineno)
        if fmt == "tsv":
            tabs = line.count("\t")
            if tabs != 1:
                raise DataError(f"{path}:{lineno}: expected source<TAB>target, found {tabs} tabs")
            src, tgt = line.split("\t")
            yield {"src": src, "tgt": tgt}
        elif line.strip():
            try:
                obj = json.loads(line)
                obj = obj.get("translation", obj)
                src, tgt = obj[src_lang], obj[tgt_lang]
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
                raise DataError(f"{path}:{lineno}: expected a JSON object with {src_lang!r} and "
                                f"{tgt_lang!r} (optionally under 'translation'): {err!r}") from None
            if not isinstance(src, str) or not isinstance(tgt, str):
                raise DataError(f"{path}:{lineno}: {src_lang!r} and {tgt_lang!r} must be strings")
            yield {"src": src, "tgt": tgt}


def load_split(cfg: DataConfig, split: str, cache_dir: str | None = None):
    """A ``datasets.Dataset`` with string columns ``src`` and ``tgt`` for one split.

    ``cache_dir`` overrides the ``datasets`` cache (``HF_DATASETS_CACHE``) for local files.
    """
    import datasets

    datasets.disable_progress_bars()  # our own progress goes to stderr; theirs is noise here
    if cfg.source == "hub":
        return _load_hub(cfg, split, cache_dir)
    if cfg.source not in ("files", "demo"):
        raise ValueError(f"data.source must be demo, files or hub, got {cfg.source!r}")
    files = split_files(cfg, split)
    # Dataset.from_generator caches by its arguments: include size and mtime, so edited files are
    # read again while unchanged ones come straight from the Arrow cache.
    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    try:
        return datasets.Dataset.from_generator(
            read_pairs,
            gen_kwargs={"files": "\n".join(str(p) for p in files), "fmt": cfg.format,
                        "src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang},
            features=datasets.Features({"src": datasets.Value("string"),
                                        "tgt": datasets.Value("string")}),
            fingerprint=_hash([stamp, cfg.format, cfg.src_lang, cfg.tgt_lang]),
            cache_dir=cache_dir,
        )
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, DataError):  # the user's problem, with file and line
            raise err.__cause__ from None
        raise


def _load_hub(cfg: DataConfig, split: str, cache_dir: str | None):
    """A hub dataset (``translation`` column, or one column per language) as src/tgt columns."""
    import datasets

    if not cfg.hub_name:
        raise ValueError("data.hub_name must name a dataset when data.source=hub")
    name = f"{cfg.hub_name}" + (f" ({cfg.hub_config})" if cfg.hub_config else "")
    local = Path(cfg.hub_name)
    try:
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            ds = datasets.load_from_disk(str(local))  # written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{local} has splits {sorted(ds)}, not {split!r}: set "
                                     "data.train / data.valid / data.test")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split,
                                       cache_dir=cache_dir)
    except ConnectionError as err:
        raise RuntimeError(
            f"could not reach the Hugging Face hub for {name} ({err}); download it once with "
            "internet (the datasets cache keeps it; HF_HUB_OFFLINE=1 then reads the cache) or use "
            "data.source=files"
        ) from None
    except FileNotFoundError as err:
        raise FileNotFoundError(f"data.hub_name={cfg.hub_name}: {err}") from None
    s, t = cfg.src_lang, cfg.tgt_lang
    if "translation" in ds.column_names:
        ds = ds.select_columns(["translation"]).flatten()
        s_col, t_col = f"translation.{s}", f"translation.{t}"
    else:
        s_col, t_col = s, t
    missing = [c for c in (s_col, t_col) if c not in ds.column_names]
    if missing:
        raise ValueError(f"{name} split {split!r} has columns {ds.column_names}, not {missing}: "
                         "check data.src_lang and data.tgt_lang")
    return ds.select_columns([s_col, t_col]).rename_columns({s_col: "src", t_col: "tgt"})


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def read_lines(path: str | os.PathLike) -> list[str]:
    """A text file's lines (UTF-8, checked), without line endings."""
    path = _find(Path(path))
    return [_decode(raw, path, i) for i, raw in enumerate(_lines(path), start=1)]


# ----------------------------------------------------------------------------- encoding


def pair_hash(src: str, tgt: str) -> int:
    """A 64-bit hash of a pair, the same in every process (unlike ``hash``), for deduplication."""
    key = f"{len(src)}:{src}\t{tgt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


class EncodeBatch:
    """``Dataset.map`` function: text to ids, plus what the filters need.

    Picklable for worker processes: it carries the serialized SentencePiece models and builds the
    processors lazily in each worker (a ``SentencePieceProcessor`` itself does not pickle).
    ``threads`` is SentencePiece's own parallelism per call (-1: all cores); with several worker
    processes, one each avoids oversubscribing the cores.
    """

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None, threads: int = -1) -> None:
        self.protos = (src_proto, tgt_proto)
        self.threads = threads
        self._tokenizer = None

    def __getstate__(self) -> dict:
        return {"protos": self.protos, "threads": self.threads, "_tokenizer": None}

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list]:
        if self._tokenizer is None:
            from mt.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(*self.protos)
        src, tgt = batch["src"], batch["tgt"]
        tok = self._tokenizer
        return {
            "src_ids": tok.src.encode(src, add_eos=True, num_threads=self.threads),
            "tgt_ids": tok.tgt.encode(tgt, num_threads=self.threads),
            "empty": [not s.strip() or not t.strip() for s, t in zip(src, tgt, strict=True)],
            "pair_hash": [pair_hash(s, t) for s, t in zip(src, tgt, strict=True)],
        }


def default_num_proc(rows: int) -> int:
    """Encoding processes: one for small corpora (start-up would dominate), else the cores."""
    if rows < 200_000:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 16))


def encode_split(ds, tokenizer, num_proc: int | None = None):
    """Encodes a src/tgt dataset into cached columns src_ids, tgt_ids, empty, pair_hash.

    The text columns are dropped (the filters only need the lengths, the empty flags and the
    hashes). Ids are stored as uint16 when the vocabulary allows, else int32. The cache key is
    derived from the input's fingerprint and the tokenizer's, so the same text and tokenizer are
    encoded once, in whatever run comes first.
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
        EncodeBatch(tokenizer.src_proto, tokenizer.tgt_proto, threads=1 if num_proc > 1 else -1),
        batched=True,
        batch_size=2000,
        writer_batch_size=10_000,  # fewer, larger record batches: faster row gathers later
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=_hash([ds._fingerprint, tokenizer.fingerprint, ENCODE_VERSION]),
        desc="encoding",
    )


def sample_texts(ds, size: int, seed: int, joint: bool) -> tuple[list[str], list[str]]:
    """A random sample of rows for SentencePiece training, read by index (no full pass).

    Joint vocabularies get ``size // 2`` rows of each side, so both languages together give
    ``size`` sentences (as ``TokenizerConfig.input_sentence_size`` means).
    """
    rows = size // 2 if joint else size
    if ds.cache_files:
        # A private memory map (unpickling re-opens the Arrow files): the pages the sample touches,
        # most of a big corpus, leave the resident set with it instead of staying mapped.
        ds = pickle.loads(pickle.dumps(ds))
    if rows < len(ds):
        rng = np.random.default_rng(seed)
        ds = ds.select(np.sort(rng.choice(len(ds), size=rows, replace=False)))
    return list(ds["src"]), list(ds["tgt"])


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

    @property
    def kept(self) -> int:
        dropped = self.empty + self.too_short + self.too_long + self.ratio + self.duplicate
        return self.total - dropped

    def __str__(self) -> str:
        return (f"kept {self.kept:,} of {self.total:,} pairs (dropped: empty {self.empty:,}, "
                f"too short {self.too_short:,}, too long {self.too_long:,}, length ratio "
                f"{self.ratio:,}, duplicate {self.duplicate:,})")


def filter_lengths(src_lens: np.ndarray, tgt_lens: np.ndarray, empty: np.ndarray,
                   hashes: np.ndarray | None, cfg: FilterConfig) -> tuple[np.ndarray, FilterReport]:
    """Indices (ascending) of the pairs that pass every rule, and the count each rule dropped.

    Args:
        src_lens: (N,) source lengths in subword tokens, without EOS.
        tgt_lens: (N,) target lengths in subword tokens.
        empty: (N,) True where either side is empty or only whitespace.
        hashes: (N,) ``pair_hash`` of each pair; None skips deduplication.
        cfg: the rules. They apply in order (empty side, min length, max length, length ratio,
            exact duplicate); a pair is counted by the first rule that drops it, and of duplicates
            the first occurrence is kept.
    """
    ls, lt = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
    empty = np.asarray(empty, bool)
    short, long_ = np.minimum(ls, lt), np.maximum(ls, lt)
    report = FilterReport(total=len(ls))
    alive = ~empty
    report.empty = int(empty.sum())
    for name, bad in (("too_short", short < cfg.min_tokens), ("too_long", long_ > cfg.max_tokens),
                      ("ratio", (long_ > cfg.max_ratio * np.maximum(short, 1))
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
    keep, report = filter_lengths(
        np.array([len(s) - 1 for s in src_ids], np.int64),
        np.array([len(t) for t in tgt_ids], np.int64),
        np.array([not s.strip() or not t.strip() for s, t in zip(src, tgt, strict=True)], bool),
        np.array([pair_hash(s, t) for s, t in zip(src, tgt, strict=True)], np.int64),
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
        import pyarrow.compute as pc

        table = encoded.with_format("arrow")
        src_col, tgt_col = encoded.data.column("src_ids"), encoded.data.column("tgt_ids")
        src_all = pc.list_value_length(src_col).to_numpy().astype(np.int32)
        tgt_all = pc.list_value_length(tgt_col).to_numpy().astype(np.int32)
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

    def batches(self, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        return token_batches(self.src_lens, self.tgt_lens, max_tokens, seed, epoch)

    def collate(self, batch: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(src (B, S), tgt_in (B, T), tgt_out (B, T)) for pair indices ``batch``."""
        sub = self._table[self.rows[np.asarray(batch, dtype=np.int64)]]  # a pyarrow Table
        src = _padded(sub.column("src_ids"), 0, 0)
        tgt_in = _padded(sub.column("tgt_ids"), 1, 0)
        tgt_out = _padded(sub.column("tgt_ids"), 0, 1)
        tgt_in[:, 0] = BOS_ID
        tgt_out[np.arange(len(tgt_out)), np.asarray(self._lens(sub.column("tgt_ids")))] = EOS_ID
        return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)

    @staticmethod
    def _lens(column) -> np.ndarray:
        import pyarrow.compute as pc

        return pc.list_value_length(column).to_numpy()


def _padded(column, left: int, right: int) -> np.ndarray:
    """A list column as (B, left + longest + right) int64, ids placed after ``left`` PAD slots."""
    import pyarrow.compute as pc

    lens = pc.list_value_length(column).to_numpy().astype(np.int64)
    values = pc.list_flatten(column).to_numpy()
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
    src = np.frombuffer(src_lens, np.int32) if isinstance(src_lens, array) else np.asarray(src_lens)
    tgt = np.frombuffer(tgt_lens, np.int32) if isinstance(tgt_lens, array) else np.asarray(tgt_lens)
    src, tgt = src.astype(np.int64), tgt.astype(np.int64)
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


def shard_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches: every world_size-th; the tail is dropped so all ranks step together."""
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


def pad(seqs: list[list[int]]) -> Tensor:
    """Right-pads to (B, L) with PAD."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """(src (B, S) ending in EOS, tgt_in (B, T) = BOS + y, tgt_out (B, T) = y + EOS)."""
    return (pad(src_ids), pad([[BOS_ID] + t for t in tgt_ids]),
            pad([t + [EOS_ID] for t in tgt_ids]))
