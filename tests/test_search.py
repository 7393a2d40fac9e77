"""Search properties on tiny random models: equivalences between searches, invariance to batching,
scores that a teacher-forced forward pass reproduces, exactness against brute force."""

import itertools
import re

import pytest
import torch

from mt.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from mt.incremental import Ensemble
from mt.model import build_model
from mt.scoring import cross_attention, forced_scores
from mt.search import (
    _ban_repeats,
    _best,
    _sample,
    beam_search,
    greedy_search,
    length_penalty,
    sample_search,
)

V = 40


def _model(seed: int = 0, vocab: int = V, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(encoder_layers=2, decoder_layers=2, d_model=32, ffn_dim=64, heads=4, dropout=0.0,
               src_vocab_size=vocab, tgt_vocab_size=vocab, max_positions=64)
    cfg.update(kw)
    model = build_model(ModelConfig(**cfg)).eval()
    # Sharper distributions than the init gives: fewer near-ties, more varied outputs.
    with torch.no_grad():
        model.output_proj.weight.mul_(3.0)
    return model


def _sources(n: int = 7, seed: int = 1, vocab: int = V) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 12, (1,), generator=g))
        out.append(torch.randint(4, vocab, (length,), generator=g).tolist() + [EOS_ID])
    return out


def _pad(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


def _rescore(model, src: list[int], tokens: list[int], lenpen: float) -> float:
    """Teacher-forced score of ``tokens`` + EOS, with the model's full (non-incremental) forward."""
    with torch.no_grad():
        logits = model(torch.tensor([src]), torch.tensor([[BOS_ID] + tokens]))
    lprobs = torch.log_softmax(logits.float(), dim=-1)[0]
    target = torch.tensor(tokens + [EOS_ID])
    total = float(lprobs.gather(1, target[:, None]).sum())
    return total / length_penalty(len(tokens) + 1, lenpen)


def _token_lps(model, src: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced log-probability of each of ``tokens`` + EOS (full forward pass)."""
    with torch.no_grad():
        logits = model(torch.tensor([src]), torch.tensor([[BOS_ID] + tokens]))
    lprobs = torch.log_softmax(logits.float(), dim=-1)[0]
    return lprobs.gather(1, torch.tensor(tokens + [EOS_ID])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("search", ["greedy", "beam", "sampling", "forced", "ensemble"])
def test_token_logprobs_are_the_models_own(search):
    """Every hypothesis carries the log-probability of each of its tokens and of EOS: they sum
    to its logprob and equal a teacher-forced pass, through prefixes and finished beams."""
    model, srcs = _model(), _sources(6)
    prefixes = [[], [9, 10], [], [], [4], []]
    if search == "ensemble":
        model = Ensemble([_model(0), _model(1, decoder_layers=1)])
    if search == "greedy":
        results = [[h] for h in greedy_search(model, _pad(srcs), prefixes=prefixes)]
    elif search in ("beam", "ensemble"):
        results = beam_search(model, _pad(srcs), beam_size=4, nbest=4, prefixes=prefixes)
    elif search == "sampling":
        results = sample_search(model, _pad(srcs), nbest=3, prefixes=prefixes,
                                generator=torch.Generator().manual_seed(0))
    else:
        found = beam_search(model, _pad(srcs), beam_size=3, nbest=3)
        pairs = [(s, h.tokens) for s, hyps in zip(srcs, found, strict=True) for h in hyps]
        forced = forced_scores(model, _pad([s for s, _ in pairs]),
                               _pad([t + [EOS_ID] for _, t in pairs]))
        srcs, results = [s for s, _ in pairs], [[h] for h in forced]
    for src, hyps in zip(srcs, results, strict=True):
        for h in hyps:
            assert len(h.token_logprobs) == len(h.tokens) + 1
            assert sum(h.token_logprobs) == pytest.approx(h.logprob, abs=1e-4)
            if search != "ensemble":
                assert h.token_logprobs == pytest.approx(_token_lps(model, src, h.tokens),
                                                         abs=1e-4)


def test_beam_one_equals_greedy():
    model, srcs = _model(), _sources()
    greedy = greedy_search(model, _pad(srcs), lenpen=0.6)
    beam = beam_search(model, _pad(srcs), beam_size=1, lenpen=0.6)
    for g, b in zip(greedy, beam, strict=True):
        assert g.tokens == b[0].tokens
        assert g.score == pytest.approx(b[0].score, abs=1e-4)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batch_equals_one_by_one(search):
    model, srcs = _model(), _sources(9)

    def run(batch):
        if search == "greedy":
            return [[h] for h in greedy_search(model, _pad(batch), max_len_b=8)]
        return beam_search(model, _pad(batch), beam_size=4, nbest=3, max_len_b=8)

    batched = run(srcs)
    reversed_order = run(srcs[::-1])[::-1]
    for i, src in enumerate(srcs):
        alone = run([src])[0]
        for hyps in (batched[i], reversed_order[i]):
            assert [h.tokens for h in hyps] == [h.tokens for h in alone]
            assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)


@pytest.mark.parametrize("search", ["greedy", "beam", "ensemble"])
def test_batch_of_very_different_lengths_equals_one_by_one(search):
    """Sentences of 1 to 40 tokens in one batch leave it many steps apart (their keys wait in
    the cache, then move), some with a prefix or under min_len, the longest with a budget of the
    model's whole maximum: each gets what it gets alone."""
    model = _model(max_positions=48)
    if search == "ensemble":
        model = Ensemble([model, _model(1, decoder_layers=1, max_positions=48)], [2.0, 1.0])
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randint(4, V, (n,), generator=g).tolist() + [EOS_ID]
            for n in (1, 40, 2, 25, 1, 5, 33)]
    prefixes = [[], [7, 8], [], [9], [], [], [7]]
    kw = dict(max_len_a=3.0, max_len_b=2, min_len=3, lenpen=0.6, prefixes=prefixes)

    def run(rows):
        src = _pad([srcs[i] for i in rows])
        kw["prefixes"] = [prefixes[i] for i in rows]
        if search == "greedy":
            return [[h] for h in greedy_search(model, src, **kw)]
        return beam_search(model, src, beam_size=3, nbest=2, **kw)

    batched = run(range(len(srcs)))
    assert max(len(hyps[0].tokens) for hyps in batched) + 1 > 40  # budgets apart
    for i in range(len(srcs)):
        alone = run([i])[0]
        assert [h.tokens for h in batched[i]] == [h.tokens for h in alone]
        assert [h.score for h in batched[i]] == pytest.approx([h.score for h in alone], abs=1e-4)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_log_probs_in_blocks_equal_all_rows_at_once(monkeypatch, search):
    """The output layer and log-softmax run a block of rows at a time into a buffer reused across
    steps (and modified in place by the search): blocks of 3 rows, which split sentences and
    beams and leave a ragged last block as the batch shrinks, give what one block of all rows
    gives."""
    from mt.incremental import Decoder

    model, src = _model(), _pad(_sources(9))

    def run():
        if search == "greedy":
            return [[h] for h in greedy_search(model, src, max_len_b=8)]
        return beam_search(model, src, beam_size=4, nbest=3, max_len_b=8)

    monkeypatch.setattr(Decoder, "ROWS", 10_000)
    whole = run()
    monkeypatch.setattr(Decoder, "ROWS", 3)
    blocks = run()
    for a, b in zip(whole, blocks, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@pytest.mark.parametrize("rows", [10_000, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoder_log_probs_are_the_float32_log_softmax_of_the_models_logits(monkeypatch, dtype,
                                                                             rows):
    """What every search reads: the float32 log-softmax of the model's own logits, whatever the
    model's dtype (bf16 logits are cast first, then normalised in float32), step after step:
    bit for bit in one block of rows; in blocks of 2 rows to the rounding by which a product of
    2 rows may differ from one of 5."""
    from mt.incremental import Decoder

    monkeypatch.setattr(Decoder, "ROWS", rows)
    model, src = _model().to(dtype), _pad(_sources(5))
    tokens = torch.tensor([BOS_ID] * 5)
    with torch.inference_mode():
        dec = Decoder(model, src, 4)
        memory, mask = model.encode(src)
        cache = model.init_cache(memory, mask, 4)
        for step in range(3):
            got = dec.log_probs(tokens)
            logits = model.decode_step(tokens, cache)
            assert got.dtype == torch.float32 and logits.dtype == dtype
            expected = torch.log_softmax(logits.float(), -1)
            if rows >= 5:
                assert torch.equal(got, expected), step
            else:
                tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
                torch.testing.assert_close(got, expected, atol=tol, rtol=0)
            tokens = got.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_log_probs_under_a_shortlist_normalise_over_each_lines_pieces(dtype):
    """Under a shortlist (``Restricted``) a row's log-probabilities are the model's logits of its
    own pieces, normalised over them alone; the pieces it may not use are -inf."""
    from mt.incremental import Decoder, Restricted

    model, src = _model().to(dtype), _pad(_sources(5))
    vocab = torch.tensor([0, 1, 2, 3, *range(5, V, 3)])
    allowed = torch.rand(5, vocab.numel(), generator=torch.Generator().manual_seed(0)) < 0.6
    allowed[:, :4] = True
    with torch.inference_mode():
        got = Decoder(Restricted(model, vocab, allowed), src, 4).log_probs(torch.full((5,), 2))
        memory, mask = model.encode(src)
        logits = model.decode_step(torch.full((5,), BOS_ID), model.init_cache(memory, mask, 4))
    expected = torch.log_softmax(logits[:, vocab].float().masked_fill(~allowed, -torch.inf), -1)
    assert torch.equal(torch.isinf(got), ~allowed)
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bf16: the subset product may round apart
    torch.testing.assert_close(got, expected, atol=tol, rtol=0)


@pytest.mark.parametrize("vocab", [128, 320, 200])
def test_best_candidates_in_two_steps_equal_one_selection(vocab):
    """_best selects the k best of beams x V candidates through the best blocks of tokens: the
    same values and indices as one topk over all of them (random values have no ties), with
    impossible (-inf) tokens and beams among them; 200 tokens have no block size (one topk)."""
    g = torch.Generator().manual_seed(vocab)
    for n, beams, k in ((7, 4, 8), (3, 1, 10), (5, 5, 10), (2, 3, 6)):
        lprobs = torch.randn(n, beams, vocab, generator=g).log_softmax(-1)
        lprobs[:, :, [PAD_ID, BOS_ID]] = -torch.inf
        lprobs[0, -1] = -torch.inf  # a dead beam
        scores = -5 * torch.rand(n, beams, generator=g)
        expected = (lprobs + scores.unsqueeze(-1)).view(n, -1).topk(k, dim=1)
        values, index = _best(lprobs.clone(), scores, k)
        assert torch.equal(values, expected.values)
        assert torch.equal(index, expected.indices)


def test_block_selection_changes_no_search_result(monkeypatch):
    """Beam search over a 128-token vocabulary (two blocks of 64) gives what one plain selection
    gives, hypotheses and scores alike."""
    from mt import search as search_module

    model, src = _model(vocab=128), _pad(_sources(9, vocab=128))
    blocks = beam_search(model, src, beam_size=5, nbest=5, max_len_b=8)
    monkeypatch.setattr(search_module, "_block_size", lambda vocab: None)
    plain = beam_search(model, src, beam_size=5, nbest=5, max_len_b=8)
    for a, b in zip(blocks, plain, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == [h.score for h in b]


@pytest.mark.parametrize("lenpen", [0.0, 0.6, 1.0])
def test_nbest_sorted_and_scores_match_forced_rescoring(lenpen):
    model, srcs = _model(), _sources()
    results = beam_search(model, _pad(srcs), beam_size=5, nbest=5, lenpen=lenpen, max_len_b=8)
    for src, hyps in zip(srcs, results, strict=True):
        assert len(hyps) == 5
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 5  # distinct hypotheses
        for h in hyps:
            assert h.score == pytest.approx(_rescore(model, src, h.tokens, lenpen), abs=1e-4)
            assert h.logprob == pytest.approx(_rescore(model, src, h.tokens, 0.0), abs=1e-4)


@pytest.mark.parametrize("members, weights", [(1, None), (2, None), (2, [3.0, 1.0])])
def test_forced_scores_are_the_scores_search_gives(members, weights):
    """Scoring the search's own n-best lists, all in one padded batch, gives back their scores:
    padding does not leak, and an ensemble renormalises (with its weights) as its search does."""
    model = (_model() if members == 1
             else Ensemble([_model(0), _model(1, decoder_layers=1)], weights))
    srcs = _sources()
    results = beam_search(model, _pad(srcs), beam_size=4, nbest=4, lenpen=0.6, max_len_b=8)
    pairs = [(src, h) for src, hyps in zip(srcs, results, strict=True) for h in hyps]
    tgt = _pad([h.tokens + [EOS_ID] for _, h in pairs])
    forced = forced_scores(model, _pad([src for src, _ in pairs]), tgt, lenpen=0.6)
    for (src, h), f in zip(pairs, forced, strict=True):
        assert f.tokens == h.tokens
        assert f.score == pytest.approx(h.score, abs=1e-4)
        assert f.logprob == pytest.approx(h.logprob, abs=1e-4)
        if members == 1:
            assert f.logprob == pytest.approx(_rescore(model, src, h.tokens, 0.0), abs=1e-4)


def test_beam_is_exact_when_it_can_hold_every_hypothesis():
    """With 4 real tokens and at most 2 before EOS there are 21 outputs; a beam of 21 must return
    exactly the brute-force ranking of all of them."""
    vocab = 8  # PAD UNK BOS EOS + 4 real tokens; UNK (1) is a real token to the model
    model = _model(vocab=vocab)
    real = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    src = [5, 6, 7, EOS_ID]
    every = [list(seq) for n in range(3) for seq in itertools.product(real, repeat=n)]
    brute = sorted((_rescore(model, src, seq, 0.6), seq) for seq in every)[::-1]
    hyps = beam_search(model, _pad([src]), beam_size=len(every), nbest=10, lenpen=0.6,
                       max_len_a=0, max_len_b=3)[0]
    assert [h.tokens for h in hyps] == [seq for _, seq in brute[:10]]
    assert [h.score for h in hyps] == pytest.approx([s for s, _ in brute[:10]], abs=1e-4)


@pytest.mark.parametrize("nbest", [1, 3])
def test_without_a_length_penalty_beam_stops_early_and_returns_the_same(nbest, monkeypatch):
    """At lenpen 0 a sentence ends once its nbest best finished hypotheses score at least its best
    live one (scores only fall): the same n-best as the search that waits for beam_size finished
    (lenpen 1e-12 ranks alike but keeps waiting), in fewer decoder steps."""
    from mt.incremental import Decoder

    model, src = _model(seed=2, final_logits_bias=True), _pad(_sources(12, seed=4))
    with torch.no_grad():  # sentences that end before the budget, as a trained model's do
        model.final_logits_bias[EOS_ID] = 1.0
    calls = []
    log_probs = Decoder.log_probs

    def counted(self, tokens):
        calls.append(tokens.numel())
        return log_probs(self, tokens)

    monkeypatch.setattr(Decoder, "log_probs", counted)
    kw = dict(beam_size=6, nbest=nbest, max_len_a=2.0, max_len_b=10)
    fast = beam_search(model, src, lenpen=0.0, **kw)
    rows_fast, calls[:] = sum(calls), []
    slow = beam_search(model, src, lenpen=1e-12, **kw)
    rows_slow = sum(calls)
    assert [[h.tokens for h in hs] for hs in fast] == [[h.tokens for h in hs] for hs in slow]
    for hs_fast, hs_slow in zip(fast, slow, strict=True):
        assert [h.logprob for h in hs_fast] == pytest.approx([h.logprob for h in hs_slow])
    assert rows_fast < rows_slow if nbest == 1 else rows_fast <= rows_slow  # fewer rows decoded


def _repeats(tokens: list[int], n: int, start: int = 0) -> bool:
    """Whether an n-gram ending at or after position ``start`` occurs earlier in ``tokens``."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return any(g in grams[:i] for i, g in enumerate(grams) if i + n - 1 >= start)


def test_ban_repeats_known_answers():
    history = torch.tensor([[5, 6, 7, 5, 6], [1, 2, 3, 4, 5], [5, 5, 5, 5, 5]])

    def banned(n: int) -> list[list[int]]:
        lprobs = torch.zeros(3, 10)
        _ban_repeats(lprobs, history, n)
        return [torch.isinf(row).nonzero().flatten().tolist() for row in lprobs]

    assert banned(3) == [[7], [], [5]]  # 5 6 -> 7 would repeat "5 6 7"
    assert banned(2) == [[7], [], [5]]
    assert banned(1) == [[5, 6, 7], [1, 2, 3, 4, 5], [5]]
    assert banned(6) == [[], [], []]  # no n-gram yet


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("search", ["greedy", "beam", "sampling"])
def test_no_repeat_ngram_holds_and_scores_stay_the_models(search, n):
    """Long outputs of a random model loop; with no_repeat_ngram=n no output repeats an n-gram
    (forced prefix tokens excepted), and every score is still the model's teacher-forced one."""
    model, srcs = _model(), _sources(6)
    prefixes = [[], [9, 9, 9], [], [4, 5, 4, 5], [], []]
    lens = dict(max_len_a=0, max_len_b=16, min_len=12, prefixes=prefixes)

    def run(ngram: int) -> list[list]:
        if search == "greedy":
            return [[h] for h in greedy_search(model, _pad(srcs), lenpen=0.6,
                                               no_repeat_ngram=ngram, **lens)]
        if search == "beam":
            return beam_search(model, _pad(srcs), beam_size=4, nbest=4, no_repeat_ngram=ngram,
                               **lens)
        return sample_search(model, _pad(srcs), nbest=3, lenpen=0.6, no_repeat_ngram=ngram,
                             generator=torch.Generator().manual_seed(0), **lens)

    free = run(0)
    assert any(_repeats(h.tokens, n, len(p)) for p, hyps in zip(prefixes, free, strict=True)
               for h in hyps)  # the constraint has work to do
    for src, prefix, hyps in zip(srcs, prefixes, run(n), strict=True):
        for h in hyps:
            assert h.tokens[: len(prefix)] == prefix
            assert not _repeats(h.tokens, n, len(prefix))
            assert len(h.tokens) >= 12
            assert h.score == pytest.approx(_rescore(model, src, h.tokens, 0.6), abs=1e-4)
    # An n longer than any output changes nothing.
    longest = [[(h.tokens, round(h.score, 5)) for h in hyps] for hyps in free]
    if search != "sampling":
        assert [[(h.tokens, round(h.score, 5)) for h in hyps] for hyps in run(17)] == longest


@pytest.mark.parametrize("n", [1, 2])
def test_beam_with_no_repeat_ngram_is_exact(n):
    """A beam that can hold every output without a repeated n-gram (4 real tokens, at most 3
    before EOS) returns exactly the brute-force ranking of those outputs."""
    vocab = 8  # PAD UNK BOS EOS + 4 real tokens; UNK (1) is a real token to the model
    model = _model(vocab=vocab)
    real = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    src = [5, 6, 7, EOS_ID]
    every = [list(seq) for length in range(4) for seq in itertools.product(real, repeat=length)
             if not _repeats(list(seq), n)]
    brute = sorted((_rescore(model, src, seq, 0.6), seq) for seq in every)[::-1]
    hyps = beam_search(model, _pad([src]), beam_size=len(every), nbest=10, lenpen=0.6,
                       max_len_a=0, max_len_b=4, no_repeat_ngram=n)[0]
    assert [h.tokens for h in hyps] == [seq for _, seq in brute[:10]]
    assert [h.score for h in hyps] == pytest.approx([s for s, _ in brute[:10]], abs=1e-4)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_no_repeat_ngram_ends_a_row_it_leaves_without_tokens(search):
    """5 real tokens, each usable once (n = 1), and min_len 8: after five tokens only EOS can
    follow, and the output ends there instead of taking PAD or an -inf token."""
    vocab = 8
    model, src = _model(vocab=vocab), _pad([[5, 6, 7, EOS_ID], [4, EOS_ID]])
    lens = dict(max_len_a=0, max_len_b=12, min_len=8, no_repeat_ngram=1)
    hyps = (greedy_search(model, src, **lens) if search == "greedy"
            else [h[0] for h in beam_search(model, src, beam_size=3, **lens)])
    for h in hyps:
        assert sorted(h.tokens) == [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
        assert h.score > -torch.inf


def test_length_budget_is_a_times_source_length_plus_b_exactly():
    """--max-len-a 1.3 and a source of 90 tokens: a budget of 1.3 * 90 + 10 = 127 tokens. In
    float32, 1.3 is 1.29999995 and the product rounds to 116.99999, so the budget was 126; the
    float64 arithmetic of the documented formula (fairseq's too) gives 127."""
    from fractions import Fraction

    from mt.search import max_lengths

    lengths = torch.arange(1, 513)
    src = torch.where(torch.arange(512)[None, :] < lengths[:, None], 5, PAD_ID)
    for a in (0.5, 1.1, 1.2, 1.3, 2.0):
        want = [int(Fraction(str(a)) * n + 10) for n in lengths.tolist()]
        assert max_lengths(src, a, 10, 10**6).tolist() == want, a
    assert max_lengths(src[89:90], 1.3, 10, 1024).tolist() == [127]


def test_length_limits():
    model, srcs = _model(), _sources()
    for hyps in beam_search(model, _pad(srcs), beam_size=3, nbest=3, min_len=4, max_len_a=0,
                            max_len_b=6):
        for h in hyps:
            assert 4 <= len(h.tokens) <= 5  # EOS counts toward max_len_b
    # min_len = budget: the output has exactly budget - 1 tokens, then EOS, whose score is the
    # model's own although min_len forbade it (beyond the budget too: the budget wins).
    for min_len in (7, 20):
        greedy = greedy_search(model, _pad(srcs), min_len=min_len, max_len_a=0, max_len_b=8)
        beam = beam_search(model, _pad(srcs), 3, 0.0, 3, min_len=min_len, max_len_a=0,
                           max_len_b=8)
        for src, g, b in zip(srcs, greedy, beam, strict=True):
            for h in [g, *b]:
                assert len(h.tokens) == 7
                assert h.token_logprobs == pytest.approx(_token_lps(model, src, h.tokens),
                                                         abs=1e-4)


@pytest.mark.parametrize("search", ["greedy", "beam", "sampling"])
def test_prefix_is_forced_and_scored(search):
    model, srcs = _model(), _sources(5)
    prefixes = [[], [7], [9, 10, 11], [4] * 6, [30, 31]]
    if search == "greedy":
        results = [[h] for h in greedy_search(model, _pad(srcs), prefixes=prefixes, lenpen=0.6)]
    elif search == "beam":
        results = beam_search(model, _pad(srcs), beam_size=3, nbest=3, prefixes=prefixes)
    else:
        results = sample_search(model, _pad(srcs), nbest=2, lenpen=0.6, prefixes=prefixes,
                                generator=torch.Generator().manual_seed(0))
    for src, prefix, hyps in zip(srcs, prefixes, results, strict=True):
        for h in hyps:
            assert h.tokens[: len(prefix)] == prefix
            assert h.score == pytest.approx(_rescore(model, src, h.tokens, 0.6), abs=1e-4)


def test_prefix_longer_than_the_model_limit_is_cut():
    model, src = _model(), _pad(_sources(2))  # max_positions=64: 63 tokens and EOS at most
    prefixes = [[5] * 80, [6] * 3]
    greedy = greedy_search(model, src, prefixes=prefixes)
    beam = beam_search(model, src, beam_size=2, prefixes=prefixes)
    for hyps in ([greedy[0]], beam[0]):
        assert hyps[0].tokens == [5] * 63
        # the EOS that the limit forces inside the prefix keeps the model's own log-probability
        assert hyps[0].token_logprobs == pytest.approx(
            _token_lps(model, _sources(2)[0], [5] * 63), abs=1e-4)
    assert greedy[1].tokens[:3] == beam[1][0].tokens[:3] == [6] * 3


def test_prefix_of_the_greedy_output_changes_nothing():
    model, srcs = _model(), _sources()
    free = greedy_search(model, _pad(srcs))
    forced = greedy_search(model, _pad(srcs), prefixes=[h.tokens[:2] for h in free])
    assert [h.tokens for h in forced] == [h.tokens for h in free]


def test_sampling_seeded_scored_and_degenerate_cases_are_greedy():
    model, srcs = _model(), _sources()
    src = _pad(srcs)

    def sample(seed, **kw):
        return sample_search(model, src, nbest=3, generator=torch.Generator().manual_seed(seed),
                             lenpen=0.6, **kw)

    a, b, c = sample(1), sample(1), sample(2)
    assert [[h.tokens for h in n] for n in a] == [[h.tokens for h in n] for n in b]
    assert [[h.tokens for h in n] for n in a] != [[h.tokens for h in n] for n in c]
    for s, hyps in zip(srcs, a, strict=True):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:  # the model's own (untempered) log-probabilities
            assert h.score == pytest.approx(_rescore(model, s, h.tokens, 0.6), abs=1e-4)
    greedy = [h.tokens for h in greedy_search(model, src)]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4, "top_k": 5}):
        for hyps, g in zip(sample(3, **kw), greedy, strict=True):
            assert all(h.tokens == g for h in hyps), kw


def test_sample_top_k_top_p_support_and_frequencies():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lprobs = probs.log().expand(20000, -1).contiguous()
    g = torch.Generator().manual_seed(0)
    nucleus = torch.bincount(_sample(lprobs, 1.0, 0, 0.7, g), minlength=4) / 20000
    assert nucleus[2:].sum() == 0  # 0.5 + 0.3 >= 0.7: the smallest set is {0, 1}
    assert nucleus[0] == pytest.approx(0.5 / 0.8, abs=0.02)
    top3 = torch.bincount(_sample(lprobs, 1.0, 3, 1.0, g), minlength=4) / 20000
    assert top3[3] == 0 and top3[2] == pytest.approx(0.15 / 0.95, abs=0.02)
    hot = torch.bincount(_sample(lprobs, 2.0, 0, 1.0, g), minlength=4) / 20000
    expected = probs.sqrt() / probs.sqrt().sum()  # temperature 2 = square root, renormalised
    assert hot.tolist() == pytest.approx(expected.tolist(), abs=0.02)
    assert _sample(lprobs[:50], 1.0, 0, 0.0, g).tolist() == [0] * 50  # top_p 0: greedy
    eps = torch.bincount(_sample(lprobs, 1.0, 0, 1.0, g, epsilon=0.1), minlength=4) / 20000
    assert eps[3] == 0 and eps[2] == pytest.approx(0.15 / 0.95, abs=0.02)  # 0.05 < 0.1: cut
    flat = torch.tensor([0.3, 0.25, 0.25, 0.2]).log().expand(5, -1)  # none reaches epsilon:
    assert _sample(flat, 1.0, 0, 1.0, g, epsilon=0.9).tolist() == [0] * 5  # the best stays


def test_a_tiny_temperature_samples_the_best_token():
    """--temperature 1e-40 passed the option checks (positive, finite), then every tempered
    log-probability but an exact 0 overflowed to -inf and multinomial failed inside torch."""
    lprobs = torch.tensor([[-0.7, -0.9, -3.0], [-2.0, -0.05, -4.0]])
    g = torch.Generator().manual_seed(0)
    assert _sample(lprobs, 1e-40, 0, 1.0, g).tolist() == [0, 1]
    assert _sample(lprobs, 1e-40, 2, 0.5, g, epsilon=0.1).tolist() == [0, 1]


@pytest.mark.parametrize("search", ["beam", "greedy", "sampling", "constrained"])
def test_scores_that_are_not_numbers_raise_instead_of_an_empty_or_random_result(search):
    """Finite weights whose activations overflow (as float16 can): every score is NaN. Beam
    search finished no hypothesis and returned empty n-best lists (translate wrote no line and
    exited 0), greedy search returned random tokens, sampling failed inside torch."""
    from mt.constraints import constrained_beam_search

    model = _model()
    with torch.no_grad():
        for layer in model.decoder_layers:
            layer.ffn.fc2.weight.fill_(1e38)  # finite; its products overflow to inf
    src = _pad(_sources(3))
    run = {"beam": lambda: beam_search(model, src, beam_size=3),
           "greedy": lambda: greedy_search(model, src),
           "sampling": lambda: sample_search(model, src, nbest=2,
                                             generator=torch.Generator().manual_seed(0)),
           "constrained": lambda: constrained_beam_search(model, src, [[[5]]] * 3, beam_size=3)}
    with pytest.raises(FloatingPointError, match="^the model's scores are not numbers \\(NaN\\)"):
        run[search]()


@pytest.mark.parametrize("step, rows", [(3, [4]), (3, slice(4, 8))])
def test_a_beam_whose_scores_turn_nan_midway_raises(monkeypatch, step, rows):
    """topk ranks NaN first: one NaN beam made its sentence done with the hypotheses finished
    so far (one of nbest=4 came back), and no error was raised (a review's case)."""
    import mt.incremental

    model, src = _model(), _pad(_sources(3))
    original, calls = mt.incremental.Decoder.log_probs, []

    def log_probs(self, tokens):
        out = original(self, tokens)
        calls.append(1)
        if len(calls) == step + 1:
            out[rows] = float("nan")  # sentence 1's beams are rows 4-7
        return out

    monkeypatch.setattr(mt.incremental.Decoder, "log_probs", log_probs)
    with pytest.raises(FloatingPointError, match="^the model's scores are not numbers"):
        beam_search(model, src, beam_size=4, nbest=4)


def test_ensemble_of_copies_equals_the_model_and_mixes_log_probs():
    model, other, srcs = _model(0), _model(1, d_model=16, ffn_dim=32, heads=2), _sources()
    single = beam_search(model, _pad(srcs), beam_size=3, nbest=3)
    copies = beam_search(Ensemble([model, model]), _pad(srcs), beam_size=3, nbest=3)
    for a, b in zip(single, copies, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
    for weights in (None, [1.0, 3.0]):
        mixed = beam_search(Ensemble([model, other], weights), _pad(srcs), beam_size=3, nbest=2,
                            lenpen=0.0)
        share = [0.5, 0.5] if weights is None else [0.25, 0.75]
        for src, hyps in zip(srcs, mixed, strict=True):
            for h in hyps:  # renormalised weighted mean of the members' teacher-forced lprobs
                with torch.no_grad():
                    tgt_in = torch.tensor([[BOS_ID] + h.tokens])
                    mean = sum(w * torch.log_softmax(m(torch.tensor([src]), tgt_in), -1)
                               for w, m in zip(share, (model, other), strict=True))
                target = torch.tensor(h.tokens + [EOS_ID])[:, None]
                lp = torch.log_softmax(mean, -1)[0].gather(1, target)
                assert h.score == pytest.approx(float(lp.sum()), abs=1e-4)


def test_ensemble_needs_one_target_vocabulary():
    with pytest.raises(ValueError, match="target vocabulary"):
        Ensemble([_model(vocab=40), _model(vocab=41)])
    with pytest.raises(ValueError, match="1 ensemble weights for 2 models"):
        Ensemble([_model(), _model()], [1.0])
    with pytest.raises(ValueError, match="above 0"):
        Ensemble([_model(), _model()], [1.0, 0.0])


def test_cross_attention_is_the_models_own():
    """With one head, weights @ values through out_proj must give the layer's cross-attention
    output; weights are distributions that ignore padding."""
    model, srcs = _model(heads=1), _sources(4)
    src = _pad(srcs)
    tgt = _pad([h.tokens + [EOS_ID] for h in greedy_search(model, src)])
    weights = cross_attention(model, src, tgt, layer=0)  # (B, T, S)
    assert weights.sum(-1) == pytest.approx(torch.ones(weights.shape[:2]), abs=1e-5)
    assert (weights[src[:, None, :].expand_as(weights) == PAD_ID] == 0).all()
    with torch.no_grad():
        memory, mask = model.encode(src)
        block = model.decoder_layers[0]
        y = model.embed(torch.cat([torch.full((4, 1), BOS_ID), tgt[:, :-1]], 1), model.tgt_embed,
                        model.tgt_positions)
        y = block.self_sub.output(y, block.self_attn(block.self_sub.input(y), causal=True))
        h = block.cross_sub.input(y)
        expected = block.cross_attn(h, mask=mask, memory=memory)
        _, v = block.cross_attn.project_kv(memory)
        got = block.cross_attn.out_proj(weights @ v[:, 0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_plot_attention_names_a_layer_the_model_lacks(tmp_path, tokenizer_dir, capsys):
    """A usage error (exit 2, one line naming --layer and the decoder's depth), not the
    ValueError traceback of mt.scoring; an existing negative index still plots."""
    import importlib.util

    pytest.importorskip("matplotlib")
    from conftest import REPO

    from mt.checkpoint import model_state, save_atomic
    from mt.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    model = _model(vocab=tok.src_vocab_size, tie_embeddings="all")
    save_atomic(model_state(model, tok, None), tmp_path / "m.pt")
    spec = importlib.util.spec_from_file_location("plot_attention",
                                                  REPO / "scripts" / "plot_attention.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["-m", str(tmp_path / "m.pt"), "a b c", "--target", "x y", "-o",
            str(tmp_path / "a.png")]
    for layer in ("2", "-3"):
        with pytest.raises(SystemExit) as err:
            script.main([*args, "--layer", layer])
        assert err.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--layer {layer}: the decoder has 2 layers" in message
    long_ = " ".join(["a b c"] * 40)  # beyond the model's positions: a ValueError from the model
    with pytest.raises(SystemExit) as err:
        script.main(["-m", str(tmp_path / "m.pt"), long_, "-o", str(tmp_path / "a.png")])
    assert err.value.code == 2
    assert "beyond the model's maximum" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit) as err:  # forced, it was plotted as <unk>
        script.main([*args[:3], "--target", "一二", *args[5:]])
    assert err.value.code == 2
    assert "--target:1: prefix '一二': the target vocabulary lacks '一'" in (
        capsys.readouterr().err.strip().splitlines()[-1])
    assert not (tmp_path / "a.png").exists()
    script.main([*args, "--layer", "-2"])
    assert (tmp_path / "a.png").stat().st_size > 0


def test_plot_attention_without_matplotlib_or_a_model_says_so_in_one_line(tmp_path, monkeypatch,
                                                                        capsys):
    """matplotlib is an optional extra: its absence (and a missing model) is one line naming
    what to do, not a ModuleNotFoundError traceback."""
    import importlib.util
    import sys

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("plot_attention",
                                                  REPO / "scripts" / "plot_attention.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["-m", str(tmp_path / "missing.pt"), "a b c", "-o", str(tmp_path / "a.png")]
    for bad, said in ((["--beam", "0"], "argument --beam: must be at least 1, got 0"),
                      (["-o", str(tmp_path / "no" / "a.png")], "-o .*: no such directory"),
                      # it wrote tmp_path.png and said "wrote tmp_path"
                      (["-o", str(tmp_path)], "-o .* is a directory; name the image file"),
                      (["-o", str(tmp_path / "a")], "-o .*a: name the image with .png"),
                      (["", "-o", str(tmp_path / "a.png")], "the sentence is empty")):
        with pytest.raises(SystemExit) as err:  # usage errors, before any work
            script.main([*args, *bad] if bad[0] else [*args[:2], *bad])
        assert err.value.code == 2
        assert re.search(said, capsys.readouterr().err.strip().splitlines()[-1])
    if importlib.util.find_spec("matplotlib") is not None:
        with pytest.raises(SystemExit) as err:
            script.main(args)
        assert err.value.code == 1
        assert "missing.pt" in capsys.readouterr().err.strip().splitlines()[-1]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(SystemExit) as err:
        script.main(args)
    assert err.value.code == 1
    assert capsys.readouterr().err.strip() == (
        "plot_attention.py: needs matplotlib, the plot extra: pip install -e '.[plot]'")
