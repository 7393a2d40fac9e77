"""Minimum Bayes risk decoding: the choice against a plain double loop over sacrebleu's sentence
scores, and the translate options that use it."""

import random

import pytest
from sacrebleu.metrics import BLEU, CHRF

from mt.mbr import CharNgrams, WordNgrams, mbr_choose

WORDS = "a man woman dog runs sits in the park street red big".split()


def _naive(candidates: list[str], utility: str) -> int:
    """Mean utility of each candidate against every other position, first best on ties."""
    metric = CHRF() if utility == "chrf" else BLEU(effective_order=True)
    means = [round(sum(100.0 if h == r else metric.sentence_score(h, [r]).score
                       for j, r in enumerate(candidates) if j != i), 9)  # same text, same sum
             for i, h in enumerate(candidates)]
    return means.index(max(means))


@pytest.mark.parametrize("utility", ["chrf", "bleu"])
def test_mbr_choice_equals_the_plain_double_loop(utility):
    rng = random.Random(0)
    for _ in range(40):
        pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
                for _ in range(rng.randint(2, 5))]
        candidates = [rng.choice(pool) for _ in range(rng.randint(1, 9))]  # with duplicates
        assert mbr_choose(candidates, utility) == _naive(candidates, utility)


def test_char_ngram_chrf_equals_sacrebleus_sentence_chrf_to_the_last_bit():
    rng = random.Random(1)
    alphabet = "abcdeéß  \t.,!Ää日本"
    texts = ["", " ", "a", "ab", "Ein Hund läuft.", "Ein  Hund\tläuft .", "aaaaaaa"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(30)]
    texts += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(30)]
    metric, grams = CHRF(), [CharNgrams(t) for t in texts]
    for i, hyp in enumerate(texts):
        for j, ref in enumerate(texts):
            shared = grams[i].matches(grams[j])
            assert shared == grams[j].matches(grams[i])
            assert grams[i].score(grams[j], shared) == metric.sentence_score(hyp, [ref]).score, \
                (hyp, ref)


def test_word_ngram_bleu_equals_sacrebleus_sentence_bleu_to_the_last_bit():
    rng = random.Random(2)
    texts = ["", " ", "a", "a man", "Ein Hund läuft.", "Ein Hund läuft .", "(hi) 3.5, x-y!",
             "a a a a a a", "Zwei Männer spielen Fußball im Park."]
    vocabulary = WORDS + [".", ",", "Park.", "x"]
    texts += [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 14)))
              for _ in range(40)]
    metric, words = BLEU(effective_order=True), [WordNgrams(t) for t in texts]
    for i, hyp in enumerate(texts):
        for j, ref in enumerate(texts):
            shared = words[i].matches(words[j])
            assert words[i].score(words[j], shared) == metric.sentence_score(hyp, [ref]).score, \
                (hyp, ref)


def test_mbr_known_answers():
    # The consensus wins over the first (most probable) candidate.
    assert mbr_choose(["x y z", "a man runs", "a man walks", "a man runs"]) == 1
    assert mbr_choose(["same text"] * 4) == 0  # ties go to the earlier candidate
    assert mbr_choose(["only one"]) == 0
    assert mbr_choose(["a man", "", ""]) == 1  # two empty candidates agree with each other
    with pytest.raises(ValueError, match="utility must be one of"):
        mbr_choose(["a", "b"], "ter")
