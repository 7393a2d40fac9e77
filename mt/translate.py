"""``translate``: text in, translations out, exactly one output line per input line.

Input is read a chunk of lines at a time (``--chunk-lines``); a chunk's lines are translated by
``mt.lines`` (encoded, sorted by length, cut into batches by a token budget, searched, put back in
input order) and written before the next chunk is read, so memory is bounded whatever the input's
size. Empty lines (also those of only whitespace, a byte-order mark or other characters the
tokenizer drops) give empty lines without touching the model. A line longer than the model's
maximum is translated in pieces, cut between sentences where it can, that are joined (one
warning), never dropped. ``-o FILE`` appears only once whole. stdout carries translations only;
logs, the progress bar and the interactive prompt go to stderr. See docs/decoding.md for every
option and output format.

``SearchOptions``, ``translate_lines``, ``translate_ids``, ``search_lines`` and ``score_lines``
are importable from here as well as from ``mt.options`` and ``mt.lines``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import sys
import time

import torch

from mt import add_version_flag
from mt import translate_checks as checks
from mt.alignment import align_lines, layer_mistake, word_scores
from mt.config import positive_int
from mt.constraints import encode_phrases, split_phrases
from mt.incremental import max_positions
from mt.inference import (
    cap_kernel_caches,
    keep_freed_memory,
    load_models,
)
from mt.interrupts import HANGUP, terminate_as_interrupt
from mt.lines import (
    IN_PIECES,
    NOT_SCORED,
    UNMET,
    UNUSED_PREFIX,
    encode_prefixes,
    nbest_texts,
    score_lines,
    search_lines,
    translate_ids,
    translate_lines,
    unmet,
)
from mt.options import (
    SearchOptions,
    add_device_arguments,
    add_search_arguments,
    add_worker_arguments,
    min_len_model_warning,
    search_failure_said,
    search_options,
)
from mt.results import LineResult
from mt.shortlist import Shortlist
from mt.textio import (
    STDOUT_NAMES,
    InputError,
    atomic_output,
    check_output,
    chunks,
    decode_line,
    fill_closed_descriptors,
    is_regular,
    is_stdin,
    parallel_lines,
    read_lines,
    reader_left,
    utf8_stdout,
)
from mt.workers import WorkerDied, default_workers

__all__ = ["SearchOptions", "main", "score_lines", "search_lines", "translate_ids",
           "translate_lines", "cli"]

log = logging.getLogger("mt.translate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="translate",
        description="Translate text with an mt model: one output line per input line. "
                    "See docs/decoding.md.",
    )
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True, action="extend", nargs="+",
                   help="a checkpoint file, or a run directory (its checkpoints/best.pt, else "
                        "last.pt; give RUN/checkpoints/averaged.pt for the averaged model); "
                        "several make an ensemble (they must share the tokenizer)")
    p.add_argument("--weights", type=float, nargs="+", default=None, metavar="W",
                   help="an ensemble's weight per -m model, in their order (scaled to sum to 1; "
                        "default: equal)")
    p.add_argument("-i", "--input", default=None,
                   help="input file (default: stdin; an interactive prompt on a terminal)")
    p.add_argument("-o", "--output", default=None,
                   help="output file, written whole or not at all (default, or '-': stdout)")
    add_search_arguments(p)
    p.add_argument("--prefix-file", default=None,
                   help="target prefixes, one line per input line (empty: none), forced at the "
                        "start of each translation")
    p.add_argument("--constraints-file", default=None, metavar="FILE",
                   help="target phrases each translation must contain, one line per input line, "
                        "phrases separated by tabs (empty: none); beam search, best with --beam "
                        "above the phrases' total pieces")
    p.add_argument("--shortlist", metavar="FILE", default=None,
                   help="a vocabulary shortlist made by mt-shortlist for this model: each line "
                        "may use only its shortlist's target pieces (faster on CPU; scores are "
                        "normalised over those pieces)")
    p.add_argument("--score", metavar="FILE", default=None,
                   help="score the translations in FILE (one per input line) instead of "
                        "searching: each output line is the score --nbest would give that "
                        "translation (its log-probability, EOS included, over the length penalty "
                        "at --lenpen; --lenpen 0: the log-probability itself), or 'nan' where a "
                        "side is longer than the model's maximum")
    p.add_argument("--alignment", action="store_true",
                   help="append ' ||| ' and Pharaoh word alignments 'i-j' to every output line")
    p.add_argument("--word-scores", action="store_true",
                   help="append ' ||| ' and each word's log-probability (the sum of its pieces'), "
                        "EOS's last, to every output line (after --alignment's links)")
    p.add_argument("--alignment-layer", type=int, default=None,
                   help="decoder layer for --alignment and --replace-unk (Python index; default: "
                        "penultimate)")
    p.add_argument("--replace-unk", action="store_true",
                   help="replace each <unk> of a translation (printed ' ⁇ ') by the source piece "
                        "it attends to most, as the input spells it (before normalization): "
                        "copies names and symbols the target vocabulary lacks")
    p.add_argument("--chunk-lines", type=positive_int, default=100_000,
                   help="lines read, sorted by length, translated and written at a time: bounds "
                        "the memory of a large file and streams a pipe (default: 100000)")
    add_worker_arguments(p)
    add_device_arguments(p)
    p.add_argument("--no-pack", action="store_true",
                   help="keep linear layers as they are on CPU (default: pre-packed for oneDNN, "
                        "faster)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 input: stop with the line number, or replace it "
                        "(default: strict)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or info logs")
    return p


def _fields(model, tokenizer, results: list[LineResult],
            args: argparse.Namespace) -> list[list[list[str]]]:
    """Per line, per n-best entry, what follows the translation after ' ||| ': the alignment
    (``--alignment``), then the word scores (``--word-scores``)."""
    parts = []
    if args.alignment:
        parts.append(align_lines(model, tokenizer, results, args.alignment_layer, args.batch_tokens,
                                 args.replace_unk))
    if args.word_scores:
        parts.append(word_scores(tokenizer, results, args.replace_unk))
    if not parts:
        return [[] for _ in results]
    return [[[part[li][e] for part in parts] for e in range(len(parts[0][li]))]
            for li in range(len(results))]


def _texts(model, tokenizer, results: list[LineResult],
           args: argparse.Namespace) -> list[list[tuple[str, float]]]:
    """Per line, its n-best (text, score), as --replace-unk asks."""
    return nbest_texts(model, tokenizer, results, args.replace_unk, args.alignment_layer,
                       args.batch_tokens)


def _format(i: int, nbest: list[tuple[str, float]], fields: list[list[str]],
            n: int) -> list[str]:
    """Output lines of one input line: the translation, or with n > 1 its n-best entries."""
    out = []
    for e, (text, score) in enumerate(nbest):
        line = text if n == 1 else f"{i}\t{text}\t{score:.4f}"
        out.append(" ||| ".join([line, *fields[e]]) if fields else line)
    return out


def _format_score(result: LineResult, fields: list[list[str]]) -> str:
    """The output line of one scored pair (``--score``)."""
    # no hypothesis: an empty line, scored as translate gives it (0), or a pair too long ("nan")
    line = (f"{result.hyps[0][0].score:.4f}" if result.hyps
            else "nan" if result.sources else f"{0.0:.4f}")
    return " ||| ".join([line, *fields[0]]) if fields else line


def _interactive(model, tokenizer, opts: SearchOptions, args: argparse.Namespace,
                 shortlist: Shortlist | None = None) -> None:
    """A prompt on stderr; each line typed is translated and printed (flushed) at once.

    Lines are read as bytes and decoded as a file's are (``--errors``). Under ``strict`` a line
    that is not UTF-8 gets the one-line error and the prompt goes on, as a shell's does after a
    mistyped command: a session is not lost to one bad paste. The n-best index counts the lines
    typed from 0, a refused one included, so that it matches the line number of an error.
    """
    out = utf8_stdout()
    # One random stream for the session, as for a file: a fresh one per line would sample the
    # same translations each time a sentence is typed again.
    generator = (torch.Generator(device=args.device).manual_seed(args.seed) if args.sampling
                 else None)
    print("translate: type a sentence and press Enter; Ctrl-D ends", file=sys.stderr)
    for lineno in itertools.count(1):
        print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            print(file=sys.stderr)
            return
        try:
            line = decode_line(raw, "<stdin>", lineno, args.errors)
        except InputError as err:
            print(f"translate: {err}", file=sys.stderr)
            continue
        try:
            results = search_lines(model, tokenizer, [line], opts, shortlist=shortlist,
                                   generator=generator)
        except (FloatingPointError, MemoryError, RuntimeError) as err:
            # NaN scores (search.NOT_A_NUMBER), out of memory (a long paste, a large --beam), a
            # worker killed: this line only, said as a file's run says it; a bug still raises
            said = search_failure_said(err, args)
            if said is None:
                raise
            print(f"translate: {said}", file=sys.stderr)
            continue
        fields = _fields(model, tokenizer, results, args)
        for text in _format(lineno - 1, _texts(model, tokenizer, results, args)[0], fields[0],
                            args.nbest):
            print(text, file=out, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    fill_closed_descriptors()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if sys.stdin is None and is_stdin(args.input):
        raise SystemExit("translate: stdin is closed; give the input with -i FILE")
    if sys.stdout is None and args.output in (None, *STDOUT_NAMES):
        raise SystemExit("translate: stdout is closed; give the output file with -o FILE")
    keep_freed_memory()
    cap_kernel_caches(args.dtype)
    checks.check_flags(args, parser)
    if args.output in STDOUT_NAMES:
        args.output = None
    try:
        check_output(args.output)  # fail before the work, not after it
    except InputError as err:
        raise SystemExit(f"translate: {err}") from None
    interactive = args.input in (None, "-") and sys.stdin.isatty()
    # Files read line by line beside the input.
    parallel = {option: path for option, path in (("--prefix-file", args.prefix_file),
                                                  ("--score", args.score),
                                                  ("--constraints-file", args.constraints_file))
                if path}
    for option, path in parallel.items():
        if sys.stdin is None and is_stdin(path):
            raise SystemExit(f"translate: {option} -: stdin is closed; give it as a file")
    if interactive and parallel:
        raise SystemExit(f"translate: {next(iter(parallel))} needs -i (or piped input)")
    if interactive and args.output is not None:  # the prompt prints; the file would never come
        raise SystemExit(f"translate: -o {args.output} needs the input from a file (-i FILE) or "
                         "a pipe; at the prompt (stdin a terminal) each translation is printed as "
                         "it is typed")
    checks.refuse_overwrite(args, parallel)
    checks.refuse_shared_streams(args, parallel)
    total = None if interactive else checks.count_input(args, parallel)
    try:
        model, tokenizer, names = load_models(args.model, args.device, args.dtype,
                                              pack=not args.no_pack, weights=args.weights)
        shortlist = Shortlist.load(args.shortlist, tokenizer) if args.shortlist else None
    except ValueError as err:
        raise SystemExit(f"translate: {err}") from None
    try:  # a prefix or phrase the target vocabulary cannot spell stops translate before any work
        for option, path in parallel.items():
            if option in SPELLED and is_regular(path):
                for n, part in enumerate(chunks(read_lines(path, args.errors), args.chunk_lines)):
                    _spelled(tokenizer, option, part, path, n * args.chunk_lines + 1,
                             max_positions(model))
    except ValueError as err:
        raise SystemExit(f"translate: {err}") from None
    mistake = layer_mistake(model, args.alignment_layer)
    if mistake:
        raise SystemExit(f"translate: {mistake}")
    if warning := min_len_model_warning(args, max_positions(model)):  # any --max-len-a/-b
        log.warning(warning)
    opts = search_options(args, args.workers or default_workers(args.device))
    if interactive:
        try:
            with torch.inference_mode():
                _interactive(model, tokenizer, opts, args, shortlist)
        except BrokenPipeError:  # the reader left (`translate -m M | head -1` at a terminal)
            raise reader_left() from None
        return
    log.info("model %s%s", " + ".join(names), "" if total is None else f", {total} lines")
    start = time.perf_counter()
    done, unfit, missed, unused = _translate_chunks(model, tokenizer, opts, args, parallel,
                                                    total, shortlist)
    if unfit:
        log.warning(NOT_SCORED if args.score else IN_PIECES, unfit, max_positions(model))
    if missed:
        log.warning(UNMET, missed)
    if unused:
        log.warning(UNUSED_PREFIX, unused)
    seconds = time.perf_counter() - start
    log.info("%s %d lines in %.1f s (%.1f lines/s)", "scored" if args.score else "translated",
             done, seconds, done / max(seconds, 1e-9))


# Side files whose lines the target vocabulary must spell (an unknown piece forced or required
# would print as "⁇"): checked whole before any work where the file can be read twice, and each
# chunk again as it comes (a pipe is read once).
SPELLED = ("--prefix-file", "--constraints-file")


def _spelled(tokenizer, option: str, lines: list[str], path: str, first_line: int,
             limit: int) -> list:
    """A chunk of an ``option`` file (one of SPELLED) as target ids: per line, the prefix, or
    the phrases. ValueError names the file and line of one the vocabulary cannot spell, or of a
    prefix that a model of ``limit`` positions cannot write."""
    if option == "--prefix-file":
        return encode_prefixes(tokenizer, lines, path, first_line, limit)
    return encode_phrases(tokenizer, [split_phrases(c) for c in lines], path, first_line)


def _translate_chunks(model, tokenizer, opts: SearchOptions, args: argparse.Namespace,
                      parallel: dict[str, str], total: int | None,
                      shortlist: Shortlist | None = None) -> tuple[int, int, int, int]:
    """Reads, translates (or scores) and writes the input a chunk at a time.

    Returns:
        (lines written, lines too long for the model, lines lacking a constraint, empty lines
        with a prefix).
    """
    rows = parallel_lines(read_lines(args.input, args.errors),
                          [(path, read_lines(path, args.errors)) for path in parallel.values()])
    # One random stream for the whole input, not one per chunk (which would repeat itself).
    generator = (torch.Generator(device=args.device).manual_seed(args.seed) if args.sampling
                 else None)
    bar = None
    if not args.quiet and total is not None:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="line", file=sys.stderr, leave=False)
    progress = False if bar is None else bar
    done = unfit = missed = unused = 0  # as returned
    try:
        # SIGHUP too: a closed terminal or a dropped ssh session killed translate outright and
        # left FILE.partial behind, which the next run to FILE then refused to write over.
        with terminate_as_interrupt((signal.SIGTERM, *HANGUP)), \
                atomic_output(args.output) as out, \
                torch.inference_mode():
            for chunk in chunks(rows, args.chunk_lines):
                lines = [row[0] for row in chunk]
                side = {option: [row[j] for row in chunk]
                        for j, option in enumerate(parallel, start=1)}
                if args.score:
                    results = score_lines(model, tokenizer, lines, side["--score"], args.lenpen,
                                          args.batch_tokens, opts.workers, progress, warn=False,
                                          processes=opts.processes)
                    # too long to score (an empty pair has no sources and needs no score)
                    unfit += sum(bool(r.sources) and not r.hyps for r in results)
                else:
                    results, (u, m, n) = _search_chunk(model, tokenizer, opts, args, lines,
                                                       side, parallel, done + 1, progress,
                                                       generator, shortlist)
                    unfit, missed, unused = unfit + u, missed + m, unused + n
                out.write(_formatted(model, tokenizer, results, args, done))
                out.flush()
                done += len(chunk)
    except InputError as err:  # only what could not be checked beforehand comes this late
        written = f" ({done} lines written before it)" if args.output is None and done else ""
        raise SystemExit(f"translate: {err}{written}") from None
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM or SIGHUP (TerminatedBySignal)
        print("translate: interrupted" + (f" after {done} lines" if args.output is None
                                          else f"; {args.output} not written"), file=sys.stderr)
        raise _Interrupted(getattr(err, "signal", signal.SIGINT)) from None
    except BrokenPipeError:  # the reader left (`translate ... | head`): stop without a traceback
        raise reader_left() from None
    except (WorkerDied, FloatingPointError, MemoryError, RuntimeError) as err:
        said = search_failure_said(err, args)
        if said is None:
            raise
        where = (f"; {args.output} not written" if args.output is not None
                 else f" ({done} lines written before it)" if done else "")
        raise SystemExit(f"translate: {said}{where}") from None
    except OSError as err:  # writing failed (a full disk); the partial file is gone
        raise SystemExit(f"translate: {args.output or '<stdout>'}: cannot write "
                         f"({err.strerror})") from None
    finally:
        if bar is not None:
            bar.close()
    return done, unfit, missed, unused


def _search_chunk(model, tokenizer, opts: SearchOptions, args: argparse.Namespace,
                  lines: list[str], side: dict[str, list[str]], paths: dict[str, str],
                  first_line: int, progress, generator: torch.Generator | None,
                  shortlist: Shortlist | None) -> tuple[list[LineResult], tuple[int, int, int]]:
    """The translations of one chunk's ``lines`` (``side``: its lines of each side file, by
    option; ``paths``: the files), and how many of them were too long for the model, lacked a
    constraint, or were empty with a prefix."""
    ids = {}
    for option in SPELLED:
        if option in side:
            try:
                ids[option] = _spelled(tokenizer, option, side[option], paths[option],
                                       first_line, max_positions(model))
            except ValueError as err:
                raise InputError(str(err)) from None
    phrases = ([split_phrases(c) for c in side["--constraints-file"]]
               if args.constraints_file else None)
    results = search_lines(model, tokenizer, lines, opts, progress, side.get("--prefix-file"),
                           generator=generator, warn=False, constraints=phrases,
                           shortlist=shortlist)
    unfit = sum(len(r.sources) > 1 for r in results)
    missed = unmet(results, ids["--constraints-file"]) if phrases is not None else 0
    unused = (sum(bool(p) and not r.sources for p, r in zip(ids["--prefix-file"], results,
                                                            strict=True))
              if args.prefix_file else 0)  # an empty line is not searched: it has no prefix
    return results, (unfit, missed, unused)


def _formatted(model, tokenizer, results: list[LineResult], args: argparse.Namespace,
               first: int) -> str:
    """The output lines of a chunk's results, the first input line's index ``first``."""
    fields = _fields(model, tokenizer, results, args)
    texts = _texts(model, tokenizer, results, args) if not args.score else [None] * len(results)
    lines = []
    for i, (r, f, nbest) in enumerate(zip(results, fields, texts, strict=True), start=first):
        lines += [_format_score(r, f)] if args.score else _format(i, nbest, f, args.nbest)
    return "".join(line + "\n" for line in lines)


class _Interrupted(SystemExit):
    """The run was interrupted by ``signum`` and has cleaned up; exit status 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def cli() -> None:
    """The ``translate`` command: ``main``, and after an interrupt (its partial output removed)
    the process ends by the signal itself, so that a shell loop running translate stops as it
    does for any other command instead of going on to the next iteration."""
    try:
        try:
            main()
        except KeyboardInterrupt:  # outside the translation loop: loading, the interactive prompt
            print("\ntranslate: interrupted", file=sys.stderr)
            raise _Interrupted(signal.SIGINT) from None
    except _Interrupted as err:
        signal.signal(err.signum, signal.SIG_DFL)
        os.kill(os.getpid(), err.signum)
        raise


if __name__ == "__main__":
    cli()
