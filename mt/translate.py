"""``translate``: text in, translations out, exactly one output line per input line.

Input is read a chunk of lines at a time (``--chunk-lines``); a chunk's lines are encoded, sorted
by length, cut into batches by a token budget, searched, put back in input order and written
before the next chunk is read, so memory is bounded whatever the input's size. Empty lines give
empty lines without touching the model. A line longer than the model's maximum is translated in
pieces, cut between sentences where it can, that are joined (one warning), never dropped.
``-o FILE`` appears only once whole. stdout carries translations only; logs, the progress bar
and the interactive prompt go to stderr. See docs/decoding.md for every option and output format.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from mt.alignment import align_lines, word_scores
from mt.batching import pad
from mt.config import EOS_ID, positive_int
from mt.constraints import constrained_beam_search, encode_phrases, satisfied, split_phrases
from mt.inference import DTYPES, keep_freed_memory, load_models
from mt.mbr import mbr_lines
from mt.options import SearchOptions, add_search_arguments, search_mistake, search_options
from mt.scoring import forced_scores
from mt.search import (
    Ensemble,
    Hypothesis,
    beam_search,
    first_member,
    greedy_search,
    max_positions,
    sample_search,
)
from mt.textio import (
    STDOUT_NAMES,
    InputError,
    atomic_output,
    check_output,
    chunks,
    count_lines,
    parallel_lines,
    read_lines,
)
from mt.tokenizer import Boundaries
from mt.workers import default_workers, map_batches

log = logging.getLogger("mt.translate")
_IN_PIECES = "%d line(s) longer than the model's %d tokens were translated in pieces"
_NOT_SCORED = "%d line pair(s) longer than the model's %d tokens were not scored (nan)"
_UNMET = ("%d translation(s) lack a constraint: the output budget ran out first (a larger "
          "--beam or --max-len-b helps), or the line was empty or translated in pieces "
          "(constraints then go unused)")


def _pieces(ids: list[int], limit: int, marks: Boundaries | None = None) -> list[list[int]]:
    """Splits a source (ending in EOS) into pieces of at most ``limit`` tokens, each with EOS.

    Each cut goes after the last sentence end that fits (Tokenizer.src_boundaries; closing quotes
    after it included, at least a quarter of the limit into the piece, so that "Dr." alone does
    not become a piece), else before the last word start that fits, else where the limit falls
    (without ``marks``, always there). A piece is translated on its own, so a cut inside a
    sentence, or a word, costs the translation its context there.
    """
    if len(ids) <= limit:
        return [ids]
    if limit < 2:
        raise ValueError(f"a model of {limit} position(s) has no room for a token and EOS")
    body, eos, step = ids[:-1], ids[-1:], limit - 1
    out, i = [], 0
    while len(body) - i > step:
        cut = _cut(body, i, step, marks) if marks else i + step
        out.append(body[i:cut] + eos)
        i = cut
    return [*out, body[i:] + eos]


def _cut(body: list[int], i: int, step: int, marks: Boundaries) -> int:
    """Where the piece starting at ``body[i]`` ends (see ``_pieces``)."""
    word = None
    for k in range(i + step, i, -1):
        spaced = marks.starts[body[k]]
        word = k if word is None and spaced else word
        j = k - 1
        while j > i and marks.closes[body[j]]:
            j -= 1
        if (marks.ends[body[j]] and (spaced or marks.unspaced[body[j]])
                and k - i >= max(step // 4, 1)):
            return k
    return word or i + step


def translate_ids(model, sources: list[list[int]], opts: SearchOptions,
                  progress: bool | Any = False, prefixes: list[list[int]] | None = None, *,
                  generator: torch.Generator | None = None,
                  constraints: list[list[list[int]]] | None = None) -> list[list[Hypothesis]]:
    """Searches every source (ids ending in EOS); returns n-best lists in input order.

    Batches are formed from length-sorted sources (longest first, so memory peaks early) and each
    holds at most ``opts.batch_tokens`` source tokens, padding included. On CPU, ``opts.workers``
    batches are searched at once, one thread each (so that many batches' activations and caches
    are in memory together). With several workers the batches are cut to keep them all busy
    (``mt.workers.balanced_batches``), so, as with another ``batch_tokens``, scores can differ in
    their last bits (and a near-tie, rarely, flip); the same options always give the same results.

    Args:
        model: a Transformer, or an Ensemble.
        sources: token ids per sentence, each ending in EOS.
        opts: the search.
        progress: a tqdm bar on stderr (True), or the caller's bar to advance per sentence.
        prefixes: per sentence, target ids to force before the free search (or None).
        generator: the random stream for sampling (default: a new one from ``opts.seed``).
        constraints: per sentence, target phrases (ids) its translation must contain
            (``mt.constraints``; beam search only).
    """
    if constraints is not None and opts.sampling:
        raise ValueError("constraints need beam search; they do not combine with sampling")
    if opts.sampling:
        if opts.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {opts.temperature}")
        if opts.nbest < 1:
            raise ValueError(f"nbest (samples per line) must be at least 1, got {opts.nbest}")
    elif not 1 <= opts.nbest <= opts.beam:
        raise ValueError(f"nbest must be between 1 and beam={opts.beam}, got {opts.nbest}")
    device = next(first_member(model).parameters()).device
    if opts.sampling and generator is None:
        generator = torch.Generator(device=device).manual_seed(opts.seed)
    lens = dict(max_len_a=opts.max_len_a, max_len_b=opts.max_len_b, min_len=opts.min_len,
                no_repeat_ngram=opts.no_repeat_ngram)

    def search(batch: list[int]) -> list[list[Hypothesis]]:
        src = pad([sources[i] for i in batch]).to(device)
        pre = [prefixes[i] for i in batch] if prefixes is not None else None
        phrases = [constraints[i] for i in batch] if constraints is not None else None
        if phrases is not None and any(phrases):
            return constrained_beam_search(model, src, phrases, opts.beam, opts.lenpen,
                                           opts.nbest, prefixes=pre, **lens)
        if opts.sampling:
            return sample_search(model, src, opts.nbest, opts.lenpen, prefixes=pre,
                                 temperature=opts.temperature, top_k=opts.top_k,
                                 top_p=opts.top_p, epsilon=opts.epsilon, generator=generator,
                                 **lens)
        if opts.beam == 1:
            return [[h] for h in greedy_search(model, src, lenpen=opts.lenpen, prefixes=pre,
                                              **lens)]
        return beam_search(model, src, opts.beam, opts.lenpen, opts.nbest, prefixes=pre, **lens)

    # Sampling draws from one random stream in batch order, so it stays on one thread.
    return map_batches(search, [len(s) for s in sources], opts.batch_tokens,
                        min(opts.workers, 1) if opts.sampling else opts.workers, device, progress)


@dataclass
class LineResult:
    """One input line's search: its source pieces and, per piece, the n-best hypotheses.

    A line fits in one piece unless it is longer than the model's maximum; an empty line has none.
    """

    sources: list[list[int]]
    hyps: list[list[Hypothesis]]


def _one_model(model):
    """A list of models is an ensemble (a list of one, that model); anything else stays."""
    if isinstance(model, list | tuple):
        return Ensemble(list(model)) if len(model) > 1 else model[0]
    return model


def search_lines(model, tokenizer, lines: list[str], opts: SearchOptions,
                 progress: bool | Any = False, prefixes: list[str] | None = None, *,
                 generator: torch.Generator | None = None, warn: bool = True,
                 constraints: list[list[str]] | None = None) -> list[LineResult]:
    """Encodes, splits over-long lines into pieces, searches them all, and groups them by line
    (with ``opts.mbr``: each piece's ``opts.mbr_candidates`` cut to the one MBR chooses).

    Args:
        model: a Transformer, a list of them (an ensemble) or an Ensemble.
        tokenizer: the model's mt.tokenizer.Tokenizer.
        lines: input sentences; empty (whitespace-only) lines are not searched.
        opts: the search.
        progress: a progress bar on stderr (True), or the caller's tqdm bar to advance per line.
        prefixes: per line, target text to force at the start of its translation ("" = none).
        generator: the random stream for sampling (default: a new one from ``opts.seed``); a
            caller that searches a file in chunks passes one stream for all of them.
        warn: log a warning for lines translated in pieces, and for translations that lack a
            constraint (a caller with chunks sums them: ``unmet``).
        constraints: per line, target phrases its translation must contain (``mt.constraints``).
            A line translated in pieces cannot say which piece a phrase belongs to: its
            constraints go unused.
    """
    model = _one_model(model)
    if prefixes is not None and len(prefixes) != len(lines):
        raise ValueError(f"{len(prefixes)} prefixes for {len(lines)} lines")
    if constraints is not None and len(constraints) != len(lines):
        raise ValueError(f"{len(constraints)} constraint lists for {len(lines)} lines")
    limit = max_positions(model)
    encoded = tokenizer.encode_src(lines)
    prefix_ids = tokenizer.encode_tgt(prefixes) if prefixes is not None else None
    phrase_ids = encode_phrases(tokenizer, constraints) if constraints is not None else None
    sources: list[list[int]] = []
    forced: list[list[int]] = []
    wanted: list[list[list[int]]] = []
    owner: list[int] = []  # which line each source piece belongs to
    long_lines = 0
    for i, (line, ids) in enumerate(zip(lines, encoded, strict=True)):
        if not line.strip():
            continue
        pieces = _pieces(ids, limit, tokenizer.src_boundaries)
        long_lines += len(pieces) > 1
        sources.extend(pieces)
        owner.extend([i] * len(pieces))
        # A prefix belongs to the start of the translation: the first piece only.
        forced.extend([prefix_ids[i] if prefix_ids else []] + [[]] * (len(pieces) - 1))
        wanted.extend([phrase_ids[i] if phrase_ids and len(pieces) == 1 else []] * len(pieces))
    if long_lines and warn:
        log.warning(_IN_PIECES, long_lines, limit)
    if not isinstance(progress, bool):  # the caller's bar counts lines, the search pieces
        progress.total += len(sources) - len(set(owner))
        progress.update(len(lines) - len(set(owner)))
    # With MBR the search draws the candidates, and each line keeps the one MBR chooses.
    search = replace(opts, nbest=opts.mbr_candidates, mbr="") if opts.mbr else opts
    hyps = (translate_ids(model, sources, search, progress,
                          forced if prefix_ids is not None else None, generator=generator,
                          constraints=wanted if phrase_ids is not None else None)
            if sources else [])
    out = [LineResult([], []) for _ in lines]
    for i, src, h in zip(owner, sources, hyps, strict=True):
        out[i].sources.append(src)
        out[i].hyps.append(h)
    out = mbr_lines(tokenizer, out, opts.mbr) if opts.mbr else out
    if phrase_ids is not None and warn and (missed := unmet(out, phrase_ids)):
        log.warning(_UNMET, missed)
    return out


def unmet(results: list[LineResult], constraints: list[list[list[int]]]) -> int:
    """Lines whose (first) translation lacks one of their constraints (ids)."""
    return sum(bool(c) and (len(r.hyps) != 1 or not satisfied(r.hyps[0][0].tokens, c))
               for r, c in zip(results, constraints, strict=True))


def score_lines(model, tokenizer, lines: list[str], targets: list[str], lenpen: float = 0.6,
                batch_tokens: int = 4096, workers: int = 1,
                progress: bool | Any = False, *, warn: bool = True) -> list[LineResult]:
    """Scores given translations (``translate --score``) instead of searching for them.

    Every pair is scored by the model, empty lines included (an empty source is EOS alone, an
    empty target EOS alone), in batches of at most ``batch_tokens`` tokens of the longer side.
    A pair with a side longer than the model's maximum cannot be scored: it gets no hypothesis
    (one warning for all of them), as no piece of it can be scored on its own.

    Returns:
        per line a LineResult whose one hypothesis carries the score (``forced_scores``); the
        result fits ``align_lines`` for forced alignments of given translations.
    """
    model = _one_model(model)
    if len(targets) != len(lines):
        raise ValueError(f"{len(targets)} translations for {len(lines)} lines")
    limit = max_positions(model)
    pairs = [(s, t + [EOS_ID]) for s, t in zip(tokenizer.encode_src(lines),
                                                  tokenizer.encode_tgt(targets), strict=True)]
    fits = [i for i, (s, t) in enumerate(pairs) if len(s) <= limit and len(t) <= limit]
    if len(fits) < len(pairs):
        if warn:
            log.warning(_NOT_SCORED, len(pairs) - len(fits), limit)
        if not isinstance(progress, bool):
            progress.update(len(pairs) - len(fits))
    device = next(first_member(model).parameters()).device

    def score(batch: list[int]) -> list[Hypothesis]:
        src = pad([pairs[fits[j]][0] for j in batch]).to(device)
        tgt = pad([pairs[fits[j]][1] for j in batch]).to(device)
        return forced_scores(model, src, tgt, lenpen)

    lengths = [max(len(s), len(t)) for s, t in (pairs[i] for i in fits)]
    hyps = map_batches(score, lengths, batch_tokens, workers, device, progress)
    out = [LineResult([], []) for _ in lines]
    for i, h in zip(fits, hyps, strict=True):
        out[i] = LineResult([pairs[i][0]], [[h]])
    return out


def _texts(tokenizer, result: LineResult) -> list[tuple[str, float]]:
    if not result.hyps:
        return [("", 0.0)]
    if len(result.hyps) == 1:
        nbest = result.hyps[0]
        texts = tokenizer.decode_tgt([h.tokens for h in nbest])
        return list(zip(texts, [h.score for h in nbest], strict=True))
    # Pieces of one long line: join their best translations.
    texts = tokenizer.decode_tgt([p[0].tokens for p in result.hyps])
    return [(" ".join(texts), sum(p[0].score for p in result.hyps))]


def translate_lines(model, tokenizer, lines: list[str], opts: SearchOptions | None = None,
                    progress: bool = False,
                    prefixes: list[str] | None = None,
                    constraints: list[list[str]] | None = None) -> list[list[tuple[str, float]]]:
    """Translates sentences; returns per line its n-best (text, score), best first.

    Empty (or whitespace-only) lines give ``[("", 0.0)]`` without being searched. ``model`` may be
    a list of models (an ensemble sharing ``tokenizer``). ``constraints``: per line, target
    phrases its translation must contain (``mt.constraints``).
    """
    results = search_lines(model, tokenizer, lines, opts or SearchOptions(), progress, prefixes,
                           constraints=constraints)
    return [_texts(tokenizer, r) for r in results]


# -- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="translate",
        description="Translate text with an mt model: one output line per input line. "
                    "See docs/decoding.md.",
    )
    p.add_argument("-m", "--model", required=True, action="extend", nargs="+",
                   help="a run directory (its best checkpoint is used) or a checkpoint file; "
                        "several make an ensemble (they must share the tokenizer)")
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
                   help="decoder layer for --alignment (Python index; default: penultimate)")
    p.add_argument("--chunk-lines", type=positive_int, default=100_000,
                   help="lines read, sorted by length, translated and written at a time: bounds "
                        "the memory of a large file and streams a pipe")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="batches searched at once, one thread and one core each (CPU); default: "
                        "one per core torch may use on CPU, 1 on a GPU. Batches are cut to keep "
                        "every worker busy, so scores may differ in their last bits between "
                        "worker counts")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights and activations; bfloat16 is the fast path on CPUs with "
                        "AVX512-BF16/AMX and on GPUs; int8: int8 linear layers (CPU only)")
    p.add_argument("--no-pack", action="store_true",
                   help="keep linear layers as they are on CPU (default: pre-packed for oneDNN, "
                        "faster)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 input: stop with the line number, or replace it")
    p.add_argument("--quiet", action="store_true", help="no progress bar or info logs")
    return p


def _fields(model, tokenizer, results: list[LineResult], args: argparse.Namespace,
            batch_tokens: int = 4096) -> list[list[list[str]]]:
    """Per line, per n-best entry, what follows the translation after ' ||| ': the alignment
    (``--alignment``), then the word scores (``--word-scores``)."""
    parts = []
    if args.alignment:
        parts.append(align_lines(model, tokenizer, results, args.alignment_layer, batch_tokens))
    if args.word_scores:
        parts.append(word_scores(tokenizer, results))
    if not parts:
        return [[] for _ in results]
    return [[[part[li][e] for part in parts] for e in range(len(parts[0][li]))]
            for li in range(len(results))]


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
    line = f"{result.hyps[0][0].score:.4f}" if result.hyps else "nan"
    return " ||| ".join([line, *fields[0]]) if fields else line


def _interactive(model, tokenizer, opts: SearchOptions, args: argparse.Namespace) -> None:
    """A prompt on stderr; each line typed is translated and printed (flushed) at once."""
    print("translate: type a sentence and press Enter; Ctrl-D ends", file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            print(file=sys.stderr)
            return
        line = line.rstrip("\r\n")
        results = search_lines(model, tokenizer, [line], opts)
        fields = _fields(model, tokenizer, results, args)
        for out in _format(0, _texts(tokenizer, results[0]), fields[0], args.nbest):
            print(out, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    keep_freed_memory()
    mistake = search_mistake(args)
    if mistake:
        raise SystemExit(f"translate: {mistake}")
    if args.mbr and args.score:
        raise SystemExit("translate: --mbr chooses among translations it searches; it does not "
                         "combine with --score")
    if args.score is not None and (args.sampling or args.nbest != 1 or args.prefix_file
                                   or args.constraints_file):
        raise SystemExit("translate: --score scores given translations; it does not combine with "
                         "--sampling, --nbest, --prefix-file or --constraints-file")
    if args.constraints_file and (args.sampling or args.beam < 2):
        raise SystemExit("translate: --constraints-file needs beam search with --beam 2 or more "
                         "(a beam of 1 has no room for a hypothesis that places a phrase)")
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
    if interactive and parallel:
        raise SystemExit(f"translate: {next(iter(parallel))} needs -i (or piped input)")
    try:  # a regular file's mistakes stop translate before any work
        total = None if interactive else count_lines(args.input, args.errors)
        for path in parallel.values():
            n = count_lines(path, args.errors)
            if None not in (n, total) and n != total:
                raise InputError(f"{path}: {n} lines, but the input has {total}; one line per "
                                 "input line")
    except InputError as err:
        raise SystemExit(f"translate: {err}") from None
    try:
        model, tokenizer, names = load_models(args.model, args.device, args.dtype,
                                              pack=not args.no_pack)
    except ValueError as err:
        raise SystemExit(f"translate: {err}") from None
    if args.alignment_layer is not None:
        n_layers = len(first_member(model).decoder_layers)
        if not -n_layers <= args.alignment_layer < n_layers:
            raise SystemExit(f"translate: --alignment-layer {args.alignment_layer}: the decoder "
                             f"has {n_layers} layers")
    opts = search_options(args, args.workers or default_workers(args.device))
    if interactive:
        with torch.inference_mode():
            _interactive(model, tokenizer, opts, args)
        return
    log.info("model %s%s", " + ".join(names), "" if total is None else f", {total} lines")
    start = time.perf_counter()
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
    done = unfit = missed = 0  # lines written; too long for the model; lacking a constraint
    try:
        with _terminate_as_interrupt(), atomic_output(args.output) as out, \
                torch.inference_mode():
            for chunk in chunks(rows, args.chunk_lines):
                lines = [row[0] for row in chunk]
                side = {option: [row[j] for row in chunk]
                        for j, option in enumerate(parallel, start=1)}
                if args.score:
                    results = score_lines(model, tokenizer, lines, side["--score"], args.lenpen,
                                          args.batch_tokens, opts.workers, progress, warn=False)
                    unfit += sum(not r.hyps for r in results)
                else:
                    phrases = None
                    if args.constraints_file:
                        phrases = [split_phrases(c) for c in side["--constraints-file"]]
                        try:
                            ids = encode_phrases(tokenizer, phrases, args.constraints_file,
                                                 done + 1)
                        except ValueError as err:
                            raise InputError(str(err)) from None
                    results = search_lines(model, tokenizer, lines, opts, progress,
                                           side.get("--prefix-file"), generator=generator,
                                           warn=False, constraints=phrases)
                    unfit += sum(len(r.sources) > 1 for r in results)
                    missed += unmet(results, ids) if phrases is not None else 0
                fields = _fields(model, tokenizer, results, args, args.batch_tokens)
                for i, (r, f) in enumerate(zip(results, fields, strict=True), start=done):
                    lines_out = ([_format_score(r, f)] if args.score
                                 else _format(i, _texts(tokenizer, r), f, args.nbest))
                    out.write("".join(line + "\n" for line in lines_out))
                out.flush()
                done += len(chunk)
    except InputError as err:  # only what could not be checked beforehand comes this late
        written = f" ({done} lines written before it)" if args.output is None and done else ""
        raise SystemExit(f"translate: {err}{written}") from None
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (_Terminated)
        print("translate: interrupted" + (f" after {done} lines" if args.output is None
                                          else f"; {args.output} not written"), file=sys.stderr)
        raise _Interrupted(getattr(err, "signal", signal.SIGINT)) from None
    except BrokenPipeError:  # the reader left (`translate ... | head`): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as Python's docs advise
        raise SystemExit(1) from None
    except OSError as err:  # writing failed (a full disk); the partial file is gone
        raise SystemExit(f"translate: {args.output or '<stdout>'}: cannot write "
                         f"({err.strerror})") from None
    finally:
        if bar is not None:
            bar.close()
    if unfit:
        log.warning(_NOT_SCORED if args.score else _IN_PIECES, unfit, max_positions(model))
    if missed:
        log.warning(_UNMET, missed)
    seconds = time.perf_counter() - start
    log.info("%s %d lines in %.1f s (%.1f lines/s)", "scored" if args.score else "translated",
             done, seconds, done / max(seconds, 1e-9))


class _Terminated(KeyboardInterrupt):
    signal = signal.SIGTERM


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


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, ``kill``, a job scheduler) ends the run as Ctrl-C does, so that the
    partial output file is removed. Only the main thread can set a signal handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):  # the parent's choice stands
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:  # a handler set outside Python reads as None: put back the default then
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    cli()
