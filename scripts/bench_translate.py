"""Translation speed on real text: mt's ``translate`` against CTranslate2, on a trained model.

``bench_decode.py`` holds every sentence of random weights to a fixed length, so all systems do
the same work. Real text does not: sentences finish at different steps and leave the batch, and
lengths vary. This script decodes a real source file with a trained mt checkpoint, through the
code ``translate`` runs (``mt.lines.translate_ids``), and with the same weights exported to
CTranslate2 (``mt.export.export_ctranslate2``), at the same beam and token budget per batch,
one batch per core in both (mt ``--workers``, CTranslate2 ``inter_threads``). CTranslate2 cuts
its own batches; ``--ct2-batches mt`` hands it mt's instead (``mt.workers.balanced_batches``,
one asynchronous call each), which on Multi30k test2016 made it 1-2% slower, not faster.

The length penalty is the same number but not the same formula: mt divides by GNMT's
((5 + length) / 6)^alpha, CTranslate2 by length^alpha, so above ``--lenpen 0`` the two searches
rank finished hypotheses differently; at 0 both rank by the log-probability. Each system's
share of output lines equal to mt float32's says how close the searches came.

With ``--shortlist FILE`` (``mt-shortlist``) a system named with ``+sl`` (``mt-bfloat16+sl``,
``ct2-int8+sl``) decodes under the shortlist: mt through ``translate --shortlist``, CTranslate2
through the same lists as its vocabulary map (``use_vmap``).

It reports seconds, sentences and whitespace words per second (model loading excluded), and BLEU
when a reference is given (tokenized for the model's target language, as mt-eval does), as
JSON. Rounds are interleaved across systems and the best counts.
Each system's first pass, before the rounds, is reported apart (``first_pass_seconds``): it is
what one ``translate`` makes, with every kernel built and every page touched the first time
(bfloat16 on one thread of the AMX machine: 5.98 s against 5.06 s for the next pass on test2016
before ``mt.kvcache.bucket_rows``).
Needs the ``bench`` extra.

    python scripts/bench_translate.py -m runs/multi30k/checkpoints/averaged.pt \\
        -i ../shared/data/multi30k/test2016.en -r ../shared/data/multi30k/test2016.de
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_decode import (  # this folder is on sys.path
    report_mistake,
    set_up_process,
    write_report,
)

from mt.checkpoint import load, load_model, resolve
from mt.config import positive_int
from mt.export import export_ctranslate2
from mt.inference import load_models
from mt.lines import translate_ids
from mt.options import SearchOptions
from mt.report import model_bleu
from mt.shortlist import Shortlist
from mt.testsets import EvalError
from mt.textio import InputError, read_lines
from mt.tokenizer import Tokenizer
from mt.workers import balanced_batches

SYSTEMS = ("mt-float32", "mt-bfloat16", "mt-int8", "ct2-float32", "ct2-int8")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="mt checkpoint file or run directory")
    p.add_argument("-i", "--input", required=True, help="source text, one sentence per line")
    p.add_argument("-r", "--reference", help="reference translations (BLEU is reported)")
    p.add_argument("--beam", type=positive_int, default=5)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--batch-tokens", type=positive_int, default=4096)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                   help="batches decoded at once, one core each, in every system")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--worker-threads", action="store_true",
                   help="mt's workers are threads of this process (translate --worker-threads), "
                        "not forked processes")
    p.add_argument("--ct2-batches", choices=("mt", "own"), default="own",
                   help="CTranslate2 cuts its own batches by the same token budget (default: "
                        "here 1-2%% faster for it than mt's) or decodes mt's")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)}, each also with "
                        "+sl (under --shortlist)")
    p.add_argument("--shortlist", help="a shortlist file (mt-shortlist) for the +sl systems")
    p.add_argument("--tgt-lang", metavar="LANG",
                   help="the target language BLEU is tokenized for (zh, ja, ko have their own "
                        "tokenizers); default: the model's data.tgt_lang")
    p.add_argument("--out", help="JSON file (default: stdout)")
    args = p.parse_args(argv)
    if mistake := report_mistake(args.out):
        p.error(mistake)
    set_up_process()
    systems = args.systems.split(",")
    if unknown := sorted({n for n in systems if n.removesuffix("+sl") not in SYSTEMS}):
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)} (each also +sl)")
    if any(n.endswith("+sl") for n in systems) and not args.shortlist:
        p.error("the +sl systems need --shortlist FILE")
    try:  # as translate reads them: a missing file or a bad line is one line, not a traceback
        lines = list(read_lines(args.input))
        refs = list(read_lines(args.reference)) if args.reference else None
        resolve(args.model)
        # read before any system is built, so that a missing file or one made for another model
        # is one line, not a traceback after the mt systems have loaded
        shortlist = (Shortlist.load(args.shortlist, Tokenizer.from_state(
            load(args.model, mmap=True)["tokenizer"])) if args.shortlist else None)
        # tokenized for the model's target language, as mt-eval and mt-train's test score are
        bleu = model_bleu(str(resolve(args.model)), args.tgt_lang) if args.reference else None
    except (InputError, OSError, ValueError, KeyError, RuntimeError, TypeError,
            EvalError) as err:
        p.error(str(err))
    if not lines:  # every system would time nothing, and the ratios compare noise
        p.error(f"{args.input}: no lines to translate")
    if refs is not None and len(refs) != len(lines):  # sacreBLEU would score the shorter zip
        p.error(f"{args.input} has {len(lines)} lines but {args.reference} has {len(refs)}")

    opts = SearchOptions(beam=args.beam, lenpen=args.lenpen, batch_tokens=args.batch_tokens,
                         workers=args.threads, processes=not args.worker_threads)
    runs = {}
    for name in systems:
        if name.startswith("mt-"):
            model, tok, _ = load_models([args.model], "cpu", name[3:].removesuffix("+sl"))
            ids = tok.encode_src(lines)
            # EOS alone (an empty line) gets an empty line, as in translate (mt.lines), which
            # does not search it: a search would make up a sentence from nothing
            kept = [i for i, x in enumerate(ids) if len(x) > 1]
            ids = [ids[i] for i in kept]
            own = shortlist if name.endswith("+sl") else None

            def run(model=model, tok=tok, ids=ids, kept=kept, own=own) -> list[str]:
                hyps = translate_ids(model, ids, opts, shortlist=own)
                out = [""] * len(lines)
                for i, text in zip(kept, tok.decode_tgt([h[0].tokens for h in hyps]),
                                   strict=True):
                    out[i] = text
                return out

            runs[name] = run
    tmp = tempfile.TemporaryDirectory()
    if any(name.startswith("ct2-") for name in systems):
        import ctranslate2
        import sentencepiece as spm

        model, tok, _ = load_model(args.model, "cpu")
        for name in (n for n in systems if n.startswith("ct2-")):
            q, restricted = name[4:].removesuffix("+sl"), name.endswith("+sl")
            out = f"{tmp.name}/{name[4:]}"
            export_ctranslate2(model, tok, out, None if q == "float32" else q,
                               shortlist if restricted else None)
            joint = Path(out, "spm.model").exists()
            name_src, name_tgt = ("spm", "spm") if joint else ("src", "tgt")
            sp_src = spm.SentencePieceProcessor(model_file=f"{out}/{name_src}.model")
            sp = spm.SentencePieceProcessor(model_file=f"{out}/{name_tgt}.model")
            translator = ctranslate2.Translator(out, device="cpu", compute_type=q,
                                                inter_threads=args.threads, intra_threads=1)
            pieces = [sp_src.encode(line, out_type=str) for line in lines]
            # mt's batches of the same sources (lengths with EOS, as mt counts them)
            lengths = [len(x) + 1 for x in pieces]
            order = sorted(range(len(lines)), key=lambda i: -lengths[i])
            batches = balanced_batches(lengths, order, args.batch_tokens, args.threads)
            # at least mt's length budget (1.5 x source + 10, EOS included; one limit for all
            # here), mt's never-emitted PAD/BOS; empty lines give empty outputs in both
            # (and within the model's positions: CTranslate2 stops at a position past them)
            budget = int(1.5 * max(map(len, pieces), default=0)) + 10
            search = dict(beam_size=args.beam, length_penalty=args.lenpen,
                          max_decoding_length=min(budget, model.cfg.max_positions - 1),
                          suppress_sequences=[["<pad>"], ["<s>"]], use_vmap=restricted)

            def run(translator=translator, sp=sp, pieces=pieces, batches=batches,
                    search=search) -> list[str]:
                if args.ct2_batches == "own":
                    results = translator.translate_batch(
                        pieces, max_batch_size=args.batch_tokens, batch_type="tokens", **search)
                else:  # queued at once: inter_threads of them run together, as mt's workers
                    pending = [translator.translate_batch([pieces[i] for i in b],
                                                          asynchronous=True, **search)
                               for b in batches]
                    results = [None] * len(pieces)
                    for b, outs in zip(batches, pending, strict=True):
                        for i, out in zip(b, outs, strict=True):
                            results[i] = out.result()
                return [sp.decode(r.hypotheses[0]) if r.hypotheses else "" for r in results]

            runs[name] = run

    torch.set_num_threads(args.threads)
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "sentences": len(lines), "torch": torch.__version__, "systems": {}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, list[str]] = {}
    first: dict[str, float] = {}
    for name, run in runs.items():  # the first pass: what one translate makes, set-up and all
        start = time.perf_counter()
        outputs[name] = run()
        first[name] = time.perf_counter() - start
    for _ in range(args.repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    for name, out in outputs.items():
        best = min(times[name])
        tokens = sum(len(line.split()) for line in out)
        entry = {"seconds": round(best, 3), "rounds": [round(t, 3) for t in times[name]],
                 "first_pass_seconds": round(first[name], 3),
                 "sentences_per_s": round(len(lines) / best, 1),
                 "words_per_s": round(tokens / best, 1)}
        if bleu is not None:
            entry["bleu"] = round(bleu.corpus_score(out, [refs]).score, 2)
        if "mt-float32" in outputs:
            same = sum(a == b for a, b in zip(out, outputs["mt-float32"], strict=True))
            entry["same_as_mt_float32"] = round(same / max(len(out), 1), 3)
        report["systems"][name] = entry
        print(f"{name:12s} {best:7.2f} s (first pass {first[name]:.2f} s)  "
              f"{entry['sentences_per_s']:8.1f} sentences/s"
              + (f"  BLEU {entry['bleu']:.2f}" if "bleu" in entry else ""), file=sys.stderr)
    ratios = {}
    pairs = [(a + sl, b + sl) for sl in ("", "+sl") for a, b in (
        ("mt-float32", "ct2-float32"), ("mt-int8", "ct2-int8"), ("mt-bfloat16", "ct2-int8"))]
    pairs += [(a + "+sl", a) for a in SYSTEMS]  # the shortlist's own gain
    for a, b in pairs:
        if a in times and b in times:
            ratios[f"{a} / {b}"] = round(min(times[b]) / min(times[a]), 2)
    report["ratios"] = ratios  # speed ratios (> 1: mt faster)
    if bleu is not None:  # the tokenizer (tok:zh for a Chinese target): known once it has scored
        report["bleu_signature"] = str(bleu.get_signature())
    write_report(report, args.out, "bench_translate.py")
    tmp.cleanup()


if __name__ == "__main__":
    main()
