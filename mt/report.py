"""What ``mt-eval`` reports: sacrebleu scores per system, paired tests, and the tables.

Scores come from sacrebleu's metric classes, each with its signature, so a number can be
reproduced with ``sacrebleu REF -i HYP -m ...``. With several systems the first is the baseline:
sacrebleu's paired bootstrap resampling and approximate randomization tests give a p-value per
system and metric. ``render`` shows one result object as text, markdown or LaTeX tables (one per
test set) or as JSON.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mt.testsets import EvalError, download_timeout, offline_var

# The mt-eval command's logger: its messages keep one name, whichever module says them.
log = logging.getLogger("mt.evaluate")

METRICS = ("bleu", "chrf", "chrf++", "ter")


# ----------------------------------------------------------------------------- scores


def make_metric(name: str, *, tokenize: str | None = None, lowercase: bool = False,
                trg_lang: str = "", references: list[list[str]] | None = None,
                sentence: bool = False):
    """A sacrebleu metric object; ``references`` (one list per reference) are cached in it.
    ``sentence``: for sentence scores (BLEU with effective order, as sacrebleu advises)."""
    from sacrebleu.metrics import CHRF, TER

    if name == "bleu":
        return _bleu(tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                     references=references, effective_order=sentence)
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else 0, lowercase=lowercase,
                    references=references)
    if name == "ter":
        return TER(references=references)
    raise EvalError(f"unknown metric {name!r} (choose from {', '.join(METRICS)})")


# ISO 639-3 codes (OPUS's zho, jpn, kor) of the languages sacrebleu has a BLEU tokenizer for,
# and the ISO 639-5 families whose members all write that way (zhx Chinese, jpx Japanese and the
# Ryukyuan languages). Other groups (mul, roa) get 13a: their members are not known.
_THREE_LETTER = {"zho": "zh", "cmn": "zh", "jpn": "ja", "kor": "ko", "zhx": "zh", "jpx": "ja"}


def bleu_target(lang: str) -> str:
    """The ``trg_lang`` sacrebleu picks BLEU's tokenizer by (it knows ``zh``, ``ja``, ``ko``
    only, exactly): ``zh-CN``, ``zh_Hant``, ``ZH``, ``jpn`` went to 13a, which keeps a Chinese or
    Japanese line (no spaces) as one token, BLEU near 0. Other codes are kept as given.

    A multilingual OPUS-MT model names its side as a list joined by '+' (tokenizer_config.json
    of opus-mt-de-ZH: ``cmn+cn+yue+ze_zh+zh_cn+...+zh``, which mt-import records): the language
    of the tokenizer its members have, where they name one only (else 13a, as for any other
    list); read whole, the list was no code sacrebleu knows, and Chinese went to 13a."""
    from sacrebleu.metrics import BLEU

    def one(code: str) -> str:
        primary = re.split(r"[-_]", code.strip())[0].lower()
        return _THREE_LETTER.get(primary, primary)

    own = {one(code) for code in lang.split("+")} & BLEU._TOKENIZER_MAP.keys()
    if "+" in lang:
        return own.pop() if len(own) == 1 else lang
    return one(lang) if own else lang


def model_bleu(path: str, tgt_lang: str | None = None):
    """sacreBLEU's BLEU for a checkpoint's translations, tokenized for its target language
    (``data.tgt_lang`` of its training config) as mt-train's valid and test BLEU and mt-eval's
    (by the test set's) are: zh, ja-mecab or ko-mecab where sacrebleu has one, else 13a. The
    evaluation scripts scored every language with 13a, which keeps a Chinese or Japanese line
    (no spaces) as one token: BLEU near 0 beside mt-eval's for the same translations.

    Where that tokenizer cannot load (ja-mecab and ko-mecab need sacrebleu's [ja] / [ko]
    extras), one warning and 13a, as mt-train's scores of the same model had on that machine
    (``mt.runlog.bleu_language``): the scripts have no --tokenize to choose another, and the
    error that said to ended them before their first translation. The signature says which.

    ``tgt_lang`` (the scripts' --tgt-lang) replaces the checkpoint's: a model imported without
    one (``mt-import``, where tokenizer_config.json names no ``target_lang``) has none.
    """
    from mt.checkpoint import load

    data = (load(path, mmap=True).get("config") or {}).get("data") or {}
    try:
        return make_metric("bleu", trg_lang=tgt_lang or data.get("tgt_lang") or "")
    except EvalError as err:
        log.warning("BLEU uses the 13a tokenizer: %s",
                    str(err).removesuffix(" (or choose another --tokenize)"))
        return make_metric("bleu")


def _bleu(*, tokenize: str | None, lowercase: bool, trg_lang: str,
          references: list[list[str]] | None, effective_order: bool = False):
    """sacreBLEU's BLEU, with a tokenizer that cannot be loaded said in one line.

    sacreBLEU loads the tokenizer when BLEU is built: the spm/flores ones download a SentencePiece
    model the first time (with no timeout), ja-mecab and ko-mecab need its ``[ja]`` / ``[ko]``
    extras; both ended in a traceback. The download is refused at once in offline mode and runs
    under a socket timeout otherwise, as for ``--test-set``.
    """
    import urllib.error

    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers import tokenizer_spm

    trg_lang = bleu_target(trg_lang)
    tok = tokenize or BLEU._TOKENIZER_MAP.get(trg_lang, BLEU.TOKENIZER_DEFAULT)
    what = f"--tokenize {tok}" if tokenize else f"BLEU's tokenizer for {trg_lang} targets ({tok})"
    cache = Path(tokenizer_spm.SACREBLEU_DIR)
    hint = (f"download it where there is a network (`sacrebleu REF -i HYP -tok {tok}` once) and "
            f"copy {cache}, or choose another --tokenize")
    if tok in tokenizer_spm.SPM_MODELS:
        model = cache / "models" / Path(tokenizer_spm.SPM_MODELS[tok]["url"]).name
        if not model.is_file() and offline_var():
            raise EvalError(f"{what}: its SentencePiece model is not in the sacrebleu cache "
                            f"({model}) and {offline_var()} is set (offline); {hint}")
    try:
        with download_timeout():
            return BLEU(tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                        references=references, effective_order=effective_order)
    except (urllib.error.URLError, TimeoutError, SystemExit) as err:  # SystemExit: its SSL error
        reason = getattr(err, "reason", err)
        raise EvalError(f"{what}: cannot download its SentencePiece model ({reason}); "
                        f"{hint}") from None
    except (ImportError, RuntimeError, AssertionError, OSError) as err:  # e.g. no sacrebleu[ja]
        raise EvalError(f"{what}: {' '.join(str(err).split())} (or choose another "
                        "--tokenize)") from None


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
        ``mt.evaluate.score`` and of mt-train's test.json, for scripts), ``"scores"``: per metric
        the details (BLEU's precisions and lengths, confidence interval, later the p-values),
        ``"len_ratio"`` (None without BLEU among ``metrics`` and its tokenizer not loading).
    """
    scores = {}
    for name in metrics:
        metric = make_metric(name, tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                             references=refs)
        s = metric.corpus_score(hyps, None, n_bootstrap=confidence_n if confidence_n > 1 else 1)
        scores[name] = _score_dict(s, str(metric.get_signature()))
    if "bleu" in scores:
        ratio = scores["bleu"]["ratio"]
    else:  # BLEU's, where its tokenizer loads: -M chrf needs no MeCab for ja (nor sacrebleu)
        try:
            ratio = make_metric("bleu", tokenize=tokenize, lowercase=lowercase,
                                trg_lang=trg_lang).corpus_score(hyps, refs).ratio
        except EvalError:
            ratio = None
    flat = {}
    for name, details in scores.items():
        flat.update({name: details["score"], f"{name}_signature": details["signature"]})
    return {**flat, "scores": scores, "len_ratio": ratio}


def sentence_scores(hyps: list[str], refs: list[list[str]], metrics: list[str], *,
                    tokenize: str | None = None, lowercase: bool = False,
                    trg_lang: str = "") -> tuple[list[dict], dict[str, str]]:
    """Every metric's score of each sentence alone, for error analysis: which lines a system
    gets wrong, where two systems differ. Corpus BLEU is not their mean.

    Returns:
        one record per line (``line`` from 1, a score per metric, ``hyp``, ``refs``) and each
        metric's signature (BLEU's says ``eff:yes``: n-gram orders a short sentence lacks are
        left out instead of zeroing its score).
    """
    scorers = {name: make_metric(name, tokenize=tokenize, lowercase=lowercase, trg_lang=trg_lang,
                                 sentence=True) for name in metrics}
    rows = []
    for i, hyp in enumerate(hyps):
        these = [r[i] for r in refs]
        rows.append({"line": i + 1, **{name: float(m.sentence_score(hyp, these).score)
                                       for name, m in scorers.items()},
                     "hyp": hyp, "refs": these})
    return rows, {name: str(m.get_signature()) for name, m in scorers.items()}


# ----------------------------------------------------------------------------- significance


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
                # observed one, so a copy of the baseline, or a system of the very same score
                # (two early checkpoints at BLEU 0: observed 0, every resample 0), would get the
                # smallest p-value possible; no difference at all is never significant.
                same = (record.get("identical_to_baseline")
                        or (i > 0 and r["score"] == pt["results"][m][0]["score"]))
                s[f"p_{kind}"] = 1.0 if same else r["p_value"]
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


# ----------------------------------------------------------------------------- tables


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
        row.append("-" if s["len_ratio"] is None else f"{s['len_ratio']:.3f}")
        if speed:
            row += ([f"{s['decode_seconds']:.1f}", f"{s['tokens_per_second']:.0f}"]
                    if "decode_seconds" in s else ["", ""])
        rows.append(row)
    return header, rows


def _title(entry: dict) -> str:
    refs = len(entry["references"])
    pair = f"{entry['langpair']}, " if entry["langpair"] else ""
    picked = ", ".join(f"{k} {entry[k]}" for k in ("origlang", "subset") if entry.get(k))
    count = (f"{picked}: {entry['sentences']} of {entry['sentences_in_test_set']} sentences"
             if "sentences_in_test_set" in entry else f"{entry['sentences']} sentences")
    return f"{entry['name']} ({pair}{count}, {refs} reference{'s' if refs > 1 else ''})"


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


_LATEX = {"\\": r"\textbackslash{}", "^": r"\textasciicircum{}", "~": r"\textasciitilde{}",
          "±": r"$\pm$", **{c: "\\" + c for c in "&%$#_{}"}}


def _escape_latex(text: str) -> str:
    """Text as LaTeX typesets it (a file name holds '_', '~' or '\\', a system name anything)."""
    return "".join(_LATEX.get(c, c) for c in text)


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
            lines = [f"**{_escape_markdown(_title(entry))}**", "", "| " + " | ".join(header) + " |",
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
