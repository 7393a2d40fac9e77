"""``mt-average``: average the weights of several checkpoints of one run.

Vaswani et al. (2017) average the last 5 or 20 checkpoints of a run:

    mt-average runs/RUN/checkpoints --last 5 -o averaged.pt
    mt-average runs/RUN/checkpoints --best 3 -o best3.pt
    mt-average a.pt b.pt c.pt -o abc.pt

`--best N` ranks the step checkpoints still on disk by the validation score recorded for their step
in last.pt (the run's `trainer.best_metric`: bleu, chrf or loss), and says their scores. The result
is an ordinary model checkpoint: `translate -m averaged.pt`. mt-train averages by itself at the end
(`trainer.average_last`); this is for another choice afterwards, or for an installed package,
which has no scripts/ folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mt import add_version_flag, checkpoint, described
from mt.config import BEST_METRICS, REGULARIZATION_KEYS, model_config_from_dict, positive_int
from mt.model import build_model
from mt.textio import output_mistake


def tied_names(model_config: dict) -> list[list[str]]:
    """The state dict names that are one weight in a model of ``model_config`` (its tied
    embeddings), each group of more than one name; read off the model built on the meta
    device, which allocates nothing."""
    with torch.device("meta"):
        model = build_model(model_config_from_dict(model_config))
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


# Model config keys that may differ between checkpoints that are averaged: the dropouts (training
# choices) and the informational name; every other key changes what a weight means.
_NOT_SHAPE = (*REGULARIZATION_KEYS, "name")


def average(paths: list[str | os.PathLike], refuse_copies: bool = True,
            across_runs: bool = False, warn: Callable[[str], None] | None = None) -> dict:
    """Averages the weights of several checkpoints of one model (Vaswani et al. average the last 5).

    The checkpoints must have the same shape and the same tokenizer: an embedding row means a
    piece of one vocabulary, and averaging rows of different vocabularies gives a model that looks
    fine and translates nonsense. Dropouts (and the informational ``name``) may differ: a
    fine-tuning run may change them, and they do not change what a weight means.

    One checkpoint must not weigh twice, unsaid: the same file twice, an average beside one it
    was made of (by the weights' digests it keeps), or, with ``refuse_copies``, two files with
    the same weights (``best.pt`` is a copy of a step file: ``mt-average checkpoints/*.pt``).
    A run's own average at its end passes False: its step files may hold the same weights
    (``optim.lr=0``) and are its own all the same.

    The checkpoints must come from one training run (the ``run_id`` each run writes into its
    checkpoints), unless ``across_runs``: two runs of one config save step files alike, and the
    average of separately trained weights translates nothing (a model soup of fine-tuned runs
    of one starting model is the exception, asked for by name). Files without a run id (saved
    before runs had one, or imported) are averaged unchecked; ``warn`` is told which.

    Returns:
        an inference checkpoint (the first one's config, dropouts included, and tokenizer;
        averaged weights, each of the widest type it has in the files (float32 beside a
        bfloat16 copy); where they came from, and their digests).
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    seen: dict[tuple[int, int], str | os.PathLike] = {}
    for p in paths:  # the same file twice would weigh it double, without a word
        info = checkpoint.resolve(p).stat()
        if (info.st_dev, info.st_ino) in seen:
            raise ValueError(f"{p}: given twice (as {seen[info.st_dev, info.st_ino]} too); "
                             "each checkpoint is averaged once")
        seen[info.st_dev, info.st_ino] = p
    base = checkpoint.load(paths[0])
    checkpoint.require(base)
    checkpoint.refuse_not_finite(base["model"], paths[0])
    digests = [checkpoint.weights_digest(base["model"])]
    made_of = {paths[0]: base.get("averaged_digests") or []}
    run_ids = {paths[0]: base.get("run_id")}
    total = {k: v.double() for k, v in base["model"].items()}
    # the widest of the files' types: a bfloat16 copy named first rounded the others to it
    dtypes = {k: v.dtype for k, v in base["model"].items()}
    for p in paths[1:]:
        ckpt = checkpoint.load(p)
        checkpoint.require(ckpt)
        checkpoint.refuse_not_finite(ckpt["model"], p)
        digest = checkpoint.weights_digest(ckpt["model"])
        if refuse_copies and digest in digests:
            raise ValueError(f"{p}: the same weights as {paths[digests.index(digest)]}; each "
                             "checkpoint is averaged once")
        digests.append(digest)
        made_of[p] = ckpt.get("averaged_digests") or []
        run_ids[p] = ckpt.get("run_id")
        a, b = base["model_config"], ckpt["model_config"]
        differ = [f"{k}={b.get(k)!r}, not {a.get(k)!r}" for k in sorted(a.keys() | b.keys())
                  if k not in _NOT_SHAPE and a.get(k) != b.get(k)]
        if differ:
            raise ValueError(f"{p}: a different model config from {paths[0]} "
                             f"({'; '.join(differ)}); cannot average")
        if ckpt["tokenizer"] != base["tokenizer"]:
            raise ValueError(f"{p}: a different tokenizer from {paths[0]} (its embedding rows "
                             "stand for other pieces); cannot average")
        weights = ckpt["model"]
        odd = sorted(total.keys() ^ weights.keys()) or [
            k for k in total if total[k].shape != weights[k].shape]
        if odd:
            raise ValueError(f"{p}: its weights differ from {paths[0]}'s at {odd[0]!r} (present "
                             "in one only, or of another shape); cannot average")
        for k, v in weights.items():
            total[k] += v.double()
            dtypes[k] = torch.promote_types(dtypes[k], v.dtype)
    runs = {p: run for p, run in run_ids.items() if run}
    if not across_runs and len(set(runs.values())) > 1:
        first = next(iter(runs))
        other = next(p for p in runs if runs[p] != runs[first])
        raise ValueError(f"{other}: from another training run than {first}; their average "
                         "would be a broken model (give --across-runs for a model soup of runs "
                         "fine-tuned from one model)")
    if warn and not across_runs and len(runs) < len(paths) and len(paths) > 1:
        # (across_runs: files of other runs asked for, so none is checked to be of one)
        unknown = [str(p) for p in paths if p not in runs]
        warn(f"{', '.join(unknown)}: no run id (saved before runs had one, imported, or "
             "an average of several runs' files): "
             "not checked to come from the same training run as the others")
    for p, sources in made_of.items():
        if inside := [str(q) for q, d in zip(paths, digests, strict=True)
                      if d in sources and q is not p]:
            raise ValueError(f"{p}: an average of {', '.join(inside)} among others, which are "
                             "averaged too: they would weigh twice; name the step checkpoints "
                             "alone")
    avg = {k: (v / len(paths)).to(dtypes[k]) for k, v in total.items()}
    try:
        tied = tied_names(base["model_config"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{paths[0]}: its model config cannot be built "
                         f"({checkpoint.first_reason(err)})") from None
    for names in tied:  # one tensor, as the run saved it
        for name in names[1:]:
            avg[name] = avg[names[0]]
    out = {k: base.get(k) for k in ("format", "model_config", "tokenizer", "config")}
    out["model"] = avg
    out["averaged_from"] = [str(checkpoint.resolve(p).absolute()) for p in paths]
    out["averaged_digests"] = digests
    if len(set(run_ids.values())) == 1 and base.get("run_id"):  # one run's, as its steps
        out["run_id"] = base["run_id"]
    return out


def pick(folder: Path, last: int | None, best: int | None) -> list[Path]:
    """The last ``last`` or the ``best`` best step checkpoints of a checkpoints folder.

    Fewer than asked when fewer are on disk (or, for ``best``, have a recorded score): said on
    stderr, since the average is then not the one the command line reads as.
    """
    steps = checkpoint.step_checkpoints(folder)
    if not steps:
        raise SystemExit(f"mt-average: {folder}: no step_N.pt checkpoints")
    if last:
        picked, asked, option = steps[-last:], last, "--last"
    else:
        if not (folder / "last.pt").is_file():
            raise SystemExit(f"mt-average: {folder}: no last.pt, which holds the "
                             "validation scores --best ranks by; use --last N or name the files")
        state = checkpoint.load(folder / "last.pt")
        history = state.get("trainer", {}).get("history", [])
        metric = (state.get("config") or {}).get("trainer", {}).get("best_metric", "bleu")
        picked = checkpoint.best_step_checkpoints(steps, history, metric)[:best]
        asked, option = best, "--best"
        key = BEST_METRICS[metric][0]
        score = {r["step"]: r[key] for r in history if key in r}
        print(f"mt-average: ranked by valid {metric} (trainer.best_metric): "
              + ", ".join(f"{p.name} {score[checkpoint.step_of(p)]:.2f}" for p in picked),
              file=sys.stderr)
    if len(picked) < asked:
        print(f"mt-average: {option} {asked}: {folder} has only {len(picked)} step "
              f"checkpoints{' with a validation score' if option == '--best' else ''}; "
              f"averaging {len(picked)}", file=sys.stderr)
    return picked


def _refuse_output(path: str, inputs: list[Path], force: bool) -> None:
    """SystemExit unless ``path`` is free to write: an existing file only with ``force``, and
    never one of the checkpoints averaged (a step_N.pt whose score in last.pt would then rank
    the average) or a file with a run's training state (a last.pt: the run could not resume)."""
    out = Path(path)
    if out.is_file():
        try:
            trains = "trainer" in checkpoint.load(out, mmap=True)
        except ValueError:  # not a checkpoint: nothing of a run to lose
            trains = False
        if trains:
            raise SystemExit(f"mt-average: -o {out} holds a run's training state (its last.pt); "
                             "the run could not resume from an average: write it elsewhere")
    if mistake := output_mistake("-o", path, force, inputs,
                                 "one of the checkpoints averaged", "checkpoint file"):
        raise SystemExit(f"mt-average: {mistake}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mt-average", description=described(__doc__))
    add_version_flag(p)
    p.add_argument("inputs", nargs="+", help="checkpoint files, or one checkpoints/ folder "
                   "(or the run directory that holds it)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--last", type=positive_int, default=None, metavar="N",
                       help="the last N step checkpoints")
    group.add_argument("--best", type=positive_int, default=None, metavar="N",
                       help="the N best step checkpoints (ranked by the scores in last.pt)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--force", action="store_true", help="replace -o if it exists")
    p.add_argument("--across-runs", action="store_true",
                   help="average checkpoints of different training runs (a model soup of runs "
                   "fine-tuned from one model); refused without it")
    args = p.parse_args(argv)
    if len(args.inputs) > 1 and (bad := next((x for x in args.inputs if Path(x).is_dir()), None)):
        raise SystemExit(f"mt-average: {bad} is a folder; name checkpoint files, or give one "
                         "folder with --last N or --best N")
    one = Path(args.inputs[0]) if len(args.inputs) == 1 else None
    if one and not one.exists():
        raise SystemExit(f"mt-average: {one}: no such file or folder")
    folder = one if one and one.is_dir() else None
    if folder and (folder / "checkpoints").is_dir():  # a run directory, as translate -m takes
        folder = folder / "checkpoints"
    if folder and not (args.last or args.best):
        raise SystemExit("mt-average: with a folder, give --last N or --best N")
    if not folder and (args.last or args.best):
        raise SystemExit("mt-average: --last and --best pick from a checkpoints folder; "
                         "named files are averaged as given")
    try:
        paths = pick(folder, args.last, args.best) if folder else [Path(x) for x in args.inputs]
        _refuse_output(args.output, paths, args.force)  # before the work, not after it
        # --last/--best pick one run's own step files, which may hold equal weights (lr 0)
        averaged = average(paths, refuse_copies=folder is None, across_runs=args.across_runs,
                           warn=None if folder else lambda said: print(f"mt-average: {said}",
                                                                        file=sys.stderr))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"mt-average: {err}") from None
    try:
        checkpoint.save_atomic(averaged, args.output)
    except OSError as err:  # -o a directory, a folder that cannot be written, a full disk
        raise SystemExit(f"mt-average: cannot write {args.output}: {err.strerror or err}") from None
    print(f"averaged {len(paths)} checkpoints -> {args.output}", file=sys.stderr)
    for path in paths:
        print(f"  {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
