"""Parallel corpora: read them (hub or local files) and check every line.

Reading goes through Hugging Face ``datasets`` so that a corpus is turned into Arrow files once and
memory-mapped afterwards: local files become a dataset with ``Dataset.from_generator`` (cached,
keyed by the files' paths, sizes and modification times), hub corpora come from ``load_dataset``
(or ``load_from_disk`` when ``data.hub_name`` is a directory written by ``save_to_disk``).

Hub corpora (``data.source=hub``, a hub dataset, a ``save_to_disk`` directory or a folder of data
files) are read and checked by ``mt.hub``.

Local layouts (``data.format``), each optionally gzip-compressed (``.gz``):
- ``text``: Moses-style ``{dir}/{split}.{src_lang}`` and ``{dir}/{split}.{tgt_lang}``, line by line;
- ``tsv``: ``{dir}/{split}.tsv``, ``source<TAB>target`` per line (exactly one tab);
- ``jsonl``: ``{dir}/{split}.jsonl``, ``{"translation": {src_lang: ..., tgt_lang: ...}}`` or
  ``{src_lang: ..., tgt_lang: ...}`` per line (blank lines are skipped).

Bad input stops with the file and line: line counts that differ, invalid UTF-8, a TSV line without
exactly one tab, a JSON line that does not parse or lacks a language.

Tagged back-translation: ``load_train`` starts the sources of ``data.tagged``'s splits with
``data.tag`` (cached like the rest, keyed by the tag); nothing else is ever tagged.

Encoding, filtering and batching the pairs read here is ``mt.batching``'s job.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import itertools
import json
import os
import pickle
import unicodedata
import zlib
from collections.abc import Collection, Iterator
from itertools import zip_longest
from pathlib import Path

import numpy as np

from mt.config import NORMALIZATIONS, DataConfig, TokenizerConfig, is_user_symbol
from mt.hub import check_hub_splits, load_hub
from mt.textio import carriage_returns_only, utf8_text

# Part of the text cache's key: bump it when reading changes what a file's lines become (2: a
# byte-order mark before line 1 is dropped, a blank TSV line is an empty pair; 3: one before
# any line, as `cat a.txt b.txt` leaves b's), so that a cache written by an older mt is not
# served as the text.
READ_VERSION = 3


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


# ----------------------------------------------------------------------------- reading


def _open_text(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, "rb")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    """A line's text; a byte-order mark before it is no text (``utf8_text``): Windows editors
    put one before line 1, and ``cat a.txt b.txt`` leaves b's before a line in mid-file."""
    if (mistake := carriage_returns_only(raw, lineno)) is not None:
        raise DataError(f"{path}:{lineno}: {mistake}")
    try:
        return utf8_text(raw)
    except ValueError as err:
        raise DataError(f"{path}:{lineno}: {err}") from None


def _find(path: Path) -> Path:
    """The path itself, or its .gz sibling. A relative path is said with the folder it starts
    in: the Multi30k recipes' ``../shared/data/multi30k``, given from outside the repository
    root, read as if the data were missing."""
    if path.exists():
        return path
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return gz
    where = "" if path.is_absolute() else f"; relative paths start in {Path.cwd()}"
    raise FileNotFoundError(f"{path}: no such file (nor {gz.name}{where})")


def split_files(cfg: DataConfig, split: str) -> list[Path]:
    """The local file(s) that hold a split."""
    base = Path(cfg.dir) / split
    if cfg.format == "text":
        return [_find(base.with_name(f"{split}.{cfg.src_lang}")),
                _find(base.with_name(f"{split}.{cfg.tgt_lang}"))]
    if cfg.format in ("tsv", "jsonl"):
        return [_find(base.with_name(f"{split}.{cfg.format}"))]
    raise ValueError(f"data.format must be text, tsv or jsonl, got {cfg.format!r}")


def check_split(cfg: DataConfig, split: str, whole: bool = False) -> list[Path]:
    """The local file(s) of a split, refused (DataError, naming them) when they hold no pair:
    ``datasets`` would stop with "corresponds to no data", naming neither file nor split.
    ``whole``: every line is read and checked (``read_pairs``), for a valid or test split at the
    start of a run, which is otherwise read at its first use (the test split after all the
    training); else up to the first pair only."""
    files = split_files(cfg, split)
    pairs = read_pairs("\n".join(str(p) for p in files), cfg.format, cfg.src_lang, cfg.tgt_lang)
    if sum(1 for _ in itertools.islice(pairs, None if whole else 1)) == 0:
        raise DataError(f"{' and '.join(str(p) for p in files)}: no sentence pairs in "
                        f"{'them' if len(files) > 1 else 'it'} (the split {split!r})")
    return files


def _lines(path: Path) -> Iterator[bytes]:
    """Raw lines; a broken gzip stream becomes a DataError naming the file."""
    with _open_text(path) as f:
        try:
            yield from f
        except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
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
            if not line.strip():  # as a blank line of the text format: an empty pair
                yield {"src": "", "tgt": ""}
                continue
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


def load_split(cfg: DataConfig, split: str, cache_dir: str | None = None,
               tagged: Collection[str] = (), sizes: bool = False):
    """A ``datasets.Dataset`` with string columns ``src`` and ``tgt`` for one split.

    ``split`` may join several with ``+`` (``train+backtranslated``), as Hugging Face's split
    syntax does: their pairs in that order, e.g. the original corpus and a synthetic one.
    ``cache_dir`` overrides the ``datasets`` cache (``HF_DATASETS_CACHE``) for local files.
    The sources of the splits named in ``tagged`` start with ``cfg.tag`` (see ``load_train``).
    ``sizes``: return (dataset, the number of pairs of each joined split) instead.
    """
    import datasets

    datasets.disable_progress_bars()  # our own progress goes to stderr; theirs is noise here
    parts = split.split("+")
    if len(parts) > 1:
        if not all(parts):
            raise ValueError(f"split {split!r}: join split names with '+', e.g. train+extra")
    loaded = []
    for part in parts:
        ds = _load_one(cfg, part, cache_dir)
        loaded.append(tag_sources(ds, cfg.tag, cfg.tokenizer.normalization)
                      if part in tagged else ds)
    joined = loaded[0] if len(loaded) == 1 else datasets.concatenate_datasets(loaded)
    return (joined, [len(ds) for ds in loaded]) if sizes else joined


def load_train(cfg: DataConfig, cache_dir: str | None = None, sizes: bool = False):
    """The training pairs of ``data.train``, the sources of ``data.tagged``'s splits tagged.

    Tagged back-translation (Caswell et al., 2019): a synthetic source that starts with a reserved
    token lets the model learn from back-translated pairs without taking their sources for real
    ones. Only training data is tagged: valid and test sources, and whatever ``translate`` reads,
    are real text and stay untagged.
    """
    check_tagging(cfg)
    return load_split(cfg, cfg.train, cache_dir, tagged=cfg.tagged, sizes=sizes)


def check_tagging(cfg: DataConfig) -> None:
    """Raises ValueError naming the key when data.tag or data.tagged cannot work."""
    if not is_user_symbol(cfg.tag):
        raise ValueError("data.tag must be one non-empty word without whitespace, ',' or "
                         f"'\u2581' that NFKC leaves as it is, got {cfg.tag!r}")
    parts = cfg.train.split("+")
    for name in cfg.tagged:
        if name not in parts:
            raise ValueError(f"data.tagged: {name!r} is not one of data.train's splits "
                             f"({', '.join(parts)})")


def data_identity(data: DataConfig) -> dict:
    """What names a run's training data, kept with what was made from it (a tokenizer, a run's
    last.pt) to tell a reuse on other data. Folders by their real path (a relative data.dir
    from another folder, a run directory moved); the demo corpus is one, wherever it lies."""
    hub = data.hub_name or ""
    where = ({"hub": f"{Path(hub).resolve() if Path(hub).is_dir() else hub}/{data.hub_config}"}
             if data.source == "hub" else
             {"dir": str(Path(data.dir).resolve())} if data.source == "files" else {})
    return {"source": data.source, **where, "train": data.train,
            "pair": f"{data.src_lang}-{data.tgt_lang}"}


def tokenizer_config(cfg: DataConfig) -> TokenizerConfig:
    """``data.tokenizer``, with ``data.tag`` among its user symbols when ``data.tagged`` is set:
    the tag must be one piece that no ordinary text segments into."""
    symbols = cfg.tokenizer.user_symbols
    if cfg.tagged and cfg.tag not in symbols:
        symbols = [*symbols, cfg.tag]
    return dataclasses.replace(cfg.tokenizer, user_symbols=symbols)


def tokenizer_dir(tok_cfg: TokenizerConfig, run_dir: Path) -> Path:
    """Where a run's tokenizer is (or is trained): ``data.tokenizer.path``, else the run
    directory's ``tokenizer/``."""
    return Path(tok_cfg.path or run_dir / "tokenizer")


def tag_sources(ds, tag: str, normalization: str = "nmt_nfkc"):
    """``ds`` with every non-empty source prefixed by ``tag`` and a space (cached Arrow).

    ``normalization``: the tokenizer's rule (``data.tokenizer.normalization``), by which a
    source tagged beforehand is found tagged as the tokenizer reads it (``_tagged``).
    The fingerprint names the tag, so the encoding cache downstream (keyed by it) never serves
    pairs tagged otherwise, or untagged (2: a source tagged already is tagged once, not twice;
    3: also one whose tag is glued to the text, which gets the space; 4: a case-folding rule;
    5: the tag found as the rule reads it).
    """
    return ds.map(_prefix, batched=True, batch_size=10_000,
                  fn_kwargs={"tag": tag, "normalization": normalization},
                  new_fingerprint=stable_hash([ds._fingerprint, "tag_sources", tag, 5,
                                               normalization]),
                  desc="tagging")


def _prefix(batch: dict[str, list[str]], tag: str, normalization: str) -> dict[str, list[str]]:
    return {"src": [_tagged(s, tag, normalization) for s in batch["src"]]}


@functools.lru_cache(maxsize=8)
def _normalizer(rule: str):
    """SentencePiece's normalizer of ``rule`` (one of ``NORMALIZATIONS``), None for a rule of
    a model's own (``user_defined``: a model put in data.tokenizer.path by hand)."""
    import sentencepiece as spm

    return spm.SentencePieceNormalizer(rule_name=rule) if rule in NORMALIZATIONS else None


def _tagged(src: str, tag: str, normalization: str = "identity") -> str:
    """``src`` as ``tag``, a space and the text.

    An empty source stays empty: tagged, it would slip past the filter that drops empty pairs.
    One whose first word starts with the tag as the tokenizer reads it (after its
    ``normalization``) is tagged already (back-translations tagged before, as other toolkits
    want them) and keeps its one tag: "<BT> <BT> ..." was another input than the tag's. Under
    a case-folding rule (``*_cf``) that is "<BT>" for the tag "<bt>"; under NFKC a fullwidth
    "＜BT＞" (as CJK text tools write it), and under the nmt_* rules a format character before
    the tag, such as a zero-width space (a byte-order mark, which ``cat`` leaves in mid-file,
    is gone already under every rule: files are read without one at a line's start); tagging
    them again gave the model two tags. That includes the tag glued to the text
    (``sed 's/^/<BT>/'``), since the tokenizer reads "<BT>Hello" as the tag and "Hello" too; it
    gets the space, so that the text after the tag encodes as it would untagged ("Hello" as a
    word, not as its middle).
    """
    text = src.lstrip()
    if not text:
        return src
    if text.startswith(tag):
        rest = text[len(tag):]
    elif _may_read_as_start(text[0], tag, normalization):
        rest = _normalized_rest(text, tag, normalization)
    else:
        rest = None
    if rest is None:
        return f"{tag} {src}"
    return src if not rest or rest[0].isspace() else f"{tag} {rest}"


def _may_read_as_start(char: str, tag: str, normalization: str) -> bool:
    """Whether the rule may read a text that starts with ``char`` as one that starts with
    ``tag``: ``char`` is one that the nmt_* rules remove (a control or format character, a
    byte-order mark) or reads as the tag's first. A cheap test, so that SentencePiece's
    normalizer (12 us a line) runs only on the few sources it may find tagged."""
    if normalization == "identity":
        return False  # read as written: an exact match only
    if char.isascii() and char.isprintable():  # NFKC keeps it
        read = char
    elif unicodedata.category(char) in ("Cc", "Cf"):
        return True
    else:
        read = unicodedata.normalize("NFKC", char)
    return (read.casefold() if normalization.endswith("_cf") else read)[:1] == tag[0]


def _normalized_rest(text: str, tag: str, normalization: str) -> str | None:
    """What follows the tag that ``text`` starts with as the tokenizer's ``normalization`` reads
    it, None if it does not start with it."""
    head = text[:len(tag) + 16]  # the tag and a few characters that the rule may remove
    if head.isascii() and head.isprintable():
        # every rule but a case fold reads printable ASCII as written (the exact match was
        # tested): no normalizer, which took 14 us a line where each source starts with '<'
        # (a multilingual corpus's "<2de> ...": 10x the tagging's time)
        if normalization.endswith("_cf") and head.lower().startswith(tag):
            return text[len(tag):]
        return None
    if (normalizer := _normalizer(normalization)) is None:
        return None
    read, offsets = normalizer.normalize(head, with_offsets=True)
    if not read.startswith("\u2581" + tag):  # SentencePiece's word mark before the first word
        return None
    return text[offsets[len(tag) + 1]:]  # offsets: of each character read, where it was


def _load_one(cfg: DataConfig, split: str, cache_dir: str | None):
    """One split (no '+'), from the hub or local files."""
    import datasets

    if cfg.source == "hub":
        return load_hub(cfg, split, cache_dir)
    if cfg.source not in ("files", "demo"):
        raise ValueError(f"data.source must be demo, files or hub, got {cfg.source!r}")
    files = check_split(cfg, split)
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
            fingerprint=stable_hash([stamp, cfg.format, cfg.src_lang, cfg.tgt_lang,
                                     READ_VERSION]),
            cache_dir=cache_dir,
        )
    except datasets.exceptions.DatasetGenerationError as err:
        if not isinstance(err.__cause__, DataError):
            raise
        mistake = err.__cause__  # the user's problem, with file and line
    # Raised outside the handler: inside it, the DataError's context would become the wrapper
    # whose cause it is, a loop for anything that walks the chain.
    raise mistake from None


def _check_split_names(key: str, value: str, local: bool) -> None:
    """Refuses an empty part of ``a+b`` (``valid+`` looked for ``.en`` in the folder above
    data.dir) and, for local files, a name with a folder in it (``sub/test``: "Invalid name")."""
    parts = value.split("+")
    if len(parts) > 1 and not all(parts):
        raise ValueError(f"{key}={value}: an empty split name; join split names with '+', e.g. "
                         "train+extra")
    if local and any("/" in p or "\\" in p for p in parts):
        raise ValueError(f"{key}={value}: a split is a file name in data.dir, without a folder; "
                         "set data.dir to the folder")


def check_splits(cfg: DataConfig, *, test: bool) -> None:
    """Refuses a mistake in a split that data.train, data.valid, data.extra_valid or (``test``)
    data.test names, at the start of a run: not after the tokenizer, the encoding or the
    training. A training file is only found and its first pair read: the rest of it is read
    (and checked line by line) as the corpus is made."""
    named = [("data.train", cfg.train), ("data.valid", cfg.valid),
             *((f"data.extra_valid[{i}]", v) for i, v in enumerate(cfg.extra_valid)),
             *([("data.test", cfg.test)] if test and cfg.test else [])]
    for key, value in named:
        _check_split_names(key, value, local=cfg.source == "files")
    tested = cfg.test.split("+") if test and cfg.test else []
    valid = "+".join([cfg.valid, *cfg.extra_valid]).split("+")
    if cfg.source == "files":
        for split in [*valid, *tested]:
            check_split(cfg, split, whole=True)
        for split in cfg.train.split("+"):  # there, with a pair; its lines are read later
            check_split(cfg, split)
    elif cfg.source == "hub":
        extra = "+".join(cfg.extra_valid).split("+") if cfg.extra_valid else []
        check_hub_splits(cfg, {f"data.train={cfg.train}": cfg.train.split("+"),
                               f"data.valid={cfg.valid}": cfg.valid.split("+"),
                               "data.extra_valid": extra, f"data.test={cfg.test}": tested})


def stable_hash(obj) -> str:
    """A short hash of a JSON-serializable object, the same in every process: a cache key."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def read_lines(path: str | os.PathLike) -> list[str]:
    """A text file's lines (UTF-8, checked), without line endings."""
    path = _find(Path(path))
    return [_decode(raw, path, i) for i, raw in enumerate(_lines(path), start=1)]


def sample_texts(ds, size: int, seed: int, joint: bool) -> tuple[list[str], list[str]]:
    """A random sample of rows for SentencePiece training, read by index (no full pass).

    Joint vocabularies get ``size // 2`` rows of each side, so both languages together give
    ``size`` sentences (as ``TokenizerConfig.input_sentence_size`` means).
    """
    rows = max(1, size // 2) if joint else size
    if ds.cache_files:
        # A private memory map (unpickling re-opens the Arrow files): the pages the sample touches,
        # most of a big corpus, leave the resident set with it instead of staying mapped.
        ds = pickle.loads(pickle.dumps(ds))
    if rows < len(ds):
        rng = np.random.default_rng(seed)
        ds = ds.select(np.sort(rng.choice(len(ds), size=rows, replace=False)))
    return list(ds["src"]), list(ds["tgt"])
