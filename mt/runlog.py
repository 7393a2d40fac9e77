"""What a training run reports besides its checkpoints: the loss and speed of each log window,
``curves.png`` after every validation, and at the end the test-set BLEU of ``best.pt`` and
``averaged.pt`` (``test.json``) with the command to run next.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from mt import checkpoint
from mt.config import TrainConfig
from mt.data import load_split

log = logging.getLogger("mt.train")


def plot_curves(metrics_file: Path, out: Path) -> bool:
    """Training loss, validation loss and BLEU against steps, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (smoothed)")
    ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-",
                 label="valid NLL")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss per token")
    ax_loss.legend()
    ax_bleu.plot([r["step"] for r in valid], [r["valid_bleu"] for r in valid], "o-")
    ax_bleu.set_xlabel("step")
    ax_bleu.set_ylabel("valid BLEU")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


class Window:
    """Loss and throughput since the last log line; the loss stays on the device until read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.loss_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self.tokens = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, tokens: int, finite: torch.Tensor) -> None:
        """A step's loss summed over ``tokens`` target tokens; a NaN/inf step counts for speed
        only."""
        self.loss += torch.where(finite, loss.float(), 0.0)
        self.loss_tokens += finite * tokens
        self.tokens += tokens

    def read(self) -> dict:
        seconds = time.perf_counter() - self.start
        out = {"loss": float(self.loss) / max(int(self.loss_tokens), 1),
               "tgt_tokens_per_s": self.tokens / max(seconds, 1e-9)}
        self.restart()
        return out


def finish(cfg: TrainConfig, run_dir: Path, device: torch.device) -> None:
    """Averaging, test-set BLEU of best.pt (and averaged.pt), and what to run next (rank 0 only).

    Which of the two to use is the user's call on the valid split; both test scores are printed so
    that nothing is chosen on the test set here.
    """
    ckpt_dir = run_dir / "checkpoints"
    if cfg.trainer.average_last > 1:
        paths = checkpoint.step_checkpoints(ckpt_dir)[-cfg.trainer.average_last :]
        if len(paths) > 1:
            checkpoint.save_atomic(checkpoint.average(paths), ckpt_dir / "averaged.pt")
            log.info("averaged %d checkpoints -> %s", len(paths), ckpt_dir / "averaged.pt")
    if cfg.trainer.test_at_end and cfg.data.test:
        from mt.data import split_files
        from mt.evaluate import score
        from mt.lines import translate_lines
        from mt.options import SearchOptions

        test = load_split(cfg.data, cfg.data.test)
        src, ref = list(test["src"]), list(test["tgt"])
        opts = SearchOptions(beam=cfg.trainer.beam_size, lenpen=cfg.trainer.lenpen)
        report = {}
        for name in ("best", "averaged"):
            path = ckpt_dir / f"{name}.pt"
            if not path.exists():
                continue
            model, tok, _ = checkpoint.load_model(path, device)
            start = time.perf_counter()
            with torch.inference_mode():
                hyps = [n[0][0] for n in translate_lines(model, tok, src, opts)]
            seconds = time.perf_counter() - start
            result = score(hyps, ref)
            suffix = "" if name == "best" else ".averaged"
            (run_dir / f"{cfg.data.test}{suffix}.hyp").write_text("".join(h + "\n" for h in hyps))
            report[name] = {**result, "checkpoint": str(path), "seconds": seconds}
            label = "test BLEU" if name == "best" else "test BLEU of averaged.pt"
            print(f"{label} = {result['bleu']:.2f}  chrF = {result['chrf']:.2f}  "
                  f"({result['sentences']} sentences, {result['bleu_signature']})")
        with open(run_dir / "test.json", "w") as f:  # best.pt's scores at the top level
            # best.pt may be missing (a run resumed from a copied last.pt alone)
            json.dump({**report.get("best", {}), "averaged": report.get("averaged")}, f, indent=2)
        if cfg.data.source != "hub":
            src_file = split_files(cfg.data, cfg.data.test.split("+")[0])[0]  # the first part
            print(f"try: translate -m {run_dir} -i {src_file}")
    print(f"run directory: {run_dir}")
