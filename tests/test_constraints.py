"""Lexically constrained beam search on tiny random models: no constraint is plain beam search,
every phrase is held, scores are the model's own, the search is exact when the beam holds every
hypothesis, and the bookkeeping of phrases matches a plain reading of the output."""

import itertools
import random

import pytest
import torch

from mt.config import BOS_ID, EOS_ID, PAD_ID
from mt.constraints import (
    _Phrases,
    allot,
    constrained_beam_search,
    contains,
    satisfied,
    split_phrases,
)
from mt.incremental import Ensemble
from mt.search import beam_search
from tests.test_search import _model, _pad, _rescore, _sources, _token_lps

V = 40


def _phrases(n: int, seed: int) -> list[list[list[int]]]:
    """Per sentence, 0-2 phrases of 1-3 real tokens."""
    rng = random.Random(seed)
    return [[[rng.randrange(4, V) for _ in range(rng.randint(1, 3))]
             for _ in range(rng.randint(0, 2))] for _ in range(n)]


def _same(a, b, exact: bool = False) -> None:
    assert [[h.tokens for h in n] for n in a] == [[h.tokens for h in n] for n in b]
    for x, y in zip(itertools.chain(*a), itertools.chain(*b), strict=True):
        if exact:
            assert (x.score, x.logprob, x.token_logprobs) == (y.score, y.logprob, y.token_logprobs)
        assert x.score == pytest.approx(y.score, abs=1e-5)
        assert x.token_logprobs == pytest.approx(y.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("extra", [{}, {"prefixes": [[], [9, 10], [], [4], [], [], []]},
                                   {"no_repeat_ngram": 2}, {"lenpen": 0.0, "min_len": 3}])
def test_no_constraints_is_plain_beam_search(extra):
    model, src = _model(), _pad(_sources(7))
    kw = dict(beam_size=5, nbest=3, **extra)
    _same(constrained_beam_search(model, src, [[]] * 7, **kw), beam_search(model, src, **kw),
          exact=True)


@pytest.mark.parametrize("members", [1, 2])
def test_every_phrase_is_held_and_scores_are_the_models(members):
    models = [_model(0), _model(1, decoder_layers=1)][:members]
    model = models[0] if members == 1 else Ensemble(models)
    srcs, phrases = _sources(8, seed=3), _phrases(8, seed=4)
    out = constrained_beam_search(model, _pad(srcs), phrases, beam_size=6, nbest=3,
                                  max_len_a=1.0, max_len_b=12)
    for src, nbest, wanted in zip(srcs, out, phrases, strict=True):
        # The best holds every phrase; an entry that does not (the budget ran out) comes last.
        held = [satisfied(h.tokens, wanted) for h in nbest]
        assert held[0] and held == sorted(held, reverse=True)
        for group in (True, False):
            scores = [h.score for h, ok in zip(nbest, held, strict=True) if ok == group]
            assert scores == sorted(scores, reverse=True)
        for h in nbest:
            assert sum(h.token_logprobs) == pytest.approx(h.logprob, abs=1e-4)
            if members == 1:
                assert h.score == pytest.approx(_rescore(model, src, h.tokens, 0.6), abs=1e-4)
                assert h.token_logprobs == pytest.approx(_token_lps(model, src, h.tokens),
                                                         abs=1e-4)
    # A phrase of tokens the free search already produces changes nothing.
    free = beam_search(model, _pad(srcs), beam_size=6, nbest=1, max_len_a=1.0, max_len_b=12)
    own = [[h[0].tokens[:2]] if h[0].tokens else [] for h in free]
    _same([n[:1] for n in constrained_beam_search(model, _pad(srcs), own, beam_size=6,
                                                  max_len_a=1.0, max_len_b=12)], free)


def test_batch_equals_one_by_one():
    model, srcs, phrases = _model(), _sources(6, seed=5), _phrases(6, seed=6)
    together = constrained_beam_search(model, _pad(srcs), phrases, beam_size=4, nbest=2)
    alone = [constrained_beam_search(model, _pad([s]), [p], beam_size=4, nbest=2)[0]
             for s, p in zip(srcs, phrases, strict=True)]
    _same(together, alone)


def test_exact_when_the_beam_can_hold_every_hypothesis():
    """4 real tokens, at most 3 before EOS: 85 outputs. With a beam that holds them all, the
    constrained search returns exactly the best outputs that hold the phrases ([7, 5] and [6]:
    only two do, and the others the budget ended come after them)."""
    vocab = 8
    model = _model(vocab=vocab)
    real = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    src = [5, 6, 7, EOS_ID]
    every = [list(seq) for n in range(4) for seq in itertools.product(real, repeat=n)]
    for phrases in ([[6]], [[4, 4]], [[7, 5], [6]]):
        brute = sorted((_rescore(model, src, seq, 0.6), seq) for seq in every
                       if satisfied(seq, phrases))[::-1]
        hyps = constrained_beam_search(model, _pad([src]), [phrases], beam_size=len(every),
                                       nbest=5, max_len_a=0, max_len_b=4)[0]
        held = [h for h in hyps if satisfied(h.tokens, phrases)]  # the rest: out of budget
        assert len(hyps) == 5 and hyps[: len(held)] == held
        assert [h.tokens for h in held] == [seq for _, seq in brute[:5]]
        assert [h.score for h in held] == pytest.approx([s for s, _ in brute[:5]], abs=1e-4)


def test_a_phrase_longer_than_the_budget_gives_the_best_it_can():
    model, src = _model(), _pad(_sources(2, seed=7))
    long = [list(range(4, 14))]  # 10 tokens; the budget is 5 with EOS
    out = constrained_beam_search(model, src, [long, []], beam_size=4, nbest=2,
                                  max_len_a=0, max_len_b=5)
    assert len(out[0]) == 2 and not satisfied(out[0][0].tokens, long)
    assert all(len(h.tokens) <= 4 for h in out[0])
    _same(out[1:], beam_search(model, src[1:], beam_size=4, nbest=2, max_len_a=0, max_len_b=5))


def test_a_row_with_nothing_but_eos_left_ends_even_without_its_phrases():
    """With no n-gram twice, a tiny vocabulary runs out of tokens long before the budget; a
    phrase that repeats a token can never be placed. Every sentence still gets its n-best."""
    model = _model(vocab=8)
    src = _pad([[4, 5, 6, EOS_ID], [7, EOS_ID]])
    out = constrained_beam_search(model, src, [[[5, 5]], [[6]]], beam_size=3, nbest=2,
                                  max_len_a=0, max_len_b=30, no_repeat_ngram=1)
    assert [len(n) for n in out] == [2, 2]
    assert not satisfied(out[0][0].tokens, [[5, 5]]) and satisfied(out[1][0].tokens, [[6]])
    assert all(len(h.tokens) <= 5 for n in out for h in n)  # 5 real tokens, each once


def test_bad_constraints_are_refused():
    model, src = _model(), _pad(_sources(2))
    for bad in ([[[]], []], [[[5, EOS_ID]], []], [[[5]]]):
        with pytest.raises(ValueError):
            constrained_beam_search(model, src, bad)
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        constrained_beam_search(model, src, [[[5]], []], no_repeat_ngram=-1)


def test_allot_lets_the_banks_take_turns_fullest_first():
    assert allot([0, 0, 1, 0, 2], 3) == [0, 2, 4]  # the best of each bank
    assert allot([0, 0, 1, 0, 2], 4) == [0, 1, 2, 4]  # then the second best of bank 0
    assert allot([3, 3, 3, 3], 2) == [0, 1]  # one bank: the best
    assert allot([1, 0], 5) == [0, 1]  # fewer candidates than slots


def test_phrase_states_follow_the_output():
    """The state after each token equals what a plain reading of the output gives: which phrases
    it contains, the longest start of a phrase not met that it ends with, and its bank."""
    rng = random.Random(0)
    for _ in range(300):
        phrases = [[rng.choice([4, 5, 6]) for _ in range(rng.randint(1, 3))]
                   for _ in range(rng.randint(1, 3))]
        book, state, out = _Phrases(phrases), _Phrases(phrases).start, []
        for _ in range(8):
            out.append(rng.choice([4, 5, 6]))
            state = book.advance(state, out[:-1], out[-1])
            met = [contains(out, p) for p in phrases]
            assert [bool(state.met >> i & 1) for i in range(len(phrases))] == met
            for i, p in enumerate(phrases):
                longest = max((j for j in range(len(p)) if out[len(out) - j :] == p[:j]
                               or j == 0), default=0)
                assert state.partial[i] == (0 if met[i] else longest)
            want = {p[j] for p, j, m in zip(phrases, state.partial, met, strict=True) if not m}
            assert set(book.next_tokens(state)) == want
            held = sum(len(p) for p, m in zip(phrases, met, strict=True) if m)
            assert state.bank == held + max(state.partial)


def test_split_phrases():
    assert split_phrases("Vertrag\t  \tEuropäische Union ") == ["Vertrag", "Europäische Union"]
    assert split_phrases("") == [] and split_phrases("\t") == []


def test_search_keeps_the_models_function():
    """Constrained search runs under inference mode and leaves the model as it was."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    constrained_beam_search(model, _pad(_sources(3)), _phrases(3, 1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
