"""Benchmark MBR's utility: ``mt.mbr.mbr_choose`` against a sacreBLEU ``sentence_score`` per
ordered pair of candidates (what ``mt.mbr`` did before ``CharNgrams`` and ``WordNgrams``), on the
same candidates, for chrF or (``--utility bleu``) sentence BLEU.

The input is ``translate --nbest N`` output (``index<TAB>translation<TAB>score``), e.g. samples:

    translate -m MODEL -i test.en -o samples.de --sampling --epsilon 0.02 --nbest 32
    python scripts/bench_mbr.py samples.de

Prints one JSON object: seconds for each way (best of ``--rounds``, alternated), milliseconds per
line, the ratio, and whether every line's choice is the same (it must be: the scores are equal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mt without being installed

from mt.config import positive_int  # noqa: E402
from mt.mbr import mbr_choose  # noqa: E402


def per_pair_choose(candidates: list[str], utility: str) -> int:
    """The choice as a plain loop over sacreBLEU's sentence scores, every ordered pair afresh."""
    metric = CHRF() if utility == "chrf" else BLEU(effective_order=True)
    counts = Counter(candidates)
    expected = {hyp: sum((counts[ref] - 1) * 100.0 if ref == hyp
                         else counts[ref] * metric.sentence_score(hyp, [ref]).score
                         for ref in counts) for hyp in counts}
    return max(range(len(candidates)), key=lambda i: (expected[candidates[i]], -i))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("nbest", help="translate --nbest output: index<TAB>translation<TAB>score")
    p.add_argument("--utility", choices=("chrf", "bleu"), default="chrf")
    p.add_argument("--rounds", type=positive_int, default=2)
    args = p.parse_args()
    groups: dict[int, list[str]] = defaultdict(list)
    try:
        with open(args.nbest, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                fields = line.rstrip("\n").split("\t")
                if len(fields) != 3 or not fields[0].isdigit():
                    p.error(f"{args.nbest}:{lineno}: not translate --nbest output "
                            "(index<TAB>translation<TAB>score)")
                groups[int(fields[0])].append(fields[1])
    except (OSError, UnicodeDecodeError) as err:
        p.error(f"{args.nbest}: cannot read ({err})")
    lines = list(groups.values())
    if not lines:
        p.error(f"{args.nbest}: no n-best lines in it")
    seconds: dict[str, list[float]] = {"per_pair": [], "mt": []}
    choices = {}
    for _ in range(args.rounds):
        for name, choose in (("per_pair", per_pair_choose), ("mt", mbr_choose)):
            start = time.perf_counter()
            choices[name] = [choose(c, args.utility) for c in lines]
            seconds[name].append(time.perf_counter() - start)
    best = {name: min(s) for name, s in seconds.items()}
    print(json.dumps({
        "utility": args.utility, "lines": len(lines),
        "candidates_per_line": max(len(c) for c in lines),
        "seconds": best, "ms_per_line": {k: 1000 * v / len(lines) for k, v in best.items()},
        "speedup": best["per_pair"] / best["mt"],
        "same_choices": choices["per_pair"] == choices["mt"],
    }, indent=2))


if __name__ == "__main__":
    main()
