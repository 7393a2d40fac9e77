"""Parallel corpora: read (hub or local files), check, filter, encode, and batch by tokens.

Reading goes through Hugging Face ``datasets`` so that a corpus is turned into Arrow files once and
memory-mapped afterwards: local files become a dataset with ``Dataset.from_generator`` (cached,
keyed by the files' paths, sizes and modification times), hub corpora come from ``load_dataset``.

Local layouts (``data.format``), each optionally gzip-compressed (``.gz``):
- ``text``: Moses-style ``{dir}/{split}.{src_lang}`` and ``{dir}/{split}.{tgt_lang}``, line by line;
- ``tsv``: ``{dir}/{split}.tsv``, ``source<TAB>target`` per line;
- ``jsonl``: ``{dir}/{split}.jsonl``, ``{"translation": {src_lang: ..., tgt_lang: ...}}`` or
  ``{src_lang: ..., tgt_lang: ...}`` per line.

Bad input stops with the file and line: line counts that differ, invalid UTF-8, a TSV line without
a tab, a JSON line that does not parse.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, DataConfig, FilterConfig

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


def _open_text(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, "rb")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 ({err.reason} at byte {err.start})") from None


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


def read_pairs(files: str, fmt: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    """Yields {"src": str, "tgt": str} per line, checking every line (see the module docstring).

    ``files`` is one path, or the source and target paths joined by a newline (a string, because
    ``Dataset.from_generator`` would shard a list across workers).
    """
    paths = [Path(f) for f in files.split("\n")]
    if fmt == "text":
        src_path, tgt_path = paths
        with _open_text(src_path) as fs, _open_text(tgt_path) as ft:
            lineno = 0
            for lineno, (s, t) in enumerate(zip(fs, ft), start=1):  # noqa: B905 (checked below)
                yield {"src": _decode(s, src_path, lineno), "tgt": _decode(t, tgt_path, lineno)}
            rest_s, rest_t = fs.readline(), ft.readline()
            if rest_s or rest_t:
                longer, shorter = (src_path, tgt_path) if rest_s else (tgt_path, src_path)
                raise DataError(
                    f"{longer}:{lineno + 1}: line counts differ: {shorter} ends after "
                    f"{lineno} lines, {longer} goes on"
                )
        return
    (path,) = paths
    with _open_text(path) as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            if fmt == "tsv":
                if "\t" not in line:
                    raise DataError(f"{path}:{lineno}: no tab between source and target")
                src, tgt = line.split("\t", 1)
                yield {"src": src, "tgt": tgt}
            else:
                try:
                    obj = json.loads(line)
                    obj = obj.get("translation", obj)
                    yield {"src": obj[src_lang], "tgt": obj[tgt_lang]}
                except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
                    raise DataError(
                        f"{path}:{lineno}: expected a JSON object with {src_lang!r} and "
                        f"{tgt_lang!r} (optionally under 'translation'): {err}"
                    ) from None


def load_split(cfg: DataConfig, split: str):
    """A ``datasets.Dataset`` with string columns ``src`` and ``tgt`` for one split."""
    import datasets

    datasets.disable_progress_bars()  # our own progress goes to stderr; theirs is noise here
    if cfg.source == "hub":
        if not cfg.hub_name:
            raise ValueError("data.hub_name must name a dataset when data.source=hub")
        try:
            ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split)
        except (ConnectionError, OSError) as err:
            raise RuntimeError(
                f"could not load {cfg.hub_name}/{cfg.hub_config} split {split!r} from the Hugging "
                f"Face hub (offline? {type(err).__name__}); download it where there is internet, "
                "or point data.source=files at local files"
            ) from None
        s, t = cfg.src_lang, cfg.tgt_lang
        return ds.map(lambda ex: {"src": ex["translation"][s], "tgt": ex["translation"][t]},
                      remove_columns=ds.column_names)
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
            fingerprint=_fingerprint(stamp),
        )
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, DataError):  # the user's problem, with file and line
            raise err.__cause__ from None
        raise


def _fingerprint(obj) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


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
        return self.total - self.empty - self.too_short - self.too_long - self.ratio - self.duplicate

    def __str__(self) -> str:
        return (f"kept {self.kept:,} of {self.total:,} pairs (dropped: empty {self.empty:,}, "
                f"too short {self.too_short:,}, too long {self.too_long:,}, length ratio "
                f"{self.ratio:,}, duplicate {self.duplicate:,})")


def filter_pairs(src: list[str], tgt: list[str], src_ids: list[list[int]],
                 tgt_ids: list[list[int]], cfg: FilterConfig) -> tuple[list[int], FilterReport]:
    """Indices of the pairs that pass every rule, and the count each rule dropped.

    Lengths are in subword tokens (source without its EOS). Rules apply in order: empty side,
    min length, max length, length ratio, exact duplicate; a pair is counted by the first rule
    that drops it.
    """
    report = FilterReport(total=len(src))
    seen: set[int] = set()
    keep = []
    for i, (s_ids, t_ids) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        ls, lt = len(s_ids) - 1, len(t_ids)
        if not src[i].strip() or not tgt[i].strip():
            report.empty += 1
        elif min(ls, lt) < cfg.min_tokens:
            report.too_short += 1
        elif max(ls, lt) > cfg.max_tokens:
            report.too_long += 1
        elif cfg.max_ratio > 0 and max(ls, lt) > cfg.max_ratio * max(1, min(ls, lt)):
            report.ratio += 1
        else:
            if cfg.dedup:
                key = hash((src[i], tgt[i]))
                if key in seen:
                    report.duplicate += 1
                    continue
                seen.add(key)
            keep.append(i)
    return keep, report


def token_batches(src_lens: list[int], tgt_lens: list[int], max_tokens: int, seed: int,
                  epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Length-bucketed batches whose padded size stays under ``max_tokens``.

    Pairs are sorted by length (random tie-break), cut into batches where
    ``batch_size * longest side <= max_tokens`` (a pair longer than the budget gets a batch of its
    own), and the batch order is shuffled. Deterministic for (seed, epoch).

    Returns:
        lists of pair indices.
    """
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(src_lens)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: (max(src_lens[i], tgt_lens[i] + 1), src_lens[i]))
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        size = max(src_lens[i], tgt_lens[i] + 1)  # +1: BOS on the input / EOS on the output
        if batch and (len(batch) + 1) * max(longest, size) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, size)
    if batch:
        batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


def shard_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches: every world_size-th, with the tail dropped so all ranks step together."""
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
    return (pad(src_ids), pad([[BOS_ID] + t for t in tgt_ids]), pad([t + [EOS_ID] for t in tgt_ids]))


def read_lines(path: str | os.PathLike) -> list[str]:
    """A text file's lines (UTF-8, checked), without line endings."""
    path = _find(Path(path))
    with _open_text(path) as f:
        return [_decode(raw, path, i) for i, raw in enumerate(f, start=1)]
