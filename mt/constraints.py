"""Lexically constrained beam search: every translation contains given target phrases.

A translator's terminology ("Vertrag" for "contract", a product name kept as it is) is a list of
target phrases per sentence. Beam search alone cannot be told to use them; a forced prefix only
fixes the start. Dynamic beam allocation (Post & Vilar, 2018; Sockeye's and fairseq's
``--constraints``) steers the search instead:

- every hypothesis tracks which phrases it has produced (and how far into one it is);
- each step's candidates are the usual best ones, plus, for every beam, its best token, the
  next token of each phrase it could advance, and EOS where all its phrases are done;
- the beam is shared out among *banks* (hypotheses with the same number of constraint tokens
  produced), which take turns filling it, so that hypotheses that have placed a phrase survive
  beside freer, better-scoring ones instead of being pushed out by them;
- EOS is allowed only to a hypothesis that holds every phrase, unless the output budget
  (``max_len_a``, ``max_len_b``, the model's maximum) is spent or nothing else is left (every
  other token banned by ``no_repeat_ngram``): then it ends as it is.

Scores stay the model's own log-probabilities, as in every search here: constraints choose which
hypotheses live, never what a token costs. With no phrase for a sentence its search is plain
beam search (``mt.search.beam_search``), token for token.

The per-sentence bookkeeping is Python (a few dozen candidates per sentence and step); the model
step, which dominates, is batched as in ``beam_search``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mt.incremental import Decoder
from mt.search import (
    NOT_A_NUMBER,
    Hypothesis,
    Prefix,
    check_beam,
    constrain_step,
    inference_search,
    length_limits,
    length_penalty,
)


def split_phrases(line: str) -> list[str]:
    """A line of a constraints file: phrases separated by tabs (fairseq's and Sockeye's
    convention); blank fields are no phrase, so an empty line has none."""
    return [p.strip() for p in line.split("\t") if p.strip()]


def encode_phrases(tokenizer, constraints: list[list[str]], name: str = "constraints",
                   first_line: int = 1) -> list[list[list[int]]]:
    """Per line, its phrases as target ids. A phrase the target vocabulary cannot spell (it would
    hold <unk>, which the translation would print as "⁇"; never with byte fallback) is refused,
    naming ``name`` and the line (``first_line`` is the number of the first). A phrase of only
    what normalization removes (a byte-order mark: line 1 of a file saved "UTF-8 with BOM" whose
    first line has no phrase; a zero-width space) is no phrase, as such an input line is empty."""
    flat = [p for phrases in constraints for p in phrases]
    ids = iter(tokenizer.encode_tgt(flat) if flat else [])
    out = []
    for i, phrases in enumerate(constraints):
        line = [next(ids) for _ in phrases]
        for p, p_ids in zip(phrases, line, strict=True):
            if UNK_ID in p_ids:
                raise ValueError(f"{name}:{first_line + i}: constraint {p!r} has characters the "
                                 "target vocabulary lacks")
        out.append([p_ids for p_ids in line if p_ids])
    return out


def _f32(x: float) -> float:
    """x rounded to float32: a token's log-probability as beam_search's float32 subtraction of
    two float32 scores gives it (the exact difference, correctly rounded)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def contains(tokens: list[int], phrase: list[int]) -> bool:
    """Whether ``phrase`` occurs in ``tokens`` as a contiguous run."""
    n = len(phrase)
    return any(tokens[i : i + n] == phrase for i in range(len(tokens) - n + 1))


def satisfied(tokens: list[int], phrases: list[list[int]]) -> bool:
    """Whether every phrase occurs in ``tokens``."""
    return all(contains(tokens, p) for p in phrases)


@dataclass(frozen=True)
class _State:
    """What a hypothesis holds of its sentence's phrases: ``met``, a bit per phrase it contains,
    and ``partial``, per phrase, the longest start of it that its output ends with (0 for a
    phrase met). Both follow from the output alone, so phrases that share pieces ("einem" and
    "einem Hut") or overlap themselves are tracked exactly. ``bank``: the constraint tokens held,
    those of the phrases met and the longest part of one under way."""

    met: int = 0
    partial: tuple[int, ...] = ()
    bank: int = 0


class _Phrases:
    """One sentence's constraints, and the moves of a hypothesis's state through them."""

    def __init__(self, phrases: list[list[int]]) -> None:
        self.phrases = [list(p) for p in phrases]
        self.done = (1 << len(self.phrases)) - 1
        self.start = _State(0, (0,) * len(self.phrases))
        self.firsts = {p[0] for p in self.phrases}

    def advance(self, state: _State, tokens: list[int], tok: int) -> _State:
        """The state of ``tokens + [tok]``, from ``state``, that of ``tokens``."""
        if tok not in self.firsts and not any(state.partial):
            return state  # most candidates: no phrase under way, none starts here
        met, partial, held = state.met, [], 0
        for i, p in enumerate(self.phrases):
            if met >> i & 1:
                partial.append(0)
                held += len(p)
                continue
            # The longest start of p that the output ends with: at most one longer than before.
            j = min(state.partial[i] + 1, len(p))
            while j and (p[j - 1] != tok or tokens[len(tokens) - j + 1 :] != p[: j - 1]):
                j -= 1
            if j == len(p):
                met |= 1 << i
                held += j
                j = 0
            partial.append(j)
        return _State(met, tuple(partial), held + max(partial, default=0))

    def next_tokens(self, state: _State) -> list[int]:
        """The tokens that advance a phrase not yet met: each one's next piece."""
        return list(dict.fromkeys(p[j] for i, (p, j) in enumerate(zip(self.phrases, state.partial,
                                                                      strict=True))
                                  if not state.met >> i & 1))


def allot(banks: list[int], k: int) -> list[int]:
    """Dynamic beam allocation: of candidates given best first with their ``banks``, the indices
    of the k that take the beam. The banks present take turns, the fullest first (the one
    nearest to holding every constraint), each giving its best candidate not yet taken: a bank
    may not crowd out the others, and no slot is kept for a bank without candidates (Hu et al.,
    2019, as fairseq). With one bank (no constraints) it is the k best. Indices in score order.
    """
    taken: dict[int, int] = {}
    turns = []
    for i, b in enumerate(banks):
        turns.append((taken.get(b, 0), -b, i))
        taken[b] = taken.get(b, 0) + 1
    return sorted(i for _, _, i in sorted(turns)[:k])


@inference_search
def constrained_beam_search(model, src: Tensor, constraints: list[list[list[int]]],
                            beam_size: int = 5, lenpen: float = 0.6, nbest: int = 1,
                            max_len_a: float = 1.5, max_len_b: int = 10, min_len: int = 0,
                            prefixes: list[list[int]] | None = None,
                            no_repeat_ngram: int = 0) -> list[list[Hypothesis]]:
    """Beam search in which each sentence's output must contain its phrases.

    Args:
        model, src, beam_size, lenpen, nbest, max_len_a, max_len_b, min_len, prefixes,
            no_repeat_ngram: as in ``mt.search.beam_search``.
        constraints: per sentence, its target phrases (token ids, no special tokens; an empty
            list: none). A beam of at least the phrases' total tokens + 1 gives every bank a slot.
    Returns:
        per sentence (input order), its ``nbest`` hypotheses: those holding every phrase first,
        then by score. A hypothesis without them all comes only when the output budget ran out
        first, or ``no_repeat_ngram`` left it nothing but EOS (``satisfied`` tells).
    """
    b, k, device = src.size(0), beam_size, src.device
    if len(constraints) != b:
        raise ValueError(f"got {len(constraints)} constraint lists for {b} sentences")
    check_beam(beam_size, nbest, no_repeat_ngram)
    for i, phrases in enumerate(constraints):
        for p in phrases:
            if not p or any(t in (PAD_ID, BOS_ID, EOS_ID) for t in p):
                raise ValueError(f"constraint of sentence {i} is empty or holds a special "
                                 f"token: {p}")
    sentences = [_Phrases(c) for c in constraints]
    prefix = Prefix(prefixes, b, device)
    limits = length_limits(model, src, max_len_a, max_len_b, prefix)
    dec = Decoder(model, src, int(limits.max()))

    active = list(range(b))  # original sentence of each active sentence
    # Per active sentence, its live beams: (score, tokens, token log-probs, state).
    beams: list[list[tuple[float, list[int], list[float], _State]]] = [
        [(0.0, [], [], sentences[i].start)] for i in range(b)]
    tokens = torch.full((b,), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    step = 0
    while active:
        width = len(beams[0])  # 1 at step 0, k after
        n = len(active)
        lprobs = dec.log_probs(tokens)
        if torch.isnan(lprobs).any():  # (a check per step: this search's steps are Python's)
            raise FloatingPointError(NOT_A_NUMBER)
        rows = torch.tensor(active, device=device).repeat_interleave(width)
        force_eos = limits[rows] <= step + 1
        history = None
        if no_repeat_ngram:
            history = torch.tensor([h[1] for hs in beams for h in hs], dtype=torch.long,
                                   device=device).view(n * width, step)
        # EOS only for a hypothesis holding every phrase, or with nothing else left: out of
        # budget, or every other token banned (no_repeat_ngram): it ends as it is.
        flat = [(sentences[s], h) for s, hs in zip(active, beams, strict=True) for h in hs]
        open_ = [h[3].met != phrases.done for phrases, h in flat]
        constrain_step(lprobs, step, min_len, force_eos, prefix,
                       rows if step < prefix.steps else None, history, no_repeat_ngram,
                       hold_eos=torch.tensor(open_, device=device))
        vocab = lprobs.size(-1)
        base = torch.tensor([h[0] for _, h in flat], device=device)
        totals = lprobs.add_(base.unsqueeze(1)).view(n, width * vocab)
        top_v, top_i = totals.topk(min(2 * k, width * vocab), dim=1)
        best_v, best_t = lprobs.view(n, width, vocab).max(dim=-1)
        # The tokens that advance a phrase, and EOS where every phrase is held.
        extra = [(r // width, r % width, t) for r, ((phrases, h), unmet) in
                 enumerate(zip(flat, open_, strict=True))
                 for t in (phrases.next_tokens(h[3]) if unmet else [EOS_ID])]
        extra_v = (totals[[e[0] for e in extra], [e[1] * vocab + e[2] for e in extra]].tolist()
                   if extra else [])
        per_sentence: list[dict[tuple[int, int], float]] = [{} for _ in range(n)]
        for i, (vs, ix) in enumerate(zip(top_v.tolist(), top_i.tolist(), strict=True)):
            for v, j in zip(vs, ix, strict=True):
                per_sentence[i][divmod(j, vocab)] = v
        for i, (vs, ts) in enumerate(zip(best_v.tolist(), best_t.tolist(), strict=True)):
            for w, (v, t) in enumerate(zip(vs, ts, strict=True)):
                per_sentence[i][w, t] = v
        for (i, w, t), v in zip(extra, extra_v, strict=True):
            per_sentence[i][w, t] = v

        next_active, next_beams, parents, next_tokens = [], [], [], []
        norm = length_penalty(step + 1, lenpen)
        for i, (s, hs) in enumerate(zip(active, beams, strict=True)):
            phrases = sentences[s]
            cands = sorted(((v, w, t) for (w, t), v in per_sentence[i].items()
                            if v != -torch.inf), key=lambda c: -c[0])
            states = [phrases.advance(hs[w][3], hs[w][1], t) for _, w, t in cands]
            banks = [st.bank for st in states]
            # Finished: EOS candidates among the k the beam would take; then the k that go on.
            for j in allot(banks, k):
                v, w, t = cands[j]
                if t == EOS_ID and len(finished[s]) < k:
                    h = hs[w]
                    finished[s].append(Hypothesis(h[1], v / norm, v, h[2] + [_f32(v - h[0])]))
            going = [j for j, (_, _, t) in enumerate(cands) if t != EOS_ID]
            chosen = [going[j] for j in allot([banks[j] for j in going], k)]
            if len(finished[s]) >= k or not chosen:
                continue
            kept = []
            for j in chosen:
                v, w, t = cands[j]
                h = hs[w]
                kept.append((v, h[1] + [t], h[2] + [_f32(v - h[0])], states[j]))
                parents.append(i * width + w)
                next_tokens.append(t)
            while len(kept) < k:  # fewer live candidates than slots: dead beams fill them
                kept.append((-torch.inf, kept[0][1], kept[0][2], kept[0][3]))
                parents.append(parents[-1])
                next_tokens.append(PAD_ID)
            next_active.append(s)
            next_beams.append(kept)
        if not next_active:
            break
        dec.reorder(torch.tensor(parents, device=device), k)
        tokens = torch.tensor(next_tokens, dtype=torch.long, device=device)
        active, beams = next_active, next_beams
        step += 1

    return [sorted(hyps, key=lambda h: (not satisfied(h.tokens, c), -h.score))[:nbest]
            for hyps, c in zip(finished, constraints, strict=True)]
