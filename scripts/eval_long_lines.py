"""How much the place where ``translate`` cuts a line longer than the model matters.

A test set's sentences are joined ``--join`` at a time into lines, the model's length limit is
lowered to ``--limit`` tokens (for this experiment only) so that many lines must be cut into
pieces, and the lines are translated twice: cut where the limit falls, and cut after the last
sentence that fits, else between words (what ``translate`` does). Prints JSON with BLEU and chrF
of both against the references joined the same way (BLEU tokenized for the model's target
language, as mt-eval and mt-train's test score: zh, ja-mecab, ko-mecab, else 13a).

    python scripts/eval_long_lines.py -m runs/m30k/checkpoints/averaged.pt \\
        --src ../shared/data/multi30k/test2016.en --ref ../shared/data/multi30k/test2016.de
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sacrebleu  # noqa: E402

from mt.config import positive_int  # noqa: E402
from mt.lines import best_translations  # noqa: E402
from mt.options import SearchOptions  # noqa: E402
from mt.testsets import model_and_pair  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--join", type=positive_int, default=3, help="sentences per line")
    p.add_argument("--limit", type=positive_int, default=48,
                   help="the model's limit, in tokens (at least 2: a piece and EOS)")
    p.add_argument("--tgt-lang", metavar="LANG",
                   help="the target language BLEU is tokenized for (zh, ja, ko have their own "
                        "tokenizers); default: the model's data.tgt_lang")
    p.add_argument("--workers", type=positive_int, default=2)
    args = p.parse_args()
    if args.limit < 2:
        p.error("--limit must be 2 or more: a piece and EOS")
    model, tok, src, ref, bleu = model_and_pair(p, args.model, args.src, args.ref, args.tgt_lang)
    if args.limit > model.cfg.max_positions:
        p.error(f"--limit {args.limit} is above the model's maximum of "
                f"{model.cfg.max_positions} tokens")
    lines = [" ".join(src[i : i + args.join]) for i in range(0, len(src), args.join)]
    refs = [" ".join(ref[i : i + args.join]) for i in range(0, len(ref), args.join)]
    model.cfg.max_positions = args.limit
    result = {"lines": len(lines), "limit": args.limit,
              "cut": sum(len(ids) > args.limit for ids in tok.encode_src(lines))}
    blind = copy.copy(tok)
    blind.src_boundaries = None  # no sentence ends or word starts known: cut at the limit
    for name, tokenizer in (("at_the_limit", blind), ("between_sentences", tok)):
        hyps = best_translations(model, tokenizer, lines, SearchOptions(workers=args.workers))
        result[name] = {"bleu": round(bleu.corpus_score(hyps, [refs]).score, 2),
                        "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)}
    result["bleu_signature"] = str(bleu.get_signature())  # known once it has scored
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
