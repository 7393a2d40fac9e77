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

For each mt system the JSON also gives ``linear_only``: the same linear-layer calls that its search
made, replayed alone on the same cores, i.e. its speed if everything around the matrix products
were free. ``targets`` puts the issue's speed targets next to that ceiling (a target above it
cannot be met by cheaper bookkeeping, only by less or faster arithmetic) and next to the speed
the search would have if its linear layers cost nothing (``free_linear_ceiling``: a target above
that cannot be met by faster linear layers, only by a cheaper rest).

    python scripts/bench_decode.py --out bench_decode.json
    python scripts/bench_decode.py --device cuda --batch 32 --out gpu_b32.json
    python scripts/bench_decode.py --device cuda --batch 256 --sentences 1024 --out gpu_b256.json

On a GPU the systems are mt float32/bfloat16, Hugging Face float32/bfloat16 and CTranslate2
float32/float16/int8 (when its CUDA wheel loads); the CPU-only paths (mt int8, unpacked) are left
out unless named in ``--systems``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mt without being installed

from mt.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig, positive_int  # noqa: E402
from mt.export import export_ctranslate2, hf_model, placeholder_vocabulary  # noqa: E402
from mt.inference import device_mistake, keep_freed_memory, prepare_model  # noqa: E402
from mt.model import build_model  # noqa: E402
from mt.search import beam_search, greedy_search  # noqa: E402
from mt.textio import output_mistake  # noqa: E402
from mt.workers import batch_workers  # noqa: E402

CPU_DEFAULT = ("mt-float32", "mt-bfloat16", "mt-int8", "mt-float32-unpacked", "hf-float32",
               "ct2-float32", "ct2-int8")
GPU_DEFAULT = ("mt-float32", "mt-bfloat16", "hf-float32", "hf-bfloat16", "ct2-float32",
               "ct2-float16", "ct2-int8")
SYSTEMS = tuple(dict.fromkeys(CPU_DEFAULT + GPU_DEFAULT))  # every system, either default's order


def set_up_process() -> None:
    """What every decoding benchmark does first, before any system runs.

    oneDNN keeps 1,024 compiled kernels (primitives) by default; a decoding makes hundreds per
    dtype (one per batch size the batch shrinks through), so two mt systems in one process
    evicted each other's and the second ran up to 8% slower than alone. Room for all, set before
    the first kernel is made: every system runs as it would in a process of its own that has
    decoded the input once. Rounds after the first reuse its kernels, so the best round can be
    faster than one ``translate``, which makes one pass with fewer kept
    (``mt.inference.cap_kernel_caches``): bfloat16 on one thread, test2016, 5.06 s against
    5.98 s for the first pass before the row buckets of ``mt.kvcache.bucket_rows``
    (docs/benchmarks.md). And freed memory stays in the heap, as in ``translate`` (every system
    here shares the process).
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
    keep_freed_memory()


def report_mistake(path: str | None) -> str | None:
    """Why ``--out path`` cannot take the JSON report (a directory, a folder that does not
    exist), said before the minutes of measuring, not in a traceback after them."""
    return output_mistake("--out", path, force=True, folder_made=False) if path else None


def write_report(report: dict, path: str | None, prog: str) -> None:
    """The JSON report to ``path``, or to stdout without one; where ``path`` cannot be written
    after all (a full disk), to stdout, so the measurements are not lost, and an error."""
    text = json.dumps(report, indent=2)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            return
        except OSError as err:
            print(text)
            sys.exit(f"{prog}: cannot write --out {path} ({err.strerror or err}); the report is "
                     "on stdout above")
    print(text)


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


def pad(seqs: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- checks and timing


def record_linear_calls(model: torch.nn.Module, decode) -> list[tuple[torch.nn.Module, int]]:
    """Every linear-layer call (module, rows) that ``decode()`` makes, in order."""
    calls: list[tuple[torch.nn.Module, int]] = []
    linears = [m for m in model.modules() if hasattr(m, "out_features")
               and not any(hasattr(c, "out_features") for c in m.children())]
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append(
                 (m, args[0].numel() // m.in_features))) for m in linears]
    try:
        decode()
    finally:
        for h in hooks:
            h.remove()
    return calls


def replay_linear_calls(calls: list[tuple[torch.nn.Module, torch.Tensor]]) -> None:
    """The same linear-layer calls alone, on inputs of their shapes: what a search would cost if
    everything around its matrix products were free."""
    with torch.inference_mode():
        for m, x in calls:
            m(x)


def ct2_problem(device: torch.device, ct2_dir: str | None = None) -> str | None:
    """Why CTranslate2 cannot run here (None: it can), so that its systems are left out with a
    note instead of ending the run: it is optional, and its CUDA build needs CUDA 12 libraries
    that a newer CUDA installation lacks. With ``ct2_dir``, one sentence is translated on
    ``device`` (a missing CUDA library shows only then)."""
    try:
        import ctranslate2
    except ImportError:
        return "ctranslate2 is not installed (the bench extra)"
    if ct2_dir is None:
        return None
    try:
        translator = ctranslate2.Translator(ct2_dir, device=device.type,
                                            device_index=device.index or 0)
        translator.translate_batch([[placeholder_vocabulary(8)[4]]], max_decoding_length=2)
    except Exception as err:  # whatever the library raises: the systems are skipped, not the run
        return f"CTranslate2 cannot run on {device}: {err}"
    return None


def check_equivalence(model, hf, ct2_dir: str | None, src: list[int], threads: int) -> dict:
    """HF logits match mt's (teacher-forced, 1e-4), so do CT2's token log-probabilities (1e-3);
    HF's and CT2's greedy outputs equal mt's. Without ``ct2_dir`` (no CTranslate2), HF only."""
    tgt_in = torch.tensor([[BOS_ID] + src[:-1][:12]])
    with torch.inference_mode():
        ours = model(torch.tensor([src]), tgt_in)
        theirs = hf(input_ids=torch.tensor([src]), decoder_input_ids=tgt_in).logits
        diff = float((ours - theirs).abs().max())
        greedy = greedy_search(model, torch.tensor([src]), max_len_a=0, max_len_b=21)[0].tokens
        hf_out = hf.generate(torch.tensor([src]), num_beams=1, do_sample=False,
                             max_new_tokens=21)[0].tolist()
    hf_tokens = [t for t in hf_out[1:] if t not in (EOS_ID, PAD_ID)]
    if diff > 1e-4:
        raise SystemExit(f"bench_decode: HF logits differ from mt's by {diff:.2e}: weight mapping")
    if ct2_dir is None:
        k = min(len(greedy), len(hf_tokens))
        if greedy[:k] != hf_tokens[:k]:
            raise SystemExit(f"bench_decode: greedy outputs differ\nmt {greedy}\nhf {hf_tokens}")
        return {"hf_max_logit_diff": diff, "greedy_tokens_equal": k,
                "greedy_distinct_tokens": len(set(greedy))}
    import ctranslate2

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
    if ct2_diff > 1e-3:
        raise SystemExit(f"bench_decode: CT2 log-probs differ from mt's by {ct2_diff:.2e}")
    k = min(len(greedy), len(hf_tokens), len(ct2_tokens))
    if not greedy[:k] == hf_tokens[:k] == ct2_tokens[:k]:
        raise SystemExit(f"bench_decode: greedy outputs differ\nmt   {greedy}\nhf   {hf_tokens}"
                         f"\nct2  {ct2_tokens}")
    return {"hf_max_logit_diff": diff, "ct2_max_logprob_diff": ct2_diff,
            "greedy_tokens_equal": k, "greedy_distinct_tokens": len(set(greedy))}


def linear_only(models: dict, batches: list, steps: int, beam: int, each_batch,
                repeat: int, device: torch.device) -> dict:
    """Per mt system, the speed its search would have if only its linear layers took time (the
    same calls, replayed alone, on the same cores), and the linear layers' FLOPs per target token:
    the ceiling that no bookkeeping around the matrix products can lift."""
    out = {}
    tokens = sum(map(len, batches)) * steps
    for name, m in models.items():
        calls = [record_linear_calls(m, lambda b=b, m=m: beam_search(
                     m, pad(b, device), beam_size=beam, lenpen=1.0, max_len_a=0,
                     max_len_b=steps, min_len=steps - 1)) for b in batches]
        flops = sum(2 * rows * mod.in_features * mod.out_features for c in calls for mod, rows in c)
        dtype = next(m.parameters()).dtype  # the embeddings': float32 in an int8 model
        inputs = {(mod.in_features, rows): torch.randn(rows, mod.in_features, dtype=dtype,
                                                       device=device)
                  for c in calls for mod, rows in set(c)}
        calls = [[(mod, inputs[mod.in_features, rows]) for mod, rows in c] for c in calls]

        def replay() -> float:
            sync(device)
            start = time.perf_counter()
            each_batch(replay_linear_calls, calls)  # noqa: B023 (called in this iteration)
            sync(device)
            return time.perf_counter() - start
        seconds = min(replay() for _ in range(repeat))
        out[name] = {"tokens_per_s": round(tokens / seconds, 1),
                     "gflop_per_s": round(flops / seconds / 1e9, 1),
                     "linear_mflop_per_target_token": round(flops / tokens / 1e6, 1)}
    return out


def free_linear_ceiling(tokens_per_s: float, linear_only: float | None) -> float | None:
    """The speed a search would have if its linear layers cost nothing: its time per token less
    the time its linear layers alone take (None without that measurement, or when the linear
    layers alone were not faster than the whole: noise)."""
    if not linear_only or linear_only <= tokens_per_s:
        return None
    return round(1 / (1 / tokens_per_s - 1 / linear_only), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=positive_int, default=64)
    p.add_argument("--tgt-len", type=positive_int, default=30, help="decoder steps per sentence")
    p.add_argument("--beam", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--vocab", type=positive_int, default=8000,
                   help="pieces, at least 5 (4 special ids and one word)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="threads per system (torch and CT2 intra-op); on a CPU shared with other "
                        "work, more threads than idle cores make OpenMP spin: keep it low")
    p.add_argument("--parallel", choices=("intra", "batches"), default="intra",
                   help="how a system uses --threads cores: intra = one batch at a time, each "
                        "operator split over the threads; batches = --threads batches at once, one "
                        "core each (mt: translate --workers, as threads unless "
                        "--worker-processes; CT2: inter_threads; HF: the same workers as mt)")
    p.add_argument("--worker-processes", action="store_true",
                   help="with --parallel batches: mt's and HF's workers are forked processes, as "
                        "translate's are by default on Linux. Each round forks them afresh from "
                        "this process, which holds every system's model: on rounds of one batch "
                        "per worker that costs more than it gains, where a translate of a file "
                        "gains (docs/benchmarks.md)")
    p.add_argument("--repeat", type=positive_int, default=2,
                   help="rounds; each round times every system once (interleaved, so load "
                        "changes on a shared CPU hit all systems alike); the best round counts")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default on CPU: "
                        f"{', '.join(CPU_DEFAULT)}; on a GPU: {', '.join(GPU_DEFAULT)})")
    p.add_argument("--device", default="cpu", help="cpu or cuda (HF and CT2 run there too)")
    p.add_argument("--sdpa-cudnn", action="store_true",
                   help="leave PyTorch's cuDNN attention on, which translate turns off on a GPU "
                        "(mt.model.avoid_cudnn_attention); for every system, the flag is global")
    p.add_argument("--out", default=None, help="JSON file (default: stdout)")
    args = p.parse_args(argv)
    if args.vocab < 5:
        p.error(f"--vocab must be at least 5 (4 special ids and one word), got {args.vocab}")
    if mistake := device_mistake(args.device) or report_mistake(args.out):
        p.error(mistake)
    set_up_process()
    by_batch = args.parallel == "batches"
    torch.set_num_threads(1 if by_batch else args.threads)
    torch.set_num_interop_threads(1)
    device = torch.device(args.device)
    systems = (args.systems.split(",") if args.systems
               else list(GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT))
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    n, steps, beam = args.sentences, args.tgt_len, args.beam
    skipped = {}
    if missing := ct2_problem(device):
        skipped = {name: missing for name in systems if name.startswith("ct2-")}

    model = base_model(args.vocab, seed=0)
    # Sorted by length, as translate batches (and CT2 with max_batch_size sorts): little padding.
    srcs = sorted(sources(n, args.vocab, seed=1), key=len, reverse=True)
    batches = [srcs[i : i + args.batch] for i in range(0, n, args.batch)]
    # Lazy initialisation is not timed: a small batch on a CPU; on a GPU a full one, since
    # libraries pick (and autotune) kernels per shape at first use.
    warm = [srcs[:4]] if device.type == "cpu" else batches[:1]
    hf = hf_model(model).eval()
    tmp = tempfile.TemporaryDirectory()
    ct2_dirs = {}
    for q in ("float32", "float16", "int8") if not missing else ():
        if f"ct2-{q}" not in systems and q != "float32":  # float32: the equivalence check's
            continue
        ct2_dirs[q] = f"{tmp.name}/ct2-{q}"
        export_ctranslate2(model, None, ct2_dirs[q], None if q == "float32" else q)
    if not missing and device.type != "cpu" and (problem := ct2_problem(device,
                                                                        ct2_dirs["float32"])):
        skipped = {name: problem for name in systems if name.startswith("ct2-")}
    for name, why in skipped.items():
        print(f"bench_decode: {name} left out: {why}", file=sys.stderr)
    systems = [name for name in systems if name not in skipped]
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "model": "transformer_base (6+6, d512, ffn2048, 8 heads), random weights",
              "torch": torch.__version__, "load_average_before": os.getloadavg(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "checks": check_equivalence(
                  model, hf, ct2_dirs.get("float32"), srcs[0], args.threads),
              "skipped": skipped, "systems": {}}
    hf_models = {"hf-float32": lambda: hf.to(device),
                 "hf-bfloat16": lambda: copy.deepcopy(hf).to(device, torch.bfloat16)}
    hf_models = {name: make() for name, make in hf_models.items() if name in systems}

    def each_batch(fn, todo, warmup=False):
        """fn over the batches: in turn, or --threads at once (translate --workers's). The
        warm-up runs here, in turn: forked workers start from this process's caches."""
        with batch_workers(fn, todo, args.threads if by_batch and not warmup else 1,
                           processes=args.worker_processes) as answers:
            return list(answers)

    def run_mt(m):
        def one(b):
            hyps = beam_search(m, pad(b, device), beam_size=beam, lenpen=1.0, max_len_a=0,
                               max_len_b=steps, min_len=steps - 1)
            return {len(h[0].tokens) + 1 for h in hyps}  # EOS is a step too

        def fn(warmup):
            lengths = set().union(*each_batch(one, warm if warmup else batches, warmup))
            assert warmup or lengths == {steps}, lengths
        return fn

    def run_hf(hf, warmup):
        def one(b):
            with torch.inference_mode():
                src = pad(b, device)
                out = hf.generate(src, attention_mask=src != PAD_ID, num_beams=beam,
                                  do_sample=False, min_new_tokens=steps, max_new_tokens=steps,
                                  early_stopping=True, length_penalty=1.0)
                assert warmup or out.size(1) == steps + 1, out.shape  # start token + steps

        each_batch(one, warm if warmup else batches, warmup)

    def run_ct2(q):
        import ctranslate2

        translator = ctranslate2.Translator(
            ct2_dirs[q], device=device.type, compute_type=q, inter_threads=args.threads if by_batch
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

    # What `translate --dtype ...` decodes with (mt.inference.prepare_model); -unpacked: nn.Linear
    # as trained, which shows what packing the weights for the GEMM gains.
    mt_models = {f"mt-{d}": (lambda d=d: prepare_model(copy.deepcopy(model).to(device), d,
                                                      str(device)))
                 for d in ("float32", "bfloat16", "int8")}
    mt_models["mt-float32-unpacked"] = lambda: copy.deepcopy(model).to(device)
    mt_models = {name: make() for name, make in mt_models.items() if name in systems}
    if device.type == "cuda":  # prepare_model turned cuDNN attention off, for HF as well
        torch.backends.cuda.enable_cudnn_sdp(args.sdpa_cudnn)
        report["sdpa_cudnn"] = args.sdpa_cudnn
    runners = {
        **{name: (lambda m=m: run_mt(m)) for name, m in mt_models.items()},
        **{name: (lambda m=m: functools.partial(run_hf, m)) for name, m in hf_models.items()},
        **{f"ct2-{q}": (lambda q=q: run_ct2(q)) for q in ("float32", "float16", "int8")},
    }
    fns = {name: runners[name]() for name in systems}
    for fn in fns.values():
        fn(warmup=True)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeat):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn(warmup=False)
            sync(device)
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        report["systems"][name] = {
            "tokens_per_s": round(n * steps / min(seconds), 1),
            "median_tokens_per_s": round(n * steps / statistics.median(seconds), 1),
            "seconds": [round(s, 3) for s in seconds]}
        print(f"{name:12s} {report['systems'][name]['tokens_per_s']:8.1f} target tokens/s",
              file=sys.stderr)
    report["linear_only"] = linear_only(mt_models, batches, steps, beam, each_batch, args.repeat,
                                        device)
    report["load_average_after"] = os.getloadavg()
    speed = {k: v["tokens_per_s"] for k, v in report["systems"].items()}
    pairs = [("mt-float32", "ct2-float32"), ("mt-bfloat16", "ct2-int8"), ("mt-int8", "ct2-int8"),
             ("mt-float32", "hf-float32"), ("mt-bfloat16", "hf-bfloat16"),
             ("mt-bfloat16", "ct2-float16"), ("mt-bfloat16", "mt-float32"),
             ("mt-float32", "mt-float32-unpacked")]
    report["ratios"] = {f"{a} / {b}": round(speed[a] / speed[b], 2) for a, b in pairs
                        if a in speed and b in speed and not math.isclose(speed[b], 0)}
    ceiling = {k: v["tokens_per_s"] for k, v in report["linear_only"].items()}
    for name, tokens in ceiling.items():
        print(f"{name:12s} {tokens:8.1f} target tokens/s with only its linear layers "
              f"({report['linear_only'][name]['gflop_per_s']} GFLOP/s)", file=sys.stderr)
    # The targets next to the two bounds a search has: what its linear layers alone
    # allow (a target above it needs less or faster arithmetic) and what everything else alone
    # allows (above it, faster linear layers cannot help: the rest of the search must shrink).
    report["targets"] = {
        f"{a} >= {x}x {b}": {"needs": round(x * speed[b], 1), "has": speed[a],
                             "linear_only_ceiling": ceiling.get(a),
                             "free_linear_ceiling": free_linear_ceiling(speed[a], ceiling.get(a))}
        for a, x, b in (("mt-float32", 1.5, "ct2-float32"), ("mt-bfloat16", 2.0, "ct2-int8"))
        if a in speed and b in speed}
    for name, target in report["targets"].items():
        print(f"target {name}: needs {target['needs']}, has {target['has']}; linear layers alone "
              f"{target['linear_only_ceiling']}, all but them {target['free_linear_ceiling']}",
              file=sys.stderr)
    write_report(report, args.out, "bench_decode.py")
    tmp.cleanup()


if __name__ == "__main__":
    main()
