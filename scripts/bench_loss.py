"""Time of the label-smoothed loss, forward and backward: mt.loss against F.cross_entropy.

The reference is what mt computed before mt.loss: ``F.cross_entropy(label_smoothing=...)`` for the
loss and a second, gradient-free ``F.cross_entropy`` for the NLL. Both run on the same random
logits; the script checks that losses and gradients agree before timing (interleaved rounds, the
best counts) and prints JSON.

    python scripts/bench_loss.py --tokens 4096 --vocab 8000 --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mt without being installed

from mt.config import PAD_ID, positive_int  # noqa: E402
from mt.loss import label_smoothed_nll  # noqa: E402


def reference(logits: torch.Tensor, target: torch.Tensor, smoothing: float):
    flat, tgt = logits.float().view(-1, logits.size(-1)), target.view(-1)
    loss = F.cross_entropy(flat, tgt, ignore_index=PAD_ID, reduction="sum",
                           label_smoothing=smoothing)
    with torch.no_grad():
        nll = F.cross_entropy(flat, tgt, ignore_index=PAD_ID, reduction="sum")
    return loss, nll


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--vocab", type=positive_int, default=8000)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--repeat", type=positive_int, default=5)
    args = p.parse_args(argv)
    if args.vocab < 5:  # targets are drawn from the ids after the 4 special ones
        p.error(f"--vocab must be at least 5 (4 special ids and one word), got {args.vocab}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    logits = torch.randn(args.tokens, args.vocab).to(dtype).requires_grad_()
    target = torch.randint(4, args.vocab, (args.tokens,))
    target[: args.tokens // 20] = PAD_ID  # some padding, as in real batches

    def run(fn) -> tuple[float, torch.Tensor, torch.Tensor]:
        logits.grad = None
        start = time.perf_counter()
        loss, _ = fn(logits, target, 0.1)
        loss.backward()
        return time.perf_counter() - start, loss.detach(), logits.grad.clone()

    _, loss_a, grad_a = run(reference)
    _, loss_b, grad_b = run(label_smoothed_nll)
    checks = {"loss_rel_diff": float(abs(loss_a - loss_b) / abs(loss_a)),
              "grad_max_diff": float((grad_a.float() - grad_b.float()).abs().max())}
    times: dict[str, list[float]] = {"F.cross_entropy": [], "mt.loss": []}
    for _ in range(args.repeat):
        times["F.cross_entropy"].append(run(reference)[0])
        times["mt.loss"].append(run(label_smoothed_nll)[0])
    best = {k: min(v) * 1e3 for k, v in times.items()}
    print(json.dumps({"config": vars(args), "checks": checks,
                      "ms_forward_backward": {k: round(v, 1) for k, v in best.items()},
                      "speedup": round(best["F.cross_entropy"] / best["mt.loss"], 2)}, indent=2))


if __name__ == "__main__":
    main()
