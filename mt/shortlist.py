"""Vocabulary shortlists: the target pieces a sentence's translation may use, so that a search
computes the output layer and the softmax over a few thousand pieces instead of the whole
vocabulary (Marian's and CTranslate2's lexical shortlists, for CPU decoding).

A sentence's shortlist is the target corpus' most frequent pieces, the pieces most likely to
translate nothing in particular (IBM Model 1's NULL word), the ``per_source`` likeliest
translations of each of its source pieces under IBM Model 1's p(target | source) (Brown et al.,
1993), trained on a parallel corpus in the model's own pieces, and whatever its prefix and
constraints force. A batch computes the union of its sentences' shortlists and each sentence's
log-softmax runs over its own pieces only, so a translation does not depend on the batch (up to
float rounding, as with another ``--batch-tokens``: the output layer is another shape).

Scores under a shortlist are log-probabilities normalised over the sentence's shortlist: a
little higher than the model's, which normalises over the whole vocabulary.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from mt import add_version_flag
from mt.batching import budget_batches, pad
from mt.config import EOS_ID, PAD_ID
from mt.incremental import Restricted
from mt.options import SearchOptions
from mt.search import Hypothesis
from mt.textio import text_list

FORMAT = "mt-shortlist/1"
SPECIAL = 4  # PAD, UNK, BOS, EOS: always allowed, at their own ids
BLOCK = 64  # a batch's pieces are padded to a multiple of this (mt.search._best's blocks)
BATCH_TOKENS = SearchOptions.batch_tokens  # translate's default --batch-tokens, for the summary


def lexical_probabilities(pairs: Sequence[tuple[list[int], list[int]]], src_vocab: int,
                          tgt_vocab: int, iterations: int = 5, chunk: int = 1 << 24) -> Tensor:
    """IBM Model 1's translation table p(t | s) by expectation maximisation.

    Args:
        pairs: (source ids, target ids) per sentence pair, without EOS.
        src_vocab, tgt_vocab: the vocabulary sizes.
        iterations: EM iterations (Model 1's likelihood is convex: a handful is enough for
            the ranking a shortlist needs).
        chunk: at most this many (source, target) position pairs are held at once.
    Returns:
        (src_vocab + 1, tgt_vocab) float32; the last row is the NULL word's. A source piece never
        seen keeps the uniform row it started with.

    The table is dense, and EM keeps two: (src_vocab + 2) x tgt_vocab x 8 bytes (512 MB for an
    8,000-piece vocabulary, 8.2 GB for 32,000), besides the corpus' pieces.
    """
    null, pad_row = src_vocab, src_vocab + 1  # the pad row stays zero: padding adds nothing
    prob = torch.full((src_vocab + 2, tgt_vocab), 1.0 / tgt_vocab)
    prob[pad_row] = 0
    counts = torch.zeros_like(prob)
    batches = []  # (src (B, 1 + S) with NULL first, tgt (B, T), tmask (B, T)) of similar lengths
    order = sorted((i for i in range(len(pairs)) if pairs[i][1]),
                   key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    start = 0
    while start < len(order):
        end, m, n = start, 0, 0
        while end < len(order):  # grow while the batch holds at most ``chunk`` cells
            s, t = pairs[order[end]]
            if end > start and (end + 1 - start) * max(m, len(s) + 1) * max(n, len(t)) > chunk:
                break
            m, n, end = max(m, len(s) + 1), max(n, len(t)), end + 1
        batch, start = order[start:end], end
        src = torch.full((len(batch), m), pad_row, dtype=torch.long)
        src[:, 0] = null
        tgt = torch.zeros((len(batch), n), dtype=torch.long)
        tmask = torch.zeros((len(batch), n))
        for row, i in enumerate(batch):
            s, t = pairs[i]
            src[row, 1 : 1 + len(s)] = torch.tensor(s, dtype=torch.long)
            tgt[row, : len(t)] = torch.tensor(t, dtype=torch.long)
            tmask[row, : len(t)] = 1
        batches.append((src, tgt, tmask))
    flat_prob, flat_counts = prob.view(-1), counts.view(-1)
    for _ in range(iterations):
        counts.zero_()
        for src, tgt, tmask in batches:
            index = (src[:, :, None] * tgt_vocab + tgt[:, None, :]).view(-1)  # (s_i, t_j) cells
            w = flat_prob[index].view(src.size(0), src.size(1), tgt.size(1))  # p(t_j | s_i)
            post = w / w.sum(1, keepdim=True).clamp_(min=1e-30)  # which s_i produced t_j
            flat_counts.index_add_(0, index, post.mul_(tmask[:, None, :]).view(-1))
        # M-step in place (no full-size temporaries); a row without counts (a piece never
        # seen, the pad row) keeps its own: the two tables swap roles.
        totals = counts.sum(1, keepdim=True)
        unseen = (totals[:, 0] == 0).nonzero().squeeze(1)
        counts.div_(totals.clamp_(min=1e-30))
        counts[unseen] = prob[unseen]
        prob, counts = counts, prob
        flat_prob, flat_counts = prob.view(-1), counts.view(-1)
    return prob[: src_vocab + 1]


class Shortlist:
    """Per source piece its likeliest target pieces, and the pieces every sentence may use.

    Args:
        table: (source vocabulary, per_source) target ids per source piece (PAD where it has
            fewer).
        always: target ids every sentence may use (the special pieces among them).
        fingerprint: the tokenizer's (``Tokenizer.fingerprint``), so that a shortlist is never
            used with a model of other pieces.
        tgt_vocab_size: the target vocabulary's size.
    """

    def __init__(self, table: Tensor, always: Tensor, fingerprint: str,
                 tgt_vocab_size: int) -> None:
        self.table = table.long()
        self.always = torch.unique(torch.cat([torch.arange(SPECIAL), always.long()]))
        self.fingerprint = fingerprint
        self.tgt_vocab_size = tgt_vocab_size

    def save(self, path: str | os.PathLike) -> None:
        """Writes the shortlist (a small torch file: int32 ids and the fingerprint)."""
        from mt.checkpoint import save_atomic

        save_atomic({"format": FORMAT, "table": self.table.int(), "always": self.always.int(),
                     "fingerprint": self.fingerprint,
                     "tgt_vocab_size": self.tgt_vocab_size}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer) -> Shortlist:
        """Reads a shortlist made for ``tokenizer``'s pieces; anything else is a ValueError naming
        the file."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such shortlist file") from None
        except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise ValueError(f"{path}: not a shortlist file ({type(err).__name__})") from None
        keys = {"format", "table", "always", "fingerprint", "tgt_vocab_size"}
        if not isinstance(state, dict) or state.get("format") != FORMAT or set(state) != keys:
            raise ValueError(f"{path}: not a shortlist file (made by mt-shortlist)")
        if state["fingerprint"] != tokenizer.fingerprint:
            raise ValueError(f"{path}: the shortlist was made for another tokenizer than the "
                             "model's; make one with mt-shortlist -m MODEL")
        return cls(state["table"], state["always"], state["fingerprint"],
                   state["tgt_vocab_size"])

    def write_vmap(self, tokenizer, path: str | os.PathLike) -> None:
        """The same shortlist as a CTranslate2 vocabulary map (``use_vmap``): per source piece
        a line ``piece<TAB>target pieces``, and one line with an empty key for the pieces every
        sentence may use. CTranslate2 gives each batch the union of its sentences' lists (and
        normalises over it), where mt keeps each sentence to its own."""
        src, tgt = tokenizer.src, tokenizer.tgt
        lines = ["\t" + " ".join(tgt.id_to_piece(int(t)) for t in self.always[SPECIAL:])]
        for s, row in enumerate(self.table.tolist()):
            kept = sorted({t for t in row if t >= SPECIAL})
            if s >= SPECIAL and kept:
                lines.append(src.id_to_piece(s) + "\t" + " ".join(tgt.id_to_piece(t)
                                                                   for t in kept))
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))

    def restrict(self, model, src: Tensor, forced: Sequence[Sequence[int]] | None = None
                 ) -> Restricted:
        """The model restricted to the batch's pieces: src (B, S) padded source ids; ``forced``,
        per sentence, target ids it must be able to produce (its prefix and constraints)."""
        device = src.device
        b, v = src.size(0), self.tgt_vocab_size
        allowed = torch.zeros((b, v), dtype=torch.bool)
        allowed[:, self.always] = True
        src_cpu = src.cpu().clamp(max=self.table.size(0) - 1)
        candidates = self.table[src_cpu].masked_fill_((src_cpu == PAD_ID)[:, :, None], PAD_ID)
        allowed.scatter_(1, candidates.view(b, -1), True)  # padding adds nothing
        for row, ids in enumerate(forced or []):
            allowed[row, list(ids)] = True
        used = allowed.any(0)
        vocab = used.nonzero().squeeze(1)
        # Padded with unused pieces (allowed to none) to a multiple of BLOCK, where the
        # search's block-wise top-k works.
        more = min(-vocab.numel() % BLOCK, v - vocab.numel())
        if more:
            vocab = torch.cat([vocab, (~used).nonzero().squeeze(1)[:more]]).sort().values
        return Restricted(model, vocab.to(device), allowed[:, vocab].to(device))


def local_ids(restricted: Restricted, ids: Sequence[int]) -> list[int]:
    """Target ids as indices into a restricted model's pieces (each must be among them)."""
    vocab = restricted.vocab.cpu()
    return torch.searchsorted(vocab, torch.tensor(list(ids), dtype=torch.long)).tolist()


def global_hypotheses(restricted: Restricted, nbest: list[list[Hypothesis]]
                      ) -> list[list[Hypothesis]]:
    """A restricted search's hypotheses with their tokens as target ids again."""
    vocab = restricted.vocab.tolist()
    return [[replace(h, tokens=[vocab[t] for t in h.tokens]) for h in hyps] for hyps in nbest]


def build_shortlist(tokenizer, sources: list[str], targets: list[str], per_source: int = 50,
                    frequent: int = 500, iterations: int = 5, max_lines: int = 1_000_000,
                    seed: int = 0) -> tuple[Shortlist, dict]:
    """A shortlist from a parallel corpus (the training data, as lines of text).

    Args:
        tokenizer: the model's (mt.tokenizer.Tokenizer).
        sources, targets: sentence pairs.
        per_source: likeliest target pieces kept per source piece.
        frequent: the target corpus' most frequent pieces, allowed to every sentence (and the
            NULL word's ``per_source`` likeliest).
        iterations: IBM Model 1's EM iterations.
        max_lines: at most this many pairs (a random sample of them, drawn with ``seed``).
    Returns:
        the shortlist and a summary (lines, pieces) to report.
    """
    sources, targets = text_list(sources, "sources"), text_list(targets, "targets")
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} source lines but {len(targets)} target lines")
    if per_source < 1 or frequent < 0 or iterations < 1 or max_lines < 1:
        raise ValueError("per_source, iterations and max_lines must be at least 1, frequent at "
                         "least 0")
    index = list(range(len(sources)))
    if len(index) > max_lines:
        index = sorted(random.Random(seed).sample(index, max_lines))
    src = tokenizer.encode_src([sources[i] for i in index])
    tgt = tokenizer.encode_tgt([targets[i] for i in index])
    pairs = [([t for t in s if t != EOS_ID], t) for s, t in zip(src, tgt, strict=True)]
    pairs = [(s, t) for s, t in pairs if s and t]
    if not pairs:
        raise ValueError("no sentence pair with text on both sides to learn a shortlist from")
    vs, vt = tokenizer.src_vocab_size, tokenizer.tgt_vocab_size
    prob = lexical_probabilities(pairs, vs, vt, iterations)
    k = min(per_source, vt)
    values, table = prob.topk(k, dim=1)
    table[values <= 0] = 0  # PAD: allowed anyway
    seen = torch.zeros(vs + 1, dtype=torch.bool)
    seen[[i for s, _ in pairs for i in s]] = True
    seen[vs] = True
    seen[:SPECIAL] = False  # <unk> too: CTranslate2's map cannot name it (write_vmap)
    table[~seen] = 0  # a piece never seen keeps its uniform row: no candidates
    counts = torch.bincount(torch.tensor([i for _, t in pairs for i in t]), minlength=vt)
    counts[:SPECIAL] = 0
    top = counts.topk(min(frequent, vt)).indices if frequent else torch.empty(0, dtype=torch.long)
    always = torch.cat([top[counts[top] > 0], table[vs]])
    shortlist = Shortlist(table[:vs], always, tokenizer.fingerprint, vt)
    # What a search pays for: a batch's union (translate's default 4,096 tokens, sorted by
    # length as translate sorts), beside a line's own list.
    probe = [s + [EOS_ID] for s, _ in pairs[:: max(1, len(pairs) // 2000)]]
    lengths = [len(s) for s in probe]
    order = sorted(range(len(probe)), key=lambda i: -lengths[i])
    unions = [shortlist.restrict(None, pad([probe[i] for i in b])) for b in
              budget_batches(lengths, order, BATCH_TOKENS)]
    return shortlist, {"lines": len(pairs), "always": shortlist.always.numel(),
                       "per_source": k, "vocabulary": vt,
                       "line_pieces": sum(u.allowed.sum().item() for u in unions) / len(probe),
                       "batch_pieces": sum(u.allowed.any(0).sum().item() for u in unions)
                       / len(unions)}


def restricted_search(search, model, shortlist: Shortlist | None, src: Tensor,
                      prefixes: list[list[int]] | None,
                      constraints: list[list[list[int]]] | None = None):
    """Runs ``search(model, prefixes, constraints)`` under the shortlist (ids mapped in and the
    hypotheses' tokens mapped back), or as it is without one."""
    if shortlist is None:
        return search(model, prefixes, constraints)
    forced = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(len(src))]
    for row, phrases in enumerate(constraints or []):
        forced[row] += [t for phrase in phrases for t in phrase]
    restricted = shortlist.restrict(model, src, forced)
    if prefixes is not None:
        prefixes = [local_ids(restricted, p) for p in prefixes]
    if constraints is not None:
        constraints = [[local_ids(restricted, phrase) for phrase in phrases]
                       for phrases in constraints]
    return global_hypotheses(restricted, search(restricted, prefixes, constraints))



def main(argv: list[str] | None = None) -> None:
    """``mt-shortlist``: learn a shortlist for a model from a parallel corpus."""
    import argparse
    import sys
    import time

    from mt.config import positive_int
    from mt.inference import load_models
    from mt.textio import InputError, output_mistake, read_lines

    p = argparse.ArgumentParser(
        prog="mt-shortlist",
        description="Learn a vocabulary shortlist for a model from a parallel corpus (its "
                    "training data): translate --shortlist FILE then computes the output layer "
                    "over each line's likely target pieces only. See docs/decoding.md.")
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True,
                   help="the model (checkpoint or run directory) whose pieces it lists")
    p.add_argument("--src", required=True, help="source side of the corpus, one sentence a line")
    p.add_argument("--tgt", required=True, help="target side, line by line with --src")
    p.add_argument("-o", "--output", required=True, help="the shortlist file to write")
    p.add_argument("--force", action="store_true", help="replace -o if it exists")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 in the corpus: stop with the line number, or read it "
                        "with U+FFFD (default: strict)")
    p.add_argument("--per-source", type=positive_int, default=50, metavar="K",
                   help="likeliest target pieces kept per source piece (default: 50)")
    p.add_argument("--frequent", type=int, default=500, metavar="N",
                   help="the target side's N most frequent pieces, allowed to every line "
                        "(default: 500)")
    p.add_argument("--iterations", type=positive_int, default=5,
                   help="IBM Model 1 EM iterations (default: 5)")
    p.add_argument("--max-lines", type=positive_int, default=1_000_000,
                   help="learn from at most this many pairs, a random sample (default: 1000000)")
    args = p.parse_args(argv)
    if args.frequent < 0:
        raise SystemExit(f"mt-shortlist: --frequent must be 0 or more, got {args.frequent}")
    if mistake := output_mistake("-o", args.output, True):  # a directory
        raise SystemExit(f"mt-shortlist: {mistake}")
    try:
        _, tokenizer, names = load_models([args.model], "cpu", pack=False)
        # before the work, not after it
        if mistake := output_mistake("-o", args.output, args.force, [*names, args.src, args.tgt],
                                     "a file it reads (the model or the corpus)"):
            raise SystemExit(f"mt-shortlist: {mistake}")
        sources = list(read_lines(args.src, args.errors))
        targets = list(read_lines(args.tgt, args.errors))
        if len(sources) != len(targets):
            raise ValueError(f"{args.src} has {len(sources)} lines but {args.tgt} has "
                             f"{len(targets)}")
        start = time.perf_counter()
        shortlist, info = build_shortlist(tokenizer, sources, targets, args.per_source,
                                          args.frequent, args.iterations, args.max_lines)
        shortlist.save(args.output)
    except (ValueError, InputError) as err:
        raise SystemExit(f"mt-shortlist: {err}") from None
    except OSError as err:
        raise SystemExit(f"mt-shortlist: {err.filename or args.output}: {err.strerror}") from None
    print(f"mt-shortlist: learnt from {info['lines']:,} sentence pairs in "
          f"{time.perf_counter() - start:.0f} s: {info['always']} pieces for every line, "
          f"{info['per_source']} per source piece; of the {info['vocabulary']:,} pieces a line "
          f"gets {info['line_pieces']:.0f} on average, and a batch of {BATCH_TOKENS:,} tokens "
          f"(its union, what the output layer computes) {info['batch_pieces']:.0f}; wrote "
          f"{args.output}", file=sys.stderr)


if __name__ == "__main__":  # python -m mt.shortlist: it exited 0 without a word or a file
    main()
