"""``mt-eval``: translate a test set and score it with sacrebleu (BLEU and chrF, with signatures).

Scores come from sacrebleu's metric objects on detokenized text, exactly what ``sacrebleu`` on the
command line computes, and each is reported with its signature so that numbers are comparable.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

log = logging.getLogger("mt.evaluate")


def score(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against one reference each.

    Returns:
        {"bleu": float, "bleu_signature": str, "chrf": float, "chrf_signature": str,
         "sentences": int}
    """
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": b.score, "bleu_signature": str(bleu.get_signature()),
            "chrf": c.score, "chrf_signature": str(chrf.get_signature()),
            "sentences": len(hypotheses)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mt-eval",
                                description="Translate a test set and score it with sacrebleu.")
    p.add_argument("-m", "--model", help="run directory or checkpoint to translate --src with")
    p.add_argument("--src", help="source file")
    p.add_argument("--ref", required=True, help="reference file (detokenized)")
    p.add_argument("--hyp", help="score this hypothesis file instead of translating")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", help="also write the translations to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from mt.data import DataError, read_lines

    try:
        refs = read_lines(args.ref)
        result: dict = {}
        if args.hyp:
            hyps = read_lines(args.hyp)
            seconds = None
        else:
            if not (args.model and args.src):
                raise SystemExit("mt-eval: give -m MODEL and --src FILE, or --hyp FILE")
            import torch

            from mt.checkpoint import load_model
            from mt.translate import SearchOptions, translate_lines

            srcs = read_lines(args.src)
            if len(srcs) != len(refs):
                raise SystemExit(f"mt-eval: {args.src} has {len(srcs)} lines but {args.ref} has "
                                 f"{len(refs)}")
            model, tokenizer, ckpt = load_model(args.model, args.device)
            opts = SearchOptions(beam=args.beam, lenpen=args.lenpen,
                                 batch_tokens=args.batch_tokens)
            start = time.perf_counter()
            with torch.inference_mode():
                hyps = [n[0][0] for n in translate_lines(model, tokenizer, srcs, opts)]
            seconds = time.perf_counter() - start
            result["model"] = ckpt["path"]
            if args.output:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.writelines(h + "\n" for h in hyps)
    except (FileNotFoundError, DataError, ValueError) as err:
        raise SystemExit(f"mt-eval: {err}") from None
    if len(hyps) != len(refs):
        raise SystemExit(f"mt-eval: {args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}")
    result.update(score(hyps, refs))
    result["seconds"] = seconds
    result["sentences_per_second"] = len(hyps) / seconds if seconds else None
    if args.json:
        print(json.dumps(result))
    else:
        print(f"BLEU = {result['bleu']:.2f}  ({result['bleu_signature']})")
        print(f"chrF = {result['chrf']:.2f}  ({result['chrf_signature']})")
        if seconds:
            print(f"{len(hyps)} sentences in {seconds:.1f} s "
                  f"({result['sentences_per_second']:.1f} sentences/s)")


if __name__ == "__main__":
    main()
