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
This module runs the systems; ``mt.testsets`` finds and reads the test sets, ``mt.report``
computes the scores and paired tests and draws the tables, ``mt.evaluate_checks`` checks the
files to write and the models' language pairs before any work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mt.evaluate_args import build_parser
from mt.evaluate_checks import check_direction, check_outputs, expand, members
from mt.options import (
    flags_mistake,
    min_len_budget_warning,
    min_len_model_warning,
    search_failure_said,
    search_options,
    unused_options,
    weights_mistake,
)
from mt.report import compare, make_metric, render, score_system, sentence_scores
from mt.testsets import (
    EvalError,
    TestSet,
    check_lines,
    collect_tests,
    read_references,
    read_text,
)
from mt.textio import (
    InputError,
    atomic_output,
    reader_left,
    text_list,
    utf8_stdout,
)

log = logging.getLogger("mt.evaluate")


def score(hypotheses: list[str], references: list[str], *, tokenize: str | None = None,
          lowercase: bool = False, trg_lang: str = "") -> dict:
    """Corpus BLEU and chrF of detokenized hypotheses against one reference each.

    Used by ``mt.runlog`` for training's validation and final test; ``mt-eval`` has more
    metrics. ``trg_lang``: the target language, whose BLEU tokenizer sacrebleu picks (zh,
    ja-mecab, ko-mecab; else 13a), as ``mt-eval`` and ``sacrebleu -l`` do. It goes through
    ``score_system``, so a training log's BLEU equals mt-eval's on the
    same files.

    Returns:
        {"bleu": float, "bleu_signature": str, "chrf": float, "chrf_signature": str,
         "sentences": int}
    """
    hypotheses, references = text_list(hypotheses, "hypotheses"), text_list(references,
                                                                            "references")
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    s = score_system(hypotheses, [references], ["bleu", "chrf"], tokenize=tokenize,
                     lowercase=lowercase, trg_lang=trg_lang)
    return {**{k: s[k] for k in ("bleu", "bleu_signature", "chrf", "chrf_signature")},
            "sentences": len(hypotheses)}


@dataclass
class System:
    kind: str  # model | hyp
    path: str
    name: str = ""
    info: dict = field(default_factory=dict)  # model path, config hash, load time


# ----------------------------------------------------------------------------- translation


def config_hash(model_config: dict) -> str:
    """First 12 hex of the sha256 of the model config as sorted JSON: same shape, same hash."""
    blob = json.dumps(model_config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def translate_test(model, tokenizer, sources: list[str], opts, shortlist=None, *,
                   replace_unk: bool = False, layer: int | None = None
                   ) -> tuple[list[str], dict]:
    """Best translations and decoding speed (target tokens of the hypotheses per second);
    ``shortlist``: an mt.shortlist.Shortlist, or None; ``replace_unk`` and ``layer``: as
    ``translate --replace-unk --alignment-layer``."""
    from mt.lines import best_translations

    start = time.perf_counter()
    hyps = best_translations(model, tokenizer, sources, opts, shortlist=shortlist,
                             replace_unk=replace_unk, layer=layer)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in tokenizer.encode_tgt(hyps))
    return hyps, {"decode_seconds": seconds, "hyp_tokens": tokens,
                  "tokens_per_second": tokens / max(seconds, 1e-9),
                  "sentences_per_second": len(hyps) / max(seconds, 1e-9)}


# ----------------------------------------------------------------------------- the run


def _target_lang(test: TestSet) -> str:
    return test.langpair.split("-")[1] if test.langpair else ""


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
    if [s.path for s in systems if s.kind == "hyp"].count("-") + sum(
            [t.src, *t.refs].count("-") for t in tests) > 1:
        raise EvalError("- (stdin) is given more than once among --hyp, --src and --ref; it can "
                        "be read only once: give the others as files")
    seen: dict[str, int] = {}
    for s in systems:  # unique display names, in the order given
        seen[s.path] = seen.get(s.path, 0) + 1
        s.name = s.path if seen[s.path] == 1 else f"{s.path}#{seen[s.path]}"
    check_outputs(args, systems, tests)
    for test in tests:  # a BLEU tokenizer that cannot load fails now, not after translating
        try:
            make_metric("bleu", trg_lang=_target_lang(test), tokenize=args.tokenize,
                        lowercase=args.lowercase)
        except EvalError as err:
            # Picked by the target language and BLEU not asked for: chrF and TER need no
            # tokenizer (`sacrebleu -m chrf -l en-ja` needs no MeCab); only the len ratio goes.
            if "bleu" in args.metrics or args.tokenize:
                raise
            log.warning("%s: %s; the len ratio (in BLEU's tokens) is left out", test.name, err)
    loaded: dict[int, tuple] = {}  # the models, loaded once for every test set
    return {"metrics": list(args.metrics),
            "tests": [_run_test(args, test, systems, loaded) for test in tests]}


def _run_test(args: argparse.Namespace, test: TestSet, systems: list[System],
              loaded: dict[int, tuple]) -> dict:
    """One test set's entry of ``run``'s result: each system's scores, the signatures, and the
    paired tests asked for."""
    metric_args = {"tokenize": args.tokenize, "lowercase": args.lowercase}
    all_refs = read_references(test)
    # Checked for --hyp systems too: a source of another length means that the references are
    # not the test set the user thinks, whatever made the hypotheses.
    sources = read_text(test.src) if test.src else None
    if sources is not None and len(sources) != len(all_refs[0]):
        raise EvalError(f"{test.src} has {len(sources)} lines but {test.refs[0]} has "
                        f"{len(all_refs[0])}; source and reference must be aligned line by line")

    def kept(lines: list[str]) -> list[str]:
        return lines if test.keep is None else [lines[i] for i in test.keep]

    refs = [kept(r) for r in all_refs]
    trg_lang = _target_lang(test)
    entry: dict = {"name": test.name, "langpair": test.langpair, "origin": test.origin,
                   "source": test.src, "references": test.refs, "sentences": len(refs[0]),
                   "systems": []}
    if test.keep is not None:
        entry.update(origlang=args.origlang, subset=args.subset,
                     sentences_in_test_set=len(all_refs[0]))
    named_hyps = []
    for n, system in enumerate(systems, 1):
        record: dict = {"name": system.name, "kind": system.kind}
        if system.kind == "hyp":
            record["hypotheses"] = expand(system.path, test, n)
            hyps = read_text(record["hypotheses"])
            hyp_file = "<stdin>" if record["hypotheses"] == "-" else record["hypotheses"]
        else:  # only the kept lines are translated
            hyps, speed = _translate(system, test, sources and kept(sources), n, loaded, args)
            record.update(system.info, **speed)
            hyp_file = record.get("hypotheses") or f"{system.name} (translations)"
        # a --hyp file holds the whole test set, or only the kept lines (as -m --output writes
        # them under --origlang)
        whole = system.kind == "hyp" and len(hyps) != len(refs[0])
        check_lines(hyps, hyp_file, all_refs if whole else refs, test.refs,
                    warn_tokenized=args.tokenize != "none", from_model=system.kind == "model",
                    refs_said=n > 1)
        hyps = kept(hyps) if whole else hyps
        record.update(score_system(hyps, refs, args.metrics, trg_lang=trg_lang,
                                   confidence_n=args.confidence_n if args.confidence else 0,
                                   **metric_args))
        if args.sentence_scores:
            record["sentence_scores"] = _write_sentence_scores(
                expand(args.sentence_scores, test, n), hyps, refs, args.metrics,
                test.keep, trg_lang=trg_lang, **metric_args)
        entry["systems"].append(record)
        named_hyps.append((system.name, hyps))
    entry["signatures"] = {m: entry["systems"][0]["scores"][m]["signature"]
                           for m in args.metrics}
    asked = [("bs", args.paired_bs_n)] * args.paired_bs
    asked += [("ar", args.paired_ar_n)] * args.paired_ar
    if asked and len(systems) > 1:
        compare(entry, named_hyps, refs, args.metrics, asked, trg_lang=trg_lang, **metric_args)
    elif asked:
        log.warning("a paired test needs two systems or more; only one was given")
    return entry


def _write(flag: str, path: str, lines: Iterable[str]) -> str:
    """Writes lines to ``path`` (its folder made) as translate -o does (``atomic_output``): the
    file appears whole or not at all, and a failed write (a full disk) keeps the one that was
    there. A failure is one line naming ``flag``."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(str(out)) as f:
            f.writelines(lines)
    except BrokenPipeError:  # a pipe or /dev/stdout whose reader left
        raise reader_left() from None
    except InputError as err:
        raise EvalError(f"{flag} {err}") from None
    except OSError as err:
        raise EvalError(f"{flag} {path}: cannot write ({err.strerror or err})") from None
    return str(out)


def _write_sentence_scores(path: str, hyps: list[str], refs: list[list[str]], metrics: list[str],
                           kept: list[int] | None, **metric_args) -> str:
    """JSON lines: the signatures, then a record per sentence (``report.sentence_scores``);
    ``line`` is the sentence's line in the test set (``kept``: the lines --origlang scored)."""
    rows, signatures = sentence_scores(hyps, refs, metrics, **metric_args)
    if kept is not None:
        for row, i in zip(rows, kept, strict=True):
            row["line"] = i + 1
    return _write("--sentence-scores", path,
                  (json.dumps(r, ensure_ascii=False) + "\n" for r in [{"signatures": signatures},
                                                                      *rows]))


def _translate(system: System, test: TestSet, sources: list[str] | None, n: int, loaded: dict,
               args: argparse.Namespace) -> tuple[list[str], dict]:
    from mt.workers import WorkerDied, default_workers

    if sources is None:
        raise EvalError(f"test set {test.name}: no source file to translate with -m "
                        f"{system.path} (give --src)")
    if n not in loaded:
        from mt.inference import load_models

        start = time.perf_counter()
        paths = members(system.path)
        from mt.shortlist import Shortlist

        try:
            model, tokenizer, names = load_models(
                paths, args.device, args.dtype, weights=args.weights if len(paths) > 1 else None)
            shortlist = Shortlist.load(args.shortlist, tokenizer) if args.shortlist else None
        except ValueError as err:
            raise EvalError(f"-m {system.path}: {err}") from None
        from mt.alignment import layer_mistake

        mistake = layer_mistake(model, args.alignment_layer)
        if mistake:
            raise EvalError(f"-m {system.path}: {mistake}")
        from mt.incremental import max_positions

        if warning := min_len_model_warning(args, max_positions(model)):
            log.warning("-m %s: %s", system.path, warning)
        loaded[n] = (model, tokenizer, shortlist)
        configs = [m.cfg for m in getattr(model, "models", [model])]
        system.info = {"model": ",".join(names),
                       "config_hash": ",".join(config_hash(dict(vars(c))) for c in configs),
                       "model_config": dict(vars(configs[0])) if len(configs) == 1
                       else [dict(vars(c)) for c in configs],
                       "load_seconds": time.perf_counter() - start,
                       **({"weights": args.weights} if len(paths) > 1 and args.weights else {}),
                       **({"shortlist": args.shortlist} if args.shortlist else {}),
                       **({"replace_unk": True, "alignment_layer": args.alignment_layer}
                          if args.replace_unk else {})}
    # on every test set: each has its language pair (or none), not only the one loaded for
    check_direction(system.info["model"].split(","), test, args.tokenize)
    model, tokenizer, shortlist = loaded[n]
    opts = search_options(args, args.workers or default_workers(args.device))
    log.info("translating %s (%d lines) with %s", test.name, len(sources), system.path)
    try:
        hyps, speed = translate_test(model, tokenizer, sources, opts, shortlist,
                                     replace_unk=args.replace_unk, layer=args.alignment_layer)
    except (WorkerDied, FloatingPointError, MemoryError, RuntimeError) as err:
        said = search_failure_said(err, args)
        if said is None:
            raise
        raise EvalError(f"-m {system.path}, {test.name}: {said}") from None
    speed.update(search=asdict(opts), device=args.device, dtype=args.dtype)
    log.info("%s: %.1f s, %.0f tokens/s", system.name, speed["decode_seconds"],
             speed["tokens_per_second"])
    if args.output:
        speed["hypotheses"] = _write("--output", expand(args.output, test, n),
                                     (h + "\n" for h in hyps))
    return hyps, speed


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()  # mt.evaluate_args
    args = parser.parse_args(argv)
    # -M bleu bleu: one score per metric (sacrebleu's paired test keys its table by name, and
    # the table and JSON have one column per metric), in the order first given.
    args.metrics = list(dict.fromkeys(args.metrics))
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)
    if args.json and args.format not in ("text", "json"):
        raise SystemExit(f"mt-eval: --json means --format json; it does not combine with "
                         f"--format {args.format}")
    mistake = flags_mistake(args)
    if mistake:
        raise SystemExit(f"mt-eval: {mistake}")
    if args.weights is not None:  # one per member of each ensemble (-m a.pt,b.pt)
        ensembles = [(v, len(members(v))) for kind, v in args.systems
                     if kind == "model" and len(members(v)) > 1]
        if not ensembles:
            raise SystemExit("mt-eval: --weights weighs the members of an ensemble (-m "
                             "a.pt,b.pt), and no -m system here is one")
        for path, n in ensembles:
            mistake = weights_mistake(args.weights, n, f"the {n} members of -m {path}")
            if mistake:
                raise SystemExit(f"mt-eval: {mistake}")
    if any(kind == "model" for kind, _ in args.systems):
        # the warnings translate gives of the same flags (a --min-len no translation can stop
        # before is said again once a model is loaded: _translate)
        for warning in [*unused_options(args, parser), min_len_budget_warning(args)]:
            if warning:
                log.warning(warning)
        from mt.inference import cap_kernel_caches, device_mistake, keep_freed_memory

        mistake = device_mistake(args.device)
        if mistake:
            raise SystemExit(f"mt-eval: {mistake}")
        keep_freed_memory()  # a command that decodes: see the docstrings
        cap_kernel_caches(args.dtype)
    else:  # hypothesis files only: nothing is translated
        for action in parser.translation_actions:
            if getattr(args, action.dest) != action.default:
                log.warning("%s has no effect without -m (nothing is translated)",
                            action.option_strings[0])
    try:
        result = run(args)
    except EvalError as err:
        raise SystemExit(f"mt-eval: {err}") from None
    except KeyboardInterrupt:  # Ctrl-C: the workers have ended (mt.workers); no traceback
        print("\nmt-eval: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    import sacrebleu

    result = {"sacrebleu_version": sacrebleu.__version__, "argv": sys.argv[1:] if argv is None
              else list(argv), **result}
    if args.json_out:
        try:
            _write("--json-out", args.json_out,
                   [json.dumps(result, indent=2, ensure_ascii=False) + "\n"])
        except EvalError as err:
            raise SystemExit(f"mt-eval: {err}") from None
    # UTF-8 whatever the locale, as --json-out: names and paths may hold any character
    try:
        print(render(result, "json" if args.json else args.format, args.width),
              file=utf8_stdout(), flush=True)
    except BrokenPipeError:  # the reader left (`mt-eval ... | head`): no traceback
        raise reader_left() from None
    except OSError as err:  # > /dev/full
        raise reader_left(f"mt-eval: cannot write the results to stdout "
                          f"({err.strerror or err})") from None


if __name__ == "__main__":
    main()
