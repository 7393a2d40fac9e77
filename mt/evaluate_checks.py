"""``mt-eval``'s checks before any work: the files it writes against those it reads, and a
model's language pair against the test set's (mt.evaluate runs the systems; this keeps the
checks, which a reader of the run need not hold, apart)."""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mt.report import bleu_target, make_metric
from mt.testsets import EvalError, TestSet
from mt.textio import STDOUT_NAMES, nearest_existing

if TYPE_CHECKING:
    from mt.evaluate import System

log = logging.getLogger("mt.evaluate")


def expand(pattern: str, test: TestSet, n: int) -> str:
    """An --output, --sentence-scores or --hyp path with the test set's name for {test} and
    the system's number for {n}."""
    return pattern.replace("{test}", test.name.replace("/", "_")).replace("{n}", str(n))


def members(path: str) -> list[str]:
    """The checkpoints of one -m system: a,b,c is one system, the ensemble of the three."""
    return [p for p in path.split(",") if p]


def check_outputs(args: argparse.Namespace, systems: list[System], tests: list[TestSet]) -> None:
    """Before any work: every file mt-eval will write is one file of its own, can be written,
    and is none of the files it reads (a --sentence-scores equal to --ref would overwrite the
    references)."""
    writes = [("--output", expand(args.output, t, i)) for i, s in enumerate(systems, 1)
              if args.output and s.kind == "model" for t in tests]
    if args.sentence_scores == "-":
        raise EvalError("--sentence-scores -: it writes a file per system and test set; give a "
                        "path (with {test} and {n} where there are several)")
    writes += [("--sentence-scores", expand(args.sentence_scores, t, i))
               for i in range(1, len(systems) + 1) if args.sentence_scores for t in tests]
    writes += [("--json-out", args.json_out)] if args.json_out else []
    reads = [("--hyp", expand(s.path, t, i)) for i, s in enumerate(systems, 1)
             if s.kind == "hyp" for t in tests]
    reads += [(flag, f) for t in tests for flag, f in [("--src", t.src)] + [("--ref", r)
                                                                          for r in t.refs] if f]
    if any(s.kind == "model" for s in systems):  # (torch only where a model is loaded anyway)
        from mt.checkpoint import resolved

        reads += [("-m", str(file)) for s in systems if s.kind == "model"
                  for m in members(s.path) if (file := resolved(m))]
    reads += [("--shortlist", args.shortlist)] if args.shortlist else []
    seen: dict[str, str] = {}
    for flag, path in writes:
        if flag != "--output" and path in STDOUT_NAMES:  # where the table goes: two documents
            raise EvalError(f"{flag} {path}: stdout carries the results; give a file"
                            + (" (--json prints the JSON there)" if flag == "--json-out" else ""))
        key = os.path.realpath(path)
        if key in seen:
            pattern, what = ((args.output, "translations") if flag == "--output" else
                             (args.sentence_scores, "systems' or test sets' scores"))
            raise EvalError(f"{flag} {pattern}: several {what} would go to one file; put "
                            "{test} and/or {n} (the system's number) in it"
                            if seen[key] == flag else f"{flag} {path} is also the {seen[key]} file")
        seen[key] = flag
        out = Path(path)
        if out.is_dir():
            raise EvalError(f"{flag} {path}: is a directory")
        for what, read in reads:
            if out.exists() and os.path.exists(read) and os.path.samefile(out, read):
                raise EvalError(f"{flag} {path} is the {what} file; writing would overwrite it")
        place = nearest_existing(out.parent.resolve())  # made when written
        if not os.access(out if out.exists() else place, os.W_OK):
            raise EvalError(f"{flag} {path}: cannot write there (permission denied)")


def check_direction(paths: list[str], test: TestSet, tokenize: str | None) -> None:
    """Warns when a model was trained for another language pair than the test set's: a
    de-en test scored with an en-de model gives BLEU near 0 and no other sign of the mix-up;
    and when a test set without a langpair leaves a Chinese, Japanese or Korean target's BLEU
    to 13a, where mt-train's test.json used that language's tokenizer (BLEU near 0 beside it)."""
    from mt.checkpoint import load

    for path in paths:
        data = (load(path, mmap=True).get("config") or {}).get("data") or {}
        # an imported model may know its target language only (mt-import --tgt-lang)
        pair, tgt = f"{data.get('src_lang') or 'SRC'}-{data.get('tgt_lang')}", data.get("tgt_lang")
        if not test.langpair and not tokenize and tgt and bleu_target(tgt) in ("zh", "ja", "ko"):
            try:  # where MeCab is missing, mt-train took 13a too
                make_metric("bleu", trg_lang=tgt)
            except EvalError:
                continue
            log.warning("%s was trained for %s targets, but test set %s has no language pair, so "
                        "BLEU tokenizes with 13a, not as for %s (as mt-train's test score did): "
                        "pass --langpair %s", path, tgt, test.name, tgt, pair)
        elif test.langpair and "src_lang" in data and tgt and not _covers(data["src_lang"], tgt,
                                                                      test.langpair):
            log.warning("%s was trained for %s, test set %s is %s: check the direction "
                        "(--langpair)", path, pair, test.name, test.langpair)


# ISO 639-5 language families and groups (roa Romance, gem Germanic, zle East Slavic, ...: the
# Tatoeba-Challenge OPUS-MT models name a side so), and ISO 639-2's mul (multiple languages) and
# und (undetermined).
GROUP_CODES = frozenset("""
    aav afa alg alv apa aqa aql art ath auf aus awd azc bad bai bat ber bih bnt btk cai cau cba
    ccn ccs cdc cdd cel cmc cpe cpf cpp crp csu cus day dmn dra egx esx euq fiu fox gem gme gmq
    gmw grk hmx hok hyx iir ijo inc ine ira iro itc jpx kar kdo khi kro map mkh mno mun myn nah
    nai ngf nic nub omq omv oto paa phi plf poz pqe pqw pra qwe roa sai sal sdv sem sgn sio sit
    sla smi son sqj ssa syd tai tbq trk tup tut tuw urj wak wen xgn xnd ypk zhx zle zls zlw znd
    mul und""".split())


def is_group(code: str) -> bool:
    """Whether a model's side names a group of languages whose members mt does not know: an
    ISO 639-5 code (``roa``, ``gem``), ``mul``, or an OPUS-MT group name in capitals whose
    first word has four letters or more (``ROMANCE``, ``SCANDINAVIA``, ``NORTH_EU``). ``ZH`` is
    Chinese, and a locale in capitals (``ZH_CN``, ``PT_BR``, ``SR_CYRL``) is one language: read
    as a group, a model for it was never checked against a test set's langpair."""
    return code.lower() in GROUP_CODES or re.fullmatch(r"[A-Z]{4,}(_[A-Z]+)*", code) is not None


def _covers(src: str | None, tgt: str, langpair: str) -> bool:
    """Whether a model trained for ``src``-``tgt`` (its data config's) translates the test
    set's ``langpair``: a side may list languages joined by '+', as a multilingual OPUS-MT
    model's tokenizer_config.json does (``fr+fr_BE+...+es+...+it``, which mt-import records),
    and each of them is that side's; 'trained for en-fr+fr_BE+..., test set is en-fr: check
    the direction' was said of the right model. A side that names a group (``is_group``: roa,
    mul, ROMANCE) cannot be checked, since its members are not known, so it covers any
    language; the other side is still checked. Languages are compared by their language
    subtag (``language``): a model for zh-Hant (mt-import --tgt-lang zh-Hant) scored on an
    en-zh test set was told to check the direction."""
    test = langpair.split("-")
    if len(test) != 2:  # not a plain pair: the same words, or no match
        return f"{src}-{tgt}" == langpair
    return all(t == m or any(c == t or is_group(c) or language(c) == language(t)
                             for c in str(m).split("+"))
               for m, t in zip((src, tgt), test, strict=True))


def language(code: str) -> str:
    """A language code's language subtag, in lower case: ``zh-Hant``, ``zh_CN`` and ``ZH`` are
    ``zh``, ``sr_Cyrl`` is ``sr`` (BCP-47 tags and POSIX locales put a script or region after a
    '-' or '_'; the direction check asks which language, not which script or country)."""
    return re.split(r"[-_]", code, maxsplit=1)[0].lower()
