"""``mt-eval``: score systems on test sets with sacrebleu, compare them, report speed.

A *system* is a model (``-m``: it translates the test set's source first) or a file of
hypotheses (``--hyp``). A *test set* is a pair of local files (``--src`` / ``--ref``, several
``--ref`` for several references per sentence), a named set from ``conf/testsets/NAME.yaml``
(``--test``), or a sacrebleu test set (``--test-set wmt14 --langpair en-de``). Every system is
scored on every test set.

Scores come from sacrebleu's metric classes on detokenized text, read the way the ``sacrebleu``
command line reads files (trailing whitespace stripped), so every number equals what
``sacrebleu REF -i HYP -m ...`` prints, and each comes with its signature. With several systems,
the first is the baseline: ``--paired-bs`` / ``--paired-ar`` run sacrebleu's paired bootstrap
resampling and approximate randomization tests and report a p-value per system and metric.

stdout carries the results only (a table, or one JSON object); logs and warnings go to stderr.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("mt.evaluate")

REPO_ROOT = Path(__file__).resolve().parent.parent  # relative paths in conf/testsets/ start here
TESTSETS_DIR = REPO_ROOT / "conf" / "testsets"
METRICS = ("bleu", "chrf", "chrf++", "ter")
OFFLINE_VARS = ("MT_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
DOWNLOAD_TIMEOUT_S = 20.0
# Marks of tokenized text: a space before a comma or a final period, split clitics, BPE joiners,
# Moses XML escapes. French puts a space before ; : ! ? so those are not on the list.
_TOKENIZED = re.compile(r" [,.](?= |$)| 's\b| n't\b|@@( |$)|&apos;|&quot;|&amp;|&lt;|&gt;")


class EvalError(Exception):
    """A mistake in the inputs; the message names the file, the test set or the option."""


def score(hypotheses: list[str], references: list[str], *, tokenize: str | None = None,
          lowercase: bool = False) -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against one reference each.

    Used by ``mt.train`` for validation and the final test; ``mt-eval`` has more metrics.

    Returns:
        {"bleu": float, "bleu_signature": str, "chrf": float, "chrf_signature": str,
         "sentences": int}
    """
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(tokenize=tokenize, lowercase=lowercase), CHRF(lowercase=lowercase)
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": b.score, "bleu_signature": str(bleu.get_signature()),
            "chrf": c.score, "chrf_signature": str(chrf.get_signature()),
            "sentences": len(hypotheses)}


# ----------------------------------------------------------------------------- inputs


@dataclass
class TestSet:
    """Where a test set's files are; ``refs`` has one file per reference translation."""

    name: str
    refs: list[str]
    src: str | None = None
    langpair: str | None = None
    origin: str = "files"  # files | conf/testsets/NAME.yaml | sacrebleu


@dataclass
class System:
    kind: str  # model | hyp
    path: str
    name: str = ""
    info: dict = field(default_factory=dict)  # model path, config hash, load time


def read_text(path: str | os.PathLike) -> list[str]:
    """A file's lines as the sacrebleu CLI reads them: UTF-8, trailing whitespace stripped."""
    p = Path(path)
    try:
        data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    except FileNotFoundError:
        raise EvalError(f"{p}: no such file") from None
    except (OSError, EOFError) as err:
        raise EvalError(f"{p}: cannot read ({err})") from None
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line
    out = []
    for lineno, raw in enumerate(lines, start=1):
        try:
            out.append(raw.decode("utf-8").rstrip())
        except UnicodeDecodeError as err:
            raise EvalError(f"{p}:{lineno}: invalid UTF-8 ({err.reason})") from None
    return out


def _split_pair(langpair: str, where: str) -> tuple[str, str]:
    parts = langpair.split("-")
    if len(parts) != 2 or not all(parts):
        raise EvalError(f"{where}: language pair {langpair!r} is not of the form en-de")
    return parts[0], parts[1]


def named_tests() -> list[str]:
    return sorted(p.stem for p in TESTSETS_DIR.glob("*.yaml"))


def load_named_test(name: str, langpair: str | None = None) -> TestSet:
    """Resolves ``--test NAME`` through ``conf/testsets/NAME.yaml``.

    The file gives ``src`` and ``ref`` (one path or a list) with ``{src}`` / ``{tgt}`` standing for
    the language codes, a default ``langpair`` and the ``languages`` it has. Relative paths are
    relative to the repository root, so the command works from any directory.
    """
    import yaml

    file = TESTSETS_DIR / f"{name}.yaml"
    if not file.is_file():
        raise EvalError(f"no test set {name!r}: {file} does not exist "
                        f"(known: {', '.join(named_tests()) or 'none'})")
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:  # e.g. a value starting with { that is not quoted
        raise EvalError(f"{file}: not valid YAML ({str(err).splitlines()[0]}; quote values "
                        "that start with {)") from None
    for key in ("src", "ref"):
        if key not in spec:
            raise EvalError(f"{file}: missing key {key!r}")
    pair = langpair or spec.get("langpair")
    if not pair:
        raise EvalError(f"{file}: no 'langpair' in it; pass --langpair")
    src_lang, tgt_lang = _split_pair(pair, str(file))
    languages = spec.get("languages")
    for lang in (src_lang, tgt_lang):
        if languages and lang not in languages:
            raise EvalError(f"{file}: no language {lang!r} (it has {', '.join(languages)})")

    def path(template: str) -> str:
        p = Path(template.format(src=src_lang, tgt=tgt_lang))
        return str(p if p.is_absolute() else (REPO_ROOT / p).resolve())

    refs = spec["ref"] if isinstance(spec["ref"], list) else [spec["ref"]]
    return TestSet(name, [path(r) for r in refs], path(spec["src"]), pair,
                   f"conf/testsets/{file.name}")


def _offline() -> str | None:
    for var in OFFLINE_VARS:
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return var
    return None


def _in_cache(dataset, langpair: str) -> bool:
    """Whether sacrebleu can give the files without a download (its raw files or text files)."""
    from sacrebleu.dataset.wmt_xml import WMTXMLDataset

    raw = [Path(dataset._rawdir) / dataset._get_tarball_filename(url) for url in dataset.data]
    if all(p.is_file() and p.stat().st_size > 0 for p in raw):
        return True
    if isinstance(dataset, WMTXMLDataset):  # its field names come from the raw file
        return False
    return all(Path(dataset._get_txt_file_path(langpair, f)).is_file()
               for f in dataset.fieldnames(langpair))


def load_sacrebleu_test(name: str, langpair: str | None) -> TestSet:
    """A sacrebleu test set: from its cache ($SACREBLEU, default ~/.sacrebleu), else downloaded.

    sacrebleu downloads with ``urlopen`` and no timeout, so an unreachable host could hang. Here
    the download is refused at once in offline mode (``HF_HUB_OFFLINE=1``, ``MT_OFFLINE=1``, ...)
    and otherwise runs under a socket timeout; any failure is one line, not a traceback.
    """
    import socket
    import urllib.error

    from sacrebleu.dataset import DATASETS
    from sacrebleu.utils import SACREBLEU_DIR

    if name not in DATASETS:
        raise EvalError(f"--test-set {name}: sacrebleu has no such test set "
                        "(`sacrebleu --list` shows them)")
    dataset = DATASETS[name]
    if not langpair:
        raise EvalError(f"--test-set {name}: give --langpair (one of "
                        f"{', '.join(dataset.langpairs)})")
    if langpair not in dataset.langpairs:
        raise EvalError(f"--test-set {name}: no language pair {langpair} (it has "
                        f"{', '.join(dataset.langpairs)})")
    cached = _in_cache(dataset, langpair)
    hint = (f"download it where there is a network (`sacrebleu -t {name} -l {langpair} "
            f"--echo src`) and copy {SACREBLEU_DIR}, or pass --src and --ref files")
    if not cached and _offline():
        raise EvalError(f"--test-set {name}: not in the sacrebleu cache {SACREBLEU_DIR} and "
                        f"{_offline()} is set (offline); {hint}")
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        if not cached:
            log.info("downloading sacrebleu test set %s to %s", name, SACREBLEU_DIR)
        src = dataset.get_source_file(langpair)
        refs = dataset.get_reference_files(langpair)
    except (urllib.error.URLError, OSError, SystemExit) as err:
        reason = getattr(err, "reason", err)
        raise EvalError(f"--test-set {name}: cannot download it ({reason}); {hint}") from None
    finally:
        socket.setdefaulttimeout(old_timeout)
    return TestSet(name, list(refs), src, langpair, "sacrebleu")


def looks_tokenized(lines: list[str]) -> tuple[int, int | None]:
    """How many lines carry marks of tokenization, and the first such line number (1-based)."""
    hits = [i for i, line in enumerate(lines, start=1) if _TOKENIZED.search(line)]
    return len(hits), (hits[0] if hits else None)


def check_lines(hyps: list[str], hyp_name: str, refs: list[list[str]], ref_names: list[str],
                warn_tokenized: bool = True, from_model: bool = False) -> None:
    """Stops the silent mistakes: misaligned or empty files; warns on tokenized text.

    A model that translates everything to empty lines is worth a score (0) and a warning; an
    empty hypothesis file is a mistake (a wrong path, a crashed run) and an error.
    """
    if not any(h.strip() for h in hyps) and from_model:
        log.warning("%s: every translation is empty", hyp_name)
    elif not any(h.strip() for h in hyps):
        raise EvalError(f"{hyp_name}: the hypotheses are empty ({len(hyps)} lines, no text) "
                        f"but {ref_names[0]} has {len(refs[0])} lines")
    for ref, ref_name in zip(refs, ref_names, strict=True):
        if len(hyps) != len(ref):
            raise EvalError(f"{hyp_name} has {len(hyps)} lines but {ref_name} has {len(ref)} "
                            "lines; hypotheses and references must be aligned line by line")
    if not warn_tokenized:
        return
    for lines, name in [(hyps, hyp_name), *zip(refs, ref_names, strict=True)]:
        count, first = looks_tokenized(lines)
        if count >= max(2, 0.1 * len(lines)):
            log.warning("%s looks tokenized: %d of %d lines have ' ,', ' .', \" 's\", '@@ ' "
                        "or &apos;-style escapes (e.g. line %d: %r). sacreBLEU expects detokenized "
                        "text: detokenize it, or pass --tokenize none if both sides are tokenized "
                        "alike (then the score is not comparable to published ones)",
                        name, count, len(lines), first, lines[first - 1][:80])


# ----------------------------------------------------------------------------- scoring


def make_metric(name: str, *, tokenize: str | None = None, lowercase: bool = False,
                trg_lang: str = "", references: list[list[str]] | None = None):
    """A sacrebleu metric object; ``references`` (one list per reference) are cached in it."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        return BLEU(tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                    references=references)
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else 0, lowercase=lowercase,
                    references=references)
    if name == "ter":
        return TER(references=references)
    raise EvalError(f"unknown metric {name!r} (choose from {', '.join(METRICS)})")


def _score_dict(s, signature: str) -> dict:
    out = {"name": s.name, "score": float(s.score), "signature": signature}
    if s._ci >= 0:  # a bootstrap interval was computed (sacrebleu keeps it private; -1 = none)
        out.update(mean=float(s._mean), ci=float(s._ci))
    if hasattr(s, "precisions"):  # BLEU
        out.update(precisions=[float(p) for p in s.precisions], bp=float(s.bp),
                   ratio=float(s.ratio), hyp_len=int(s.sys_len), ref_len=int(s.ref_len))
    return out


def score_system(hyps: list[str], refs: list[list[str]], metrics: list[str], *,
                 tokenize: str | None = None, lowercase: bool = False, trg_lang: str = "",
                 confidence_n: int = 0) -> dict:
    """Every metric's score and signature for one system; ``len_ratio`` from BLEU's lengths.

    Returns:
        ``{"bleu": 27.3, "bleu_signature": "nrefs:1|...", ...}`` per metric (the flat keys of
        ``score`` and of mt-train's test.json, for scripts), ``"scores"``: per metric the details
        (BLEU's precisions and lengths, confidence interval, later the p-values), ``"len_ratio"``.
    """
    from sacrebleu.metrics import BLEU

    scores = {}
    for name in metrics:
        metric = make_metric(name, tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                             references=refs)
        s = metric.corpus_score(hyps, None, n_bootstrap=confidence_n if confidence_n > 1 else 1)
        scores[name] = _score_dict(s, str(metric.get_signature()))
    if "bleu" in scores:
        ratio = scores["bleu"]["ratio"]
    else:
        ratio = BLEU(tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang).corpus_score(
            hyps, refs).ratio
    flat = {}
    for name, details in scores.items():
        flat.update({name: details["score"], f"{name}_signature": details["signature"]})
    return {**flat, "scores": scores, "len_ratio": ratio}


def paired_test(systems: list[tuple[str, list[str]]], refs: list[list[str]], metrics: list[str],
                test_type: str, n_samples: int, **metric_args) -> dict:
    """sacrebleu's paired test of every system against the first.

    Returns:
        {"type": "bs" | "ar", "n": int, "signatures": {metric: str},
         "results": {metric: [{"score", "p_value", "mean", "ci"} per system]}}
    """
    from sacrebleu.significance import PairedTest

    objs = {m: make_metric(m, references=refs, **metric_args) for m in metrics}
    test = PairedTest(systems, objs, references=None, test_type=test_type, n_samples=n_samples)
    sigs, table = test()
    names = [k for k in table if k != "System"]  # sacrebleu's score names, in our metric order

    def num(x) -> float | None:  # sacrebleu hands back numpy float32s, which JSON refuses
        return None if x is None else float(x)

    results = {m: [{"score": num(r.score), "p_value": num(r.p_value), "mean": num(r.mean),
                    "ci": num(r.ci)} for r in table[n]]
               for m, n in zip(metrics, names, strict=True)}
    return {"type": test_type, "n": test.n_samples,
            "signatures": {m: str(sigs[n]) for m, n in zip(metrics, names, strict=True)},
            "results": results}


# ----------------------------------------------------------------------------- translation


def config_hash(model_config: dict) -> str:
    """First 12 hex of the sha256 of the model config as sorted JSON: same shape, same hash."""
    blob = json.dumps(model_config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def translate_test(model, tokenizer, sources: list[str], opts) -> tuple[list[str], dict]:
    """Best translations and decoding speed (target tokens of the hypotheses per second)."""
    import torch

    from mt.translate import translate_lines

    start = time.perf_counter()
    with torch.inference_mode():
        hyps = [nbest[0][0] for nbest in translate_lines(model, tokenizer, sources, opts)]
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in tokenizer.encode_tgt(hyps))
    return hyps, {"decode_seconds": seconds, "hyp_tokens": tokens,
                  "tokens_per_second": tokens / max(seconds, 1e-9),
                  "sentences_per_second": len(hyps) / max(seconds, 1e-9)}


# ----------------------------------------------------------------------------- the run


def _expand(pattern: str, test: TestSet, n: int) -> str:
    return pattern.replace("{test}", test.name.replace("/", "_")).replace("{n}", str(n))


def collect_tests(args: argparse.Namespace) -> list[TestSet]:
    tests = []
    if args.langpair:
        _split_pair(args.langpair, "--langpair")
    if args.ref:
        name = args.name or args.ref[0]
        tests.append(TestSet(name, list(args.ref), args.src, args.langpair))
    elif args.src:
        raise EvalError("--src needs --ref (the reference translations)")
    for name in args.test or []:
        tests.append(load_named_test(name, args.langpair))
    for names in args.test_set or []:
        for name in names.split(","):
            tests.append(load_sacrebleu_test(name, args.langpair))
    if not tests:
        raise EvalError("no test set: give --ref FILE (and --src for -m), --test NAME or "
                        "--test-set NAME --langpair L1-L2")
    return tests


def run(args: argparse.Namespace) -> dict:
    """Translates (for models), scores and compares every system on every test set."""
    systems = [System(kind, path) for kind, path in args.systems or []]
    if not systems:
        raise EvalError("nothing to score: give -m MODEL or --hyp FILE (several allowed)")
    tests = collect_tests(args)
    for s in systems:
        if s.kind == "hyp" and len(tests) > 1 and "{test}" not in s.path:
            raise EvalError(f"--hyp {s.path}: with several test sets, write {{test}} in the path "
                            "where the test set's name goes (e.g. out/{test}.hyp)")
    seen: dict[str, int] = {}
    for s in systems:  # unique display names, in the order given
        seen[s.path] = seen.get(s.path, 0) + 1
        s.name = s.path if seen[s.path] == 1 else f"{s.path}#{seen[s.path]}"
    if args.output:
        outs = [_expand(args.output, t, i) for i, s in enumerate(systems, 1)
                if s.kind == "model" for t in tests]
        if not outs:
            log.warning("--output is for translations made with -m; ignored")
        if len(set(outs)) != len(outs):
            raise EvalError(f"--output {args.output}: several translations would go to one file; "
                            "put {test} and/or {n} (the system's number) in it")
    metric_args = {"tokenize": args.tokenize, "lowercase": args.lowercase}
    result: dict = {"metrics": list(args.metrics), "tests": []}
    loaded: dict[int, tuple] = {}
    for test in tests:
        refs = [read_text(r) for r in test.refs]
        for r, name in zip(refs[1:], test.refs[1:], strict=True):
            if len(r) != len(refs[0]):
                raise EvalError(f"{name} has {len(r)} lines but {test.refs[0]} has "
                                f"{len(refs[0])}; every reference must have one line per sentence")
        trg_lang = test.langpair.split("-")[1] if test.langpair else ""
        entry: dict = {"name": test.name, "langpair": test.langpair, "origin": test.origin,
                       "source": test.src, "references": test.refs, "sentences": len(refs[0]),
                       "systems": []}
        named_hyps = []
        for n, system in enumerate(systems, 1):
            record: dict = {"name": system.name, "kind": system.kind}
            if system.kind == "hyp":
                hyp_file = _expand(system.path, test, n)
                hyps = read_text(hyp_file)
                record["hypotheses"] = hyp_file
            else:
                hyps, speed = _translate(system, test, n, loaded, args, refs)
                record.update(system.info, **speed)
                hyp_file = record.get("hypotheses") or f"{system.name} (translations)"
            check_lines(hyps, hyp_file, refs, test.refs, warn_tokenized=args.tokenize != "none",
                        from_model=system.kind == "model")
            record.update(score_system(hyps, refs, args.metrics, trg_lang=trg_lang,
                                       confidence_n=args.confidence_n if args.confidence else 0,
                                       **metric_args))
            entry["systems"].append(record)
            named_hyps.append((system.name, hyps))
        entry["signatures"] = {m: entry["systems"][0]["scores"][m]["signature"]
                               for m in args.metrics}
        asked = [("bs", args.paired_bs_n)] * args.paired_bs
        asked += [("ar", args.paired_ar_n)] * args.paired_ar
        if asked and len(systems) > 1:
            compare(entry, named_hyps, refs, args.metrics, asked, trg_lang=trg_lang,
                    **metric_args)
        elif asked:
            log.warning("a paired test needs two systems or more; only one was given")
        result["tests"].append(entry)
    return result


def compare(entry: dict, named_hyps: list[tuple[str, list[str]]], refs: list[list[str]],
            metrics: list[str], asked: list[tuple[str, int]], **metric_args) -> None:
    """Adds paired-test p-values (``p_bs``, ``p_ar``) against the first system to ``entry``."""
    base = named_hyps[0][1]
    for (_, hyps), record in zip(named_hyps[1:], entry["systems"][1:], strict=True):
        record["differing_sentences"] = sum(a != b for a, b in zip(hyps, base, strict=True))
        if hyps == base:
            record["identical_to_baseline"] = True
    entry["paired"] = []
    for kind, n_samples in asked:
        log.info("%s: paired %s test of %d system(s) against %s", entry["name"], kind,
                 len(named_hyps) - 1, named_hyps[0][0])
        pt = paired_test(named_hyps, refs, metrics, kind, n_samples, **metric_args)
        entry["paired"].append({k: pt[k] for k in ("type", "n", "signatures")})
        for i, record in enumerate(entry["systems"]):
            for m in metrics:
                r, s = pt["results"][m][i], record["scores"][m]
                # sacrebleu counts only resamples with a difference strictly larger than the
                # observed one, so a copy of the baseline (observed 0, every resample 0) would get
                # the smallest p-value possible; no difference at all is never significant.
                s[f"p_{kind}"] = 1.0 if record.get("identical_to_baseline") else r["p_value"]
                if kind == "bs":
                    s.update(bs_mean=r["mean"], bs_ci=r["ci"])
            _warn_few_differences(record, kind, metrics)


def _warn_few_differences(record: dict, kind: str, metrics: list[str]) -> None:
    """Warns when an AR p-value is an artefact of a system that barely differs from the baseline.

    sacrebleu's AR test counts only shuffles with a strictly larger difference than observed; when
    a system differs from the baseline in a few sentences no shuffle can exceed it, and the
    p-value is the smallest possible however small the difference.
    """
    few = record.get("differing_sentences", 0)
    if kind == "ar" and 0 < few <= 10 and any(
            record["scores"][m]["p_ar"] < 0.05 for m in metrics):
        log.warning("%s differs from the baseline in only %d sentence(s): sacrebleu's "
                    "approximate randomization p-value is not meaningful here (use --paired-bs)",
                    record["name"], few)


def _translate(system: System, test: TestSet, n: int, loaded: dict, args: argparse.Namespace,
               refs: list[list[str]]) -> tuple[list[str], dict]:
    from mt.translate import SearchOptions

    if not test.src:
        raise EvalError(f"test set {test.name}: no source file to translate with -m "
                        f"{system.path} (give --src)")
    sources = read_text(test.src)
    if len(sources) != len(refs[0]):
        raise EvalError(f"{test.src} has {len(sources)} lines but {test.refs[0]} has "
                        f"{len(refs[0])}; source and reference must be aligned line by line")
    if n not in loaded:
        from mt.checkpoint import load_model

        start = time.perf_counter()
        try:
            model, tokenizer, ckpt = load_model(system.path, args.device)
        except (FileNotFoundError, ValueError) as err:
            raise EvalError(f"-m {system.path}: {err}") from None
        loaded[n] = (model, tokenizer)
        system.info = {"model": ckpt["path"], "config_hash": config_hash(ckpt["model_config"]),
                       "model_config": ckpt["model_config"],
                       "load_seconds": time.perf_counter() - start}
    model, tokenizer = loaded[n]
    opts = SearchOptions(beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                         max_len_b=args.max_len_b, batch_tokens=args.batch_tokens)
    log.info("translating %s (%d lines) with %s", test.name, len(sources), system.path)
    hyps, speed = translate_test(model, tokenizer, sources, opts)
    speed.update(search=asdict(opts), device=args.device)
    log.info("%s: %.1f s, %.0f tokens/s", system.name, speed["decode_seconds"],
             speed["tokens_per_second"])
    if args.output:
        out = Path(_expand(args.output, test, n))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        speed["hypotheses"] = str(out)
    return hyps, speed


# ----------------------------------------------------------------------------- output


def _cell(s: dict, width: int) -> str:
    text = f"{s['score']:.{width}f}"
    ci = s.get("ci", s.get("bs_ci"))
    if ci is not None:
        text += f" ± {ci:.{width}f}"
    ps = [(k, s[f"p_{k}"]) for k in ("bs", "ar") if s.get(f"p_{k}") is not None]
    if ps:
        text += " (" + ", ".join(f"p{'_' + k if len(ps) > 1 else ''}={p:.4f}" for k, p in ps)
        text += ")" + ("*" if any(p < 0.05 for _, p in ps) else "")
    return text


def table_rows(entry: dict, width: int) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one test set's table (system, each metric, ratio, speed)."""
    systems = entry["systems"]
    speed = any(s["kind"] == "model" for s in systems)
    header = ["system"] + [systems[0]["scores"][m]["name"] for m in systems[0]["scores"]]
    header += ["len ratio"] + (["decode s", "tokens/s"] if speed else [])
    rows = []
    for i, s in enumerate(systems):
        name = f"baseline: {s['name']}" if i == 0 and entry.get("paired") else s["name"]
        row = [name] + [_cell(v, width) for v in s["scores"].values()]
        row.append(f"{s['len_ratio']:.3f}")
        if speed:
            row += ([f"{s['decode_seconds']:.1f}", f"{s['tokens_per_second']:.0f}"]
                    if "decode_seconds" in s else ["", ""])
        rows.append(row)
    return header, rows


def _title(entry: dict) -> str:
    refs = len(entry["references"])
    pair = f"{entry['langpair']}, " if entry["langpair"] else ""
    return (f"{entry['name']} ({pair}{entry['sentences']} sentences, {refs} "
            f"reference{'s' if refs > 1 else ''})")


def _notes(entry: dict) -> list[tuple[str, bool]]:
    """Lines under a table: (text, is_signature). Signatures say how to reproduce each number."""
    names = {m: entry["systems"][0]["scores"][m]["name"] for m in entry["signatures"]}
    notes = [(f"{names[m]}: {sig}", True) for m, sig in entry["signatures"].items()]
    for pt in entry.get("paired", []):
        what = ("paired bootstrap resampling" if pt["type"] == "bs"
                else "paired approximate randomization")
        notes.append((f"{what} ({pt['n']} samples) against the baseline, * = p < 0.05:", False))
        notes += [(f"{names[m]}: {sig}", True) for m, sig in pt["signatures"].items()]
    return notes


def _escape_markdown(text: str) -> str:
    return text.replace("|", r"\|").replace("*", r"\*")


def _escape_latex(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text).replace("±", r"$\pm$")


def _text_row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()


def render(result: dict, fmt: str, width: int = 2) -> str:
    """The results as text, markdown or latex tables (one per test set), or one JSON object."""
    if fmt == "json":
        return json.dumps(result, indent=2, ensure_ascii=False)
    blocks = []
    for entry in result["tests"]:
        header, rows = table_rows(entry, width)
        notes = _notes(entry)
        if fmt == "markdown":
            lines = [f"**{_title(entry)}**", "", "| " + " | ".join(header) + " |",
                     "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|"]
            lines += ["| " + " | ".join(_escape_markdown(c) for c in r) + " |" for r in rows]
            lines += [""] + [f"- `{n}`" if sig else f"\n{_escape_markdown(n)}\n"
                             for n, sig in notes]
        elif fmt == "latex":
            lines = [f"% {_title(entry)}", r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}",
                     r"\toprule", " & ".join(_escape_latex(h) for h in header) + r" \\",
                     r"\midrule"]
            lines += [" & ".join(_escape_latex(c) for c in r) + r" \\" for r in rows]
            lines += [r"\bottomrule", r"\end{tabular}"] + [f"% {n}" for n, _ in notes]
        else:
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            lines = [_title(entry), _text_row(header, widths), "  ".join("-" * w for w in widths)]
            lines += [_text_row(r, widths) for r in rows]
            lines += [f"  {n}" if sig and i > len(entry["signatures"]) else n
                      for i, (n, sig) in enumerate(notes, 1)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ----------------------------------------------------------------------------- command line


class _AddSystem(argparse.Action):
    """-m and --hyp append to one list, so the first system given is the baseline."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        kind = "model" if self.dest == "model" else "hyp"
        systems = list(getattr(namespace, "systems", None) or [])
        systems += [(kind, v) for v in values]
        namespace.systems = systems


def build_parser() -> argparse.ArgumentParser:
    from sacrebleu.metrics import BLEU

    p = argparse.ArgumentParser(
        prog="mt-eval", description="Score and compare MT systems with sacrebleu. The first "
        "system given is the baseline of the paired tests.")
    g = p.add_argument_group("systems (several allowed, in any mix)")
    g.add_argument("-m", "--model", nargs="+", action=_AddSystem, default=None,
                   help="run directory or checkpoint; translates each test set's source")
    g.add_argument("--hyp", nargs="+", action=_AddSystem, default=None,
                   help="hypothesis file (detokenized, one line per sentence); with several "
                   "test sets put {test} in the path")
    g = p.add_argument_group("test sets (several allowed)")
    g.add_argument("--src", help="source file (needed with -m)")
    g.add_argument("--ref", nargs="+", action="extend",
                   help="reference file(s); several = several references per sentence")
    g.add_argument("--name", help="name of the --src/--ref test set in the output")
    g.add_argument("--test", nargs="+", action="extend",
                   help=f"named test set from conf/testsets/ ({', '.join(named_tests())})")
    g.add_argument("--test-set", "-t", nargs="+", action="extend",
                   help="sacrebleu test set(s), e.g. wmt14 (downloaded when online)")
    g.add_argument("--langpair", "-l", help="e.g. en-de: for --test-set, and to pick the "
                   "languages of a --test set")
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics", "-M", nargs="+", choices=METRICS, default=["bleu", "chrf"],
                   metavar="METRIC", help=f"any of {', '.join(METRICS)} (default: bleu chrf)")
    g.add_argument("--tokenize", "-tok", choices=list(BLEU.TOKENIZERS), default=None,
                   metavar="TOK", help="BLEU tokenizer: " + ", ".join(BLEU.TOKENIZERS)
                   + " (default: 13a, or zh / ja-mecab / ko-mecab for those targets)")
    g.add_argument("--lowercase", "-lc", action="store_true", help="case-insensitive BLEU, chrF")
    g.add_argument("--confidence", "-ci", action="store_true",
                   help="bootstrap 95%% confidence interval of each score")
    g.add_argument("--confidence-n", type=int, default=1000, metavar="N",
                   help="bootstrap resamples (default: 1000)")
    g.add_argument("--paired-bs", action="store_true",
                   help="paired bootstrap resampling test of each system against the first")
    g.add_argument("--paired-ar", action="store_true",
                   help="paired approximate randomization test against the first")
    g.add_argument("--paired-bs-n", type=int, default=1000, metavar="N",
                   help="bootstrap resamples (default: 1000)")
    g.add_argument("--paired-ar-n", type=int, default=10000, metavar="N",
                   help="approximate randomization trials (default: 10000)")
    g = p.add_argument_group("translation (with -m)")
    g.add_argument("--beam", type=int, default=5, help="beam size; 1 = greedy (default: 5)")
    g.add_argument("--lenpen", type=float, default=0.6, help="length penalty (default: 0.6)")
    g.add_argument("--max-len-a", type=float, default=1.5)
    g.add_argument("--max-len-b", type=int, default=10)
    g.add_argument("--batch-tokens", type=int, default=4096,
                   help="source tokens per batch, padding included (default: 4096)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    g.add_argument("--output", help="write translations here; {test} and {n} (system number) "
                   "are replaced")
    g = p.add_argument_group("output")
    g.add_argument("--format", "-f", choices=("text", "markdown", "latex", "json"),
                   default="text", help="tables on stdout, or one JSON object (default: text)")
    g.add_argument("--json", action="store_true", help="same as --format json")
    g.add_argument("--json-out", help="write every score, signature and timing to this file")
    g.add_argument("--width", "-w", type=int, default=2, help="decimals in tables")
    g.add_argument("--quiet", "-q", action="store_true", help="warnings and errors only")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)
    args.systems = getattr(args, "systems", None)
    try:
        result = run(args)
    except EvalError as err:
        raise SystemExit(f"mt-eval: {err}") from None
    import sacrebleu

    result = {"sacrebleu_version": sacrebleu.__version__, "argv": sys.argv[1:] if argv is None
              else list(argv), **result}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    print(render(result, "json" if args.json else args.format, args.width))


if __name__ == "__main__":
    main()
