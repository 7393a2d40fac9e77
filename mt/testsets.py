"""Where ``mt-eval``'s text comes from: test sets resolved to files, files read as sacrebleu reads.

A test set is a pair of local files (``--src`` / ``--ref``, several ``--ref`` for several
references per sentence), a named set from ``conf/testsets/NAME.yaml`` (``--test``), or a
sacrebleu test set (``--test-set wmt14 --langpair en-de``), taken from sacrebleu's cache and
downloaded only when online. The checks here stop the silent mistakes (misaligned or empty files)
and warn on tokenized text before anything is scored.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import re
import socket
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mt.config import conf_dir
from mt.textio import carriage_returns_only, first_line, utf8_text

# The mt-eval command's logger: its messages keep one name, whichever module says them.
log = logging.getLogger("mt.evaluate")

REPO_ROOT = Path(__file__).resolve().parent.parent  # relative paths in conf/testsets/ start here
TESTSETS_DIR = conf_dir() / "testsets"
OFFLINE_VARS = ("MT_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
DOWNLOAD_TIMEOUT_S = 20.0
# Marks of tokenized text: a space before a comma or a final period, split clitics, BPE joiners,
# Moses XML escapes. French puts a space before ; : ! ? so those are not on the list.
_TOKENIZED = re.compile(r" [,.](?= |$)| 's\b| n't\b|@@( |$)|&apos;|&quot;|&amp;|&lt;|&gt;")


@contextmanager
def download_timeout() -> Iterator[None]:
    """Downloads inside give up after ``DOWNLOAD_TIMEOUT_S`` without data (sacrebleu's ``urlopen``
    has no timeout); the process's default socket timeout comes back after."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        yield
    finally:
        socket.setdefaulttimeout(old)


class EvalError(Exception):
    """A mistake in the inputs; the message names the file, the test set or the option."""


@dataclass
class TestSet:
    """Where a test set's files are; ``refs`` has one file per reference translation."""

    name: str
    refs: list[str]
    src: str | None = None
    langpair: str | None = None
    origin: str = "files"  # files | conf/testsets/NAME.yaml | sacrebleu
    # --origlang / --subset: the (0-based) lines scored, chosen by the documents' metadata
    keep: list[int] | None = None


def read_text(path: str | os.PathLike) -> list[str]:
    """A file's lines as the sacrebleu CLI reads them (UTF-8, trailing whitespace stripped), but
    for a byte-order mark at the start of a line (the file's, or one ``cat`` left in mid-file):
    not text, so not part of the line, as ``mt-train`` and ``translate`` read it (sacrebleu keeps
    it, which moved the test chrF of a run whose reference file had one in its 4th decimal
    against the run's own ``test.json``)."""
    p = Path(path)
    try:
        if str(path) == "-":  # `translate ... | mt-eval --hyp - --ref REF`, as sacrebleu reads it
            if sys.stdin is None:
                raise EvalError("-: stdin is closed; give a file")
            data, p = sys.stdin.buffer.read(), Path("<stdin>")
        else:
            data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    except FileNotFoundError:
        raise EvalError(f"{p}: no such file") from None
    except (OSError, EOFError, zlib.error) as err:  # a broken .gz
        raise EvalError(f"{p}: cannot read ({err})") from None
    if (mistake := carriage_returns_only(data, 1)) is not None:  # no line feed in the file
        raise EvalError(f"{p}:1: {mistake}")
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line
    out = []
    for lineno, raw in enumerate(lines, start=1):
        try:
            out.append(utf8_text(raw).rstrip())
        except ValueError as err:
            raise EvalError(f"{p}:{lineno}: {err}") from None
    return out


def read_pair(src: str | os.PathLike, ref: str | os.PathLike) -> tuple[list[str], list[str]]:
    """A source file and its reference (``read_text``), checked to have as many lines, and some:
    what the evaluation scripts score."""
    sources, refs = read_text(src), read_text(ref)
    if len(sources) != len(refs):
        raise EvalError(f"{src} has {len(sources)} lines but {ref} has {len(refs)}")
    if not sources:
        raise EvalError(f"{src}: no lines to translate")
    return sources, refs


def model_and_pair(parser, model: str, src: str, ref: str, tgt_lang: str | None = None
                   ) -> tuple:
    """(model, tokenizer, sources, references, BLEU) for an evaluation script: the files read
    and checked first (``read_pair``), then the model loaded in float32 on the CPU, and the BLEU
    for its target language (``mt.report.model_bleu``; ``tgt_lang``, the script's --tgt-lang,
    replaces the model's); a mistake in any ends the script (``parser``'s) with one line naming
    the file."""
    from mt.inference import load_models
    from mt.report import model_bleu

    try:
        sources, refs = read_pair(src, ref)
        loaded, tokenizer, names = load_models([model], "cpu", "float32")
        bleu = model_bleu(names[0], tgt_lang)
    except (EvalError, ValueError) as err:
        parser.exit(1, f"{parser.prog}: {err}\n")
    return loaded, tokenizer, sources, refs, bleu


def read_references(test: TestSet) -> list[list[str]]:
    """Every reference file's lines (one list per reference), checked to have equal lengths and
    some: an empty test set has no score (sacrebleu's corpus_score fails on no sentences, after a
    model has translated nothing)."""
    refs = [read_text(r) for r in test.refs]
    if not refs[0]:
        raise EvalError(f"{test.refs[0]}: no lines; a test set needs one reference line per "
                        "sentence")
    for r, name in zip(refs[1:], test.refs[1:], strict=True):
        if len(r) != len(refs[0]):
            raise EvalError(f"{name} has {len(r)} lines but {test.refs[0]} has "
                            f"{len(refs[0])}; every reference must have one line per sentence")
    return refs


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
        raise EvalError(f"{file}: not valid YAML ({first_line(err)}; quote values "
                        "that start with {)") from None
    if not isinstance(spec, dict):
        raise EvalError(f"{file}: not a mapping of keys (src, ref, langpair, languages)")
    for key in ("src", "ref"):
        if key not in spec:
            raise EvalError(f"{file}: missing key {key!r}")
    # Checked here: a null, a number or an empty list went on as a path and was a traceback.
    refs = spec["ref"] if isinstance(spec["ref"], list) else [spec["ref"]]
    for key, values in (("src", [spec["src"]]), ("ref", refs)):
        if not values or not all(isinstance(v, str) and v for v in values):
            raise EvalError(f"{file}: {key}: {spec[key]!r} is not a path"
                            + (" or a list of paths" if key == "ref" else ""))
    pair = langpair or spec.get("langpair")
    if not pair:
        raise EvalError(f"{file}: no 'langpair' in it; pass --langpair")
    if not isinstance(pair, str):
        raise EvalError(f"{file}: langpair: {pair!r} is not of the form en-de")
    src_lang, tgt_lang = _split_pair(pair, str(file))
    languages = spec.get("languages")
    if languages is not None and not (isinstance(languages, list)
                                      and all(isinstance(x, str) for x in languages)):
        # a string was read as its letters ("no language 'de' (it has e, n)"), and YAML reads
        # Norwegian's no as false
        raise EvalError(f"{file}: languages: {languages!r} is not a list of language codes "
                        "(write [en, de], and quote one that YAML reads otherwise: 'no')")
    for lang in (src_lang, tgt_lang):
        if languages and lang not in languages:
            raise EvalError(f"{file}: no language {lang!r} (it has {', '.join(languages)})")

    def path(template: str) -> str:
        try:
            p = Path(template.format(src=src_lang, tgt=tgt_lang))
        except (KeyError, IndexError, ValueError) as err:  # {target}, {0}, a lone brace
            raise EvalError(f"{file}: {template!r}: the placeholders are {{src}} and {{tgt}} "
                            f"({type(err).__name__}: {err})") from None
        return str(p if p.is_absolute() else (REPO_ROOT / p).resolve())

    return TestSet(name, [path(r) for r in refs], path(spec["src"]), pair,
                   f"conf/testsets/{file.name}")


def offline_var() -> str | None:
    """The offline variable that is set (``HF_HUB_OFFLINE``, ``MT_OFFLINE``, ...), or None."""
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


def load_sacrebleu_test(name: str, langpair: str | None, origlang: str | None = None,
                        subset: str | None = None) -> TestSet:
    """A sacrebleu test set: from its cache ($SACREBLEU, default ~/.sacrebleu), else downloaded;
    with ``origlang`` or ``subset``, only the lines of the documents they pick are scored.

    sacrebleu downloads with ``urlopen`` and no timeout, so an unreachable host could hang. Here
    the download is refused at once in offline mode (``HF_HUB_OFFLINE=1``, ``MT_OFFLINE=1``, ...)
    and otherwise runs under a socket timeout; any failure is one line, not a traceback.
    """
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
    if not cached and offline_var():
        raise EvalError(f"--test-set {name}: not in the sacrebleu cache {SACREBLEU_DIR} and "
                        f"{offline_var()} is set (offline); {hint}")
    try:
        with download_timeout():
            if not cached:
                log.info("downloading sacrebleu test set %s to %s", name, SACREBLEU_DIR)
            src = dataset.get_source_file(langpair)
            refs = dataset.get_reference_files(langpair)
    except (urllib.error.URLError, OSError, SystemExit) as err:
        reason = getattr(err, "reason", err)
        raise EvalError(f"--test-set {name}: cannot download it ({reason}); {hint}") from None
    test = TestSet(name, list(refs), src, langpair, "sacrebleu")
    if origlang or subset:
        test.keep = _documents(test, origlang, subset)
    return test


def _documents(test: TestSet, origlang: str | None, subset: str | None) -> list[int]:
    """The lines that sacrebleu's ``--origlang`` / ``--subset`` keep, through its own function
    (which reads the documents' metadata from the raw SGML or XML file), so that a score on a
    subset is the sacrebleu command line's."""
    from sacrebleu.utils import filter_subset

    what = " ".join(f"--{k} {v}" for k, v in (("origlang", origlang), ("subset", subset)) if v)
    lines = list(range(len(read_text(test.src))))
    try:
        (kept,) = filter_subset([lines], test.name, test.langpair, origlang, subset)
    except FileNotFoundError as err:  # the cache holds the text files but not the raw ones
        raise EvalError(f"--test-set {test.name}: {what} reads the documents' metadata from "
                        f"{err.filename}, which is not in the sacrebleu cache (`sacrebleu -t "
                        f"{test.name} -l {test.langpair} --echo src` puts it there)") from None
    except Exception as err:  # sacrebleu's own: no annotation for this test set, a raw .txt
        raise EvalError(f"--test-set {test.name}: {what}: {err}") from None
    if not kept:
        raise EvalError(f"--test-set {test.name}: {what} keeps no sentence of its "
                        f"{len(lines)}")
    return kept


def _files_there(test: TestSet) -> TestSet:
    """``test`` (a ``--test`` set), once its files are found; a missing one names the YAML file
    that gave the path, and where its relative paths start (the repository root, not the working
    directory as for ``mt-train``'s ``data.dir``): the path alone left the user to guess both."""
    for key, path in [("src", test.src)] + [("ref", r) for r in test.refs]:
        if path and not Path(path).is_file():
            raise EvalError(f"{test.origin}: {key} {path}: no such file (relative paths there "
                            f"start at {REPO_ROOT})")
    return test


def collect_tests(args: argparse.Namespace) -> list[TestSet]:
    """Every test set the options name: --src/--ref, then each --test, then each --test-set."""
    tests = []
    if args.langpair:
        _split_pair(args.langpair, "--langpair")
    if args.ref:
        name = args.name or args.ref[0]
        tests.append(TestSet(name, list(args.ref), args.src, args.langpair))
    elif args.src:
        raise EvalError("--src needs --ref (the reference translations)")
    for name in args.test or []:
        tests.append(_files_there(load_named_test(name, args.langpair)))
    if (args.origlang or args.subset) and (tests or not args.test_set):
        raise EvalError("--origlang and --subset pick documents of sacrebleu test sets "
                        "(--test-set) by their metadata; --ref and --test sets have none")
    for names in args.test_set or []:
        for name in names.split(","):
            tests.append(load_sacrebleu_test(name, args.langpair, args.origlang, args.subset))
    if not tests:
        raise EvalError("no test set: give --ref FILE (and --src for -m), --test NAME or "
                        "--test-set NAME --langpair L1-L2")
    return tests


def looks_tokenized(lines: list[str]) -> tuple[int, int | None]:
    """How many lines carry marks of tokenization, and the first such line number (1-based)."""
    hits = [i for i, line in enumerate(lines, start=1) if _TOKENIZED.search(line)]
    return len(hits), (hits[0] if hits else None)


def check_lines(hyps: list[str], hyp_name: str, refs: list[list[str]], ref_names: list[str],
                warn_tokenized: bool = True, from_model: bool = False,
                refs_said: bool = False) -> None:
    """Stops the silent mistakes: misaligned or empty files; warns on tokenized text.

    A model that translates everything to empty lines is worth a score (0) and a warning, and
    so is a file of its translations, a line per reference (an early validation's
    ``step_N.hyp``, scored beside later ones: sacrebleu scores it 0 too, where this refused the
    whole command); an empty hypothesis file is a mistake (a wrong path, a crashed run) and an
    error. ``refs_said``: the references were looked at for an earlier system of the same test
    set (their warning came once per system).
    """
    if not any(h.strip() for h in hyps) and (from_model or len(hyps) == len(refs[0])):
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
    refs_to_check = [] if refs_said else list(zip(refs, ref_names, strict=True))
    for lines, name in [(hyps, hyp_name), *refs_to_check]:
        count, first = looks_tokenized(lines)
        if count >= max(2, 0.1 * len(lines)):
            log.warning("%s looks tokenized: %d of %d lines have ' ,', ' .', \" 's\", '@@ ' "
                        "or &apos;-style escapes (e.g. line %d: %r). sacreBLEU expects detokenized "
                        "text: detokenize it, or pass --tokenize none if both sides are tokenized "
                        "alike (then the score is not comparable to published ones)",
                        name, count, len(lines), first, lines[first - 1][:80])
