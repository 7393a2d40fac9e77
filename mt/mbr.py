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

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mt.lines import LineResult

UTILITIES = ("chrf", "bleu")


def _utility(name: str):
    from sacrebleu.metrics import BLEU, CHRF

    if name == "chrf":
        return CHRF()
    if name == "bleu":
        return BLEU(effective_order=True)  # sentence BLEU: no zero for a missing 4-gram
    raise ValueError(f"MBR utility must be one of {UTILITIES}, got {name!r}")


def mbr_choose(candidates: list[str], utility: str = "chrf") -> int:
    """The index of the candidate with the highest mean utility against the other candidates.

    Each distinct text is scored once against each distinct other (a text drawn k times counts
    k times as a pseudo-reference, and k - 1 times against itself). Ties go to the earlier
    candidate, so with candidates sorted best first the model's preference breaks them.
    """
    if not candidates:
        raise ValueError("MBR needs at least one candidate")
    metric = _utility(utility)
    counts = Counter(candidates)
    distinct = list(counts)
    expected = {}
    for hyp in distinct:
        total = 0.0
        for ref in distinct:
            if ref == hyp:  # its other copies agree fully (sacrebleu scores "" against "" as 0)
                total += (counts[ref] - 1) * 100.0
            else:
                total += counts[ref] * metric.sentence_score(hyp, [ref]).score
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
