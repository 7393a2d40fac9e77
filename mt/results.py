"""What the search of one input line gives (``LineResult``) and its n-best texts: the shape that
``lines`` makes and ``alignment``, ``mbr`` and ``translate`` read, in a module of its own so
that each of them imports it downward.
"""

from __future__ import annotations

from dataclasses import dataclass

from mt.search import Hypothesis


@dataclass
class LineResult:
    """One input line's search: its source pieces and, per piece, the n-best hypotheses.

    A line fits in one piece unless it is longer than the model's maximum; an empty line has none.
    """

    sources: list[list[int]]
    hyps: list[list[Hypothesis]]
    text: str = ""  # the input line, whose words ``--alignment`` numbers


def line_texts(tokenizer, result: LineResult) -> list[tuple[str, float]]:
    """A line's n-best (text, score), best first: ("", 0.0) for an empty line, and one entry for
    a line in pieces, their best translations joined and their scores summed (each normalised by
    its own length penalty: the whole does not fit the model, so it has no score of its own)."""
    if not result.hyps:
        return [("", 0.0)]
    if len(result.hyps) == 1:
        nbest = result.hyps[0]
        texts = tokenizer.decode_tgt([h.tokens for h in nbest])
        return list(zip(texts, [h.score for h in nbest], strict=True))
    # Pieces of one long line: join their best translations.
    texts = tokenizer.decode_tgt([p[0].tokens for p in result.hyps])
    return [(" ".join(texts), sum(p[0].score for p in result.hyps))]
