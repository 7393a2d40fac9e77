"""What a training run reports besides its checkpoints: the loss and speed of each log window,
the valid-split scores, ``curves.png`` after every validation, and at the end the test-set BLEU
of ``best.pt`` and ``averaged.pt`` (``test.json``) with the command to run next.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mt import checkpoint, version_line
from mt.batching import collate, token_batches
from mt.config import PAD_ID, TrainConfig, TrainerConfig
from mt.data import load_split, split_files
from mt.loss import label_smoothed_nll
from mt.textio import replace_file

log = logging.getLogger("mt.train")
_said_too_long: set[tuple[str, int]] = set()  # (valid split, limit): warned once per process


def perplexity(nll: float) -> float:
    """exp(NLL per token), capped where an untrained model's would overflow."""
    return math.exp(min(nll, 50))


def bleu_language(tgt_lang: str) -> str:
    """The ``trg_lang`` that training's BLEU is computed for: ``tgt_lang``, so that Chinese,
    Japanese and Korean targets get sacrebleu's tokenizer for them, as mt-eval gives (13a split
    a Chinese line into one token: BLEU 0). Where that tokenizer cannot load (ja-mecab and
    ko-mecab need sacrebleu's [ja] / [ko] extras), one warning and 13a, rather than a run that
    stops at its first validation."""
    from mt.report import make_metric
    from mt.testsets import EvalError

    try:
        make_metric("bleu", trg_lang=tgt_lang)
    except EvalError as err:
        log.warning("valid and test BLEU use the 13a tokenizer: %s",
                    str(err).removesuffix(" (or choose another --tokenize)"))
        return ""
    return tgt_lang


def validate(model: torch.nn.Module, tokenizer, src: list[str], tgt: list[str],
             trainer: TrainerConfig, device: torch.device, hyp_file: Path | None = None,
             split: str = "valid", trg_lang: str = "",
             between_batches: Callable[[], None] | None = None) -> dict:
    """Loss and perplexity on the valid pairs (teacher forced, without label smoothing, so runs
    with different smoothing compare), and BLEU and chrF of the search the test at the end uses.

    The caller puts the model in eval mode and under inference mode (and autocast, if any).
    ``hyp_file``: where to write the translations scored, one line per source line
    (``write_lines``), so that a score can be read against what the model produced.
    ``split``: the pairs' name, for the warning about pairs too long. ``trg_lang``: BLEU's
    target language (``bleu_language``). ``between_batches``: called after each batch of the loss
    and of the search; an exception it raises ends the validation there (a stop signal:
    ``mt.distributed.SigtermWatch.between_batches``).
    """
    from mt.evaluate import score
    from mt.lines import best_translations
    from mt.options import SearchOptions

    src_ids, tgt_ids = tokenizer.encode_src(src), tokenizer.encode_tgt(tgt)
    limit = model.cfg.max_positions
    fits = fitting(src_ids, tgt_ids, limit)
    if len(fits) < len(src_ids) and (split, limit) not in _said_too_long:
        _said_too_long.add((split, limit))
        log.warning("valid loss on %s leaves out %d of %d pairs longer than "
                    "model.max_positions=%d (BLEU and chrF keep them)", split,
                    len(src_ids) - len(fits), len(src_ids), limit)
    src_ids, tgt_ids = [src_ids[i] for i in fits], [tgt_ids[i] for i in fits]
    loss_sum, tokens = 0.0, 0
    batches = token_batches([len(s) for s in src_ids], [len(t) for t in tgt_ids],
                            trainer.max_tokens, 0, 0, shuffle=False)
    for batch in batches:
        src_t, tgt_in, tgt_out = (t.to(device) for t in collate(
            [src_ids[i] for i in batch], [tgt_ids[i] for i in batch]))
        _, nll = label_smoothed_nll(model(src_t, tgt_in), tgt_out, 0.0)
        loss_sum += float(nll)
        tokens += int((tgt_out != PAD_ID).sum())
        if between_batches is not None:
            between_batches()
    opts = SearchOptions(beam=trainer.beam_size, lenpen=trainer.lenpen)
    hyps = best_translations(model, tokenizer, src, opts,
                             progress=_EachBatch(between_batches) if between_batches else False)
    if hyp_file is not None:
        write_lines(hyp_file, hyps)
    scores = score(hyps, tgt, trg_lang=trg_lang)
    loss = loss_sum / tokens if tokens else math.nan  # no pair fits: no loss, not a perfect 0
    return {"valid_loss": loss, "valid_ppl": perplexity(loss),
            "valid_bleu": scores["bleu"], "valid_chrf": scores["chrf"]}


class _EachBatch:
    """The progress bar ``search_lines`` advances after each batch it searched (``total``: what
    it adds its pieces to), calling ``call`` there instead."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call, self.total = call, 0

    def update(self, _done: int) -> None:
        self.call()


def fitting(src_ids: list[list[int]], tgt_ids: list[list[int]], limit: int) -> list[int]:
    """The pairs (their indices) a valid loss can be computed on: a pair longer than the model's
    positions cannot be teacher-forced (training filters such pairs out); the search translates
    its source in pieces, so BLEU keeps it."""
    return [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True))
            if len(s) <= limit and len(t) + 1 <= limit]


def write_lines(path: Path, lines: list[str]) -> None:
    """Writes ``lines`` one per line, whole or not at all (``mt.textio.replace_file``). A line
    break inside a line (\\n or \\r, should the tokenizer decode a piece to one) becomes a space,
    so that line N of the file stays line N of the input."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, "".join(line.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
                               + "\n" for line in lines))


class UnreadStderr:
    """The progress bar's stream (stderr) where no one may read it any more: the terminal closed
    (EIO) or, under ``mt-train 2>&1 | tee log``, tee ended by the same SIGHUP (EPIPE, which tqdm
    raised in the training loop: the run ended in a traceback instead of saving the step it
    stopped at). The descriptor is then pointed at /dev/null, so that this write, the logs' and
    the one at exit all succeed; train.log keeps the logs."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as err:
            self._unread(err)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as err:
            self._unread(err)

    def __getattr__(self, name: str):  # fileno, isatty, encoding: the stream's
        return getattr(self.stream, name)

    def _unread(self, err: OSError) -> None:
        if err.errno not in (errno.EPIPE, errno.EIO):
            raise err
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self.stream.fileno())
        finally:
            os.close(null)
        self.stream.flush()  # what the buffer held, into /dev/null


class Metrics:
    """``metrics.jsonl`` (one JSON object per log line and per validation), TensorBoard events
    when tensorboard is installed, and ``curves.png`` redrawn at each validation (rank 0 only)."""

    def __init__(self, run_dir: Path, tensorboard: bool, step: int = 0) -> None:
        """``step``: where the run starts (a resumed run's checkpoint). Records after it came from
        steps the checkpoint does not hold (a run killed between saves): they go, so that the
        steps run again are not in the curves twice."""
        self.run_dir, self.writer = run_dir, None
        path = run_dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines(keepends=True)
            kept = [x for x in lines if _step_of(x) <= step]
            if len(kept) < len(lines):
                replace_file(path, "".join(x if x.endswith("\n") else x + "\n" for x in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
            else:  # purge_step hides the events of steps after ``step`` likewise
                self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1)

    def write(self, record: dict) -> None:
        # NaN and inf as null: Python's json would write bare NaN, which strict parsers refuse
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}
        path = self.run_dir / "metrics.jsonl"
        try:
            with open(path, "a") as f:
                f.write(json.dumps(finite) + "\n")
        except OSError as err:  # a full disk said no file: "[Errno 28] No space left on device"
            if err.filename:
                raise
            raise OSError(err.errno, err.strerror, str(path)) from None
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, int | float):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if "valid_loss" in record:
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")


def plot_curves(metrics_file: Path, out: Path) -> bool:
    """Training loss, validation loss and BLEU against steps, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = [{k: math.nan if v is None else v for k, v in json.loads(line).items()}
               for line in metrics_file.read_text().splitlines() if line]  # null: no value
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "valid_loss" in r]
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 4))
    # NLL against NLL (the label-smoothed loss sits higher; runs before "nll" was logged: that)
    key = "nll" if train and "nll" in train[0] else "loss"
    ax_loss.plot([r["step"] for r in train], [r[key] for r in train],
                 label="train NLL" if key == "nll" else "train (smoothed)")
    ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-",
                 label="valid NLL")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss per token")
    ax_loss.legend()
    ax_bleu.plot([r["step"] for r in valid], [r["valid_bleu"] for r in valid], "o-",
                 label="valid")
    extra = dict.fromkeys(k.removesuffix("/bleu") for r in valid for k in r if k.endswith("/bleu"))
    for split in extra:  # data.extra_valid's splits
        scored = [r for r in valid if f"{split}/bleu" in r]
        ax_bleu.plot([r["step"] for r in scored], [r[f"{split}/bleu"] for r in scored], "o-",
                     label=split)
    ax_bleu.set_xlabel("step")
    ax_bleu.set_ylabel("BLEU")
    if extra:
        ax_bleu.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def _step_of(line: str) -> float:
    """A metrics.jsonl record's step; a line cut short by a kill counts as after every step."""
    try:
        return json.loads(line).get("step", 0) if line.strip() else math.inf
    except ValueError:
        return math.inf


class Window:
    """Loss and throughput since the last log line; the loss stays on the device until read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.loss = torch.zeros(2, device=self.device)  # label-smoothed loss, NLL
        self.loss_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self.restart_clock()

    def restart_clock(self) -> None:
        """Speed counts from here (after a validation: tokens/s measures training only); the
        loss keeps every step since the last log line."""
        self.tokens = 0
        self.start = time.perf_counter()

    def state(self) -> dict:
        """The loss so far, for a checkpoint: a resumed run's next log line then equals the
        uninterrupted run's (a sync with the device: called at saves only)."""
        loss, nll = self.loss.tolist()
        return {"loss": loss, "nll": nll, "loss_tokens": int(self.loss_tokens)}

    def load(self, state: dict) -> None:
        self.loss.copy_(torch.tensor([state["loss"], state.get("nll", 0.0)]))
        self.loss_tokens.fill_(state["loss_tokens"])

    def add(self, loss: torch.Tensor, tokens: int, finite: torch.Tensor) -> None:
        """A step's loss and NLL ((2,)) summed over ``tokens`` target tokens; a NaN/inf step
        counts for speed only."""
        self.loss += torch.where(finite, loss.float(), 0.0)
        self.loss_tokens += finite * tokens
        self.tokens += tokens

    def read(self) -> dict:
        seconds = time.perf_counter() - self.start
        loss, nll = (self.loss / self.loss_tokens).tolist()  # no finite step: NaN, not 0
        out = {"loss": loss, "nll": nll, "ppl": perplexity(nll),
               "tgt_tokens_per_s": self.tokens / max(seconds, 1e-9)}
        self.restart()
        return out


def _earlier_tests(path: Path) -> dict:
    """The reports of an earlier finish of this run (test.json) by checkpoint name: {} when
    there is none, or none that reads."""
    try:
        tests = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(tests, dict):
        return {}
    best = {k: v for k, v in tests.items() if k != "averaged"}
    return {"best": best, "averaged": tests.get("averaged") or {}}


def _texts_digest(*sides: list[str]) -> str:
    """A digest of a test set's sources and references: an edited file is another test."""
    digest = hashlib.blake2b(digest_size=16)
    for side in sides:
        for line in side:
            digest.update(line.encode("utf-8", "surrogatepass") + b"\n")
        digest.update(b"\0")
    return digest.hexdigest()


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None


def _test_line(label: str, result: dict) -> str:
    return (f"{label} = {result['bleu']:.2f}  chrF = {result['chrf']:.2f}  "
            f"({result['sentences']} sentences, {result['bleu_signature']})")


def finish(cfg: TrainConfig, run_dir: Path, device: torch.device,
           valid: tuple[list[str], list[str]] | None, trg_lang: str) -> None:
    """Averaging, the valid and test scores of best.pt and averaged.pt, and what to run next (rank
    0 only).

    Which of the two to use is the user's call on the valid split: when averaged.pt is made, both
    are scored on ``valid`` (the (sources, references) the run validated on, so
    ``data.max_valid_sentences`` of them), decoded alike (float32, the validation's search;
    best.pt's score in the history may come from bf16), printed on one line and kept in
    test.json. Both test scores are printed too, so that nothing is chosen on the test set here.
    ``trg_lang``: BLEU's target language (``bleu_language``).
    """
    from mt.average import average
    from mt.evaluate import score
    from mt.lines import best_translations
    from mt.options import SearchOptions

    ckpt_dir = run_dir / "checkpoints"
    averaged = False
    if cfg.trainer.average_last > 1:
        paths = checkpoint.step_checkpoints(ckpt_dir)[-cfg.trainer.average_last :]
        if len(paths) > 1:
            checkpoint.save_atomic(average(paths, refuse_copies=False),
                                   ckpt_dir / "averaged.pt")
            log.info("averaged %d checkpoints -> %s", len(paths), ckpt_dir / "averaged.pt")
            averaged = True
        else:
            log.warning("trainer.average_last=%d: %d step checkpoint(s) on disk, nothing to "
                        "average", cfg.trainer.average_last, len(paths))
    on_valid = valid is not None and averaged and bool(valid[0])
    on_test = cfg.trainer.test_at_end and bool(cfg.data.test)
    opts = SearchOptions(beam=cfg.trainer.beam_size, lenpen=cfg.trainer.lenpen)
    src, ref = [], []
    if on_test:
        test = load_split(cfg.data, cfg.data.test)
        src, ref = list(test["src"]), list(test["tgt"])
    report, valid_scores, said = {}, {}, []
    earlier = _earlier_tests(run_dir / "test.json") if on_test else {}
    # an averaged.pt this run did not write (an earlier run's, in a directory run again) is not
    # its own: not scored as if it were
    for name in ("best", "averaged")[: 1 + averaged] if on_valid or on_test else ():
        path = ckpt_dir / f"{name}.pt"
        if not path.exists():  # best.pt may be missing (a run resumed from a copied last.pt)
            log.warning("%s is missing (a run resumed from a copied last.pt?): no %s score of "
                        "it (mt-eval -m %s scores last.pt)", path, "test" if on_test else "valid",
                        ckpt_dir / "last.pt")
            continue
        model, tok, saved = checkpoint.load_model(path, device)
        suffix = "" if name == "best" else ".averaged"
        hyp_file = run_dir / f"{cfg.data.test}{suffix}.hyp"
        label = "test BLEU" if name == "best" else "test BLEU of averaged.pt"
        tested_with = json.loads(json.dumps({  # as read back from test.json
            "weights": checkpoint.weights_digest(model.state_dict()),
            "model": saved["model_config"], "tokenizer": tok.fingerprint,
            "test": _texts_digest(src, ref), "search": dataclasses.asdict(opts),
            "device": device.type, "target_language": trg_lang,
            "valid": _texts_digest(*valid) if on_valid else None, "versions": version_line()},
            default=str))
        kept = earlier.get(name)
        if (on_test and isinstance(kept, dict) and kept.get("tested_with") == tested_with
                and kept.get("hyp_digest") is not None
                and _file_digest(hyp_file) == kept["hyp_digest"]):
            # a finished run started again (a sweep resumed after an interrupt): the same
            # weights, texts, search and code give the same scores, so the decoding is not
            # redone; the .hyp must be the one they were of (a later finish, cut short after
            # writing its own, leaves another beside the old test.json)
            log.info("%s: the scores in %s are of these weights, texts and search: kept",
                     path.name, run_dir / "test.json")
            report[name] = kept
            if "valid" in kept:
                valid_scores[name] = kept["valid"]
            said.append(_test_line(label, kept))
            continue
        if on_valid:
            hyps = best_translations(model, tok, valid[0], opts)
            valid_scores[name] = {k: v for k, v in score(hyps, valid[1], trg_lang=trg_lang).items()
                                  if k in ("bleu", "chrf", "sentences")}
        if not on_test:
            continue
        start = time.perf_counter()
        hyps = best_translations(model, tok, src, opts)
        seconds = time.perf_counter() - start
        result = score(hyps, ref, trg_lang=trg_lang)
        write_lines(hyp_file, hyps)
        report[name] = {**result, "checkpoint": str(path), "seconds": seconds}
        if name in valid_scores:
            report[name]["valid"] = valid_scores[name]
        report[name].update(tested_with=tested_with, hyp_digest=_file_digest(hyp_file))
        said.append(_test_line(label, result))
    if on_test:  # on disk before a word is printed: a stdout that fails loses nothing
        replace_file(run_dir / "test.json", json.dumps(  # best.pt's scores at the top level
            {**report.get("best", {}), "averaged": report.get("averaged")}, indent=2))
    if valid_scores:  # first: the line to choose by
        print(f"valid BLEU / chrF ({len(valid[0])} sentences; choose on these, not on test): "
              + ", ".join(f"{name}.pt {v['bleu']:.2f} / {v['chrf']:.2f}"
                          for name, v in valid_scores.items()))
    for line in said:
        print(line)
    if on_test:
        if cfg.data.source != "hub" and cfg.data.format == "text":  # tsv/jsonl: no source file
            src_file = split_files(cfg.data, cfg.data.test.split("+")[0])[0]  # the first part
            # quoted for the shell, so that it runs as printed from anywhere (a run directory
            # or data.dir with a space in it split into two arguments)
            print(f"try: translate -m {shlex.quote(str(run_dir))} "
                  f"-i {shlex.quote(str(src_file.resolve()))}")
    print(f"run directory: {run_dir}")
