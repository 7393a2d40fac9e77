"""Reading every source format, filtering counts, encoding caches, token batches and rank shards."""

import gzip
import json
import os
import random
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets is imported: never wait on a network

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mt.batching import (  # noqa: E402
    EncodedPairs,
    collate,
    encode_split,
    epoch_steps,
    filter_lengths,
    filter_pairs,
    pair_hash,
    step_batches,
    token_batches,
)
from mt.config import BOS_ID, EOS_ID, PAD_ID, DataConfig, FilterConfig, TokenizerConfig  # noqa: E402
from mt.data import DataError, check_hub_splits, load_split, read_lines, sample_texts  # noqa: E402
from mt.subwords import SampledPairs, Segmentations  # noqa: E402
from mt.tokenizer import train_tokenizer  # noqa: E402

PAIRS = [
    ("Hello world.", "Hallo Welt."),
    ("", ""),  # an empty pair is data too (the filters drop it, not the readers)
    ("Größe ✓ 日本語", "size ✓ japanese"),
    ("only source", ""),
    ('quotes " and \\ backslash', "{not json}"),
    ("Hello world.", "Hallo Welt."),  # duplicate
]


def _write(path, text: str, gz: bool, bom: bool = False):
    text = "\ufeff" + text if bom else text
    if gz:
        with gzip.open(str(path) + ".gz", "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def _write_split(directory, fmt: str, split: str, pairs, gz: bool = False,
                 bom: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        _write(directory / f"{split}.en", "".join(s + "\n" for s, _ in pairs), gz, bom)
        _write(directory / f"{split}.de", "".join(t + "\n" for _, t in pairs), gz, bom)
    elif fmt == "tsv":
        _write(directory / f"{split}.tsv", "".join(f"{s}\t{t}\n" for s, t in pairs), gz, bom)
    else:
        lines = [json.dumps({"translation": {"en": s, "de": t}} if i % 2 else {"de": t, "en": s})
                 for i, (s, t) in enumerate(pairs)]
        _write(directory / f"{split}.jsonl", "\n".join(lines) + "\n\n", gz, bom)  # blank tail


def _cfg(directory, fmt: str = "text", **kw) -> DataConfig:
    return DataConfig(source="files", dir=str(directory), format=fmt, src_lang="en",
                      tgt_lang="de", **kw)


def _pairs(ds) -> list[tuple[str, str]]:
    return list(zip(ds["src"], ds["tgt"], strict=True))


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_every_local_format_loads_the_same_pairs(tmp_path, fmt, gz):
    _write_split(tmp_path / "d", fmt, "train", PAIRS, gz)
    ds = load_split(_cfg(tmp_path / "d", fmt), "train", cache_dir=str(tmp_path / "cache"))
    assert _pairs(ds) == PAIRS


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_a_byte_order_mark_before_line_one_is_not_text(tmp_path, fmt):
    """Windows editors save "UTF-8 with BOM": it must not stick to the first source (nor break
    the first JSON line)."""
    _write_split(tmp_path / "d", fmt, "train", PAIRS, bom=True)
    ds = load_split(_cfg(tmp_path / "d", fmt), "train", cache_dir=str(tmp_path / "cache"))
    assert _pairs(ds) == PAIRS
    assert read_lines(tmp_path / "d" / f"train.{'en' if fmt == 'text' else fmt}")[0][0] != "\ufeff"


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_a_byte_order_mark_before_a_line_in_mid_file_is_not_text(tmp_path, fmt):
    """`cat a.txt b.txt > train.txt`, b saved "UTF-8 with BOM": b's BOM is now before a line in
    mid-file. It stuck to that source, where the identity and nfkc normalizations keep it (the
    line's first piece <unk>), and broke a JSON line."""
    _write_split(tmp_path / "a", fmt, "train", PAIRS[:2])
    _write_split(tmp_path / "b", fmt, "train", PAIRS[2:], bom=True)
    for a in (tmp_path / "a").iterdir():  # cat a/train.X b/train.X > d/train.X
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / "d" / a.name).write_bytes(a.read_bytes()
                                              + (tmp_path / "b" / a.name).read_bytes())
    ds = load_split(_cfg(tmp_path / "d", fmt), "train", cache_dir=str(tmp_path / "cache"))
    assert _pairs(ds) == PAIRS
    lines = read_lines(tmp_path / "d" / f"train.{'en' if fmt == 'text' else fmt}")
    assert not any(line.startswith("\ufeff") for line in lines)


def test_splits_joined_by_plus_are_concatenated_in_order(tmp_path):
    """`data.train=train+bt`: the original pairs then the synthetic ones, with a fingerprint of
    their own that is stable across loads (the encoding cache is keyed by it)."""
    synthetic = [("back translated", "rückübersetzt"), ("second", "zweite")]
    _write_split(tmp_path / "d", "text", "train", PAIRS)
    _write_split(tmp_path / "d", "text", "bt", synthetic, gz=True)
    cache = str(tmp_path / "cache")
    both = load_split(_cfg(tmp_path / "d"), "train+bt", cache_dir=cache)
    assert _pairs(both) == PAIRS + synthetic
    assert _pairs(load_split(_cfg(tmp_path / "d"), "bt+train", cache_dir=cache)) == (
        synthetic + PAIRS)
    again = load_split(_cfg(tmp_path / "d"), "train+bt", cache_dir=cache)
    assert again._fingerprint == both._fingerprint
    only = load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)
    assert only._fingerprint != both._fingerprint
    with pytest.raises(ValueError, match="join split names"):
        load_split(_cfg(tmp_path / "d"), "train+", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="missing.en"):
        load_split(_cfg(tmp_path / "d"), "train+missing", cache_dir=cache)


@pytest.mark.parametrize("key, value, said", [
    ("valid", "valid+", "data.valid=valid+: an empty split name; join split names with '+'"),
    ("test", "+test", "data.test=+test: an empty split name"),
    ("extra_valid", ["valid+"], "data.extra_valid[0]=valid+: an empty split name"),
    ("test", "sub/test", "data.test=sub/test: a split is a file name in data.dir, without a "
                         "folder; set data.dir to the folder")])
def test_a_split_name_with_an_empty_part_or_a_folder_is_refused_naming_the_key(tmp_path, key,
                                                                               value, said):
    """``data.valid=valid+`` read ``.en`` and ``.de`` from the folder above data.dir (or said
    that they were missing there); ``data.test=sub/test`` was "Invalid name 'sub/test.en'"."""
    from mt.data import check_splits

    for split in ("train", "valid", "test"):
        _write_split(tmp_path / "d", "text", split, PAIRS)
    with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
        check_splits(_cfg(tmp_path / "d", **{key: value}), test=True)
    check_splits(_cfg(tmp_path / "d"), test=True)  # the same folder with good names


def test_hub_style_datasets_load_the_same_pairs(tmp_path):
    rows = {"translation": [{"en": s, "de": t} for s, t in PAIRS]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "dd")
    (tmp_path / "json").mkdir()  # a script-free hub repository layout: data files only
    with open(tmp_path / "json" / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"translation": {"en": s, "de": t}}) + "\n" for s, t in PAIRS)
    flat = datasets.Dataset.from_dict({"en": [s for s, _ in PAIRS], "de": [t for _, t in PAIRS]})
    datasets.DatasetDict({"train": flat}).save_to_disk(tmp_path / "flat")  # a column per language
    for name in ("dd", "json", "flat"):
        cfg = DataConfig(source="hub", hub_name=str(tmp_path / name), src_lang="en", tgt_lang="de")
        assert _pairs(load_split(cfg, "train", cache_dir=str(tmp_path / "cache"))) == PAIRS
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "dd"), src_lang="en", tgt_lang="fr")
    with pytest.raises(ValueError, match="data.src_lang and data.tgt_lang"):
        load_split(cfg, "train")
    with pytest.raises(ValueError, match=r"splits \['train'\], not 'valid'"):
        load_split(DataConfig(source="hub", hub_name=str(tmp_path / "dd")), "valid")
    # '+' joins a DatasetDict's splits
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "dd"), src_lang="en", tgt_lang="de")
    assert _pairs(load_split(cfg, "train+train", cache_dir=str(tmp_path / "cache"))) == PAIRS * 2
    # A single saved Dataset has no split names: every split would be all of it (a review saw
    # test BLEU scored on the training pairs), so it is refused, whichever split is asked for.
    flat.save_to_disk(tmp_path / "single")
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "single"), src_lang="en", tgt_lang="de")
    for split in ("train", "valid", "train+bt"):
        with pytest.raises(ValueError, match="one saved Dataset, without split names"):
            load_split(cfg, split)


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_a_missing_value_in_a_hub_dataset_names_its_split_and_row(tmp_path, layout):
    """A null (a JSON row without "de", a None) would reach the tokenizer or, in the test split,
    crash sacreBLEU after the whole training: it stops the load, naming split and row."""
    src, tgt = [s for s, _ in PAIRS], [t for _, t in PAIRS]
    tgt[2] = None
    rows = ({"en": src, "de": tgt} if layout == "columns" else
            {"translation": [{"en": s, "de": t} for s, t in zip(src, tgt, strict=True)]})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "d")
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "d"), src_lang="en", tgt_lang="de")
    with pytest.raises(DataError, match=r"split 'test' row 2 \(counting from 0\): no de text "
                                        r"\(null; 1 such rows\)"):
        load_split(cfg, "test")


def test_a_slice_of_a_hub_split_is_a_split_it_has(tmp_path):
    """``datasets`` loads ``train[:2]``; the start-up check refused it as a split the dataset
    lacks."""
    src, tgt = zip(*PAIRS, strict=True)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"en": src, "de": tgt})}
                         ).save_to_disk(tmp_path / "d")
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "d"), src_lang="en", tgt_lang="de")
    check_hub_splits(cfg, {"data.valid": ["train[:2]"], "data.test": ["train[50%:]"]})
    assert _pairs(load_split(cfg, "train[:2]")) == PAIRS[:2]
    assert _pairs(load_split(cfg, "train[-1:]")) == PAIRS[-1:]
    with pytest.raises(ValueError, match=r"^data.test: .* has splits \['train'\], not "
                                         r"'test\[:2\]'"):
        check_hub_splits(cfg, {"data.test": ["test[:2]"]})


def test_a_hub_dataset_without_a_languages_column_is_a_data_error(tmp_path):
    """A data.tgt_lang that names no column of the dataset is the command's mistake (a
    DataError: mt-train says it in one line and takes away the run directory it made), not a
    crash whose traceback train.log keeps."""
    src, tgt = zip(*PAIRS, strict=True)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"en": src, "de": tgt})}
                         ).save_to_disk(tmp_path / "d")
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "d"), src_lang="en", tgt_lang="fr")
    with pytest.raises(DataError, match=r"split 'train' has columns \['en', 'de'\], not "
                                        r"\['fr'\]: check data.src_lang and data.tgt_lang$"):
        load_split(cfg, "train")


@pytest.mark.parametrize("values, kind", [([1, 2, 3, 4], "int64"), ([["a"], ["b"], ["c"], ["d"]],
                                                                    "List")])
def test_a_hub_column_that_is_not_text_names_its_split_and_column(tmp_path, values, kind):
    """Numbers in a language's column passed the load and failed later with a traceback: in
    the tokenizer's sample ('int' object has no attribute 'strip'), or, in the valid split
    only, at the first validation, after the first stretch of training."""
    rows = {"en": ["a b", "c d", "e f", "g h"], "de": values}
    datasets.DatasetDict({"valid": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "d")
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "d"), src_lang="en", tgt_lang="de")
    with pytest.raises(DataError, match=f"split 'valid' column 'de' holds {kind}, not text$"):
        load_split(cfg, "valid")


@pytest.mark.parametrize("data, said", [
    # a folder of one column per language: a KeyError ('Field "src" does not exist in schema')
    # from datasets, as a traceback; text, JSON lines or a translation column: the same text on
    # both sides, a model trained to copy, without a word
    (dict(source="hub", hub_name="corpus", src_lang="en", tgt_lang="en"),
     "data.src_lang and data.tgt_lang are both 'en'"),
    (dict(source="files", format="text", src_lang="de", tgt_lang="de"),
     "data.src_lang and data.tgt_lang are both 'de'"),
    (dict(source="files", format="jsonl", src_lang="de", tgt_lang="de"),
     "data.src_lang and data.tgt_lang are both 'de'"),
    # data.source=hub without data.hub_name: a TypeError traceback (Path(None)) at the split check
    (dict(source="hub", hub_name=None), "data.source=hub needs data.hub_name"),
    # the second copy went as duplicates under data.filter.dedup (the default), so the split was
    # not weighed twice as asked; data.upsample.train would have weighed both copies
    (dict(source="files", train="train+bt+train"),
     "data.train=train+bt+train names train twice: to weigh a split, give "
     "+data.upsample.train=2 instead"),
])
def test_data_settings_that_cannot_name_a_corpus_are_refused_naming_the_key(data, said):
    from mt.config import TrainConfig
    from mt.config_checks import check_values

    cfg = TrainConfig()
    cfg.data = DataConfig(**data)
    with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
        check_values(cfg)
    # one language on both sides is a task of its own (paraphrase, correction) in a TSV file,
    # whose columns, not names, tell the sides apart
    cfg.data = DataConfig(source="files", format="tsv", src_lang="en", tgt_lang="en")
    check_values(cfg)


@pytest.mark.skipif(not datasets.config.HF_HUB_OFFLINE, reason="needs HF_HUB_OFFLINE=1")
def test_hub_offline_fails_with_one_clear_sentence():
    cfg = DataConfig(source="hub", hub_name="wmt/wmt14", hub_config="de-en", src_lang="en",
                     tgt_lang="de")
    with pytest.raises(ConnectionError, match="could not reach the Hugging Face hub for wmt/wmt14"):
        load_split(cfg, "train")


def test_a_wrong_or_missing_hub_config_of_a_local_folder_names_the_key(tmp_path):
    """datasets' own words, ``BuilderConfig 'en-de' not found`` or ``Config name is missing``,
    named no key; they name data.hub_config now, with the configs the folder has, at the
    start-up check and at the load."""
    rows = "".join(json.dumps({"translation": {"en": s, "de": t}}) + "\n" for s, t in PAIRS)
    for folder in ("plain", "multi/de", "multi/fr"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "train.jsonl").write_text(rows)
    (tmp_path / "multi" / "README.md").write_text(
        "---\nconfigs:\n" + "".join(f"- config_name: {c}-en\n  data_files:\n  - split: train\n"
                                     f"    path: {c}/train.jsonl\n" for c in ("de", "fr"))
        + "---\n")
    cases = [("plain", "en-de", f"data.hub_config=en-de: {tmp_path / 'plain'} has no such config "
                                "(its configs: default); set data.hub_config=null"),
             ("multi", "xx", f"data.hub_config=xx: {tmp_path / 'multi'} has no such config (its "
                             "configs: de-en, fr-en)"),
             ("multi", None, f"data.hub_config is not set, and {tmp_path / 'multi'} has several "
                             "configs (its configs: de-en, fr-en): set data.hub_config to one")]
    for folder, config, said in cases:
        cfg = DataConfig(source="hub", hub_name=str(tmp_path / folder), hub_config=config,
                         src_lang="en", tgt_lang="de")
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            check_hub_splits(cfg, {"data.train=train": ["train"]})
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            load_split(cfg, "train", cache_dir=str(tmp_path / "cache"))
    cfg = DataConfig(source="hub", hub_name=str(tmp_path / "multi"), hub_config="fr-en",
                     src_lang="en", tgt_lang="de")
    assert _pairs(load_split(cfg, "train", cache_dir=str(tmp_path / "cache"))) == PAIRS


@pytest.mark.skipif(not datasets.config.HF_HUB_OFFLINE, reason="needs HF_HUB_OFFLINE=1")
def test_offline_a_missing_folder_that_could_be_a_hub_name_is_said_both_ways(tmp_path,
                                                                             monkeypatch):
    """``data/corpus`` is a valid hub name too: offline, a folder the user meant but that is
    not there was only "could not reach the Hugging Face hub ... download it once"."""
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(source="hub", hub_name="data/corpus", src_lang="en", tgt_lang="de")
    said = (f"; if data.hub_name=data/corpus meant a folder, there is none at "
            f"{tmp_path / 'data' / 'corpus'} (a relative folder starts at the directory mt-train "
            "runs in)")
    with pytest.raises(ConnectionError, match=f"^could not reach .*{re.escape(said)}$"):
        check_hub_splits(cfg, {"data.train=train": ["train"]})
    with pytest.raises(ConnectionError, match=f"^could not reach .*{re.escape(said)}$"):
        load_split(cfg, "train")


@pytest.mark.parametrize("name", ["./saved_corpus", "../data/saved", "data/corpus/saved"])
def test_a_hub_name_that_is_a_missing_folder_is_said_so_not_sent_to_the_hub(tmp_path, name,
                                                                            monkeypatch):
    """A path that no hub dataset can be named (``./saved``, three parts) and no folder holds:
    a save_to_disk folder given from another directory was "could not reach the Hugging Face
    hub ...; download it once with internet" (offline), about a dataset that is no hub's."""
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(source="hub", hub_name=name, src_lang="en", tgt_lang="de")
    said = f"data.hub_name={name}: no such folder ({tmp_path / name}), nor a hub dataset's name"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(said)}"):
        check_hub_splits(cfg, {"data.train=train": ["train"]})
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(said)}"):
        load_split(cfg, "train")


def test_file_cache_is_reused_and_sees_edits(tmp_path):
    _write_split(tmp_path / "d", "text", "train", PAIRS)
    cache = str(tmp_path / "cache")
    first = load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)
    again = load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)
    assert again.cache_files == first.cache_files
    _write_split(tmp_path / "d", "text", "train", PAIRS[:2])
    assert len(load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)) == 2


def test_a_new_way_of_reading_is_not_served_from_an_old_cache(tmp_path, monkeypatch):
    """The text cache is keyed by the files' stamps; an mt that reads them otherwise (a BOM
    dropped) must bump READ_VERSION and get fresh text, not the older mt's."""
    import mt.data

    _write_split(tmp_path / "d", "text", "train", PAIRS)
    cache = str(tmp_path / "cache")
    assert _pairs(load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)) == PAIRS
    decode = mt.data._decode
    monkeypatch.setattr(mt.data, "_decode", lambda *a: decode(*a).upper())
    monkeypatch.setattr(mt.data, "READ_VERSION", mt.data.READ_VERSION + 1)
    again = load_split(_cfg(tmp_path / "d"), "train", cache_dir=cache)
    assert _pairs(again) == [(s.upper(), t.upper()) for s, t in PAIRS]


@pytest.mark.parametrize(
    ("fmt", "files", "message"),
    [
        ("text", {"train.en": b"a\nb\nc\n", "train.de": b"x\ny\n"},
         r"train\.en:3: line counts differ"),
        ("text", {"train.en": b"a\n", "train.de": b"x\ny\n"}, r"train\.de:2: line counts differ"),
        ("text", {"train.en": b"a\nb\xff\n", "train.de": b"x\ny\n"}, r"train\.en:2: invalid UTF-8"),
        ("tsv", {"train.tsv": b"a\tx\nno tab here\n"}, r"train\.tsv:2: expected source<TAB>target"),
        ("tsv", {"train.tsv": b"a\tx\tz\n"}, r"train\.tsv:1: .*found 2 tabs"),
        # old Mac line ends: both files read as one line each, a pair of whole files
        ("text", {"train.en": b"a\rb\r", "train.de": b"x\ry\r"},
         r"train\.en:1: its lines end in a carriage return \(\\r\) alone"),
        ("tsv", {"train.tsv": b"a\tx\rb\ty\r"}, r"train\.tsv:1: .*carriage return"),
        ("jsonl", {"train.jsonl": b'{"en": "a", "de": "x"}\n{"en": "a"}\n'},
         r"train\.jsonl:2: expected a JSON object"),
        ("jsonl", {"train.jsonl": b'{"en": "a", "de": "x"}\n{oops\n'}, r"train\.jsonl:2:"),
        ("jsonl", {"train.jsonl": b'{"en": "a", "de": null}\n'}, r"train\.jsonl:1: .*strings"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, fmt, files, message):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=message):
        load_split(_cfg(tmp_path, fmt), "train", cache_dir=str(tmp_path / "cache"))


def test_a_carriage_return_inside_a_line_of_a_file_with_line_feeds_is_text(tmp_path):
    """Web corpora hold stray \\r inside lines; only a file without any line feed is refused."""
    (tmp_path / "train.en").write_bytes(b"a\rb\r\nc\n")
    (tmp_path / "train.de").write_bytes(b"x\r\ny\n")
    ds = load_split(_cfg(tmp_path), "train", cache_dir=str(tmp_path / "cache"))
    assert _pairs(ds) == [("a\rb", "x"), ("c", "y")]


def test_a_blank_tsv_line_is_an_empty_pair_as_in_the_text_format(tmp_path):
    (tmp_path / "train.tsv").write_bytes(b"a\tx\n\nb\ty\n\n")
    ds = load_split(_cfg(tmp_path, "tsv"), "train", cache_dir=str(tmp_path / "cache"))
    assert _pairs(ds) == [("a", "x"), ("", ""), ("b", "y"), ("", "")]


def test_bad_gzip_input_names_file_and_line(tmp_path):
    with gzip.open(tmp_path / "train.tsv.gz", "wb") as f:
        f.write(b"a\tb\n\xc3(\tx\n")
    with pytest.raises(DataError, match=r"train\.tsv\.gz:2: invalid UTF-8"):
        load_split(_cfg(tmp_path, "tsv"), "train", cache_dir=str(tmp_path / "cache"))
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"broken\.txt\.gz: cannot read"):
        read_lines(tmp_path / "broken.txt")
    with pytest.raises(FileNotFoundError, match="nor missing.txt.gz"):
        read_lines(tmp_path / "missing.txt")


# ----------------------------------------------------------------------------- filtering


def test_filter_counts_are_exact():
    cfg = FilterConfig(min_tokens=2, max_tokens=10, max_ratio=2.0, dedup=True)
    #        src, tgt, empty, hash
    rows = [(5, 5, False, 1),   # kept
            (0, 0, True, 2),    # empty (also too short: the first rule counts)
            (1, 5, False, 3),   # too short
            (11, 4, False, 4),  # too long (also a bad ratio)
            (3, 7, False, 5),   # ratio 7 > 2 * 3
            (3, 6, False, 6),   # ratio 6 == 2 * 3: kept
            (5, 5, False, 1),   # duplicate of row 0
            (11, 4, False, 4),  # too long again: counted as too long, not as a duplicate
            (4, 4, False, 7),   # kept
            (5, 5, False, 1)]   # duplicate
    src, tgt, empty, hashes = (np.array(c) for c in zip(*rows, strict=True))
    keep, report = filter_lengths(src, tgt, empty, hashes, cfg)
    assert keep.tolist() == [0, 5, 8]
    assert (report.total, report.empty, report.too_short, report.too_long, report.ratio,
            report.duplicate, report.kept) == (10, 1, 1, 2, 1, 2, 3)
    # each count with its limit: max_tokens may be the model's, lowered from data.filter's
    assert str(report) == ("kept 3 of 10 pairs (dropped: empty 1, too short (< 2 tokens) 1, too "
                           "long (> 10 tokens) 2, length ratio (> 2) 1, duplicate 2)")
    keep, report = filter_lengths(src, tgt, empty, hashes,
                                  FilterConfig(min_tokens=0, max_tokens=100, max_ratio=0,
                                               dedup=False))
    assert report.kept == 9 and report.empty == 1  # empty sides are always dropped
    assert "length ratio (off) 0" in str(report)
    # a ratio of exactly max_ratio is kept even where max_ratio x short rounds below long
    # (1.15 x 100 = 114.99999999999999 < 115)
    for ratio, short, long_ in ((1.15, 100, 115), (2.3, 50, 115)):
        keep, report = filter_lengths(np.array([short]), np.array([long_]), np.array([False]),
                                      None, FilterConfig(1, 1000, ratio, False))
        assert report.ratio == 0 and keep.tolist() == [0], (ratio, short, long_)


def test_filter_pairs_on_text_matches_the_rules():
    src = ["a b", "a b", " ", "a b c d e f g", "a", "a b"]
    tgt = ["x y", "x y", "x", "x", "x", "x z"]
    ids = {w: i + 4 for i, w in enumerate("abcdefgxyz")}
    src_ids = [[ids[w] for w in s.split()] + [EOS_ID] for s in src]
    tgt_ids = [[ids[w] for w in t.split()] for t in tgt]
    keep, report = filter_pairs(src, tgt, src_ids, tgt_ids,
                                FilterConfig(min_tokens=1, max_tokens=6, max_ratio=3.0))
    assert keep == [0, 4, 5]
    assert (report.duplicate, report.empty, report.too_long, report.ratio) == (1, 1, 1, 0)
    assert pair_hash("ab", "c") != pair_hash("a", "bc")  # the boundary is part of the key


# ----------------------------------------------------------------------------- encoding


def _corpus(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)] + ["Größe", "日本"]
    out = []
    for _ in range(n):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(0, 25)))
        t = " ".join(rng.choice(words) + "x" for _ in range(rng.randint(0, 25)))
        out.append((s, t))
    return out + out[:20]  # some duplicates


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enc")
    pairs = _corpus(600, 0)
    _write_split(tmp / "d", "text", "train", pairs)
    ds = load_split(_cfg(tmp / "d"), "train", cache_dir=str(tmp / "cache"))
    src, tgt = sample_texts(ds, 10_000, 0, joint=True)
    tok = train_tokenizer(src, tgt, TokenizerConfig(vocab_size=100))
    return pairs, ds, tok, encode_split(ds, tok, num_proc=1)


def test_tokenizer_sample_is_aligned_and_sized(encoded):
    pairs, ds, _, _ = encoded
    assert [len(side) for side in sample_texts(ds, 1, seed=3, joint=True)] == [1, 1]
    src, tgt = sample_texts(ds, 100, seed=3, joint=True)  # joint: 50 rows, both sides
    assert len(src) == len(tgt) == 50
    assert all(pair in pairs for pair in zip(src, tgt, strict=True))
    assert (src, tgt) == sample_texts(ds, 100, seed=3, joint=True)
    src, tgt = sample_texts(ds, 100, seed=3, joint=False)
    assert len(src) == 100
    assert sample_texts(ds, 10_000, seed=3, joint=True)[0] == [s for s, _ in pairs]


def test_encoded_pairs_match_in_memory_encoding(encoded):
    pairs, ds, tok, enc = encoded
    cfg = FilterConfig(min_tokens=1, max_tokens=40, max_ratio=2.5)
    src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
    src_ids, tgt_ids = tok.encode_src(src), tok.encode_tgt(tgt)
    keep, report = filter_pairs(src, tgt, src_ids, tgt_ids, cfg)
    data = EncodedPairs(enc, cfg)
    assert vars(data.report) == vars(report) and report.duplicate > 0 and report.too_long > 0
    assert data.rows.tolist() == keep
    assert list(data.src_lens) == [len(src_ids[i]) for i in keep]
    assert list(data.tgt_lens) == [len(tgt_ids[i]) for i in keep]
    batch = [5, 0, 17, 3]
    got = data.collate(batch)
    want = collate([src_ids[keep[i]] for i in batch], [tgt_ids[keep[i]] for i in batch])
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and bool((g == w).all())
    src_t, tgt_in, tgt_out = got
    assert bool((tgt_in[:, 0] == BOS_ID).all()) and int((tgt_out == EOS_ID).sum()) == len(batch)
    assert bool(((src_t == PAD_ID) | (src_t >= 0)).all())


def _sampled(encoded, nbest: int, alpha: float = 0.5):
    pairs, ds, tok, enc = encoded
    cfg = FilterConfig(min_tokens=1, max_tokens=40, max_ratio=2.5)
    data = EncodedPairs(enc, cfg)
    kept = ds.select(data.rows)
    return data, SampledPairs(data, kept["src"], kept["tgt"], tok, alpha, nbest, cfg.max_tokens)


def _same(a, b) -> bool:
    return all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b, strict=True))


def test_subword_sampling_of_one_best_is_the_encoded_corpus(encoded):
    data, sampled = _sampled(encoded, nbest=1)
    assert list(sampled.src_lens) == list(data.src_lens)
    for epoch in (0, 1):
        batches = sampled.batches(300, seed=3, epoch=epoch)
        assert batches == data.batches(300, seed=3, epoch=epoch)
        assert all(_same(sampled.collate(b), data.collate(b)) for b in batches)


def test_subword_sampling_changes_per_epoch_keeps_the_text_and_repeats(encoded):
    pairs, ds, tok, _ = encoded
    data, sampled = _sampled(encoded, nbest=8)
    everything = list(range(len(sampled)))
    seen = []
    for epoch in (0, 1, 0):
        batches = sampled.batches(300, seed=3, epoch=epoch)
        assert sorted(i for b in batches for i in b) == everything
        assert all(sum(max(sampled.src_lens[i], sampled.tgt_lens[i] + 1) for i in b) <= 300 * len(b)
                   for b in batches)
        src, tgt_in, tgt_out = sampled.collate(everything)
        seen.append((src, tgt_out))
        def text(ids):
            return tok.src.decode([[t for t in row if t not in (PAD_ID, EOS_ID)] for row in ids])

        assert text(src.tolist()) == [pairs[r][0] for r in data.rows]
        assert text(tgt_out.tolist()) == [pairs[r][1] for r in data.rows]  # joint vocabulary
        shifted = np.where(tgt_out[:, :-1] == EOS_ID, PAD_ID, tgt_out[:, :-1])  # y + PAD
        assert bool((tgt_in[:, 0] == BOS_ID).all()) and (tgt_in[:, 1:].numpy() == shifted).all()
        assert max(sampled.src_lens) <= 41 and max(sampled.tgt_lens) <= 40
    assert _same(seen[0], seen[2])  # the same (seed, epoch): the same segmentations (resume)
    changed = (seen[0][0].shape != seen[1][0].shape or bool((seen[0][0] != seen[1][0]).any()))
    assert changed  # another epoch: other segmentations
    assert sum(sampled.src_lens) > sum(data.src_lens)  # the best segmentation is the shortest-ish


def test_subword_sampling_draws_with_probability_p_to_the_alpha(encoded):
    tok = encoded[2]
    seg = Segmentations(tok.src, ["w12 w34 Größe w5"] * 4000, nbest=4, max_tokens=99, add_eos=True)
    scores = seg.scores[:4]
    assert len(seg.scores) == 4 * 4000 and bool((np.diff(scores) <= 1e-9).all())  # nbest order
    for alpha in (0.2, 1.0):
        chosen, _ = seg.pick(alpha, np.random.default_rng(0))
        freq = np.bincount(chosen - seg.first[:-1], minlength=4) / 4000
        want = np.exp(alpha * (scores - scores.max()))
        assert np.abs(freq - want / want.sum()).max() < 0.03
    chosen, lens = seg.pick(0.5, None)
    assert (chosen == seg.first[:-1]).all()
    assert list(lens[:1]) == [len(tok.encode_src(["w12 w34 Größe w5"])[0])]


def test_subword_candidates_found_by_several_processes_are_the_same(encoded):
    """The candidates are found in chunks by worker processes (a 64-best list costs some 50
    plain encodings): the arrays equal those found by one process, in the same order."""
    pairs, _, tok, _ = encoded
    texts = [s for s, _ in pairs] * 3  # several chunks of at least 256
    one = Segmentations(tok.src, texts, nbest=8, max_tokens=6, add_eos=True)
    two = Segmentations(tok.src, texts, nbest=8, max_tokens=6, add_eos=True, processes=2)
    for name in ("ids", "offsets", "first", "owner", "scores"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert len(texts) > 512 and (np.diff(one.first) < 8).any()  # max_tokens did drop some


class _Parents:
    """The parent's side of a SentencePiece model, for Segmentations' checks."""

    def nbest_encode(self, *args, **kwargs):
        return [[[4]]]

    def serialized_model_proto(self):
        return b""


def _workers_that(monkeypatch, tmp_path, act):
    """Workers whose n-best lists ``act`` (stall, die), each leaving its signal dispositions
    in tmp_path: forked, they see the patched loader."""
    import os
    import signal

    from mt import subwords

    class Acts:
        def nbest_encode(self, *args, **kwargs):
            act()

    def load(proto):
        said = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        (tmp_path / f"worker{os.getpid()}").write_text(repr(said))
        subwords._SP = Acts()

    monkeypatch.setattr(subwords, "_load", load)


def test_ctrl_c_while_workers_find_candidates_ends_them(monkeypatch, tmp_path, capfd):
    """Ctrl-C while worker processes found the candidates hung mt-train: the executor waited
    on the chunks it had queued. A terminal sends Ctrl-C to the workers too: they ignore it
    (no traceback of their own) and are ended at once; SIGTERM, which ends them, is the
    default again (the trainer's handler, inherited by fork, would ignore it)."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    _workers_that(monkeypatch, tmp_path, lambda: time.sleep(60))

    def ctrl_c():
        for worker in multiprocessing.active_children():
            os.kill(worker.pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as in a terminal: a background job of a script (CI's, maybe) ignores SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(2, ctrl_c).start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            Segmentations(_Parents(), ["w"] * 2048, nbest=4, max_tokens=9, add_eos=True,
                          processes=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 20
    deadline = time.time() + 10
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    said = [p.read_text() for p in tmp_path.glob("worker*")]
    assert len(said) == 2
    assert all(x == repr((signal.SIG_IGN, signal.SIG_DFL)) for x in said), said
    assert "Traceback" not in capfd.readouterr().err


def test_a_worker_killed_while_finding_candidates_is_one_line(monkeypatch, tmp_path):
    """The kernel's OOM killer ends a worker: one line, not a wait for ever on its chunk."""
    import os
    import signal

    _workers_that(monkeypatch, tmp_path, lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(ValueError, match=r"^data.subword_alpha: a process finding the subword "
                                         r"candidates died \(killed, out of memory\?\); lower "
                                         r"data.num_proc \(now 2 processes\)"):
        Segmentations(_Parents(), ["w"] * 2048, nbest=4, max_tokens=9, add_eos=True, processes=2)


def test_subword_sampling_needs_a_unigram_model(encoded):
    pairs = encoded[0]
    bpe = train_tokenizer([s for s, _ in pairs], [t for _, t in pairs],
                          TokenizerConfig(vocab_size=90, model_type="bpe"))
    with pytest.raises(ValueError, match="data.subword_alpha needs a unigram"):
        Segmentations(bpe.src, ["w1 w2"], nbest=4, max_tokens=10, add_eos=False)


def test_subword_sampling_with_a_bpe_tokenizer_it_did_not_train_says_where_that_comes_from(
        encoded, tmp_path):
    """A BPE tokenizer reused from data.tokenizer.path, or a checkpoint's (init_from, a resume),
    was refused with "needs a unigram model (data.tokenizer.model_type=unigram)", which was
    already set: the message names where the tokenizer comes from and what it is. It is
    refused at start-up (``check_sampling``), before the corpus is read."""
    from dataclasses import asdict

    from mt.config import TrainConfig
    from mt.startup import check_sampling
    from mt.subwords import model_type

    pairs, _, unigram, _ = encoded
    made = TokenizerConfig(vocab_size=90, model_type="bpe")
    bpe = train_tokenizer([s for s, _ in pairs], [t for _, t in pairs], made)
    assert (model_type(unigram.src_proto), model_type(bpe.src_proto)) == ("unigram", "BPE")
    cfg = TrainConfig()
    cfg.data = _cfg(tmp_path / "d", subword_alpha=0.5, tokenizer=TokenizerConfig(vocab_size=90))
    with pytest.raises(ValueError, match=re.escape(
            "data.subword_alpha samples among a unigram model's segmentations, but the "
            "tokenizer is the one of init_from=base.pt, a BPE model: a model keeps the "
            "tokenizer it was trained with, whatever data.tokenizer.model_type says: set "
            "data.subword_alpha=0")):
        check_sampling(cfg, tmp_path / "run", {"tokenizer": bpe.to_state()}, "init_from=base.pt")
    check_sampling(cfg, tmp_path / "run", {"tokenizer": unigram.to_state()}, "init_from=u.pt")
    check_sampling(cfg, tmp_path / "run", None, "")  # none yet: this run trains a unigram one
    bpe.save(tmp_path / "run" / "tokenizer", {"config": asdict(made)})  # an earlier attempt's
    with pytest.raises(ValueError, match=re.escape(
            f"is reused from {tmp_path / 'run' / 'tokenizer'} (an earlier attempt's in this run "
            "directory), a BPE model: set data.subword_alpha=0, or start in another run")):
        check_sampling(cfg, tmp_path / "run", None, "")
    cfg.data.tokenizer.path = str(tmp_path / "run" / "tokenizer")
    with pytest.raises(ValueError, match=re.escape(
            f"is reused from data.tokenizer.path={tmp_path / 'run' / 'tokenizer'}, a BPE "
            "model: set data.subword_alpha=0, or point data.tokenizer.path at a new directory")):
        check_sampling(cfg, tmp_path / "run", None, "")
    (tmp_path / "run" / "tokenizer" / "tokenizer.json").unlink()  # a model put there by hand
    with pytest.raises(ValueError, match="is reused from data.tokenizer.path="):
        check_sampling(cfg, tmp_path / "run", None, "")
    cfg.data.subword_alpha = 0.0
    check_sampling(cfg, tmp_path / "run", None, "")


def test_a_valid_split_with_text_is_found_by_encoding_up_to_its_first_pair_with_text(encoded):
    """data.valid's "no pair with text" check encoded the whole split (3 to 13 s for 100k
    pairs, at every start); it stops at the first pair with text now, with the same answers as
    the encoding's ``empty``: blank sides and a zero-width space (which ``str.strip`` keeps,
    and the tokenizer removes) are no text."""
    from mt.batching import has_text_pair

    pairs, _, tok, _ = encoded

    class Counting:  # the tokenizer, counting the sources it encodes
        encoded = 0

        def encode_src(self, texts):
            Counting.encoded += len(texts)
            return tok.encode_src(texts)

        def encode_tgt(self, texts):
            return tok.encode_tgt(texts)

    src, tgt = [s for s, _ in pairs] * 20, [t for _, t in pairs] * 20
    assert has_text_pair(Counting(), src, tgt) and Counting.encoded <= 64
    empty = [("", "a"), ("a", " "), ("\u200b", "a"), ("a", "\u200b \u200b")] * 50
    assert not has_text_pair(tok, *map(list, zip(*empty, strict=True)))
    later = [*empty, pairs[0], *empty]  # found past the first rounds
    assert has_text_pair(tok, *map(list, zip(*later, strict=True)))
    assert not has_text_pair(tok, [], [])


def test_encoding_cache_is_reused_and_keyed_by_tokenizer(encoded):
    pairs, ds, tok, enc = encoded
    again = encode_split(ds, tok, num_proc=1)
    assert again.cache_files == enc.cache_files
    two = encode_split(ds, tok, num_proc=2)  # several processes give the same columns
    assert two["src_ids"][:] == enc["src_ids"][:] and two["pair_hash"][:] == enc["pair_hash"][:]
    other = train_tokenizer([s for s, _ in pairs], [t for _, t in pairs],
                            TokenizerConfig(vocab_size=90, model_type="bpe"))
    assert encode_split(ds, other, num_proc=1).cache_files != enc.cache_files


# ----------------------------------------------------------------------------- batching


def _lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A WMT-like mix: lognormal source lengths (mean ~30 subwords), correlated targets."""
    rng = np.random.default_rng(seed)
    src = np.maximum(2, rng.lognormal(np.log(30) - 0.18, 0.6, n).astype(int))
    tgt = np.maximum(1, (src * rng.lognormal(0.05, 0.15, n)).astype(int))
    return src, tgt


def test_batches_respect_max_tokens_and_cover_every_pair_once():
    src, tgt = _lengths(20_000, 0)
    src[7], tgt[8] = 900, 900  # larger than the budget: batches of their own
    batches = token_batches(src.tolist(), tgt.tolist(), 512, seed=1, epoch=0)
    size = np.maximum(src, tgt + 1)
    for b in batches:
        assert len(b) * size[b].max() <= 512 or len(b) == 1
    assert [7] in batches and [8] in batches
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(src)))
    assert all(isinstance(i, int) for i in batches[0])


def test_batches_are_deterministic_and_reshuffled_per_epoch():
    src, tgt = _lengths(5000, 1)
    first = token_batches(src, tgt, 1024, seed=3, epoch=0)
    assert first == token_batches(src, tgt, 1024, seed=3, epoch=0)
    assert first != token_batches(src, tgt, 1024, seed=3, epoch=1)
    assert first != token_batches(src, tgt, 1024, seed=4, epoch=0)
    unshuffled = token_batches(src, tgt, 1024, seed=3, epoch=0, shuffle=False)
    sizes = [max(max(src[i], tgt[i] + 1) for i in b) for b in unshuffled]
    assert sizes == sorted(sizes)  # in length order, for validation and translation


@pytest.mark.parametrize("max_tokens", [2048, 4096, 8192])
def test_padding_overhead_under_ten_percent(max_tokens):
    src, tgt = _lengths(200_000, 2)
    batches = token_batches(src, tgt, max_tokens, seed=0, epoch=0)
    cells = sum(len(b) * (src[b].max() + tgt[b].max() + 1) for b in batches)
    real = int(src.sum() + tgt.sum() + len(tgt))
    assert cells / real - 1 < 0.10
    budget = sum(len(b) * max(src[b].max(), tgt[b].max() + 1) for b in batches)
    assert budget / (len(batches) * max_tokens) > 0.9  # batches are nearly full, too


@pytest.mark.parametrize(("world", "accumulation"), [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_ranks_see_disjoint_batches_covering_the_epoch(world, accumulation):
    """What mt.trainer.Trainer.fit trains: every batch of an epoch once, by one rank, the tail
    that cannot fill a step (fewer than accumulation x world batches) in a last step of its own
    (it was left out)."""
    src, tgt = _lengths(3001, 3)
    batches = token_batches(src, tgt, 700, seed=0, epoch=2)
    per_step = accumulation * world
    steps = [step_batches(batches, k, accumulation, world)
             for k in range(epoch_steps(len(batches), accumulation, world))]
    assert all(len(share) == accumulation for shares in steps[:-1] for share in shares)
    assert all(len(share) <= accumulation for share in steps[-1]) and steps[-1][0]
    trained = [b for shares in steps for share in shares for b in share]
    assert trained == batches  # in order, none twice, none left out
    if world > 1:  # a tail that some rank has no batch of
        assert any(not share for share in step_batches(batches[:per_step + 1], 1, accumulation,
                                                       world))
    ranks = {tuple(b): r for shares in steps for r, share in enumerate(shares) for b in share}
    assert len(ranks) == len(trained)  # each batch on exactly one rank


def test_corpus_interface_and_reuse(tmp_path, monkeypatch):
    from mt.config import TrainConfig
    from mt.corpus import Corpus

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    pairs = _corpus(300, 5)
    _write_split(tmp_path / "d", "tsv", "train", pairs, gz=True)
    _write_split(tmp_path / "d", "tsv", "valid", pairs[:7])
    cfg = TrainConfig()
    cfg.data = _cfg(tmp_path / "d", "tsv", tokenizer=TokenizerConfig(vocab_size=100),
                    filter=FilterConfig(max_tokens=1000, max_ratio=0, dedup=False))
    cfg.model.max_positions = 30  # longer pairs could not be embedded: filtered, not a crash
    corpus = Corpus(cfg, tmp_path / "run", rank=0, world=1)
    assert corpus.pairs.report.too_long > 0
    assert max(corpus.src_lens) <= 30 and max(corpus.tgt_lens) + 1 <= 30
    assert corpus.valid == {"valid": ([s for s, _ in pairs[:7]], [t for _, t in pairs[:7]])}
    batches = corpus.batches(200, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(corpus.src_lens)))
    src, tgt_in, tgt_out = corpus.collate(batches[0])
    assert src.shape[0] == tgt_in.shape[0] == len(batches[0]) and tgt_in.shape == tgt_out.shape
    assert src.shape[1] == max(corpus.src_lens[i] for i in batches[0])
    meta = tmp_path / "run" / "tokenizer" / "tokenizer.json"
    stamp = meta.stat().st_mtime_ns
    again = Corpus(cfg, tmp_path / "run", rank=0, world=1)  # tokenizer and encoding reused
    assert meta.stat().st_mtime_ns == stamp
    assert again.tokenizer.fingerprint == corpus.tokenizer.fingerprint
    assert again.pairs.rows.tolist() == corpus.pairs.rows.tolist()


def test_a_missing_split_file_at_a_relative_path_says_where_it_was_looked_for(tmp_path,
                                                                              monkeypatch):
    """The Multi30k recipes' data.dir=../shared/data/multi30k, from outside the repository root,
    said only '../shared/data/multi30k/valid.en: no such file', as if the data were missing."""
    from mt.data import split_files

    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(source="files", dir="../shared/data/multi30k", src_lang="en", tgt_lang="de")
    with pytest.raises(FileNotFoundError, match=re.escape(
            "../shared/data/multi30k/valid.en: no such file (nor valid.en.gz; relative paths "
            f"start in {tmp_path})")):
        split_files(cfg, "valid")
    cfg.dir = str(tmp_path / "nowhere")  # an absolute path says all
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{tmp_path}/nowhere/valid.en: no such file (nor valid.en.gz)")):
        split_files(cfg, "valid")


@pytest.mark.parametrize("line", [b"caf\xe9\n", b"caf\xe9\r\n", b"a\xff b\n"])
def test_invalid_utf8_is_said_alike_by_train_translate_and_eval(tmp_path, line):
    """The same line said "unexpected end of data" to translate and "invalid continuation byte
    at byte 3" to mt-train (which decoded it with its line end): one wording for every reader."""
    from mt import textio
    from mt.testsets import EvalError, read_text

    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n" + line)
    said = []
    for read, error in ((read_lines, DataError), (lambda p: list(textio.read_lines(str(p))),
                                                 textio.InputError), (read_text, EvalError)):
        with pytest.raises(error) as caught:
            read(path)
        said.append(str(caught.value).removesuffix("; use --errors replace to read it anyway"))
    reason = ("unexpected end of data at byte 3" if b"\xe9" in line
              else "invalid start byte at byte 1")
    assert said == [f"{path}:2: invalid UTF-8 ({reason})"] * 3
