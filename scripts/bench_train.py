r"""Training speed and MFU of mt against Hugging Face MarianMTModel of the same size, side by side.

Both models get the same batches (random tokens with a realistic length mix, length-bucketed and
padded the same way), the same fused Adam and label smoothing; the systems take turns in blocks of
``--block`` steps, so machine noise hits all alike, and the device is synchronised only at block
boundaries (no host sync inside a step; losses are read at the end). Reports target tokens/s,
source+target tokens/s, model FLOP/s and MFU per system and the ratios against Hugging Face, as
JSON on stdout.

MFU is model FLOPs over the measured bf16 matrix-product peak of the device (``peak`` in the JSON:
the best of several large bf16 products). Model FLOPs per step are 6 x the multiply-adds of every
matrix product a forward pass needs on the batch's real (unpadded) tokens: the linear layers, the
output layer, and attention (QK^T and AV: self-attention over s^2 and t^2 token pairs per
sentence, cross-attention over s x t, counted in full as PaLM's MFU does). Padding is not counted,
so padding waste shows up as lower MFU.

    python scripts/bench_train.py --model transformer_small --steps 10
    python scripts/bench_train.py --model transformer_big --device cuda --max-tokens 25000 \
        --steps 50 --systems hf_bf16,mt_bf16,mt_bf16_compile

Systems: hf_fp32, hf_bf16, mt_fp32, mt_bf16, each optionally with ``_compile`` (torch.compile).
Needs the `bench` extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt.batching import collate, token_batches  # noqa: E402
from mt.config import EOS_ID, PAD_ID, ModelConfig, count_or_off, positive_int  # noqa: E402
from mt.loss import label_smoothed_nll  # noqa: E402
from mt.model import avoid_cudnn_attention, build_model, count_parameters  # noqa: E402
from mt.textio import output_mistake  # noqa: E402

SIZES = {
    "transformer_tiny": dict(encoder_layers=3, decoder_layers=3, d_model=256, ffn_dim=1024,
                             heads=4),
    "transformer_small": dict(encoder_layers=6, decoder_layers=6, d_model=512, ffn_dim=1024,
                              heads=4),
    "transformer_base": dict(encoder_layers=6, decoder_layers=6, d_model=512, ffn_dim=2048,
                             heads=8),
    "transformer_big": dict(encoder_layers=6, decoder_layers=6, d_model=1024, ffn_dim=4096,
                            heads=16),
}


def make_batches(n_batches: int, max_tokens: int, vocab: int, seed: int):
    """Padded (src, tgt_in, tgt_out) batches from a WMT-like length mix (lognormal, mean ~27)."""
    rng = random.Random(seed)
    n = n_batches * max_tokens // 20
    src_lens = [min(200, max(2, int(rng.lognormvariate(3.1, 0.55)))) for _ in range(n)]
    tgt_lens = [min(200, max(2, int(s * rng.uniform(0.8, 1.25)))) for s in src_lens]
    src = [[rng.randrange(4, vocab) for _ in range(s - 1)] + [EOS_ID] for s in src_lens]
    tgt = [[rng.randrange(4, vocab) for _ in range(t)] for t in tgt_lens]
    batches = token_batches(src_lens, tgt_lens, max_tokens, seed, 0)[:n_batches]
    return [collate([src[i] for i in b], [tgt[i] for i in b]) for b in batches]


def model_flops(src: torch.Tensor, tgt_in: torch.Tensor, cfg: ModelConfig) -> int:
    """Training FLOPs of one batch: 6 x the forward pass's multiply-adds on unpadded tokens."""
    d, f, vocab = cfg.d_model, cfg.ffn_dim, cfg.tgt_vocab_size
    s = (src != PAD_ID).sum(1).long()
    t = (tgt_in != PAD_ID).sum(1).long()
    s_sum, t_sum = int(s.sum()), int(t.sum())
    linear = (s_sum * cfg.encoder_layers * (4 * d * d + 2 * d * f)
              + s_sum * cfg.decoder_layers * 2 * d * d  # cross-attention keys and values
              + t_sum * cfg.decoder_layers * (6 * d * d + 2 * d * f)  # self q/k/v/o, cross q/o
              + t_sum * d * vocab)
    attention = 2 * d * (cfg.encoder_layers * int((s * s).sum())
                         + cfg.decoder_layers * int((t * t).sum() + (s * t).sum()))
    return 6 * (linear + attention)


def measure_peak(device: torch.device) -> float:
    """The device's bf16 matrix-product speed (FLOP/s): best of a few large square products."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / 5)
    return 2 * n**3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(name: str, step, batches, device: torch.device, rows: int) -> None:
    """The costliest operators of a few steps, and how much of their wall time the device was
    busy: a step whose device is mostly idle is held back by the host (Python, kernel launches,
    allocations), not by the arithmetic."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for batch in batches:
            step(batch)
        sync(device)
    wall = time.perf_counter() - start
    table = prof.key_averages()
    keys = ["self_device_time_total"] if gpu else []
    busy = sum(e.self_device_time_total for e in table) / 1e6 if gpu else None
    print(f"-- {name}: {len(batches)} steps in {wall:.3f} s (profiled)"
          + (f", the device busy {busy:.3f} s of it" if gpu else ""), file=sys.stderr)
    for key in keys + ["self_cpu_time_total"]:  # on a GPU the host side too: launches, mallocs
        print(table.table(sort_by=key, row_limit=rows), file=sys.stderr)


def step_fn(name: str, model, optimizer, dtype, device):
    """One training step on a batch (already on the device) -> the loss, a device tensor."""
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                else torch.autocast(device.type, enabled=False))

    def step(batch):
        src, tgt_in, tgt_out = batch
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            if name.startswith("hf"):
                logits = model(input_ids=src, attention_mask=src != PAD_ID,
                               decoder_input_ids=tgt_in,
                               decoder_attention_mask=tgt_in != PAD_ID).logits
            else:
                logits = model(src, tgt_in)
        if name.startswith("hf"):
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt_out.view(-1),
                                   ignore_index=PAD_ID, label_smoothing=0.1)
        else:  # what mt-train computes: the same loss, with its hand-written gradient
            loss = label_smoothed_nll(logits, tgt_out, 0.1)[0] / (tgt_out != PAD_ID).sum()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="transformer_small", choices=sorted(SIZES))
    p.add_argument("--vocab", type=positive_int, default=8000)
    p.add_argument("--max-tokens", type=positive_int, default=4096,
                   help="padded tokens per batch")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per system")
    p.add_argument("--warmup", type=count_or_off, default=2,
                   help="untimed steps per system (compilation)")
    p.add_argument("--block", type=positive_int, default=5,
                   help="steps a system runs between two device synchronisations")
    p.add_argument("--device", default="cpu")
    p.add_argument("--systems", default="hf_fp32,mt_fp32,mt_bf16",
                   help="comma-separated: hf_fp32, hf_bf16, mt_fp32, mt_bf16, each optionally "
                        "with _compile")
    p.add_argument("--threads", type=count_or_off, default=0,
                   help="torch threads (0: torch's default)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="0 (default) makes the loss curves comparable step by step")
    p.add_argument("--profile", type=count_or_off, default=0, metavar="N",
                   help="after timing, profile 3 steps of each system and print its N costliest "
                        "operators (device time on a GPU, else CPU time) to stderr")
    p.add_argument("--sdpa-cudnn", action="store_true",
                   help="leave PyTorch's cuDNN attention on (mt-train turns it off on a GPU: "
                        "mt.model.avoid_cudnn_attention); for every system, as the flag is global")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.vocab < 5:  # random tokens are drawn from the ids after the 4 special ones
        p.error(f"--vocab must be at least 5 (4 special ids and one word), got {args.vocab}")
    if args.out and (mistake := output_mistake("--out", args.out, force=True, folder_made=False)):
        p.error(mistake)  # before a minute of measuring the peak, not a traceback after all of it
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if not args.sdpa_cudnn:
        avoid_cudnn_attention(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what any fp32 GPU baseline would use
        torch.backends.cudnn.allow_tf32 = True
    cfg = ModelConfig(name=args.model, **SIZES[args.model], dropout=args.dropout,
                      src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, max_positions=256)
    batches = make_batches(args.warmup + args.steps, args.max_tokens, args.vocab, seed=1)
    if len(batches) < args.warmup + args.steps:  # the report would divide by steps not run
        p.error(f"--max-tokens {args.max_tokens} makes {len(batches)} batches of the "
                f"{args.warmup + args.steps} that --warmup and --steps ask for; raise it")
    flops = [model_flops(b[0], b[1], cfg) for b in batches]
    batches = [tuple(t.to(device) for t in b) for b in batches]  # the timing is the model's
    systems = {}
    for name in args.systems.split(","):
        base = name.removesuffix("_compile")
        if base not in ("hf_fp32", "hf_bf16", "mt_fp32", "mt_bf16"):
            raise SystemExit(f"--systems: unknown system {name!r}")
        # Every system starts from the same weights (mt's init, copied into Marian through
        # mt.export), so with dropout 0 the loss curves must agree step for step.
        torch.manual_seed(0)
        model = build_model(cfg)
        if base.startswith("hf"):
            from mt.export import hf_model

            model = hf_model(model)
        model = model.to(device)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                               fused=True)  # as mt-train (mt.optim.build_optimizer)
        params = count_parameters(model)
        if name.endswith("_compile"):
            model = torch.compile(model)
        dtype = torch.bfloat16 if base.endswith("bf16") else None
        systems[name] = {"step": step_fn(base, model, opt, dtype, device), "times": [],
                         "losses": [], "params": params}

    for s in systems.values():  # warm-up (and compilation) before any timing
        for batch in batches[: args.warmup]:
            s["step"](batch)
        sync(device)
    timed = batches[args.warmup :]
    for first in range(0, len(timed), args.block):  # blocks of steps, systems in turn
        block = timed[first : first + args.block]
        for s in systems.values():
            sync(device)
            start = time.perf_counter()
            s["losses"] += [s["step"](batch) for batch in block]
            sync(device)
            s["times"].append(time.perf_counter() - start)

    if args.profile:
        for name, s in systems.items():
            profile_steps(name, s["step"], timed[:3], device, args.profile)

    tgt_tokens = sum(int((b[2] != PAD_ID).sum()) for b in timed)
    src_tokens = sum(int((b[0] != PAD_ID).sum()) for b in timed)
    step_flops = sum(flops[args.warmup :])
    peak = measure_peak(device)
    report = {
        "benchmark": "train_step", "model": args.model, "vocab": args.vocab,
        "max_tokens": args.max_tokens, "steps": args.steps, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "sdpa_cudnn": device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled(),
        "peak_bf16_tflops": peak / 1e12, "model_tflop_per_step": step_flops / args.steps / 1e12,
        "systems": {},
    }
    for name, s in systems.items():
        seconds = sum(s["times"])
        report["systems"][name] = {
            "parameters": s["params"],
            "seconds": seconds,
            "tgt_tokens_per_s": tgt_tokens / seconds,
            "src_tgt_tokens_per_s": (src_tokens + tgt_tokens) / seconds,
            "model_tflops": step_flops / seconds / 1e12,
            "mfu": step_flops / seconds / peak,
            "losses": [float(x) for x in s["losses"]],
        }
    for base_name in ("hf_fp32", "hf_bf16"):
        base = report["systems"].get(base_name)
        if not base:
            continue
        for r in report["systems"].values():
            r[f"speedup_vs_{base_name}"] = r["tgt_tokens_per_s"] / base["tgt_tokens_per_s"]
            r[f"max_loss_diff_vs_{base_name}"] = max(
                abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
    report["note"] = ("losses: label-smoothed CE per step on the same batches from the same "
                      "weights; with dropout 0 an fp32 curve matches hf_fp32 to float rounding, "
                      "a bf16 one to bf16 rounding. mfu: model FLOPs (unpadded tokens) over "
                      "peak_bf16_tflops")
    text = json.dumps(report, indent=2)
    print(text)
    for name, r in report["systems"].items():
        print(f"{name:18s} {r['tgt_tokens_per_s']:10.0f} tgt tok/s  {r['model_tflops']:7.2f} "
              f"TFLOP/s  MFU {r['mfu']:.1%}", file=sys.stderr)
    if args.out:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as err:  # a full disk: the report is printed above
            sys.exit(f"bench_train.py: cannot write --out {args.out} ({err.strerror or err}); "
                     "the report is on stdout above")


if __name__ == "__main__":
    main()
