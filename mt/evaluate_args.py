"""``mt-eval``'s command line: which systems, test sets, metrics, translation settings and
outputs it takes (``mt.evaluate`` runs them). Apart so that the runner stays readable.
"""

from __future__ import annotations

import argparse

from mt import add_version_flag
from mt.config import count_or_off, positive_int, resamples
from mt.options import add_device_arguments, add_search_arguments, add_worker_arguments
from mt.report import METRICS
from mt.testsets import named_tests


class _AddSystem(argparse.Action):
    """-m and --hyp append to one list, so the first system given is the baseline."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        kind = "model" if self.dest == "model" else "hyp"
        namespace.systems = [*namespace.systems, *((kind, v) for v in values)]


def build_parser() -> argparse.ArgumentParser:
    from sacrebleu.metrics import BLEU

    p = argparse.ArgumentParser(
        prog="mt-eval", description="Score and compare MT systems with sacrebleu. The first "
        "system given is the baseline of the paired tests.")
    add_version_flag(p)
    g = p.add_argument_group("systems (several allowed, in any mix)")
    g.add_argument("-m", "--model", nargs="+", action=_AddSystem, default=None,
                   help="run directory or checkpoint; translates each test set's source. "
                   "Unlike translate's -m, several paths (-m a.pt b.pt) are several systems, "
                   "scored side by side; comma-separated paths (a.pt,b.pt) are one system, "
                   "their ensemble")
    g.add_argument("--hyp", nargs="+", action=_AddSystem, default=None,
                   help="hypothesis file (detokenized, one line per sentence; - reads stdin); with "
                   "several test sets put {test} in the path")
    g = p.add_argument_group("test sets (several allowed)")
    g.add_argument("--src", help="source file (needed with -m)")
    g.add_argument("--ref", nargs="+", action="extend",
                   help="reference file(s); several = several references per sentence")
    g.add_argument("--name", help="name of the --src/--ref test set in the output and in "
                   "{test} (default: the first --ref path, / as _ in {test})")
    g.add_argument("--test", nargs="+", action="extend",
                   help=f"named test set from conf/testsets/ ({', '.join(named_tests())})")
    g.add_argument("--test-set", "-t", nargs="+", action="extend",
                   help="sacrebleu test set(s), e.g. wmt14 (downloaded when online)")
    g.add_argument("--langpair", "-l", help="e.g. en-de: for --test-set, and to pick the "
                   "languages of a --test set")
    g.add_argument("--origlang", "-ol", metavar="LANG",
                   help="score only the documents of a --test-set first written in LANG (as "
                   "sacrebleu's --origlang; non-LANG: the others), e.g. --origlang de")
    g.add_argument("--subset", metavar="REGEX",
                   help="score only the documents of a --test-set whose domain or annotation "
                   "matches REGEX (as sacrebleu's --subset)")
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics", "-M", nargs="+", choices=METRICS, default=["bleu", "chrf"],
                   metavar="METRIC", help=f"any of {', '.join(METRICS)} (default: bleu chrf)")
    g.add_argument("--tokenize", "-tok", choices=list(BLEU.TOKENIZERS), default=None,
                   metavar="TOK", help="BLEU tokenizer: " + ", ".join(BLEU.TOKENIZERS)
                   + " (default: 13a, or zh / ja-mecab / ko-mecab for those targets)")
    g.add_argument("--lowercase", "-lc", action="store_true", help="case-insensitive BLEU, chrF")
    g.add_argument("--confidence", "-ci", action="store_true",
                   help="bootstrap 95%% confidence interval of each score")
    g.add_argument("--confidence-n", type=resamples, default=1000, metavar="N",
                   help="bootstrap resamples, at least 2 (default: 1000)")
    g.add_argument("--paired-bs", action="store_true",
                   help="paired bootstrap resampling test of each system against the first")
    g.add_argument("--paired-ar", action="store_true",
                   help="paired approximate randomization test against the first")
    g.add_argument("--paired-bs-n", type=resamples, default=1000, metavar="N",
                   help="bootstrap resamples, at least 2 (default: 1000)")
    g.add_argument("--paired-ar-n", type=positive_int, default=10000, metavar="N",
                   help="approximate randomization trials (default: 10000)")
    g = p.add_argument_group("translation (with -m)")
    add_search_arguments(g, nbest=False)
    add_device_arguments(g)
    add_worker_arguments(g)
    g.add_argument("--weights", type=float, nargs="+", default=None, metavar="W",
                   help="the weight of each member of an ensemble (-m a.pt,b.pt), in their "
                        "order, as translate --weights (default: equal); every ensemble given "
                        "takes them")
    g.add_argument("--shortlist", metavar="FILE", default=None,
                   help="a vocabulary shortlist (mt-shortlist) for every -m system, as "
                        "translate --shortlist")
    g.add_argument("--replace-unk", action="store_true",
                   help="replace each <unk> of a translation by the source piece it attends to "
                        "most, as translate --replace-unk")
    g.add_argument("--alignment-layer", type=int, default=None, metavar="L",
                   help="decoder layer whose cross-attention --replace-unk reads (default: "
                        "penultimate)")
    g.add_argument("--output", help="write translations here; {test} and {n} (system number) "
                   "are replaced")
    p.translation_actions = list(g._group_actions)  # said to do nothing without -m
    g = p.add_argument_group("output")
    g.add_argument("--format", "-f", choices=("text", "markdown", "latex", "json"),
                   default="text", help="tables on stdout, or one JSON object (default: text)")
    g.add_argument("--json", action="store_true", help="same as --format json")
    g.add_argument("--json-out", help="write every score, signature and timing to this file")
    g.add_argument("--sentence-scores", metavar="PATH",
                   help="write each sentence's scores (JSON lines: its metrics, hypothesis and "
                        "references; BLEU with effective order) to PATH, for error analysis; "
                        "{test} and {n} (system number) are replaced")
    g.add_argument("--width", "-w", type=count_or_off, default=2, help="decimals in tables")
    g.add_argument("--quiet", "-q", action="store_true", help="warnings and errors only")
    # What translate's flags would give: mt-eval prints one translation and scores none given.
    p.set_defaults(systems=[], nbest=1, score=None)
    return p
