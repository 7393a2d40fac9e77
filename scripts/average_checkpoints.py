"""Average the weights of several checkpoints of one run (Vaswani et al. average the last 5 or 20).

    python scripts/average_checkpoints.py runs/RUN/checkpoints --last 5 -o averaged.pt
    python scripts/average_checkpoints.py runs/RUN/checkpoints --best 3 -o best3.pt
    python scripts/average_checkpoints.py a.pt b.pt c.pt -o abc.pt

`--best N` ranks the step checkpoints still on disk by the validation score recorded for their step
in last.pt (the run's `trainer.best_metric`). The result is an ordinary model checkpoint:
`translate -m averaged.pt`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt import checkpoint  # noqa: E402


def pick(folder: Path, last: int, best: int) -> list[Path]:
    steps = checkpoint.step_checkpoints(folder)
    if not steps:
        raise SystemExit(f"average_checkpoints: {folder}: no step_N.pt checkpoints")
    if last:
        return steps[-last:]
    state = checkpoint.load(folder / "last.pt")
    history = state.get("trainer", {}).get("history", [])
    metric = (state.get("config") or {}).get("trainer", {}).get("best_metric", "bleu")
    return checkpoint.best_step_checkpoints(steps, history, metric)[:best]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="checkpoint files, or one checkpoints/ folder")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--last", type=int, default=0, help="the last N step checkpoints")
    group.add_argument("--best", type=int, default=0, help="the N best step checkpoints")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    if len(args.inputs) == 1 and Path(args.inputs[0]).is_dir():
        if not (args.last or args.best):
            raise SystemExit("average_checkpoints: with a folder, give --last N or --best N")
        paths = pick(Path(args.inputs[0]), args.last, args.best)
    else:
        paths = [Path(x) for x in args.inputs]
    try:
        averaged = checkpoint.average(paths)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"average_checkpoints: {err}") from None
    checkpoint.save_atomic(averaged, args.output)
    print(f"averaged {len(paths)} checkpoints -> {args.output}", file=sys.stderr)
    for path in paths:
        print(f"  {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
