"""Vocabulary shortlists (mt.shortlist): what they learn, and that a search under one is the
search over each sentence's own pieces, whatever the batch."""

from __future__ import annotations

import random

import pytest
import torch

from mt.config import EOS_ID, PAD_ID, UNK_ID
from mt.incremental import Ensemble
from mt.inference import Int8Linear, PackedLinear, can_pack, load_models
from mt.lines import translate_ids
from mt.options import SearchOptions
from mt.search import beam_search, greedy_search
from mt.shortlist import Shortlist, lexical_probabilities, restricted_search
from tests.test_search import _model, _pad, _sources

V = 200


def _shortlist(seed: int = 0, per_source: int = 6, always: int = 10) -> Shortlist:
    """Random candidates per source piece: each sentence gets a small, different set."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(4, V, (V, per_source), generator=g)
    return Shortlist(table, torch.randint(4, V, (always,), generator=g), "fp", V)


def _searches():
    return {"greedy": lambda m, src, pre: [[h] for h in greedy_search(m, src, prefixes=pre)],
            "beam": lambda m, src, pre: beam_search(m, src, 4, 0.6, nbest=3, prefixes=pre)}


def _run(search, model, shortlist, sources, prefixes=None):
    src = _pad(sources)
    return restricted_search(lambda m, pre, _: search(m, src, pre), model, shortlist, src,
                             prefixes)


@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_a_shortlist_of_every_piece_changes_nothing(name):
    model, sources, search = _model(vocab=V), _sources(9, vocab=V), _searches()[name]
    every = Shortlist(torch.zeros((V, 1), dtype=torch.long), torch.arange(V), "fp", V)
    assert _run(search, model, every, sources) == _run(search, model, None, sources)


def test_greedy_under_a_shortlist_that_holds_its_output_changes_nothing():
    """Renormalising over fewer pieces moves no arg-max that is among them: greedy search under a
    shortlist holding each line's free translation (and no more than a few other pieces) gives
    that translation, its tokens mapped back to the model's ids, with scores at least the
    model's (a log-softmax over fewer pieces)."""
    model, sources = _model(vocab=V), _sources(9, vocab=V)
    free = _run(_searches()["greedy"], model, None, sources)
    used = sorted({t for (h,) in free for t in h.tokens})
    assert 4 < len(used) + 4 < V // 4  # a real restriction
    table = torch.full((V, 1), PAD_ID, dtype=torch.long)
    shortlist = Shortlist(table, torch.tensor(used, dtype=torch.long), "fp", V)
    restricted = _run(_searches()["greedy"], model, shortlist, sources)
    assert [h.tokens for (h,) in restricted] == [h.tokens for (h,) in free]
    for (r,), (f,) in zip(restricted, free, strict=True):
        assert r.logprob >= f.logprob - 1e-5


@pytest.mark.parametrize("bucketed", [False, True], ids=["rows", "bucketed"])
@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_each_sentence_searches_its_own_pieces_whatever_the_batch(name, bucketed):
    """A batch under a shortlist gives what each sentence alone gives from a model whose other
    pieces are impossible (-inf logits: the log-softmax then runs over its own pieces); also
    when the batch's steps compute padding rows (``pad_step_rows``: 36 beams, 48 rows)."""
    model, sources, search = _model(vocab=V), _sources(9, vocab=V), _searches()[name]
    model.pad_step_rows = bucketed
    shortlist = _shortlist()
    prefixes = [[5, 6] if i % 3 == 0 else [] for i in range(len(sources))]
    batched = _run(search, model, shortlist, sources, prefixes)
    project = model.project
    for i, src in enumerate(sources):
        own = shortlist.restrict(None, _pad([src]), [prefixes[i]])
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[own.vocab[own.allowed[0]]] = True
        assert allowed[prefixes[i]].all()
        assert batched[i][0].tokens[: len(prefixes[i])] == prefixes[i]
        bias = torch.zeros(V).masked_fill_(~allowed, -torch.inf)
        model.project = lambda y, bias=bias: project(y) + bias
        alone = _run(search, model, None, [src], [prefixes[i]])[0]
        del model.project
        assert [h.tokens for h in batched[i]] == [h.tokens for h in alone]
        assert all(allowed[t] for h in batched[i] for t in h.tokens)
        for a, b in zip(batched[i], alone, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    # and the shortlist did restrict: the unrestricted search differs somewhere
    assert batched != _run(search, model, None, sources, prefixes)


def test_a_batch_holds_its_pieces_in_blocks_of_64_the_specials_first():
    restricted = _shortlist().restrict(None, _pad(_sources(3, vocab=V)))
    vocab = restricted.vocab
    assert vocab.numel() % 64 == 0 and vocab[:4].tolist() == [0, 1, 2, 3]
    assert torch.equal(vocab, vocab.unique())
    assert restricted.allowed[:, :4].all()
    assert not restricted.allowed.all(0).all()  # padding pieces, allowed to none


def test_ibm1_learns_which_word_translates_which():
    """a b -> x y and a -> x: EM moves y's mass to b (the pigeonhole: a explains x)."""
    a, b, x, y = 4, 5, 6, 7
    pairs = [([a, b], [x, y]), ([a], [x])] * 3 + [([b], [y])]
    prob = lexical_probabilities(pairs, 8, 8, iterations=10)
    assert prob[a, x] > 0.9 and prob[b, y] > 0.9
    assert prob[a].sum() == pytest.approx(1.0) and prob[8].sum() == pytest.approx(1.0)  # NULL row
    assert prob[3].tolist() == [1 / 8] * 8  # never seen: uniform, as it started


def test_shortlist_file_round_trip_and_refusals(tmp_path):
    class Tok:
        fingerprint = "fp"

    shortlist = _shortlist()
    shortlist.save(tmp_path / "s.pt")
    back = Shortlist.load(tmp_path / "s.pt", Tok())
    assert torch.equal(back.table, shortlist.table) and torch.equal(back.always, shortlist.always)
    Tok.fingerprint = "other"
    with pytest.raises(ValueError, match="s.pt: the shortlist was made for another tokenizer"):
        Shortlist.load(tmp_path / "s.pt", Tok())
    (tmp_path / "bad.pt").write_text("not a shortlist")
    with pytest.raises(ValueError, match="bad.pt: not a shortlist file"):
        Shortlist.load(tmp_path / "bad.pt", Tok())
    with pytest.raises(ValueError, match="missing.pt: no such shortlist file"):
        Shortlist.load(tmp_path / "missing.pt", Tok())


@pytest.mark.parametrize("kind", ["packed", "int8"])
def test_output_layer_rows_compute_those_outputs(kind):
    if kind == "packed" and not can_pack("float32", "cpu"):
        pytest.skip("no oneDNN packing in this torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, V)
    layer = PackedLinear(linear, keep_plain=True) if kind == "packed" else Int8Linear(linear)
    index = torch.tensor([0, 3, 17, 150, 199])
    x = torch.randn(5, 32)
    with torch.inference_mode():
        assert torch.allclose(layer.rows(index)(x), layer(x)[:, index], atol=1e-5)


def test_padding_pieces_never_come_out_and_eos_always_can():
    model, sources = _model(vocab=V), _sources(6, vocab=V)
    tiny = Shortlist(torch.full((V, 1), PAD_ID), torch.tensor([9]), "fp", V)  # 9, UNK or EOS
    for nbest in _run(_searches()["beam"], model, tiny, sources):
        assert all(set(h.tokens) <= {UNK_ID, 9} for h in nbest)
    assert EOS_ID in tiny.always.tolist()


@pytest.fixture(scope="module")
def shortlisted(tmp_path_factory):
    """A tiny model, a corpus of its pieces and a shortlist learnt from it by mt-shortlist."""
    from mt.config import TokenizerConfig
    from mt.shortlist import main as shortlist_main
    from mt.tokenizer import train_tokenizer
    from tests.test_translate import _save_model, _sentence, _write

    tmp = tmp_path_factory.mktemp("shortlist")
    rng = random.Random(0)
    src = [_sentence(rng) for _ in range(300)]
    tgt = [" ".join(reversed(s.split())) for s in src]
    tok = train_tokenizer(src, tgt, TokenizerConfig(vocab_size=100))
    model = _save_model(tmp / "a.pt", tok, 0)
    out = tmp / "s.pt"
    shortlist_main(["-m", model, "--src", _write(tmp / "train.src", src), "--tgt",
                    _write(tmp / "train.tgt", tgt), "-o", str(out), "--per-source", "2",
                    "--frequent", "3"])
    lines = [_sentence(rng) for _ in range(12)]
    lines[4] = ""
    return {"model": model, "shortlist": str(out), "tok": tok, "lines": lines, "train": (src, tgt),
            "input": _write(tmp / "in.txt", lines)}


def test_mt_shortlist_learns_the_pieces_the_training_targets_use(shortlisted):
    """The targets are the sources' words reversed: each target piece has its source piece, so
    a sentence's list (3 frequent pieces, 2 per source piece) should hold nearly all of them."""
    s, tok = shortlisted, shortlisted["tok"]
    shortlist = Shortlist.load(s["shortlist"], tok)
    src, tgt = s["train"]
    hit = total = size = 0
    for ids, target in zip(tok.encode_src(src), tok.encode_tgt(tgt), strict=True):
        own = shortlist.restrict(None, torch.tensor([ids]))
        pieces = set(own.vocab[own.allowed[0]].tolist())
        hit += sum(t in pieces for t in target)
        total, size = total + len(target), size + len(pieces)
    assert hit / total > 0.95 and size / len(src) < 40  # of 100 pieces
    seen = {t for ids in tok.encode_src(src) for t in ids}
    never = [i for i in range(4, tok.src_vocab_size) if i not in seen]
    assert never and (shortlist.table[never] == PAD_ID).all()  # no candidates: nothing learnt
    assert (shortlist.table[:4] == PAD_ID).all()  # nor for <unk> (CTranslate2 cannot map it)


def test_translate_shortlist_cli_keeps_each_line_to_its_pieces(shortlisted, tmp_path, capsys):
    from mt.lines import search_lines, translate_lines
    from mt.results import line_texts
    from mt.translate import main
    from tests.test_translate import FAST

    s = shortlisted
    main(["-m", s["model"], "-i", s["input"], "--shortlist", s["shortlist"], *FAST])
    out = capsys.readouterr().out.split("\n")[:-1]
    assert len(out) == len(s["lines"]) and out[4] == ""
    tok = s["tok"]
    shortlist = Shortlist.load(s["shortlist"], tok)
    model, _, _ = load_models([s["model"]], "cpu")
    opts = SearchOptions(max_len_a=0, max_len_b=4, min_len=1)
    results = search_lines(model, tok, s["lines"], opts, shortlist=shortlist)
    assert out == [line_texts(tok, r)[0][0] for r in results]
    free = [n[0][0] for n in translate_lines(model, tok, s["lines"], opts)]
    assert out != free  # the shortlist is small enough to matter
    for r in results:
        for src, nbest in zip(r.sources, r.hyps, strict=True):
            own = shortlist.restrict(None, torch.tensor([src]))
            assert set(nbest[0].tokens) <= set(own.vocab[own.allowed[0]].tolist())
    # mt-eval --shortlist translates the same
    from mt.evaluate import main as eval_main

    ref = tmp_path / "ref.txt"
    ref.write_text("".join(t + "\n" for t in out), encoding="utf-8")
    hyp = tmp_path / "hyp.txt"
    eval_main(["-m", s["model"], "--src", s["input"], "--ref", str(ref), "--shortlist",
               s["shortlist"], "--max-len-a", "0", "--max-len-b", "4", "--min-len", "1",
               "--output", str(hyp), "--quiet"])
    assert hyp.read_text(encoding="utf-8").split("\n")[:-1] == out


def test_shortlist_refusals_name_the_file_or_option(shortlisted, tmp_path, capsys):
    from mt.shortlist import main as shortlist_main
    from mt.translate import main

    s = shortlisted
    with pytest.raises(SystemExit, match="does not combine with .*--shortlist"):
        main(["-m", s["model"], "-i", s["input"], "--score", s["input"], "--shortlist",
              s["shortlist"]])
    with pytest.raises(SystemExit, match="nope.pt: no such shortlist file"):
        main(["-m", s["model"], "-i", s["input"], "--shortlist", str(tmp_path / "nope.pt")])
    short = tmp_path / "short.txt"
    short.write_text("a\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=f"{s['input']} has 12 lines but {short} has 1"):
        shortlist_main(["-m", s["model"], "--src", s["input"], "--tgt", str(short), "-o",
                        str(tmp_path / "x.pt")])
    # -o never replaces what it reads (the model was written over, exit 0), nor, without
    # --force, any file; a directory or bad UTF-8 is one line that helps
    args = ["-m", s["model"], "--src", s["input"], "--tgt", s["input"], "-o"]
    before = open(s["model"], "rb").read()
    for out in (s["model"], s["input"]):
        with pytest.raises(SystemExit, match=f"^mt-shortlist: -o {out} is a file it reads"):
            shortlist_main([*args, out, "--force"])
    assert open(s["model"], "rb").read() == before
    with pytest.raises(SystemExit, match=f"^mt-shortlist: {short} exists; choose another -o or "
                                         "pass --force"):
        shortlist_main([*args, str(short)])
    shortlist_main([*args, str(short), "--force"])
    assert Shortlist.load(short, s["tok"]).tgt_vocab_size == s["tok"].tgt_vocab_size
    for out in (str(tmp_path), str(tmp_path / "new") + "/"):
        with pytest.raises(SystemExit, match=f"^mt-shortlist: -o {out} is a directory"):
            shortlist_main([*args, out])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\n\xff b\n" + b"c\n" * 10)
    with pytest.raises(SystemExit, match=f"^mt-shortlist: {bad}:2: invalid UTF-8 .*; use "
                                         "--errors replace to read it anyway$"):
        shortlist_main(["-m", s["model"], "--src", str(bad), "--tgt", s["input"], "-o",
                        str(tmp_path / "y.pt")])
    shortlist_main(["-m", s["model"], "--src", str(bad), "--tgt", s["input"], "-o",
                    str(tmp_path / "y.pt"), "--errors", "replace"])


def test_ctranslate2_vocabulary_map_is_the_same_shortlist(shortlisted, tmp_path):
    s, tok = shortlisted, shortlisted["tok"]
    shortlist = Shortlist.load(s["shortlist"], tok)
    shortlist.write_vmap(tok, tmp_path / "vmap.txt")
    rows = dict(line.split("\t") for line in
                (tmp_path / "vmap.txt").read_text(encoding="utf-8").splitlines())
    assert set(rows.pop("").split()) | set(tok.tgt.id_to_piece(range(4))) == set(
        tok.tgt.id_to_piece(shortlist.always.tolist()))
    for piece, targets in rows.items():
        row = shortlist.table[tok.src.piece_to_id(piece)].tolist()
        assert set(targets.split()) == set(tok.tgt.id_to_piece([t for t in row if t >= 4]))
    ctranslate2 = pytest.importorskip("ctranslate2")
    from mt.interop import export_main

    export_main(["-m", s["model"], "--format", "ctranslate2", "--out", str(tmp_path / "ct2"),
                 "--shortlist", s["shortlist"]])
    assert (tmp_path / "ct2" / "vmap.txt").read_text(encoding="utf-8") == (
        tmp_path / "vmap.txt").read_text(encoding="utf-8")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    for line in s["lines"][:4]:  # one sentence per batch: CTranslate2's union is its own list
        own = shortlist.restrict(None, torch.tensor([tok.encode_src([line])[0]]))
        allowed = set(tok.tgt.id_to_piece(own.vocab[own.allowed[0]].tolist()))
        result = translator.translate_batch([tok.src.encode(line, out_type=str)], beam_size=2,
                                            max_decoding_length=4, use_vmap=True)
        assert set(result[0].hypotheses[0]) <= allowed


def test_prefixes_and_constraints_are_allowed_beyond_the_shortlist():
    """A forced prefix or a constraint phrase outside a line's shortlist joins that line's
    pieces (and only that line's): the translation holds it, and nothing else new."""
    from mt.constraints import satisfied

    model, sources = _model(vocab=V), _sources(4, vocab=V)
    tiny = Shortlist(torch.full((V, 1), PAD_ID), torch.tensor([9]), "fp", V)
    opts = SearchOptions(beam=4, max_len_a=0, max_len_b=8)
    phrases = [[[7, 8]], [], [[11]], []]
    prefixes = [[], [12], [], []]
    hyps = translate_ids(model, sources, opts, prefixes=prefixes, constraints=phrases,
                         shortlist=tiny)
    for nbest, phrase, prefix in zip(hyps, phrases, prefixes, strict=True):
        own = {t for p in phrase for t in p} | set(prefix) | {9, UNK_ID}
        assert set(nbest[0].tokens) <= own
        assert satisfied(nbest[0].tokens, phrase) and nbest[0].tokens[: len(prefix)] == prefix


def _naive_ibm1(pairs, vs, vt, iterations):
    t = torch.full((vs + 1, vt), 1.0 / vt, dtype=torch.float64)
    for _ in range(iterations):
        c = torch.zeros_like(t)
        for s, tgt in pairs:
            for y in tgt:
                z = sum(t[x, y] for x in [vs, *s])
                for x in [vs, *s]:
                    c[x, y] += t[x, y] / z
        tot = c.sum(1, keepdim=True)
        seen = tot[:, 0] > 0
        t[seen] = c[seen] / tot[seen]
    return t


@pytest.mark.parametrize("chunk", [1, 50, 1 << 24])
def test_ibm1_equals_the_textbook_loop(chunk):
    rng = random.Random(0)
    pairs = [([rng.randrange(4, 30) for _ in range(rng.randint(1, 7))],
              [rng.randrange(4, 25) for _ in range(rng.randint(0, 6))]) for _ in range(60)]
    got = lexical_probabilities(pairs, 30, 25, 3, chunk=chunk)
    assert torch.allclose(got.double(), _naive_ibm1(pairs, 30, 25, 3), atol=1e-6)


def test_prefix_ids_above_the_padding_are_mapped():
    model, sources = _model(vocab=V), _sources(3, vocab=V)
    tiny = Shortlist(torch.full((V, 1), PAD_ID), torch.tensor([9]), "fp", V)
    opts = SearchOptions(beam=4, max_len_a=0, max_len_b=6)
    prefixes = [[150, 170], [], [199]]
    hyps = translate_ids(model, sources, opts, prefixes=prefixes, shortlist=tiny)
    for nbest, p in zip(hyps, prefixes, strict=True):
        assert nbest[0].tokens[: len(p)] == p


def test_a_lines_constraints_do_not_reach_the_others():
    from mt.constraints import constrained_beam_search

    model, sources = _model(vocab=V), _sources(4, vocab=V)
    tiny = Shortlist(torch.full((V, 1), PAD_ID), torch.tensor([9]), "fp", V)
    phrases = [[[120, 130]], [[140]], [[150]], [[160]]]
    src = _pad(sources)
    hyps = restricted_search(lambda m, pre, ph: constrained_beam_search(m, src, ph, 4, 0.6, 4,
                                                                        max_len_a=0, max_len_b=8),
                             model, tiny, src, None, phrases)
    for nbest, phrase in zip(hyps, phrases, strict=True):
        own = {t for p in phrase for t in p} | {9, UNK_ID}
        assert all(set(h.tokens) <= own for h in nbest)


@pytest.mark.parametrize("kind", ["ensemble", "final_logits_bias"])
def test_each_sentence_its_own_pieces_for_ensembles_and_logits_bias(kind):
    if kind == "ensemble":
        model = Ensemble([_model(vocab=V), _model(seed=1, vocab=V)], [2, 1])
    else:
        model = _model(vocab=V, final_logits_bias=True)
        torch.nn.init.normal_(model.final_logits_bias, std=3.0)
    members = getattr(model, "models", [model])
    sources = _sources(9, vocab=V)
    g = torch.Generator().manual_seed(0)
    sl = Shortlist(torch.randint(4, V, (V, 3), generator=g),
                   torch.randint(4, V, (5,), generator=g), "fp", V)
    src = _pad(sources)
    batched = restricted_search(lambda m, pre, _: beam_search(m, src, 4, 0.6, 2), model, sl,
                                src, None)
    for i, s in enumerate(sources):
        own = sl.restrict(None, _pad([s]))
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[own.vocab[own.allowed[0]]] = True
        bias = torch.zeros(V).masked_fill_(~allowed, -torch.inf)
        for m in members:
            m.project = lambda y, p=m.project, bias=bias: p(y) + bias
        alone = beam_search(model, _pad([s]), 4, 0.6, 2)[0]
        for m in members:
            del m.project
        assert [h.tokens for h in batched[i]] == [h.tokens for h in alone]


def test_sampling_several_per_line_under_a_shortlist():
    model, sources = _model(vocab=V), _sources(3, vocab=V)
    tiny = Shortlist(torch.full((V, 1), PAD_ID), torch.tensor([9, 150]), "fp", V)
    opts = SearchOptions(sampling=True, nbest=3, max_len_a=0, max_len_b=6)
    for nbest in translate_ids(model, sources, opts, shortlist=tiny):
        assert len(nbest) == 3 and all(set(h.tokens) <= {UNK_ID, 9, 150} for h in nbest)
