"""SentencePiece training, special ids, save/load and reuse of a tokenizer directory."""

import json
import logging
import random
import re

import pytest
import sentencepiece as spm

from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TokenizerConfig
from mt.tokenizer import META_FILE, Tokenizer, _sample, load_or_train, train_tokenizer

WORDS = ["house", "garden", "green", "small", "river", "stone", "light", "water", "tree", "bird",
         "walks", "sees", "the", "a", "of", "in", "and", "runs", "old", "new"]


def _sentences(n: int, seed: int, suffix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) + suffix for _ in range(rng.randint(1, 12)))
            for _ in range(n)]


SRC = _sentences(400, 1)
TGT = _sentences(400, 2, suffix="en")


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
@pytest.mark.parametrize("joint", [True, False])
def test_train_special_ids_round_trip(model_type, joint):
    cfg = TokenizerConfig(model_type=model_type, vocab_size=120, joint=joint)
    tok = train_tokenizer(SRC, TGT, cfg, seed=0)
    assert tok.joint == joint
    for sp in (tok.src, tok.tgt):
        assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID,
                                                                        EOS_ID)
        assert sp.get_piece_size() <= 120
    src_ids = tok.encode_src(SRC[:20])
    assert all(ids[-1] == EOS_ID and EOS_ID not in ids[:-1] for ids in src_ids)
    assert tok.src.decode([ids[:-1] for ids in src_ids]) == SRC[:20]
    tgt_ids = tok.encode_tgt(TGT[:20])
    assert all(EOS_ID not in ids and BOS_ID not in ids for ids in tgt_ids)
    assert tok.decode_tgt(tgt_ids) == TGT[:20]
    if not joint:  # each side has its own pieces: target words all end in "en"
        assert tok.src.piece_to_id("▁house") != UNK_ID
        assert tok.tgt.piece_to_id("▁house") == UNK_ID


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_vocabulary_larger_than_the_text_supports_shrinks(model_type, caplog):
    # hard_vocab_limit=False: valid for bpe too (SentencePiece picks the largest size it can)
    with caplog.at_level("WARNING", logger="mt.tokenizer"):
        tok = train_tokenizer(SRC[:50], TGT[:50], TokenizerConfig(model_type=model_type,
                                                                   vocab_size=5000), seed=0)
    assert 30 < tok.src_vocab_size < 5000
    assert (f"data.tokenizer.vocab_size=5000: the text holds {tok.src_vocab_size} pieces"
            in caplog.text)  # said, not silent


@pytest.mark.parametrize("joint", [True, False])
def test_a_blank_side_says_which_side_has_no_text(joint):
    """A blank target file (as many empty lines as the source has) with separate vocabularies
    stopped mt-train with "no non-empty sentence to train SentencePiece on", naming no side."""
    tgt = [" "] * len(SRC)
    if joint:  # the sources alone make a joint vocabulary; the filters then drop every pair
        assert train_tokenizer(SRC, tgt, TokenizerConfig(vocab_size=100)).src_vocab_size > 4
        with pytest.raises(ValueError, match=r"^no non-empty sentence to train SentencePiece on "
                                             r"in the sample of data.train \(up to "):
            train_tokenizer(tgt, tgt, TokenizerConfig(vocab_size=100))
    else:
        with pytest.raises(ValueError, match="^no non-empty target sentence to train "
                                             "SentencePiece on .*is that side of the corpus "
                                             "blank"):
            train_tokenizer(SRC, tgt, TokenizerConfig(vocab_size=100, joint=False))


def test_same_seed_same_model_and_bad_type():
    cfg = TokenizerConfig(vocab_size=100)
    assert train_tokenizer(SRC, TGT, cfg, 3).fingerprint == train_tokenizer(SRC, TGT, cfg,
                                                                            3).fingerprint
    with pytest.raises(ValueError, match="data.tokenizer.model_type"):
        train_tokenizer(SRC, TGT, TokenizerConfig(model_type="wordpiece"))


def test_character_coverage_maps_rare_characters_to_unk():
    text = SRC + ["house ж"]  # one rare character among thousands
    full = train_tokenizer(text, TGT, TokenizerConfig(vocab_size=100, character_coverage=1.0))
    partial = train_tokenizer(text, TGT, TokenizerConfig(vocab_size=100, character_coverage=0.99))
    assert UNK_ID not in full.encode_tgt(["ж"])[0]
    assert UNK_ID in partial.encode_tgt(["ж"])[0]


def test_sample_is_bounded_deterministic_and_skips_empty_lines():
    lines = [f"line {i}" if i % 3 else " " for i in range(1000)]
    sample = _sample(iter(lines), 50, seed=4)
    assert len(sample) == 50 and all(s.strip() for s in sample)
    assert set(sample) <= set(lines)
    assert sample == _sample(iter(lines), 50, seed=4)
    assert sample != _sample(iter(lines), 50, seed=5)
    assert _sample(lines[:30], 50, seed=4) == [s for s in lines[:30] if s.strip()]
    # a small sample still trains a usable model
    tok = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=60, input_sentence_size=100))
    assert tok.decode_tgt(tok.encode_tgt(TGT[:5])) == TGT[:5]


@pytest.mark.parametrize("joint", [True, False])
def test_save_load_and_state_round_trip(tmp_path, joint):
    tok = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=100, joint=joint))
    tok.save(tmp_path / "tok", {"note": "x"})
    names = {p.name for p in (tmp_path / "tok").iterdir()}
    assert names == ({"spm.model", META_FILE} if joint else {"src.model", "tgt.model", META_FILE})
    meta = json.loads((tmp_path / "tok" / META_FILE).read_text())
    assert meta["joint"] == joint and meta["fingerprint"] == tok.fingerprint and meta["note"] == "x"
    for other in (Tokenizer.load(tmp_path / "tok"), Tokenizer.from_state(tok.to_state())):
        assert other.fingerprint == tok.fingerprint
        assert other.encode_src(SRC[:10]) == tok.encode_src(SRC[:10])
        assert other.encode_tgt(TGT[:10]) == tok.encode_tgt(TGT[:10])
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        Tokenizer.load(tmp_path)


def test_load_or_train_reuses_a_complete_directory(tmp_path, caplog):
    cfg = TokenizerConfig(vocab_size=100)
    calls = []

    def texts():
        calls.append(1)
        return SRC, TGT

    first = load_or_train(tmp_path / "tok", texts, cfg, seed=1)
    meta = json.loads((tmp_path / "tok" / META_FILE).read_text())
    assert meta["config"]["vocab_size"] == 100 and meta["seed"] == 1
    with caplog.at_level(logging.INFO, logger="mt.tokenizer"):
        again = load_or_train(tmp_path / "tok", texts, cfg, seed=1)
    assert calls == [1] and again.fingerprint == first.fingerprint
    assert f"reusing the tokenizer in {tmp_path / 'tok'} (joint, {first.src_vocab_size} pieces)" \
        in caplog.text  # which one a run reuses is said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.tokenizer"):
        other = load_or_train(tmp_path / "tok", texts, TokenizerConfig(vocab_size=200), seed=1)
    assert calls == [1] and other.fingerprint == first.fingerprint
    assert "vocab_size=100 (now 200)" in caplog.text
    # naming the directory in data.tokenizer.path is not a different setting
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mt.tokenizer"):
        load_or_train(tmp_path / "tok", texts, TokenizerConfig(vocab_size=100,
                                                               path=str(tmp_path / "tok")), seed=1)
    assert "different settings" not in caplog.text
    # a directory without tokenizer.json is incomplete (interrupted): trained again
    (tmp_path / "tok" / META_FILE).unlink()
    load_or_train(tmp_path / "tok", texts, cfg, seed=1)
    assert calls == [1, 1]


def test_a_model_put_in_data_tokenizer_path_by_hand_is_used_never_trained_over(tmp_path,
                                                                               caplog):
    """A SentencePiece model copied into data.tokenizer.path without tokenizer.json (one from
    elsewhere, as tokenizers/README.md allows) was taken for an interrupted save: the run trained
    a tokenizer of its own and wrote it over the user's spm.model, and trained with that."""
    from mt.tokenizer import place

    mine = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=100), seed=1)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "spm.model").write_bytes(mine.src_proto)
    cfg = TokenizerConfig(vocab_size=150, path=str(tmp_path / "tok"))
    with caplog.at_level(logging.INFO, logger="mt.tokenizer"):
        tok = load_or_train(tmp_path / "tok", lambda: pytest.fail("trained over it"), cfg,
                            seed=1, shared=True)
    assert tok.fingerprint == mine.fingerprint
    assert (tmp_path / "tok" / "spm.model").read_bytes() == mine.src_proto
    assert f"using the SentencePiece model in {tmp_path / 'tok'} as it is" in caplog.text
    # a model's own tokenizer (init_from) is not written over it either
    other = train_tokenizer(SRC, SRC, TokenizerConfig(vocab_size=60), seed=1)
    with pytest.raises(ValueError, match="the model's tokenizer is not the one in"):
        place(tmp_path / "tok", other, "init_from=x.pt", shared=True)
    assert place(tmp_path / "tok", mine, "init_from=x.pt", shared=True).fingerprint == \
        mine.fingerprint
    assert (tmp_path / "tok" / "spm.model").read_bytes() == mine.src_proto
    # half a pair of separate models is said, naming the folder, not trained over
    (tmp_path / "tok" / "spm.model").rename(tmp_path / "tok" / "src.model")
    with pytest.raises(FileNotFoundError, match="expected spm.model, or src.model and tgt.model"):
        load_or_train(tmp_path / "tok", lambda: pytest.fail("trained over it"), cfg, seed=1,
                      shared=True)
    # a model trained with SentencePiece's own special ids is refused naming its folder
    (tmp_path / "tok" / "src.model").unlink()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SRC), model_prefix=str(
        tmp_path / "tok" / "spm"), vocab_size=30, minloglevel=2)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'tok'))}: source "
                                         r"SentencePiece model has special ids .* --pad_id=0"):
        load_or_train(tmp_path / "tok", lambda: pytest.fail("trained over it"), cfg, seed=1,
                      shared=True)


def test_a_save_cut_short_leaves_no_torn_model(tmp_path, monkeypatch):
    """A kill in the middle of writing spm.model left half a model under its name, which a
    data.tokenizer.path without tokenizer.json is now taken as (a model put there by hand)."""
    from pathlib import Path

    tok = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=100), seed=1)
    write = Path.write_bytes

    def killed_midway(self, data):
        write(self, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        tok.save(tmp_path / "tok")
    assert not (tmp_path / "tok" / "spm.model").exists()
    assert list((tmp_path / "tok").iterdir()) == []


def test_a_tokenizer_reused_on_other_data_is_said(tmp_path, caplog, monkeypatch):
    """A run's tokenizer, left by an attempt interrupted before its first checkpoint, was reused
    without a word by the next attempt in that folder on other data (another pair, another
    corpus): its pieces fit the first data only."""
    from mt.config import DataConfig
    from mt.data import data_identity

    cfg = TokenizerConfig(vocab_size=100)
    first = DataConfig(source="files", dir=str(tmp_path / "corpus"), src_lang="en", tgt_lang="de")
    load_or_train(tmp_path / "tok", lambda: (SRC, TGT), cfg, 1, data_identity(first))
    with caplog.at_level(logging.WARNING, logger="mt.tokenizer"):
        load_or_train(tmp_path / "tok", lambda: pytest.fail("trained again"), cfg, 1,
                      data_identity(first))
        assert "other data" not in caplog.text
        other = DataConfig(source="files", dir=str(tmp_path / "corpus"), src_lang="en",
                           tgt_lang="fr", train="train+bt")
        load_or_train(tmp_path / "tok", lambda: pytest.fail("trained again"), cfg, 1,
                      data_identity(other))
    assert (f"reusing the tokenizer in {tmp_path / 'tok'}, trained on other data: "
            "train='train' (now 'train+bt'), pair='en-de' (now 'en-fr')") in caplog.text
    demo = data_identity(DataConfig(dir=str(tmp_path / "run1")))
    assert demo == data_identity(DataConfig(dir=str(tmp_path / "run2")))  # one corpus
    (tmp_path / "corpus").mkdir()
    monkeypatch.chdir(tmp_path / "corpus")  # the same folder named from another: no change
    assert data_identity(DataConfig(source="files", dir="../corpus", src_lang="en",
                                    tgt_lang="de")) == data_identity(first)


@pytest.mark.parametrize("damage", ["spm.model", "empty spm.model", "json text", "json list"])
def test_a_damaged_reused_tokenizer_is_one_line_naming_its_file(tmp_path, damage):
    """A reused tokenizer folder (data.tokenizer.path) with a damaged file: SentencePiece's
    RuntimeError and an AttributeError on a JSON list were tracebacks in mt-train, and text that
    is not JSON was "Expecting value: line 1 column 1 (char 0)", naming no file."""
    cfg = TokenizerConfig(vocab_size=100)
    load_or_train(tmp_path / "tok", lambda: (SRC, TGT), cfg, seed=1)
    file, text = {"spm.model": ("spm.model", "junk\n"), "empty spm.model": ("spm.model", ""),
                  "json text": (META_FILE, "junk\n"),
                  "json list": (META_FILE, "[1, 2]\n")}[damage]
    (tmp_path / "tok" / file).write_text(text)
    said = ("not a SentencePiece model" if file == "spm.model" else "not a JSON object")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'tok' / file}: {said} \\(") as err:
        load_or_train(tmp_path / "tok", lambda: (SRC, TGT), cfg, seed=1)
    assert "\n" not in str(err.value)


def test_lines_longer_than_sentencepieces_default_limit_are_learned_from():
    """SentencePiece skips, without a word, every sentence over its max_sentence_length (4,192
    bytes by default): characters found only in long lines (a document-level corpus) got no
    piece and came out as <unk>, and a corpus of long lines only failed inside SentencePiece."""
    long = [" ".join(["straße grün über"] * 300)] * 20  # 5,999 bytes each: ß, ü only here
    tok = train_tokenizer(SRC[:50], long, TokenizerConfig(vocab_size=120), seed=1)
    ids = tok.encode_tgt(["straße grün über"])[0]
    assert UNK_ID not in ids and tok.decode_tgt([ids]) == ["straße grün über"]
    only_long = train_tokenizer(long, long, TokenizerConfig(vocab_size=60), seed=1)
    assert UNK_ID not in only_long.encode_src(["grün"])[0]


def test_a_user_symbol_given_twice_is_one_piece():
    """SentencePiece refused a repeated user symbol with a traceback ("is already defined")."""
    tok = train_tokenizer(SRC, TGT, TokenizerConfig(vocab_size=100, user_symbols=["<X>", "<X>"]),
                          seed=1)
    assert tok.encode_src(["<X> the house"])[0][0] == tok.src.piece_to_id("\u2581<X>")


def test_special_ids_are_checked():
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SRC), model_writer=model,
                                   vocab_size=40, minloglevel=2)  # default ids: unk=0, bos=1...
    with pytest.raises(ValueError, match="special ids"):
        Tokenizer(model.getvalue())


def test_source_boundaries_mark_word_starts_and_sentence_ends():
    ends = [".", "!", "?", '."', "", ",", ' "Yes."']
    text = [s + e for s, e in zip(SRC, ends * 60, strict=False)]
    tok = train_tokenizer(text, text, TokenizerConfig(vocab_size=150), seed=0)
    marks = tok.src_boundaries
    assert len(marks.starts) == len(marks.ends) == len(marks.closes) == tok.src_vocab_size
    assert marks.closes[tok.src.piece_to_id('"')] and marks.ends[tok.src.piece_to_id(".")]
    for ids, line in zip(tok.encode_src(text[:70]), text[:70], strict=True):
        words = [i for i, t in enumerate(ids[:-1]) if marks.starts[t]]
        assert len(words) == len(line.split())  # every word starts at a flagged piece
        last = len(ids) - 2
        while last > 0 and marks.closes[ids[last]]:
            last -= 1
        assert marks.ends[ids[last]] == line.rstrip('"').endswith((".", "!", "?"))
    assert not any(marks.starts[i] or marks.ends[i] or marks.closes[i]
                   for i in (PAD_ID, BOS_ID, EOS_ID, UNK_ID))


@pytest.mark.parametrize(("model_type", "coverage", "byte_fallback", "normalization", "joint"),
                         [("unigram", 1.0, False, "nmt_nfkc", True),
                          ("bpe", 0.9995, True, "nfkc_cf", False),
                          ("unigram", 0.98, False, "identity", False)])
def test_the_settings_read_from_a_tokenizer_are_those_it_was_trained_with(
        model_type, coverage, byte_fallback, normalization, joint):
    """What a run records as its data.tokenizer when the tokenizer is not of its making (a
    checkpoint's, one put in data.tokenizer.path by hand): read from the models themselves."""
    from mt.spm_spec import tokenizer_settings

    cfg = TokenizerConfig(model_type=model_type, vocab_size=400, joint=joint,
                          character_coverage=coverage, byte_fallback=byte_fallback,
                          normalization=normalization, user_symbols=["<bt>"])
    tok = train_tokenizer(SRC, TGT, cfg, seed=0)
    assert tokenizer_settings(tok.to_state()) == {
        "model_type": model_type, "character_coverage": coverage, "byte_fallback": byte_fallback,
        "normalization": normalization, "joint": joint,
        "vocab_size": max(tok.src_vocab_size, tok.tgt_vocab_size)}
    with pytest.raises(ValueError, match=r"^not a SentencePiece model \(cut short\)$"):
        tokenizer_settings({"src": tok.src_proto[:-3]})
