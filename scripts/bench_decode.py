"""Decoding speed of mt against Hugging Face Marian and CTranslate2, on identical weights.

One random transformer_base (6+6 layers, d 512, FFN 2048, 8 heads, 8k joint vocabulary, post-norm,
sinusoidal positions, tied embeddings) is built in mt, then copied into a MarianMTModel of the same
architecture (q/k/v split out of mt's fused projections, final_logits_bias zero) and into a
CTranslate2 TransformerSpec (whose fused qkv / kv layout is mt's own), both by ``mt.export``.
Before timing, each copy is checked against mt: the logits of a teacher-forced forward (HF, to
1e-4), CT2's log-probabilities of a given target (1e-3) and the greedy output of one sentence (HF
and CTranslate2).

Every system decodes the same random sources with beam 4, batches of 32 and exactly ``--tgt-len``
decoder steps per sentence (EOS forbidden before, forced at the end; HF min_new_tokens =
max_new_tokens; CT2 min/max_decoding_length), so all do the same work; speed is target tokens
(steps x sentences) per second, the best of ``--repeat`` runs. Needs the ``bench`` extra
(transformers, ctranslate2).

    python scripts/bench_decode.py --out bench_decode.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

from mt.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from mt.export import export_ctranslate2, hf_model, placeholder_vocabulary
from mt.inference import prepare_model
from mt.model import build_model
from mt.search import beam_search, greedy_search
from mt.translate import worker_threads

SYSTEMS = ("mt-float32", "mt-bfloat16", "mt-int8", "mt-float32-unpacked", "hf-float32",
           "ct2-float32", "ct2-int8")


def base_model(vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(name="transformer_base", encoder_layers=6, decoder_layers=6, d_model=512,
                      ffn_dim=2048, heads=8, dropout=0.0, src_vocab_size=vocab,
                      tgt_vocab_size=vocab, max_positions=1024)
    return build_model(cfg).eval()


def sources(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(15, 46, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (n_i,), generator=g).tolist() + [EOS_ID] for n_i in lengths]


def pad(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


# -- checks and timing


def check_equivalence(model, hf, ct2_dir: str, src: list[int], threads: int) -> dict:
    """HF logits match mt's (teacher-forced, 1e-4), so do CT2's token log-probabilities (1e-3);
    HF's and CT2's greedy outputs equal mt's."""
    import ctranslate2

    tgt_in = torch.tensor([[BOS_ID] + src[:-1][:12]])
    with torch.inference_mode():
        ours = model(torch.tensor([src]), tgt_in)
        theirs = hf(input_ids=torch.tensor([src]), decoder_input_ids=tgt_in).logits
        diff = float((ours - theirs).abs().max())
        greedy = greedy_search(model, torch.tensor([src]), max_len_a=0, max_len_b=21)[0].tokens
        hf_out = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False,
                             max_new_tokens=21)[0].tolist()
    hf_tokens = [t for t in hf_out[1:] if t not in (EOS_ID, PAD_ID)]
    translator = ctranslate2.Translator(ct2_dir, device="cpu", compute_type="float32",
                                        intra_threads=threads)
    vocab = placeholder_vocabulary(model.cfg.tgt_vocab_size)
    pieces = [vocab[t] for t in src[:-1]]  # CT2 appends the source EOS itself
    ct2 = translator.translate_batch([pieces], beam_size=1,
                                     max_decoding_length=21)[0].hypotheses[0]
    ct2_tokens = [vocab.index(t) for t in ct2]
    # CT2 scores a given target: its token log-probabilities against mt's teacher-forced ones.
    target = greedy[:12]
    scored = translator.score_batch([pieces], [[vocab[t] for t in target]])[0].log_probs  # + EOS
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([src]), torch.tensor([[BOS_ID] + target])), -1)
    ours_lp = lp[0].gather(1, torch.tensor(target + [EOS_ID])[:, None])[:, 0]
    ct2_diff = float((ours_lp - torch.tensor(scored)).abs().max())
    if diff > 1e-4:
        raise SystemExit(f"bench_decode: HF logits differ from mt's by {diff:.2e}: weight mapping")
    if ct2_diff > 1e-3:
        raise SystemExit(f"bench_decode: CT2 log-probs differ from mt's by {ct2_diff:.2e}")
    k = min(len(greedy), len(hf_tokens), len(ct2_tokens))
    if not greedy[:k] == hf_tokens[:k] == ct2_tokens[:k]:
        raise SystemExit(f"bench_decode: greedy outputs differ\nmt   {greedy}\nhf   {hf_tokens}"
                         f"\nct2  {ct2_tokens}")
    return {"hf_max_logit_diff": diff, "ct2_max_logprob_diff": ct2_diff,
            "greedy_tokens_equal": k, "greedy_distinct_tokens": len(set(greedy))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--tgt-len", type=int, default=30, help="decoder steps per sentence")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1,
                   help="threads per system (torch and CT2 intra-op); on a CPU shared with other "
                        "work, more threads than idle cores make OpenMP spin: keep it low")
    p.add_argument("--parallel", choices=("intra", "batches"), default="intra",
                   help="how a system uses --threads cores: intra = one batch at a time, each "
                        "operator split over the threads; batches = --threads batches at once, one "
                        "thread each (mt: translate --workers, CT2: inter_threads, HF: the same "
                        "thread pool as mt)")
    p.add_argument("--repeat", type=int, default=2,
                   help="rounds; each round times every system once (interleaved, so load "
                        "changes on a shared CPU hit all systems alike); the best round counts")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--out", default=None, help="JSON file (default: stdout)")
    args = p.parse_args(argv)
    by_batch = args.parallel == "batches"
    torch.set_num_threads(1 if by_batch else args.threads)
    torch.set_num_interop_threads(1)
    systems = args.systems.split(",")
    n, steps, beam = args.sentences, args.tgt_len, args.beam

    model = base_model(args.vocab, seed=0)
    # Sorted by length, as translate batches (and CT2 with max_batch_size sorts): little padding.
    srcs = sorted(sources(n, args.vocab, seed=1), key=len, reverse=True)
    batches = [srcs[i : i + args.batch] for i in range(0, n, args.batch)]
    warm = [srcs[:4]]  # a small batch, so that lazy initialisation is not timed
    hf = hf_model(model).eval()
    tmp = tempfile.TemporaryDirectory()
    ct2_dirs = {}
    for q in ("float32", "int8"):
        ct2_dirs[q] = f"{tmp.name}/ct2-{q}"
        export_ctranslate2(model, None, ct2_dirs[q], None if q == "float32" else q)
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "model": "transformer_base (6+6, d512, ffn2048, 8 heads), random weights",
              "torch": torch.__version__, "load_average_before": os.getloadavg(),
              "checks": check_equivalence(
                  model, hf, ct2_dirs["float32"], srcs[0], args.threads), "systems": {}}

    def each_batch(fn, todo):
        """fn over the batches: in turn, or --threads at once (translate --workers's pool)."""
        with worker_threads(args.threads if by_batch else 1) as pool:
            return list(pool.map(fn, todo))

    def run_mt(m):
        def one(b):
            hyps = beam_search(m, pad(b), beam_size=beam, lenpen=1.0, max_len_a=0,
                               max_len_b=steps, min_len=steps - 1)
            return {len(h[0].tokens) + 1 for h in hyps}  # EOS is a step too

        def fn(warmup):
            lengths = set().union(*each_batch(one, warm if warmup else batches))
            assert warmup or lengths == {steps}, lengths
        return fn

    def run_hf(warmup):
        def one(b):
            with torch.inference_mode():
                src = pad(b)
                out = hf.generate(src, attention_mask=src != PAD_ID, num_beams=beam,
                                  do_sample=False, min_new_tokens=steps, max_new_tokens=steps,
                                  early_stopping=True, length_penalty=1.0)
                assert warmup or out.size(1) == steps + 1, out.shape  # start token + steps

        each_batch(one, warm if warmup else batches)

    def run_ct2(q):
        import ctranslate2

        translator = ctranslate2.Translator(
            ct2_dirs[q], device="cpu", compute_type=q, inter_threads=args.threads if by_batch
            else 1, intra_threads=1 if by_batch else args.threads)
        vocab = placeholder_vocabulary(args.vocab)

        def fn(warmup):
            # One call with every sentence: CT2 sorts them by length (already done) and cuts
            # max_batch_size batches (the same as mt's), inter_threads of them at once.
            todo = [s for b in (warm if warmup else batches) for s in b]
            res = translator.translate_batch(
                [[vocab[t] for t in s[:-1]] for s in todo],  # CT2 appends the source EOS
                beam_size=beam, max_batch_size=args.batch, batch_type="examples",
                min_decoding_length=steps, max_decoding_length=steps, length_penalty=1.0)
            assert warmup or {len(r.hypotheses[0]) for r in res} == {steps}
        return fn

    runners = {
        # What `translate --dtype ...` decodes with (mt.inference.prepare_model).
        "mt-float32": lambda: run_mt(prepare_model(copy.deepcopy(model), "float32")),
        "mt-bfloat16": lambda: run_mt(prepare_model(copy.deepcopy(model), "bfloat16")),
        "mt-int8": lambda: run_mt(prepare_model(copy.deepcopy(model), "int8")),
        "mt-float32-unpacked": lambda: run_mt(model),  # nn.Linear as trained: the GEMM's gain
        "hf-float32": lambda: run_hf,
        "ct2-float32": lambda: run_ct2("float32"),
        "ct2-int8": lambda: run_ct2("int8"),
    }
    fns = {name: runners[name]() for name in systems}
    for fn in fns.values():
        fn(warmup=True)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(warmup=False)
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        report["systems"][name] = {
            "tokens_per_s": round(n * steps / min(seconds), 1),
            "median_tokens_per_s": round(n * steps / statistics.median(seconds), 1),
            "seconds": [round(s, 3) for s in seconds]}
        print(f"{name:12s} {report['systems'][name]['tokens_per_s']:8.1f} target tokens/s",
              file=sys.stderr)
    report["load_average_after"] = os.getloadavg()
    speed = {k: v["tokens_per_s"] for k, v in report["systems"].items()}
    pairs = [("mt-float32", "ct2-float32"), ("mt-bfloat16", "ct2-int8"), ("mt-int8", "ct2-int8"),
             ("mt-float32", "hf-float32"), ("mt-bfloat16", "mt-float32"),
             ("mt-float32", "mt-float32-unpacked")]
    report["ratios"] = {f"{a} / {b}": round(speed[a] / speed[b], 2) for a, b in pairs
                        if a in speed and b in speed and not math.isclose(speed[b], 0)}
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    tmp.cleanup()


if __name__ == "__main__":
    main()
