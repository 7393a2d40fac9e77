"""``translate``: text in, translations out, exactly one output line per input line.

Input lines are encoded, sorted by length, cut into batches by a token budget, searched, and put
back in input order. Empty lines give empty lines without touching the model. A line longer than
the model's maximum is translated in pieces that are joined (one warning), never dropped.
stdout carries translations only; logs and the progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mt.search import Hypothesis, beam_search, greedy_search

log = logging.getLogger("mt.translate")


@dataclass
class SearchOptions:
    beam: int = 5
    lenpen: float = 0.6
    nbest: int = 1
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_len: int = 0
    batch_tokens: int = 4096


def _pieces(ids: list[int], limit: int) -> list[list[int]]:
    """Splits a source (ending in EOS) into pieces of at most ``limit`` tokens, each ending in EOS."""
    if len(ids) <= limit:
        return [ids]
    body = ids[:-1]
    step = limit - 1
    return [body[i : i + step] + ids[-1:] for i in range(0, len(body), step)]


def _batches(lengths: list[int], order: list[int], budget: int) -> Iterable[list[int]]:
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * max(lengths[i], lengths[batch[0]]) > budget:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def translate_ids(model, sources: list[list[int]], opts: SearchOptions,
                  progress: bool = False) -> list[list[Hypothesis]]:
    """Searches every source (ids ending in EOS); returns n-best lists in input order.

    Batches are formed from length-sorted sources (longest first, so memory peaks early) and each
    holds at most ``opts.batch_tokens`` source tokens, padding included.
    """
    from mt.data import pad

    device = next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    results: list[list[Hypothesis]] = [[] for _ in sources]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), unit="sent", file=sys.stderr, leave=False)
    lengths = [len(s) for s in sources]
    for batch in _batches(lengths, order, opts.batch_tokens):
        src = pad([sources[i] for i in batch]).to(device)
        if opts.beam == 1 and opts.nbest == 1:
            hyps = [[h] for h in greedy_search(model, src, opts.max_len_a, opts.max_len_b,
                                              opts.min_len)]
        else:
            hyps = beam_search(model, src, opts.beam, opts.lenpen, opts.nbest, opts.max_len_a,
                               opts.max_len_b, opts.min_len)
        for i, h in zip(batch, hyps, strict=True):
            results[i] = h
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return results


def translate_lines(model, tokenizer, lines: list[str], opts: SearchOptions | None = None,
                    progress: bool = False) -> list[list[tuple[str, float]]]:
    """Translates sentences; returns per line its n-best (text, score), best first.

    Empty (or whitespace-only) lines give ``[("", 0.0)]`` without being searched.
    """
    opts = opts or SearchOptions()
    limit = model.cfg.max_positions
    encoded = tokenizer.encode_src(lines)
    sources: list[list[int]] = []
    owner: list[int] = []  # which line each source piece belongs to
    long_lines = 0
    for i, (line, ids) in enumerate(zip(lines, encoded, strict=True)):
        if not line.strip():
            continue
        pieces = _pieces(ids, limit)
        long_lines += len(pieces) > 1
        sources.extend(pieces)
        owner.extend([i] * len(pieces))
    if long_lines:
        log.warning("%d line(s) longer than the model's %d tokens were translated in pieces",
                    long_lines, limit)
    hyps = translate_ids(model, sources, opts, progress) if sources else []
    out: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in lines]
    pieces_of: dict[int, list[list[Hypothesis]]] = {}
    for i, h in zip(owner, hyps, strict=True):
        pieces_of.setdefault(i, []).append(h)
    for i, parts in pieces_of.items():
        if len(parts) == 1:
            texts = tokenizer.decode_tgt([h.tokens for h in parts[0]])
            out[i] = list(zip(texts, [h.score for h in parts[0]], strict=True))
        else:  # pieces of one long line: join their best translations
            texts = tokenizer.decode_tgt([p[0].tokens for p in parts])
            out[i] = [(" ".join(texts), sum(p[0].score for p in parts))]
    return out


def _read_input(path: str | None, errors: str) -> list[str]:
    if path is None or path == "-":
        data = sys.stdin.buffer.read()
        name = "<stdin>"
    else:
        with open(path, "rb") as f:
            data = f.read()
        name = path
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline ends the last line; it does not start a new one
    out = []
    for lineno, raw in enumerate(lines, start=1):
        try:
            out.append(raw.decode("utf-8", errors=errors).rstrip("\r"))
        except UnicodeDecodeError as err:
            raise SystemExit(f"translate: {name}:{lineno}: invalid UTF-8 ({err.reason}); "
                             "use --errors replace to translate it anyway") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="translate",
        description="Translate text with an mt model: one output line per input line.",
    )
    p.add_argument("-m", "--model", required=True,
                   help="a run directory (its best checkpoint is used) or a checkpoint file")
    p.add_argument("-i", "--input", default=None, help="input file (default: stdin)")
    p.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    p.add_argument("--beam", type=int, default=5, help="beam size; 1 = greedy (default: 5)")
    p.add_argument("--nbest", type=int, default=1,
                   help="print N lines per input line: 'index<TAB>translation<TAB>score'")
    p.add_argument("--lenpen", type=float, default=0.6, help="GNMT length penalty alpha")
    p.add_argument("--max-len-a", type=float, default=1.5)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--min-len", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=4096,
                   help="source tokens per batch, padding included")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 input: stop with the line number, or replace it")
    p.add_argument("--quiet", action="store_true", help="no progress bar or info logs")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from mt.checkpoint import load_model

    if args.nbest > args.beam:
        raise SystemExit(f"translate: --nbest {args.nbest} is larger than --beam {args.beam}")
    lines = _read_input(args.input, args.errors)
    try:
        model, tokenizer, ckpt = load_model(args.model, args.device)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"translate: {err}") from None
    log.info("model %s, %d lines", ckpt["path"], len(lines))
    opts = SearchOptions(beam=args.beam, lenpen=args.lenpen, nbest=args.nbest,
                         max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                         min_len=args.min_len, batch_tokens=args.batch_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        results = translate_lines(model, tokenizer, lines, opts,
                                  progress=not args.quiet and args.input is not None)
    seconds = time.perf_counter() - start
    log.info("translated %d lines in %.1f s (%.1f lines/s)", len(lines), seconds,
             len(lines) / max(seconds, 1e-9))
    out = sys.stdout if args.output is None else open(args.output, "w", encoding="utf-8")
    try:
        for i, nbest in enumerate(results):
            if args.nbest == 1:
                out.write(nbest[0][0] + "\n")
            else:  # N lines per input line, 'index<TAB>translation<TAB>score', index from 0
                for text, score in nbest:
                    out.write(f"{i}\t{text}\t{score:.4f}\n")
    finally:
        if out is not sys.stdout:
            out.close()


if __name__ == "__main__":
    main()
