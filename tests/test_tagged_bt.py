"""Tagged back-translation (Caswell et al., 2019): the sources of data.tagged's splits start with
data.tag, one piece of the source vocabulary that ordinary text never segments into."""

import dataclasses
import json
import logging
import random
import re
import shutil
import subprocess

import datasets
import pytest
import torch
from conftest import PYTHON, cli_env, tiny_train_args

from mt.batching import encode_split
from mt.config import (
    EOS_ID,
    UNK_ID,
    DataConfig,
    FilterConfig,
    TokenizerConfig,
    TrainConfig,
)
from mt.data import (
    load_split,
    load_train,
    sample_texts,
    tokenizer_config,
)
from mt.subwords import Segmentations
from mt.tokenizer import META_FILE, Tokenizer, load_or_train, train_tokenizer

WORDS = ["house", "garden", "green", "small", "river", "stone", "Light", "water", "tree", "bird"]
# Sources as they come: glued punctuation, quotes, a leading space, one made of punctuation only.
ODD = ['"Hello," she said.', "(tree) bird!", " water", ".", "«stone»", "x<BT>y", "BT", "<B"]


def _sentences(n: int, seed: int, suffix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) + suffix for _ in range(rng.randint(1, 10)))
            + rng.choice(["", ".", "?", "!"]) for _ in range(n)]


def _write(directory, split: str, src: list[str], tgt: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{split}.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (directory / f"{split}.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")


TRAIN = (_sentences(150, 1), _sentences(150, 2, "en"))
BT = ([*_sentences(60, 3), "", *ODD], [*_sentences(60 + 1 + len(ODD), 4, "en")])


def _cfg(directory, **kw) -> DataConfig:
    return DataConfig(**{"source": "files", "dir": str(directory), "src_lang": "en",
                         "tgt_lang": "de", "train": "train+bt", "tagged": ["bt"], **kw})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bt")
    _write(out, "train", *TRAIN)
    _write(out, "bt", *BT)
    _write(out, "valid", TRAIN[0][:5], TRAIN[1][:5])
    return out


def _tokenizer(ds, cfg: DataConfig) -> Tokenizer:
    """As mt.corpus trains one: a sample of the (tagged) training pairs, data.tag a user symbol."""
    tok_cfg = tokenizer_config(cfg)
    return train_tokenizer(*sample_texts(ds, 10_000, 0, tok_cfg.joint), tok_cfg, seed=0)


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_tagged_sources_start_with_the_tag_id_and_untagged_ones_never_hold_it(
        data_dir, tmp_path, model_type):
    cfg = _cfg(data_dir, tokenizer=TokenizerConfig(vocab_size=80, model_type=model_type))
    ds = load_train(cfg, cache_dir=str(tmp_path / "cache"))
    tok = _tokenizer(ds, cfg)
    tag = tok.symbol_id("<BT>")
    assert tag is not None
    rows = encode_split(ds, tok, num_proc=1)["src_ids"]
    n = len(TRAIN[0])
    for ids in rows[:n]:
        assert tag not in ids
    for src, ids in zip(BT[0], rows[n:], strict=True):
        if src.strip():
            assert ids[0] == tag and tag not in ids[1:]
        else:  # an empty source stays empty, so the filters still drop the pair
            assert ids == [EOS_ID]
    assert _tagged(ds) == sum(1 for s in BT[0] if s.strip())
    valid = load_split(cfg, cfg.valid, cache_dir=str(tmp_path / "cache"))
    assert all(tag not in ids for ids in tok.encode_src(list(valid["src"])))


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
@pytest.mark.parametrize("joint", [True, False])
def test_the_tag_is_one_piece_whatever_the_source_starts_with(model_type, joint):
    src, tgt = _sentences(300, 5), _sentences(300, 6, "en")
    cfg = TokenizerConfig(vocab_size=80, model_type=model_type, joint=joint,
                          user_symbols=["<BT>"])
    tok = train_tokenizer(["<BT> " + s for s in src[:100]] + src, tgt, cfg, seed=0)
    tag = tok.symbol_id("<BT>")
    assert tag is not None
    for s in [*ODD, *src[:20]]:  # the tag, then the source exactly as it encodes untagged
        assert tok.src.encode(f"<BT> {s}") == [tag, *tok.src.encode(s)], s
    if model_type == "unigram":  # subword sampling never draws a candidate that splits it
        texts = ["<BT> " + s for s in src[:50]]
        raw = [c for t in texts for c in tok.src.nbest_encode(t, nbest_size=64)]
        assert any(c[0] != tag for c in raw)  # SentencePiece's n-best list alone would
        seg = Segmentations(tok.src, texts, nbest=64, max_tokens=99, add_eos=True, symbols=[tag])
        cands = [seg.ids[seg.offsets[c] : seg.offsets[c + 1]] for c in range(len(seg.scores))]
        assert len(cands) > 5 * len(texts)  # still a choice to draw from
        assert all(c[0] == tag and (c == tag).sum() == 1 and UNK_ID not in c for c in cands)
    pieces = [tok.src.id_to_piece(i) for i in range(tok.src_vocab_size)
              if i != tag and not tok.src.is_control(i) and not tok.src.is_unknown(i)]
    assert not any(set(p) & set("<>") for p in pieces)  # the tagged sample taught no other
    if not joint:  # only sources are tagged
        assert tok.tgt.piece_to_id("\u2581<BT>") == UNK_ID
    plain = train_tokenizer(src, tgt, TokenizerConfig(vocab_size=80, model_type=model_type,
                                                      joint=joint), seed=0)
    assert plain.symbol_id("<BT>") is None


def _tagged(ds) -> int:
    return sum(1 for s in ds["src"] if s.startswith("<BT> "))


def test_a_source_tagged_beforehand_keeps_one_tag(tmp_path):
    """Back-translations tagged by an earlier pipeline, named in data.tagged (the way to make
    the tag one piece): they were tagged again, and the model trained on "<BT> <BT> ...". So
    was one whose tag is glued to the text (``sed 's/^/<BT>/'``), which the tokenizer reads as
    the tag and the text: it gets the space, and its text encodes as it would untagged."""
    src = ["<BT> green tree", "<BT>  river", "water <BT>", "<BT>green", " <BT>Light.", "<BT>",
           "x<BT>"]
    _write(tmp_path / "d", "train", TRAIN[0][:3], TRAIN[1][:3])
    _write(tmp_path / "d", "bt", src, list("abcdefg"))
    cfg = _cfg(tmp_path / "d", tokenizer=TokenizerConfig(vocab_size=60))
    ds = load_train(cfg, cache_dir=str(tmp_path / "cache"))
    assert list(ds["src"][3:]) == ["<BT> green tree", "<BT>  river", "<BT> water <BT>",
                                   "<BT> green", "<BT> Light.", "<BT>", "<BT> x<BT>"]
    tok = train_tokenizer([*TRAIN[0], *src], TRAIN[1], tokenizer_config(cfg), seed=0)
    tag = tok.symbol_id("<BT>")
    for row, text in ((6, "green"), (7, "Light.")):
        assert tok.src.encode(src[row - 3])[0] == tag  # as the tokenizer reads it: tagged
        assert tok.src.encode(ds["src"][row]) == [tag, *tok.src.encode(text)]


def test_a_case_folding_tokenizer_finds_a_source_tagged_beforehand_in_any_case(tmp_path):
    """Under data.tokenizer.normalization=nmt_nfkc_cf, data.tag must be lower case ("<bt>"), and
    back-translations tagged "<BT> ..." by another pipeline read as that tag: they were tagged
    again, and the model trained on two tags. Without folding, "<BT>" stays other text."""
    src = ["<BT> green tree", "<Bt>green", "<bt> water", "green"]
    _write(tmp_path / "d", "train", TRAIN[0][:3], TRAIN[1][:3])
    _write(tmp_path / "d", "bt", src, list("abcd"))
    cfg = _cfg(tmp_path / "d", tag="<bt>",
               tokenizer=TokenizerConfig(vocab_size=60, normalization="nmt_nfkc_cf"))
    ds = load_train(cfg, cache_dir=str(tmp_path / "cache"))
    assert list(ds["src"][3:]) == ["<BT> green tree", "<bt> green", "<bt> water", "<bt> green"]
    tok = train_tokenizer([*TRAIN[0], *src], TRAIN[1], tokenizer_config(cfg), seed=0)
    tag = tok.symbol_id("<bt>")
    for row, text in enumerate(["green tree", "green", "water", "green"], start=3):
        assert tok.src.encode(ds["src"][row]) == [tag, *tok.src.encode(text)]
    plain = dataclasses.replace(cfg, tokenizer=TokenizerConfig(vocab_size=60))
    ds = load_train(plain, cache_dir=str(tmp_path / "cache"))  # not served the folded cache
    assert list(ds["src"][3:]) == ["<bt> <BT> green tree", "<bt> <Bt>green", "<bt> water",
                                   "<bt> green"]


def test_a_source_tagged_beforehand_is_found_as_the_tokenizers_normalization_reads_it(tmp_path):
    """Under nmt_nfkc (the default) the tokenizer reads a fullwidth "＜BT＞" (as CJK text
    tools write it) as the tag "<BT>", and a byte-order mark before the tag (a file joined to
    another by ``cat``, the second's BOM in mid-file) as nothing: such sources were tagged
    again, and encoded to two tags. Under identity "＜BT＞" is other text, and is tagged; the
    BOM is not read at all under any rule (it was, under identity: "<BT> \ufeff<BT> water")."""
    src = ["\uff1cBT\uff1e green tree", "\uff1cBT\uff1egreen", "\ufeff<BT> water",
           "\ufeff\uff1cBT\uff1e stone", "green"]
    _write(tmp_path / "d", "train", TRAIN[0][:3], TRAIN[1][:3])
    _write(tmp_path / "d", "bt", src, list("abcde"))
    cfg = _cfg(tmp_path / "d", tokenizer=TokenizerConfig(vocab_size=60))
    ds = load_train(cfg, cache_dir=str(tmp_path / "cache"))
    tok = train_tokenizer([*TRAIN[0], *src], TRAIN[1], tokenizer_config(cfg), seed=0)
    tag = tok.symbol_id("<BT>")
    for row, text in enumerate(["green tree", "green", "water", "stone", "green"], start=3):
        assert tok.src.encode(ds["src"][row]) == [tag, *tok.src.encode(text)]
    assert ds["src"][4] == "<BT> green"  # glued: the space, as for "<BT>green"
    identity = TokenizerConfig(vocab_size=60, normalization="identity")
    ds = load_train(dataclasses.replace(cfg, tokenizer=identity),
                    cache_dir=str(tmp_path / "cache"))  # not served the nmt_nfkc cache
    assert list(ds["src"][3:]) == ["<BT> \uff1cBT\uff1e green tree", "<BT> \uff1cBT\uff1egreen",
                                   "<BT> water", "<BT> \uff1cBT\uff1e stone", "<BT> green"]


@pytest.mark.parametrize("rule", ["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"])
def test_sources_that_start_with_ascii_are_tagged_without_the_normalizer(rule, monkeypatch):
    """A multilingual corpus's sources all start with '<' ("<2de> ..."), the tag's first
    character: each ran SentencePiece's normalizer (14 us a line, 10x the tagging's time),
    which reads printable ASCII as written (case folded under *_cf); the answers stay its."""
    import mt.data

    sources = ["<2de> Haus", "<b>bold</b>", "<", "<BT>Haus", "<BT>", "<bt> Haus", "<Bt>  Haus"]
    expected = ["<bt> <2de> Haus", "<bt> <b>bold</b>", "<bt> <", "<bt> Haus", "<BT>",
                "<bt> Haus", "<Bt>  Haus"]  # as the normalizer reads them
    if not rule.endswith("_cf"):
        expected[3:] = ["<bt> <BT>Haus", "<bt> <BT>", "<bt> Haus", "<bt> <Bt>  Haus"]
    monkeypatch.setattr(mt.data, "_normalizer", lambda rule: 1 / 0)
    assert [mt.data._tagged(s, "<bt>", rule) for s in sources] == expected


def test_a_change_of_tag_or_tagged_splits_is_not_served_a_stale_cache(data_dir, tmp_path):
    cache = str(tmp_path / "cache")
    tagged = load_train(_cfg(data_dir), cache_dir=cache)
    assert load_train(_cfg(data_dir), cache_dir=cache)._fingerprint == tagged._fingerprint
    other_tag = load_train(_cfg(data_dir, tag="<SYN>"), cache_dir=cache)
    untagged = load_train(_cfg(data_dir, tagged=[]), cache_dir=cache)
    both = load_train(_cfg(data_dir, tagged=["train", "bt"]), cache_dir=cache)
    fingerprints = {d._fingerprint for d in (tagged, other_tag, untagged, both)}
    assert len(fingerprints) == 4
    n = len(TRAIN[0])
    assert list(other_tag["src"][n:n + 2]) == ["<SYN> " + s for s in BT[0][:2]]
    assert list(untagged["src"]) == TRAIN[0] + BT[0]
    assert _tagged(both) == sum(1 for s in TRAIN[0] + BT[0] if s.strip())
    tok = train_tokenizer(TRAIN[0], TRAIN[1], TokenizerConfig(vocab_size=60, user_symbols=["<BT>"]))
    encoded = [encode_split(d, tok, num_proc=1) for d in (tagged, other_tag, untagged)]
    assert len({e._fingerprint for e in encoded}) == 3
    assert encoded[0]["src_ids"][n][0] == tok.symbol_id("<BT>")
    # the tag's id decides which sources are empty (the tag alone): part of the key too
    with_tag = encode_split(tagged, tok, num_proc=1, tag_id=tok.symbol_id("<BT>"))
    assert with_tag._fingerprint != encoded[0]._fingerprint
    assert encoded[2]["src_ids"][n][0] != tok.symbol_id("<BT>")


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"tagged": ["bx"]}, r"^data\.tagged: 'bx' is not one of data\.train's splits \(train, bt\)$"),
     ({"tagged": ["valid"]}, r"^data\.tagged: 'valid' is not one of data\.train's splits"),
     ({"tag": ""}, r"^data\.tag must be one non-empty word"),
     ({"tag": "<B T>"}, r"^data\.tag must be one non-empty word"),
     ({"tag": "<B,T>"}, r"^data\.tag must be one non-empty word"),
     ({"tag": "\uff1cBT\uff1e"}, r"^data\.tag must be .* that NFKC leaves as it is")],
)
def test_bad_tagged_names_and_tags_fail_naming_the_key(data_dir, changes, message):
    with pytest.raises(ValueError, match=message):
        load_train(_cfg(data_dir, **changes))


def test_a_reused_tokenizer_without_the_tag_fails_at_start_up(data_dir, tmp_path, monkeypatch,
                                                               caplog):
    from mt.corpus import Corpus

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    plain = train_tokenizer(TRAIN[0], TRAIN[1], TokenizerConfig(vocab_size=60))
    plain.save(tmp_path / "plain")
    cfg = TrainConfig()
    cfg.data = _cfg(data_dir, tokenizer=TokenizerConfig(vocab_size=60,
                                                        path=str(tmp_path / "plain")))
    with pytest.raises(ValueError, match=r"^data\.tagged / data\.tokenizer\.user_symbols: .*plain"
                                         r".*data\.tokenizer\.path.*'<BT>'; retrain it"):
        Corpus(cfg, tmp_path / "run", rank=0, world=1)
    # a tokenizer trained here has it, is recorded as such, and is reused without a word
    cfg.data.tokenizer.path = str(tmp_path / "tagged")
    with caplog.at_level(logging.INFO, logger="mt.train"):
        corpus = Corpus(cfg, tmp_path / "run", rank=0, world=1)
    tagged_pairs = sum(1 for row in corpus.pairs.rows if row >= len(TRAIN[0]))  # bt's kept
    assert f"data.tagged: {tagged_pairs} of the {len(corpus.pairs)} training pairs kept have " \
           "sources tagged <BT> (splits bt)" in caplog.text
    assert corpus.tokenizer.symbol_id("<BT>") is not None
    assert corpus.valid["valid"][0] == TRAIN[0][:5]  # valid stays untagged
    meta = json.loads((tmp_path / "tagged" / META_FILE).read_text())
    assert meta["config"]["user_symbols"] == ["<BT>"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.tokenizer"):
        again = load_or_train(tmp_path / "tagged", lambda: pytest.fail("trained again"),
                              TokenizerConfig(vocab_size=60), seed=cfg.trainer.seed)
    assert again.fingerprint == corpus.tokenizer.fingerprint
    assert "different settings" not in caplog.text  # an unused extra symbol is no change


def test_a_tagged_source_without_text_is_dropped_as_empty_and_the_log_counts_what_is_kept(
        tmp_path, monkeypatch, caplog):
    """A source that encodes to nothing (a zero-width space, blanks, the tag alone) in a tagged
    split trained as the tag alone, "<BT>" -> target: one token passed data.filter.min_tokens=1.
    And the log counted tagged pairs before the filters, not the ones trained on."""
    from mt.corpus import Corpus

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    blank = ["\u200b", "<BT>", "<BT> \u200b", "\u200b\u200b ", "<BT>\u200b", "   "]
    src, tgt = _sentences(40, 7), _sentences(40, 8, "en")
    _write(tmp_path / "d", "train", ["\u200b", *TRAIN[0][:60]], ["a b", *TRAIN[1][:60]])
    _write(tmp_path / "d", "bt", [*blank, *src], [*_sentences(len(blank), 9, "en"), *tgt])
    _write(tmp_path / "d", "valid", TRAIN[0][:5], TRAIN[1][:5])
    cfg = TrainConfig()
    cfg.data = _cfg(tmp_path / "d", tokenizer=TokenizerConfig(vocab_size=60),
                    filter=FilterConfig(max_ratio=0, dedup=False))
    with caplog.at_level(logging.INFO, logger="mt.train"):
        corpus = Corpus(cfg, tmp_path / "run", rank=0, world=1)
    report = corpus.pairs.report
    assert (report.empty, report.too_short) == (1 + len(blank), 0)  # "\u200b" in train too
    assert report.kept == 60 + len(src) == len(corpus.pairs)
    first_bt = 61 + len(blank)
    assert corpus.pairs.rows.tolist() == [*range(1, 61), *range(first_bt, first_bt + len(src))]
    tag = corpus.tokenizer.symbol_id("<BT>")
    for i in range(60, len(corpus.pairs)):
        ids = corpus.collate([i])[0][0].tolist()
        assert ids[0] == tag and ids[1] not in (tag, EOS_ID)
    assert (f"data.tagged: {len(src)} of the {60 + len(src)} training pairs kept have sources "
            "tagged <BT> (splits bt)") in caplog.text


def test_fine_tuning_a_model_without_the_tag_on_tagged_data_fails_at_start_up(data_dir, tmp_path,
                                                                              monkeypatch):
    from mt.corpus import Corpus

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    plain = train_tokenizer(TRAIN[0], TRAIN[1], TokenizerConfig(vocab_size=60))
    cfg = TrainConfig(init_from="base.pt")
    cfg.data = _cfg(data_dir)
    with pytest.raises(ValueError, match=r"^data\.tagged / data\.tokenizer\.user_symbols: the "
                                         r"tokenizer of init_from=base\.pt has no single piece "
                                         r"for '<BT>'; the model was trained without it$"):
        Corpus(cfg, tmp_path / "run", rank=0, world=1, tokenizer=plain, origin="init_from=base.pt")
    assert not (tmp_path / "run" / "tokenizer").exists()  # nothing placed that a retry would meet


def test_mt_train_with_tagged_back_translation(tmp_path, corpus_dir, tokenizer_dir):
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    for lang in ("en", "zz"):  # a synthetic corpus: some training pairs again
        lines = (corpus_dir / f"train.{lang}").read_text().splitlines()[:100]
        (data / f"bt.{lang}").write_text("".join(line + "\n" for line in lines))
    run = tmp_path / "run"
    cmd = [PYTHON, "-m", "mt.train", *tiny_train_args(corpus_dir, tokenizer_dir),
           f"data.dir={data}", "data.train=train+bt", "data.tagged=[bt]",
           f"data.tokenizer.path={tmp_path / 'tok'}", "data.tokenizer.vocab_size=200",
           "trainer.max_steps=3", "trainer.validate_every=3", "trainer.test_at_end=false",
           f"hydra.run.dir={run}"]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    kept = re.search(r"kept ([\d,]+) of 500 pairs", result.stderr).group(1)
    tagged = re.search(rf"data\.tagged: (\d+) of the {kept} training pairs kept have sources "
                       r"tagged <BT> \(splits bt\)", result.stderr)
    assert tagged and 90 <= int(tagged.group(1)) <= 100, result.stderr[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    tok = Tokenizer.from_state(ckpt["tokenizer"])
    assert tok.symbol_id("<BT>") is not None
    assert ckpt["config"]["data"]["tagged"] == ["bt"]


def test_a_case_folding_tokenizer_put_in_data_tokenizer_path_by_hand_finds_the_tag(
        tmp_path, corpus_dir, trainer_factory):
    """A SentencePiece model put in data.tokenizer.path by hand (no tokenizer.json) is used as it
    is, but the sources were tagged by the command line's normalization (nmt_nfkc) before it was
    loaded: "<BT> ..." lines were tagged again for a case-folding model's "<bt>", and trained on
    two tags; the resume, which reads the model's settings first, tagged them once, so the run
    trained on other pairs after each restart."""
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    src, tgt = ([line.rstrip("\n") for line in open(corpus_dir / f"train.{lang}")][:40]
                for lang in ("en", "zz"))
    (data / "bt.en").write_text("".join(f"<BT> {line}\n" for line in src))
    (data / "bt.zz").write_text("".join(f"{line}\n" for line in tgt))
    made = TokenizerConfig(vocab_size=150, normalization="nmt_nfkc_cf", user_symbols=["<bt>"])
    tok = train_tokenizer(src, tgt, made, seed=0)
    by_hand = tmp_path / "tok"
    tok.save(by_hand)
    (by_hand / META_FILE).unlink()  # as tokenizers/README.md's models, or a model's place()d one
    trainer = trainer_factory("run", f"data.tokenizer.path={by_hand}", f"data.dir={data}",
                              "data.train=train+bt", "data.tagged=[bt]", "data.tag='<bt>'")
    tag = tok.symbol_id("<bt>")
    corpus = trainer.corpus
    firsts = [corpus.collate([i])[0][0].tolist()[:2] for i in range(len(corpus.pairs))]
    assert sum(ids[0] == tag for ids in firsts) >= 30  # bt's pairs kept, tagged
    assert not any(ids == [tag, tag] for ids in firsts)  # "<BT> ..." read as tagged: once
