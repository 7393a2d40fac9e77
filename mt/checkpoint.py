"""Checkpoints: atomic writes, self-contained models, finding the model a user means.

A checkpoint is one ``torch.save`` file holding plain data only (it loads with
``weights_only=True``):

- ``model_config``: the ModelConfig as a dict, ``model``: the state dict,
- ``tokenizer``: the serialized SentencePiece model(s), so a model never meets the wrong vocabulary,
- ``config``: the whole resolved training config (for the record),
- ``run_id`` (a training run's checkpoints): a random id made when the run starts and kept
  across its resumes: two runs of one config and shape save step files alike, and averaging
  files of different runs gives a broken model (``mt-average`` refuses it),
- ``trainer`` (training checkpoints only): optimizer, scheduler, step, data position, RNG states
  (``mt.resume.trainer_state`` lists them).

A run directory keeps ``checkpoints/last.pt`` (full state, for resuming), ``checkpoints/best.pt``
(weights only, best validation score) and a few ``checkpoints/step_N.pt``. Wherever a user passes
a model (``translate -m``, ``mt-eval -m``, ``init_from=``) a run directory, its ``checkpoints/``
folder or a single file works.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import random
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mt.config import BEST_METRICS, model_config_from_dict
from mt.model import Transformer, build_model
from mt.textio import first_line
from mt.tokenizer import Tokenizer

FORMAT = "mt-checkpoint-1"


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says the process ran out of memory: CUDA's OutOfMemoryError, Python's
    MemoryError, or the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate
    memory" / "not enough memory"), which names no cause a user would recognise. The commands
    say it in one line with what to lower, instead of a traceback from inside torch."""
    return isinstance(err, MemoryError | torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("DefaultCPUAllocator" in str(err)
                                           or "allocate memory" in str(err)))


LOCK = ".lock"  # run_dir_lock's file in the run directory; it stays when the run ends


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Holds ``RUN/.lock`` for as long as a run trains there.

    A second ``mt-train`` on the same directory (a resume started twice, a copied command) would
    interleave ``last.pt``, ``best.pt`` and ``metrics.jsonl`` with the first one's, and delete
    its half-written checkpoints as leftovers; it is refused at start instead, in one line. An
    ``flock``: it ends with its process, even one killed with -9, so nothing stale is left to
    clear by hand. Where there is no ``fcntl`` (Windows) runs are not locked.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            by = f" (process {holder})" if holder.isdigit() else ""
            raise ValueError(f"{run_dir}: another mt-train{by} is training in this directory; "
                             "wait for it to end, or give this run another hydra.run.dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def remove_unfinished(directory: Path) -> int:
    """Deletes the temporary files of ``save_atomic`` writes that never finished (the writer was
    killed with SIGKILL, or the machine went down: each is a checkpoint's size) and says how
    many. For a run's own directory, when it starts: no other writer is at work there."""
    unfinished = list(directory.glob(".*.pt.*.tmp")) if directory.is_dir() else []
    for path in unfinished:
        path.unlink(missing_ok=True)
    return len(unfinished)


def save_atomic(obj: Any, path: str | os.PathLike) -> None:
    """Writes to a temporary file in the same directory, fsyncs, then renames over ``path``.

    A crash at any moment leaves either the old file or the new one, never half of one. The file
    gets the permissions of any new file (0666 less the umask): mkstemp's private 0600 would hide
    checkpoints from the other users of a shared cluster.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; name the checkpoint file to write")
    if path.exists() and not path.is_file():  # a rename would replace /dev/null itself (as root)
        raise FileExistsError(f"{path} is not a regular file; name the checkpoint file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:  # named the hidden temporary file, not the one asked for
        raise type(err)(err.errno, err.strerror, str(path)) from None
    try:
        os.fchmod(fd, 0o666 & ~umask())
        os.close(fd)
        # By name, not through a Python file: a Ctrl-C inside torch.save leaves its C++ zip
        # writer unfinished, and when it is freed it writes the zip's end to its file; a Python
        # file closed by then aborted the whole process (SIGABRT), its own file does not.
        try:
            torch.save(obj, tmp)
        except RuntimeError as err:  # torch's zip writer reports a full disk so, unnamed
            if not any(w in str(err) for w in ("iostream error", "inline_container",
                                               "PytorchStreamWriter")):
                raise  # not the file's: a bug, with its traceback
            raise OSError(errno.EIO, f"write failed, is the disk full? (torch: "
                          f"{first_line(err)})", str(path)) from None
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def umask() -> int:
    """The process's umask (what a new file's permissions leave out)."""
    mask = os.umask(0o022)  # reading it means setting it: set it straight back
    os.umask(mask)
    return mask


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint file a user means: a file, or best.pt (else last.pt) of a run directory."""
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (p / "checkpoints" / "best.pt", p / "best.pt", p / "checkpoints" / "last.pt",
                      p / "last.pt"):
        if candidate.is_file():
            return candidate
    if p.is_dir():
        raise FileNotFoundError(f"{p}: no checkpoint in it (looked for best.pt, last.pt)")
    if p.exists():  # /dev/null, a FIFO: there, but no file a checkpoint can be read from
        raise FileNotFoundError(f"{p}: not a regular file; give a checkpoint file or a run "
                                "directory")
    raise FileNotFoundError(f"{p}: no such model file or run directory")


def resolved(path: str | os.PathLike) -> Path | None:
    """``resolve(path)``, or None where it names no checkpoint: for the checks a command makes
    before loading (an output that would overwrite a model), which leave the error to loading."""
    try:
        return resolve(path)
    except OSError:
        return None


def load(path: str | os.PathLike, mmap: bool = False) -> dict:
    """Loads a checkpoint's dict (tensors on the CPU), with a one-line error for a file that is
    not one.

    ``mmap``: tensors stay in the file until read, for a caller that wants only the configs.
    """
    file = resolve(path)
    if file.stat().st_size == 0:  # torch's words for it were about mmap and zip files
        raise ValueError(f"{file}: an empty file, not an mt checkpoint (a copy or a disk that "
                         "failed?); mt writes checkpoints whole or not at all")
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises many kinds for a corrupt or foreign file
        if out_of_memory(err):  # not the file's fault
            raise ValueError(f"{file}: out of memory while loading it") from None
        said = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
        raise ValueError(f"{file}: not a readable mt checkpoint ({type(err).__name__}"
                         f"{': ' + said if said else ''})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{file}: not an mt checkpoint (no '{FORMAT}' format tag)")
    ckpt["path"] = str(file)
    return ckpt


def load_setting(key: str, path: str, mmap: bool = False) -> dict:
    """``load`` of a model a setting names (``init_from``), its one-line errors naming the key
    too: "/x/run: no checkpoint in it" does not say which of a run's settings to fix."""
    try:
        ckpt = load(path, mmap)
        require(ckpt)
        return ckpt
    except (OSError, ValueError) as err:
        said = str(err)
        raise type(err)(f"{key}={said}" if said.startswith(f"{path}:")
                        else f"{key}={path}: {said}") from None


def require(ckpt: dict, keys: tuple[str, ...] = ("model_config", "model", "tokenizer")) -> None:
    """A one-line ValueError naming the file when a checkpoint lacks what a model needs (a file
    saved by other code with the format tag, or cut down by hand), instead of a KeyError later."""
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise ValueError(f"{ckpt['path']}: not an mt model checkpoint (it has no "
                         f"{' or '.join(repr(k) for k in missing)})")


def first_reason(err: Exception) -> str:
    """The line of a (torch) error message that says what is wrong: load_state_dict's first line
    is only a heading ("Error(s) in loading state_dict for Transformer:")."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    reason = lines[0] if lines else type(err).__name__
    return reason if len(reason) <= 300 else reason[:297] + "..."


def load_model(path: str | os.PathLike,
               device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model (eval mode, on ``device``), its tokenizer, and the checkpoint dict (minus weights).

    Raises ValueError, naming the file, for a checkpoint whose parts do not belong together:
    weights that do not fit its config, or a tokenizer of another size than the embeddings (which
    would translate a whole file and then fail on a piece id it cannot spell).
    """
    ckpt = load(path)
    require(ckpt)
    file = ckpt["path"]
    try:
        cfg = model_config_from_dict(ckpt["model_config"])
        model = build_model(cfg)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: its model config cannot be built ({first_reason(err)})"
                         ) from None
    try:
        tokenizer = Tokenizer.from_state(ckpt["tokenizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{file}: its tokenizer cannot be read ({first_reason(err)})") from None
    pieces = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    if pieces != (cfg.src_vocab_size, cfg.tgt_vocab_size):
        raise ValueError(f"{file}: its tokenizer has {pieces[0]}/{pieces[1]} source/target "
                         f"pieces, its model {cfg.src_vocab_size}/{cfg.tgt_vocab_size}: they do "
                         "not belong together")
    try:
        model.load_state_dict(ckpt.pop("model"))
    except RuntimeError as err:
        raise ValueError(f"{file}: its weights do not fit its model config "
                         f"({first_reason(err)})") from None
    refuse_not_finite(model, file)
    model.to(device).eval()
    return model, tokenizer, ckpt


def refuse_not_finite(model: torch.nn.Module | dict[str, torch.Tensor], file) -> None:
    """ValueError naming the file for weights that hold NaN or infinite values (a diverged run's
    or a damaged copy): every score of such a model is NaN, and beam search then finishes no
    hypothesis, greedy search picks tokens at random and sampling fails inside torch. ``model``
    may be a checkpoint's state dict (``average``: a NaN in one input made every average NaN)."""
    def finite(w: torch.Tensor) -> bool:  # NaN and inf carry through min and max: 9x faster
        return (not w.is_floating_point() or w.numel() == 0
                or all(map(math.isfinite, (v.item() for v in w.aminmax()))))

    # named_parameters names a tied weight once; a state dict names it once per use
    named = _distinct(model) if isinstance(model, dict) else model.named_parameters()
    bad = {name: int((~torch.isfinite(w)).sum()) for name, w in named if not finite(w.detach())}
    if bad:
        raise ValueError(f"{file}: its weights hold {sum(bad.values())} values that are not "
                         f"finite (NaN or infinite), first in '{next(iter(bad))}': a damaged or "
                         "diverged model")


def _storage_key(v: torch.Tensor) -> tuple:
    """What two names of one tensor (a tied weight) have alike, and two tensors never do."""
    return (v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride(), v.dtype)


def _distinct(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A state dict's (name, tensor) pairs, a tensor that several names share (a tied
    embedding, saved once) under the first name only."""
    seen: set[tuple] = set()
    out = []
    for name, v in state.items():
        key = _storage_key(v)
        if key not in seen or v.numel() == 0:
            seen.add(key)
            out.append((name, v))
    return out


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state dict on the CPU, tied weights still one tensor: the state
    dict names a tied embedding three times (source, target, output layer), and a copy per
    name stored it three times (transformer_base at 32k pieces: 130 MB more per checkpoint)."""
    copies: dict[tuple, torch.Tensor] = {}

    def copy(v: torch.Tensor) -> torch.Tensor:
        key = _storage_key(v)
        if key not in copies:
            copies[key] = v.detach().clone().cpu()
        return copies[key]

    return {k: copy(v) for k, v in model.state_dict().items()}


def model_state(model: torch.nn.Module, tokenizer: Tokenizer, config: dict | None,
                run_id: str | None = None) -> dict:
    """The self-contained inference part of a checkpoint (of the bare model: the trainer keeps
    its DDP or torch.compile wrapper apart, in ``Trainer.net``). ``run_id``: the training run
    that saved it, which ``mt-average`` compares (None: not a run's, an import)."""
    state = {
        "format": FORMAT,
        "model_config": dict(vars(model.cfg)),
        "model": weights(model),
        "tokenizer": tokenizer.to_state(),
        "config": config,
    }
    if run_id is not None:
        state["run_id"] = run_id
    return state


def step_of(path: Path) -> int | None:
    """N of a step_N.pt file; None for any other name."""
    m = re.fullmatch(r"step_(\d+)\.pt", path.name)
    return int(m.group(1)) if m else None


def step_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """step_N.pt files of a checkpoints folder, oldest (smallest N) first."""
    found = [(n, p) for p in Path(directory).glob("step_*.pt") if (n := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def best_step_checkpoints(paths: list[Path], history: list[dict], best_metric: str) -> list[Path]:
    """Step checkpoints ranked best first by the validation score recorded for their step.

    Args:
        paths: step_N.pt files.
        history: the run's validation records (``trainer.history`` in last.pt).
        best_metric: ``bleu`` or ``chrf`` (higher is better), or ``loss`` (lower is better).
    Returns:
        those of ``paths`` whose step has a score, best first.
    """
    if best_metric not in BEST_METRICS:  # a config this version does not know: never guess
        raise ValueError(f"trainer.best_metric={best_metric!r}: not one of "
                         f"{', '.join(BEST_METRICS)}")
    key, sign = BEST_METRICS[best_metric]
    score = {r["step"]: sign * r[key] for r in history if key in r}
    return sorted((p for p in paths if step_of(p) in score), key=lambda p: -score[step_of(p)])


def prune_step_checkpoints(directory: Path, history: list[dict], keep_last: int, keep_best: int,
                           best_metric: str) -> None:
    """Keeps the last ``keep_last`` and the ``keep_best`` best step checkpoints (by the run's
    validation ``history``); deletes the others."""
    steps = step_checkpoints(directory)
    keep = set(steps[-keep_last:]) if keep_last else set()
    if keep_best:
        keep.update(best_step_checkpoints(steps, history, best_metric)[:keep_best])
    for path in steps:
        if path not in keep:
            path.unlink()


def rng_state(device: torch.device) -> dict:
    """This process's random streams (torch, Python, CUDA), for an exact resume."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []}


def set_rng_state(state: dict) -> None:
    """Puts back what ``rng_state`` saved; the streams draw on as before the save."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]  # a checkpoint round trip may give lists
    random.setstate((version, tuple(internal), gauss))
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """A digest of every weight's bytes: two files with the same weights (best.pt and the step
    checkpoint it copies) are one checkpoint, which averaging would weigh twice."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        w = weights[name]
        digest.update(f"{name}:{w.dtype}:{tuple(w.shape)};".encode())
        digest.update(w.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
