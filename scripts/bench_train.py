"""Training throughput of mt against Hugging Face MarianMTModel of identical size, side by side.

Both models get the same batches (random tokens with a realistic length mix, padded the same way),
the same Adam optimizer and label smoothing; steps of the two are interleaved so that machine
noise hits both alike. Reports target tokens/s and source+target tokens/s per system and the
ratios against Hugging Face float32, as JSON on stdout.

    python scripts/bench_train.py --model transformer_small --steps 10
    python scripts/bench_train.py --model transformer_base --device cuda --steps 50

Needs the `bench` extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt.batching import collate, token_batches  # noqa: E402
from mt.config import EOS_ID, PAD_ID, ModelConfig  # noqa: E402
from mt.loss import label_smoothed_nll  # noqa: E402
from mt.model import build_model, count_parameters  # noqa: E402

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


def step_fn(name: str, model, optimizer, dtype, device):
    """One training step on a batch -> (loss value)."""
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                else torch.autocast(device.type, enabled=False))

    def step(batch):
        src, tgt_in, tgt_out = (t.to(device) for t in batch)
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
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    p.add_argument("--device", default="cpu")
    p.add_argument("--systems", default="hf_fp32,mt_fp32,mt_bf16",
                   help="comma-separated: hf_fp32, hf_bf16, mt_fp32, mt_bf16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="0 (default) makes the loss curves comparable step by step")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = ModelConfig(name=args.model, **SIZES[args.model], dropout=args.dropout,
                      src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, max_positions=256)
    batches = make_batches(args.warmup + args.steps, args.max_tokens, args.vocab, seed=1)
    systems = {}
    for name in args.systems.split(","):
        # Every system starts from the same weights (mt's init, copied into Marian through
        # mt.export), so with dropout 0 the loss curves must agree step for step.
        torch.manual_seed(0)
        model = build_model(cfg)
        if name.startswith("hf"):
            from mt.export import hf_model

            model = hf_model(model)
        model = model.to(device)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                               foreach=True)
        dtype = torch.bfloat16 if name.endswith("bf16") else None
        systems[name] = {"step": step_fn(name, model, opt, dtype, device), "times": [],
                         "losses": [], "params": count_parameters(model)}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i, batch in enumerate(batches):
        for s in systems.values():  # interleaved: noise hits every system alike
            sync()
            start = time.perf_counter()
            loss = s["step"](batch)
            sync()
            if i >= args.warmup:
                s["times"].append(time.perf_counter() - start)
                s["losses"].append(float(loss))

    timed = batches[args.warmup :]
    tgt_tokens = sum(int((b[2] != PAD_ID).sum()) for b in timed)
    src_tokens = sum(int((b[0] != PAD_ID).sum()) for b in timed)
    report = {
        "benchmark": "train_step", "model": args.model, "vocab": args.vocab,
        "max_tokens": args.max_tokens, "steps": args.steps, "device": str(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "systems": {},
    }
    for name, s in systems.items():
        seconds = sum(s["times"])
        report["systems"][name] = {
            "parameters": s["params"],
            "seconds": seconds,
            "median_step_s": statistics.median(s["times"]),
            "tgt_tokens_per_s": tgt_tokens / seconds,
            "src_tgt_tokens_per_s": (src_tokens + tgt_tokens) / seconds,
            "losses": s["losses"],
        }
    base = report["systems"].get("hf_fp32")
    if base:
        for r in report["systems"].values():
            r["speedup_vs_hf_fp32"] = r["tgt_tokens_per_s"] / base["tgt_tokens_per_s"]
            r["max_loss_diff_vs_hf_fp32"] = max(
                abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
    report["note"] = ("losses: label-smoothed CE per step on the same batches from the same "
                      "weights; with dropout 0 an fp32 curve matches hf_fp32 to float rounding, "
                      "a bf16 one to bf16 rounding")
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
