"""What lexical constraints (``translate --constraints-file``) do to a test set.

The usual check of a constrained search (Hokamp & Liu, 2017; Post & Vilar, 2018): phrases are
drawn from each reference (``--phrases`` per line, ``--words`` words at most each, seeded), as a
terminology list would give them, and the test set is translated without and with them through
the code ``translate`` runs. Prints JSON: BLEU (tokenized for the model's target language, as
mt-eval's) and chrF of both, the share of lines whose translation holds every phrase, and the
seconds each took.

    python scripts/eval_constraints.py -m runs/m30k/checkpoints/averaged.pt \\
        --src ../shared/data/multi30k/test2016.en --ref ../shared/data/multi30k/test2016.de
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sacrebleu  # noqa: E402

from mt.config import positive_int  # noqa: E402
from mt.lines import best_translations  # noqa: E402
from mt.options import SearchOptions  # noqa: E402
from mt.testsets import model_and_pair  # noqa: E402


def draw(reference: str, phrases: int, words: int, rng: random.Random) -> list[str]:
    """Up to ``phrases`` non-overlapping runs of 1..``words`` words of the reference."""
    tokens = reference.split()
    taken: set[int] = set()
    out = []
    for _ in range(phrases):
        n = rng.randint(1, words)
        starts = [i for i in range(len(tokens) - n + 1) if not taken & set(range(i, i + n))]
        if not starts:
            break
        i = rng.choice(starts)
        taken |= set(range(i, i + n))
        out.append(" ".join(tokens[i : i + n]).strip(".,;:!?\"'"))
    return [p for p in out if p]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--phrases", type=positive_int, default=2, help="phrases per line")
    p.add_argument("--words", type=positive_int, default=3, help="words per phrase, at most")
    p.add_argument("--beam", type=positive_int, default=5, help="at least 2 (constraints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tgt-lang", metavar="LANG",
                   help="the target language BLEU is tokenized for (zh, ja, ko have their own "
                        "tokenizers); default: the model's data.tgt_lang")
    p.add_argument("--workers", type=positive_int, default=2)
    args = p.parse_args()
    if args.beam < 2:
        p.error("--beam must be 2 or more: a beam of 1 has no room for a constrained hypothesis")
    model, tok, src, ref, bleu = model_and_pair(p, args.model, args.src, args.ref, args.tgt_lang)
    rng = random.Random(args.seed)
    constraints = [draw(r, args.phrases, args.words, rng) for r in ref]
    opts = SearchOptions(beam=args.beam, workers=args.workers)
    result = {"lines": len(src), "beam": args.beam,
              "phrases": sum(map(len, constraints)),
              "phrase_words": sum(len(c.split()) for cs in constraints for c in cs)}
    best_translations(model, tok, src[:64], opts)  # first-call set-up: timed by neither
    for name, given in (("free", None), ("constrained", constraints)):
        start = time.perf_counter()
        hyps = best_translations(model, tok, src, opts, constraints=given)
        seconds = time.perf_counter() - start
        held = sum(all(c in h for c in cs) for h, cs in zip(hyps, constraints, strict=True))
        result[name] = {"bleu": round(bleu.corpus_score(hyps, [ref]).score, 2),
                        "chrf": round(sacrebleu.corpus_chrf(hyps, [ref]).score, 2),
                        "lines_holding_every_phrase": round(held / len(src), 4),
                        "seconds": round(seconds, 1)}
    result["bleu_signature"] = str(bleu.get_signature())  # known once it has scored
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
