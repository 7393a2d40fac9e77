"""Minimum Bayes risk decoding (``translate --mbr``): of each line's candidates, the one that
agrees most with all the others.

Beam search returns the most probable translation, which is often not the best one: the mode of
a neural model's distribution can be short or odd while most of the probability mass agrees on
something else. MBR (Kumar and Byrne, 2004; for NMT Eikema and Aziz, 2020; Freitag et al., 2022)
draws candidates from the model and picks the one with the highest expected utility (chrF or
BLEU, from sacrebleu) against the candidates themselves taken as pseudo-references, each weighing
the same: with samples, a Monte Carlo estimate of the expected utility under the model. It costs
one search for the candidates and N x (N - 1) sentence scores per line (fewer with duplicates).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mt.results import LineResult  # (mbr stays free of torch: mt.options imports it)

UTILITIES = ("chrf", "bleu")


class _Ngrams:
    """A text's n-grams per order (``counts``) and their totals, counted once for every pair it
    is scored in. sacreBLEU's ``sentence_score`` extracts both texts' n-grams at every call, so
    N candidates cost N x (N - 1) extractions where N suffice, and the clipped matches of a pair
    are the same either way, so they are counted once for both directions: choosing among 16-32
    samples took 5.8-6.4x less time for chrF, 3.4-3.7x for BLEU (docs/decoding.md). The arithmetic
    is sacreBLEU's, step for step, so the scores are equal to the last bit (tests compare).
    """

    counts: list[Counter]

    def matches(self, other: _Ngrams) -> list[int]:
        """Per order, the n-grams the two texts share (with counts clipped): the same either way."""
        out = []
        for mine, theirs in zip(self.counts, other.counts, strict=True):
            if len(theirs) < len(mine):
                mine, theirs = theirs, mine
            out.append(sum(min(c, theirs[g]) for g, c in mine.items() if g in theirs))
        return out

    def score(self, ref: _Ngrams, matches: list[int]) -> float:
        raise NotImplementedError


class CharNgrams(_Ngrams):
    """Character 1- to 6-grams, whitespace removed: sacreBLEU's sentence chrF (chrF2, its
    defaults)."""

    ORDER, BETA = 6, 2

    def __init__(self, text: str) -> None:
        line = "".join(text.split())
        self.counts = [Counter(line[i : i + n] for i in range(len(line) - n + 1))
                       for n in range(1, self.ORDER + 1)]
        self.totals = [sum(c.values()) for c in self.counts]

    def score(self, ref: _Ngrams, matches: list[int]) -> float:
        """sacreBLEU's CHRF().sentence_score(self's text, [ref's text]).score."""
        factor = self.BETA**2
        avg_prec = avg_rec = 0.0
        effective_order = 0
        for n_hyp, n_ref, n_match in zip(self.totals, ref.totals, matches, strict=True):
            if n_hyp > 0 and n_ref > 0:  # sacreBLEU's effective order (no eps smoothing)
                avg_prec += n_match / n_hyp
                avg_rec += n_match / n_ref
                effective_order += 1
        if effective_order == 0:
            return 0.0
        avg_prec /= effective_order
        avg_rec /= effective_order
        if not avg_prec + avg_rec:
            return 0.0
        score = (1 + factor) * avg_prec * avg_rec
        score /= (factor * avg_prec) + avg_rec
        return 100 * score


class WordNgrams(_Ngrams):
    """13a-tokenized word 1- to 4-grams: sacreBLEU's sentence BLEU with effective order and exp
    smoothing (``BLEU(effective_order=True)``); the statistics are its
    ``_compute_segment_statistics`` for one reference, the score its public ``compute_bleu``."""

    ORDER = 4

    def __init__(self, text: str) -> None:
        from sacrebleu.metrics.helpers import extract_all_word_ngrams

        tokens = _bleu_metric().tokenizer(text.rstrip())  # as BLEU._preprocess_segment
        ngrams, self.length = extract_all_word_ngrams(tokens, 1, self.ORDER)
        self.counts = [Counter() for _ in range(self.ORDER)]
        for gram, count in ngrams.items():
            self.counts[len(gram) - 1][gram] = count
        self.totals = [sum(c.values()) for c in self.counts]

    def score(self, ref: WordNgrams, matches: list[int]) -> float:
        """sacreBLEU's BLEU(effective_order=True).sentence_score(self's text, [ref's text])."""
        metric = _bleu_metric()
        return metric.compute_bleu(matches, self.totals, self.length, ref.length,
                                   smooth_method=metric.smooth_method,
                                   smooth_value=metric.smooth_value, effective_order=True,
                                   max_ngram_order=self.ORDER).score


@functools.cache
def _bleu_metric():
    from sacrebleu.metrics import BLEU

    return BLEU(effective_order=True)  # sentence BLEU: no zero for a missing 4-gram


NGRAMS = {"chrf": CharNgrams, "bleu": WordNgrams}


def _pair_scores(distinct: list[str], utility: str) -> dict[tuple[int, int], float]:
    """utility(hyp i, ref j) for every ordered pair of distinct texts."""
    if utility not in NGRAMS:
        raise ValueError(f"MBR utility must be one of {UTILITIES}, got {utility!r}")
    grams = [NGRAMS[utility](t) for t in distinct]
    scores = {}
    for i in range(len(distinct)):
        for j in range(i + 1, len(distinct)):
            shared = grams[i].matches(grams[j])
            scores[i, j] = grams[i].score(grams[j], shared)
            scores[j, i] = grams[j].score(grams[i], shared)
    return scores


def mbr_choose(candidates: list[str], utility: str = "chrf") -> int:
    """The index of the candidate with the highest mean utility against the other candidates.

    Each distinct text is scored once against each distinct other (a text drawn k times counts
    k times as a pseudo-reference, and k - 1 times against itself). Ties go to the earlier
    candidate, so with candidates sorted best first the model's preference breaks them.
    """
    if not candidates:
        raise ValueError("MBR needs at least one candidate")
    counts = Counter(candidates)
    distinct = list(counts)
    scores = _pair_scores(distinct, utility)
    expected = {}
    for i, hyp in enumerate(distinct):
        total = 0.0
        for j, ref in enumerate(distinct):
            if i == j:  # its other copies agree fully (sacrebleu scores "" against "" as 0)
                total += (counts[ref] - 1) * 100.0
            else:
                total += counts[ref] * scores[i, j]
        expected[hyp] = total
    return max(range(len(candidates)), key=lambda i: (expected[candidates[i]], -i))


def mbr_lines(tokenizer, results: list[LineResult], utility: str = "chrf") -> list[LineResult]:
    """Each line's (and each piece's) n-best candidates cut to the MBR choice among them."""
    out = []
    for r in results:
        hyps = []
        for nbest in r.hyps:
            texts = tokenizer.decode_tgt([h.tokens for h in nbest])
            hyps.append([nbest[mbr_choose(texts, utility)]])
        out.append(replace(r, hyps=hyps))
    return out
