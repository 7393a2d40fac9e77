"""Byte fallback and normalization (data.tokenizer.byte_fallback / normalization): characters the
vocabulary lacks survive encoding and decoding, a tokenizer trained otherwise is not reused, and
everything that reads pieces (long-line cuts, prefixes, constraints, alignment, exports) copes
with a character spelled in several byte pieces."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import unicodedata

import pytest
import torch

from mt.config import UNK_ID, ModelConfig, TokenizerConfig, TrainConfig
from mt.config_checks import check_values
from mt.tokenizer import META_FILE, Tokenizer, load_or_train, train_tokenizer

WORDS = ["house", "garden", "green", "small", "river", "stone", "light", "water", "tree", "bird",
         "walks", "sees", "the", "a", "of", "in", "and", "runs", "old", "new", "12", "2024", "."]
RARE = "\u00bd \u20ac \U0001f600 \u5317\u4eac"  # ½ € 😀 北京: none of them in the training text
TYPOGRAPHY = "\ufb01 \uff12\uff10\uff12\uff14"  # ﬁ ２０２４: NFKC makes them fi 2024


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(n)]


TEXT = _sentences(300, 1)


def _train(**kw) -> Tokenizer:
    return train_tokenizer(TEXT, TEXT, TokenizerConfig(vocab_size=kw.pop("vocab_size", 320), **kw),
                           seed=0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte fallback, no normalization: the text as written, whatever its characters."""
    return _train(byte_fallback=True, normalization="identity")


def test_byte_fallback_round_trips_what_the_vocabulary_lacks(tok):
    lines = [RARE, TYPOGRAPHY, f"the {RARE} house", "man\U0001f600 and \U0001f600dog"]
    for ids in tok.encode_src(lines) + tok.encode_tgt(lines):
        assert UNK_ID not in ids
    assert tok.decode_tgt(tok.encode_tgt(lines)) == lines  # exactly: nothing rewritten
    assert [tok.src.decode(ids[:-1]) for ids in tok.encode_src(lines)] == lines
    pieces = tok.src.encode(RARE, out_type=str)
    assert "<0xE2>" in pieces and "<0xF0>" in pieces  # € and 😀 in bytes


def test_without_byte_fallback_rare_characters_are_unk_as_before():
    off = _train(vocab_size=100, byte_fallback=False)
    ids = off.encode_tgt([RARE])[0]
    assert ids.count(UNK_ID) == 4  # ⁄ (NFKC made ½ 1⁄2), €, 😀 and 北京 (one run of unknowns)
    assert "\u2047" in off.decode_tgt([ids])[0] and "\u20ac" not in off.decode_tgt([ids])[0]
    assert not any(off.src.is_byte(i) for i in range(off.src_vocab_size))


@pytest.mark.parametrize("rule", ["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"])
def test_normalization_is_the_rule_asked_for(rule):
    tok = _train(byte_fallback=True, normalization=rule)  # bytes for what NFKC does not rewrite
    text = f"House {TYPOGRAPHY} \u00bd"
    back = tok.decode_tgt(tok.encode_tgt([text]))[0]
    want = text if rule == "identity" else unicodedata.normalize("NFKC", text)
    assert back == (want.casefold() if rule.endswith("_cf") else want)


def test_the_model_holds_the_settings_asked_for(tok):
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    for proto, fallback, rule in [(tok.src_proto, True, "identity"),
                                  (_train(vocab_size=100).src_proto, False, "nmt_nfkc"),
                                  (_train(normalization="nfkc_cf").src_proto, False, "nfkc_cf")]:
        model = pb.ModelProto()
        model.ParseFromString(proto)
        assert (model.trainer_spec.byte_fallback, model.normalizer_spec.name) == (fallback, rule)


def test_bad_values_are_one_line_errors_naming_the_key():
    cfg = TrainConfig()
    cfg.data.tokenizer = TokenizerConfig(normalization="nfc")
    with pytest.raises(ValueError, match="^data.tokenizer.normalization must be one of nmt_nfkc"):
        check_values(cfg)
    cfg.data.tokenizer = TokenizerConfig(vocab_size=200, byte_fallback=True)
    with pytest.raises(ValueError, match="^data.tokenizer.vocab_size=200 leaves no room for the "
                                         "256 byte pieces"):
        check_values(cfg)
    cfg.data.tokenizer = TokenizerConfig(vocab_size=200)  # byte fallback is off by default
    check_values(cfg)
    # room for the bytes but not for the text's characters too: SentencePiece's count, our key
    with pytest.raises(ValueError, match=r"^data.tokenizer.vocab_size=270: the text needs at "
                                         r"least \d+ pieces.*byte_fallback=false\)$"):
        _train(vocab_size=270, byte_fallback=True)
    with pytest.raises(ValueError, match=r"^data.tokenizer.vocab_size=270: the source text needs "
                                         r"at least \d+ pieces"):  # separate: which side is said
        _train(vocab_size=270, byte_fallback=True, joint=False)
    with pytest.raises(ValueError, match="data.tokenizer.normalization"):
        _train(normalization="nfc")
    # case folding would fold the back-translation tag out of its own piece: said before training
    with pytest.raises(ValueError, match="nmt_nfkc_cf folds the case of '<BT>' .*lower case"):
        _train(normalization="nmt_nfkc_cf", user_symbols=["<BT>"])
    assert _train(normalization="nmt_nfkc_cf", user_symbols=["<bt>"]).symbol_id("<bt>") is not None


def _forget_settings(directory) -> None:
    """Makes ``directory``'s tokenizer.json as mt wrote it before these keys existed."""
    meta = json.loads((directory / META_FILE).read_text())
    del meta["config"]["byte_fallback"], meta["config"]["normalization"]
    (directory / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("change", [{"byte_fallback": True}, {"normalization": "identity"}])
@pytest.mark.parametrize("recorded", [True, False])
def test_a_tokenizer_trained_otherwise_is_not_reused(tmp_path, change, recorded):
    """Another vocabulary size only warns; a tokenizer that spells text otherwise than the run
    asks (unk for what it lacks, or rewritten typography) stops the run, as tokenizer.json
    records it; one that predates these keys (``recorded=False``) was trained without byte
    fallback and with nmt_nfkc."""
    before = TokenizerConfig(vocab_size=300, byte_fallback=False)
    made = load_or_train(tmp_path / "tok", lambda: (TEXT, TEXT), before, seed=0)
    if not recorded:
        _forget_settings(tmp_path / "tok")
    now = dataclasses.replace(before, **change)
    key, value = next(iter(change.items()))
    was = {"byte_fallback": "false", "normalization": "nmt_nfkc"}[key]
    with pytest.raises(ValueError, match=f"tok: its tokenizer was trained with data.tokenizer."
                                         f"{key}={was}, this run asks for {str(value).lower()}: "
                                         f"set data.tokenizer.{key}={was} to use it, or point "
                                         "data.tokenizer.path at a new directory"):
        load_or_train(tmp_path / "tok", lambda: pytest.fail("trained again"), now)
    again = load_or_train(tmp_path / "tok", lambda: pytest.fail("trained again"), before)
    assert again.fingerprint == made.fingerprint
    # encoded data is cached by the tokenizer's fingerprint: another setting, another cache
    assert train_tokenizer(TEXT, TEXT, now).fingerprint != made.fingerprint


def test_a_tokenizer_from_before_the_keys_is_reused_with_the_defaults(tmp_path, caplog):
    """The defaults are what mt did before the keys existed: such a tokenizer is reused without
    an error or a warning. A model's tokenizer that ``place`` wrote records no settings and is
    taken as it is."""
    cfg = TokenizerConfig(vocab_size=300)
    made = load_or_train(tmp_path / "old", lambda: (TEXT, TEXT), cfg, seed=0)
    _forget_settings(tmp_path / "old")
    with caplog.at_level(logging.WARNING, logger="mt.tokenizer"):
        again = load_or_train(tmp_path / "old", lambda: pytest.fail("trained again"), cfg)
    assert again.fingerprint == made.fingerprint and "different settings" not in caplog.text
    made.save(tmp_path / "placed", {"from": "init_from=x"})
    asks = dataclasses.replace(cfg, byte_fallback=True, normalization="identity")
    placed = load_or_train(tmp_path / "placed", lambda: pytest.fail("trained again"), asks)
    assert placed.fingerprint == made.fingerprint


def test_prefixes_and_constraints_take_what_the_vocabulary_lacks(tok):
    from mt.constraints import encode_phrases
    from mt.lines import encode_prefixes

    [prefix] = encode_prefixes(tok, [f"{RARE} the"])
    [[phrase]] = encode_phrases(tok, [[RARE]])
    assert UNK_ID not in prefix and UNK_ID not in phrase
    assert tok.decode_tgt([prefix, phrase]) == [f"{RARE} the", RARE]


def test_a_long_word_is_cut_between_characters_not_inside_one(tok):
    from mt.lines import _pieces

    word = "\u5317\u4eac\u4e0a\u6d77\u5e7f\u5dde\u6df1\u5733" * 3  # one word, 3 bytes a character
    ids = tok.encode_src([word])[0]
    assert len(ids) > 70
    for limit in range(5, 12):  # room for a whole character (3 bytes) after the cut
        pieces = _pieces(ids, limit, tok.src_boundaries)
        texts = [tok.src.decode(p[:-1]) for p in pieces]
        assert all(len(p) <= limit for p in pieces)
        assert "".join(texts) == word and all("\ufffd" not in t for t in texts)


def test_alignment_and_word_scores_count_a_character_in_bytes_as_one(tok):
    """An emoji in bytes belongs to the word it is written in, on both sides: every link names a
    word of the source line and of the translation, and word scores are one per word."""
    from mt.alignment import _word_index, align_lines, word_scores
    from mt.lines import search_lines
    from mt.model import build_model
    from mt.options import SearchOptions

    lines = ["the dog\U0001f600 runs", "\U0001f600 \u5317\u4eac green", "a \U0001f600 b \u20ac",
             "\U0001f600"]
    for line in lines:  # as the input's whitespace-separated words, bytes joined
        ids = tok.encode_src([line])[0][:-1]
        index = _word_index(tok.src, ids, source=True)
        assert [w for w in index if w >= 0] == sorted(w for w in index if w >= 0)
        assert max(index) == len(line.split()) - 1
    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=2, d_model=32, ffn_dim=64,
                                    heads=2, dropout=0.0, max_positions=64,
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    prefixes = ["\U0001f600 the", "green \u20ac", "", "\u5317"]  # bytes in every translation
    with torch.inference_mode():  # as translate runs them
        results = search_lines(model, tok, lines, SearchOptions(beam=2, max_len_a=0, max_len_b=6),
                               prefixes=prefixes)
        aligned, scores = align_lines(model, tok, results), word_scores(tok, results)
    for line, r, links, score in zip(lines, results, aligned, scores, strict=True):
        hyp = tok.decode_tgt([r.hyps[0][0].tokens])[0]
        pairs = [tuple(map(int, p.split("-"))) for p in links[0].split()]
        assert pairs and all(i < len(line.split()) and j < len(hyp.split()) for i, j in pairs)
        assert len(score[0].split()) == len(hyp.split()) + 1  # and EOS


def test_bytes_of_whitespace_separate_words_in_alignments_and_word_scores(tok):
    """A model with byte fallback can write whitespace in bytes (<0x20>, <0x0A>, a no-break
    space's <0xC2><0xA0>): the printed text splits there, so word scores and alignment links
    count the words on each side of it. They joined them into one, giving fewer word scores than
    words, and a link to a word the text does not have the number of."""
    from mt.alignment import _word_index, align_lines, word_scores
    from mt.lines import nbest_texts
    from mt.model import build_model
    from mt.results import LineResult
    from mt.search import Hypothesis

    sp = tok.tgt
    house, garden, s = (sp.piece_to_id(p) for p in ["\u2581house", "\u2581garden", "s"])
    space, newline, c2, a0 = (sp.piece_to_id(p) for p in ["<0x20>", "<0x0A>", "<0xC2>", "<0xA0>"])
    euro = [sp.piece_to_id(p) for p in ["<0xE2>", "<0x82>", "<0xAC>"]]  # €: no whitespace
    translations = [[house, space, s], [house, newline, garden], [space, house], [house, space],
                    [house, c2, a0, s, *euro], [house, *euro, space, *euro]]
    assert _word_index(sp, translations[0]) == [0, -1, 1]
    assert _word_index(sp, translations[4]) == [0, -1, -1, 1, 1, 1, 1]
    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, dropout=0.0, max_positions=64,
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    line = "the old house"
    src = tok.encode_src([line])[0]
    lps = [[-0.5] * (len(t) + 1) for t in translations]
    results = [LineResult([src], [[Hypothesis(t, -1.0, sum(lp), lp)]], line)
               for t, lp in zip(translations, lps, strict=True)]
    texts = [nbest[0][0] for nbest in nbest_texts(model, tok, results)]
    scores, aligned = word_scores(tok, results), align_lines(model, tok, results)
    for text, score, links, r in zip(texts, scores, aligned, results, strict=True):
        numbers = [float(x) for x in score[0].split()]
        assert len(numbers) == len(text.split()) + 1, (text, score)
        assert sum(numbers) == pytest.approx(r.hyps[0][0].logprob)
        pairs = [tuple(map(int, p.split("-"))) for p in links[0].split()]
        assert all(j < len(text.split()) for _, j in pairs), (text, links)
        assert len({j for _, j in pairs}) == len(text.split()), (text, links)  # each word linked


def test_a_tab_in_the_source_takes_no_link_and_splits_words_in_a_translation(tok, monkeypatch):
    """normalization=identity keeps a tab: byte fallback spells it <0x09>, a vocabulary trained
    on tabbed text has a piece of its own for it. A source tab belongs to no word, yet it was a
    candidate for each target token's link: one that attended to it most lost its link instead of
    taking its best word. In a translation a tab piece joined the words on either side into one
    (two words scored, three printed)."""
    import mt.alignment
    from mt.alignment import _word_index, align_lines, word_scores
    from mt.model import build_model
    from mt.results import LineResult
    from mt.search import Hypothesis

    tabbed = [s.replace(" ", "\t", 1) for s in TEXT]
    tab_tok = train_tokenizer(tabbed, tabbed, TokenizerConfig(vocab_size=70,
                                                              normalization="identity"), seed=0)
    line = "the\told house"
    for t, tab in ((tok, "<0x09>"), (tab_tok, "\t")):
        src = t.encode_src([line])[0]
        assert t.src.piece_to_id(tab) in src
        hyp = t.encode_tgt([line])[0]  # the line itself as the translation (no EOS)
        index = _word_index(t.tgt, hyp)
        assert index[:2] == [0, -1] and set(index[2:]) == {1, 2}  # three words, no tab
        words = mt.alignment._source_words(t.src, line, src[:-1])

        def attention(model, src_t, tgt_t, layer, src=src, words=words, hyp=hyp, t=t):
            """Each target token weighs the tab most, then the first token of its own word."""
            out = torch.zeros(1, tgt_t.shape[1], src_t.shape[1])
            out[0, :, [i for i, w in enumerate(words) if w < 0]] = 0.9
            for j, w in enumerate(_word_index(t.tgt, hyp)):
                if w >= 0:
                    out[0, j, words.index(w)] = 0.5
            return out

        monkeypatch.setattr(mt.alignment, "cross_attention", attention)
        model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16,
                                        ffn_dim=32, heads=2, max_positions=64,
                                        src_vocab_size=t.src_vocab_size,
                                        tgt_vocab_size=t.tgt_vocab_size)).eval()
        lps = [-0.5] * (len(hyp) + 1)
        results = [LineResult([src], [[Hypothesis(hyp, -1.0, sum(lps), lps)]], line)]
        assert align_lines(model, t, results) == [["0-0 1-1 2-2"]]
        assert len(word_scores(t, results)[0][0].split()) == len(line.split()) + 1  # and EOS


def test_a_piece_with_a_tab_inside_counts_the_words_it_spans(monkeypatch):
    """Under normalization=identity a tab and the digits beside it are one Unicode script, so
    SentencePiece learns pieces such as '\\t2024\\t'. In a translation such a piece joined the
    words before and after it into one (two words counted in "old<TAB>2024<TAB>green tree", four
    printed, every later link and score off by two); in a source it belonged to its tab's no word,
    so 2024 was never linked."""
    import mt.alignment
    from mt.alignment import _source_words, _word_index, align_lines, word_scores
    from mt.model import build_model
    from mt.results import LineResult
    from mt.search import Hypothesis

    tabbed = [s.replace(" ", "\t") for s in TEXT]
    t = train_tokenizer(tabbed, tabbed, TokenizerConfig(vocab_size=80, normalization="identity"),
                        seed=0)
    line = "old\t2024\tgreen tree"
    hyp = t.encode_tgt([line])[0]
    assert any("\t" in p and p.strip() for p in map(t.tgt.id_to_piece, hyp)), hyp
    index = _word_index(t.tgt, hyp)
    assert sorted(set(index)) == [0, 1, 2, 3]  # as line.split() counts them
    src = t.encode_src([line])[0]
    words = _source_words(t.src, line, src[:-1])
    assert sorted(set(words)) == [0, 1, 2, 3]

    def attention(model, src_t, tgt_t, layer):
        """Each target token weighs the first source token of its own word most."""
        out = torch.zeros(1, tgt_t.shape[1], src_t.shape[1])
        for j, w in enumerate(index):
            out[0, j, words.index(w)] = 0.5
        return out

    monkeypatch.setattr(mt.alignment, "cross_attention", attention)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, max_positions=64, src_vocab_size=t.src_vocab_size,
                                    tgt_vocab_size=t.tgt_vocab_size)).eval()
    lps = [-0.5] * (len(hyp) + 1)
    results = [LineResult([src], [[Hypothesis(hyp, -1.0, sum(lps), lps)]], line)]
    assert align_lines(model, t, results) == [["0-0 1-1 2-2 3-3"]]
    assert len(word_scores(t, results)[0][0].split()) == len(line.split()) + 1  # and EOS


def test_subword_candidates_spell_a_rare_character_alike(tok):
    from mt.subwords import Segmentations

    seg = Segmentations(tok.src, [f"the {RARE}", "green house"], nbest=8, max_tokens=100,
                        add_eos=False)
    assert seg.first[1] > 1  # several candidates
    for c in range(len(seg.offsets) - 1):
        ids = seg.ids[seg.offsets[c]:seg.offsets[c + 1]].tolist()
        assert tok.src.decode(ids) == ["the " + RARE, "green house"][seg.owner[c]]


def test_exports_keep_byte_pieces(tmp_path, tok):
    """Marian's tokenizer and CTranslate2 read and write byte pieces as mt does, and an import of
    the Marian export gives back the same tokenizer behaviour."""
    transformers = pytest.importorskip("transformers")
    ctranslate2 = pytest.importorskip("ctranslate2")
    pytest.importorskip("google.protobuf")
    from mt.export import export_ctranslate2, export_hf
    from mt.import_hf import import_hf
    from mt.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32,
                                    heads=2, dropout=0.0, max_positions=64,
                                    src_vocab_size=tok.src_vocab_size,
                                    tgt_vocab_size=tok.tgt_vocab_size)).eval()
    lines = [RARE, f"the {RARE} house"]
    export_hf(model, tok, tmp_path / "hf")
    hf_tok = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(lines)["input_ids"] == tok.encode_src(lines)
    assert hf_tok.batch_decode(tok.encode_tgt(lines), skip_special_tokens=True) == lines
    _, back = import_hf(tmp_path / "hf")
    assert back.encode_src(lines) == tok.encode_src(lines)
    assert back.decode_tgt(tok.encode_tgt(lines)) == lines

    export_ctranslate2(model, tok, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    pieces = [tok.src.encode(t, out_type=str) for t in lines]
    result = translator.translate_batch(pieces, max_decoding_length=40, target_prefix=pieces)
    for want, r in zip(lines, result, strict=True):  # the prefix comes back as pieces it knows
        assert tok.tgt.decode_pieces(r.hypotheses[0]).startswith(want)
