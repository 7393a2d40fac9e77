"""Greedy and beam search over the model's incremental interface.

Search knows the model only through ``encode``, ``init_cache``, ``decode_step`` and the cache's
``reorder``; it never sees the trainer. Both searches drop finished sentences from the active
batch, so a long sentence does not make the short ones pay for its steps.

Scores are sums of log-probabilities of the generated tokens, EOS included; beam search ranks
finished hypotheses by that sum divided by the GNMT length penalty ``((5 + len) / 6) ** alpha``
(alpha = 0: no normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # length-normalised log-probability (what the beam ranks by)
    logprob: float  # raw sum of token log-probabilities, EOS included


def length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """GNMT length penalty (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src: Tensor, max_len_a: float, max_len_b: int, limit: int) -> Tensor:
    """Per-sentence output budget ``a * src_len + b`` (EOS included), capped by the model's limit."""
    src_len = (src != PAD_ID).sum(dim=1)
    return (src_len.float() * max_len_a + max_len_b).long().clamp(min=1, max=limit)


@torch.inference_mode()
def greedy_search(model, src: Tensor, max_len_a: float = 1.5, max_len_b: int = 10,
                  min_len: int = 0) -> list[Hypothesis]:
    """Arg-max decoding.

    Args:
        model: a Transformer (mt.model) in eval mode.
        src: (B, S) source ids, right-padded.
        max_len_a, max_len_b: each output has at most ``a * src_len + b`` tokens, EOS included.
        min_len: EOS is forbidden before this many tokens.
    Returns:
        one Hypothesis per sentence, in input order.
    """
    b = src.size(0)
    memory, src_mask = model.encode(src)
    limits = max_lengths(src, max_len_a, max_len_b, model.cfg.max_positions)
    cache = model.init_cache(memory, src_mask, int(limits.max()))
    active = torch.arange(b, device=src.device)  # original row of each active row
    tokens = torch.full((b,), BOS_ID, dtype=torch.long, device=src.device)
    out: list[list[int]] = [[] for _ in range(b)]
    logprob = torch.zeros(b, device=src.device)
    results: list[Hypothesis | None] = [None] * b
    step = 0
    while active.numel():
        lprobs = torch.log_softmax(model.decode_step(tokens, cache).float(), dim=-1)
        force_eos = limits[active] <= step + 1
        _constrain(lprobs, step, min_len, force_eos)
        scores, tokens = lprobs.max(dim=-1)
        logprob[active] += scores
        done = tokens == EOS_ID
        for row, tok in zip(active.tolist(), tokens.tolist(), strict=True):
            if tok != EOS_ID:
                out[row].append(tok)
        if done.any():
            for row in active[done].tolist():
                lp = float(logprob[row])
                results[row] = Hypothesis(out[row], lp, lp)
            keep = (~done).nonzero().squeeze(1)
            active, tokens = active[keep], tokens[keep]
            cache.reorder(keep)
        step += 1
    return results  # type: ignore[return-value]


def _constrain(lprobs: Tensor, step: int, min_len: int, force_eos: Tensor) -> None:
    """In place: no PAD/BOS ever, no EOS before min_len, only EOS where the budget is spent."""
    lprobs[:, PAD_ID] = -torch.inf
    lprobs[:, BOS_ID] = -torch.inf
    if step < min_len:
        lprobs[:, EOS_ID] = -torch.inf
    if force_eos.any():
        eos = lprobs[force_eos, EOS_ID].clone()
        lprobs[force_eos] = -torch.inf
        # EOS keeps its own probability (the hypothesis score stays honest) but is the only option.
        lprobs[force_eos, EOS_ID] = torch.where(torch.isfinite(eos), eos, torch.zeros_like(eos))


@torch.inference_mode()
def beam_search(model, src: Tensor, beam_size: int = 5, lenpen: float = 0.6, nbest: int = 1,
                max_len_a: float = 1.5, max_len_b: int = 10,
                min_len: int = 0) -> list[list[Hypothesis]]:
    """Batched beam search.

    Each step scores ``beam_size * V`` continuations per sentence and keeps the best
    ``2 * beam_size``: those ending in EOS become finished hypotheses (if they rank within the
    first ``beam_size``), the best ``beam_size`` others stay on the beam. A sentence is done when it
    has ``beam_size`` finished hypotheses, then it leaves the active batch.

    Args:
        model: a Transformer in eval mode.
        src: (B, S) source ids, right-padded.
        beam_size: hypotheses kept per sentence.
        lenpen: GNMT alpha for ranking finished hypotheses.
        nbest: how many hypotheses to return per sentence (<= beam_size).
        max_len_a, max_len_b, min_len: as in greedy_search.
    Returns:
        per sentence (input order), its ``nbest`` hypotheses, best first.
    """
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    b, k, device = src.size(0), beam_size, src.device
    memory, src_mask = model.encode(src)
    limits = max_lengths(src, max_len_a, max_len_b, model.cfg.max_positions)
    # Cross-attention keys/values are computed on B rows, then repeated for the beams.
    cache = model.init_cache(memory, src_mask, int(limits.max()))
    cache.reorder(torch.arange(b, device=device).repeat_interleave(k))

    active = torch.arange(b, device=device)  # original sentence of each active sentence
    scores = torch.full((b, k), -torch.inf, device=device)
    scores[:, 0] = 0.0  # all beams start identical: only the first may expand at step 0
    history = torch.empty((b, k, 0), dtype=torch.long, device=device)  # generated tokens
    tokens = torch.full((b * k,), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    step = 0
    while active.numel():
        n = active.numel()
        lprobs = torch.log_softmax(model.decode_step(tokens, cache).float(), dim=-1)
        force_eos = (limits[active] <= step + 1).repeat_interleave(k)
        _constrain(lprobs, step, min_len, force_eos)
        vocab = lprobs.size(-1)
        cand = (scores.unsqueeze(-1) + lprobs.view(n, k, vocab)).view(n, k * vocab)
        top_scores, top_idx = cand.topk(min(2 * k, k * vocab), dim=1)  # (n, 2k)
        top_beam, top_tok = top_idx // vocab, top_idx % vocab

        # Finished candidates: EOS within the first k ranks and a finite score.
        is_eos = (top_tok == EOS_ID) & torch.isfinite(top_scores)
        eos_ranked = is_eos.clone()
        eos_ranked[:, k:] = False
        if eos_ranked.any():
            length = step + 1  # generated tokens, EOS included
            norm = length_penalty(length, lenpen)
            for i, j in eos_ranked.nonzero().tolist():
                row = int(active[i])
                if len(finished[row]) < k:
                    lp = float(top_scores[i, j])
                    toks = history[i, int(top_beam[i, j])].tolist()
                    finished[row].append(Hypothesis(toks, lp / norm, lp))

        # The best k non-EOS candidates continue.
        cont_scores = top_scores.masked_fill(is_eos, -torch.inf)
        cont_scores, order = cont_scores.topk(k, dim=1)  # (n, k)
        cont_beam = top_beam.gather(1, order)
        cont_tok = top_tok.gather(1, order)

        done = torch.tensor([len(finished[r]) >= k for r in active.tolist()], device=device)
        # A sentence whose live beams are all -inf (budget spent) is done too.
        done |= ~torch.isfinite(cont_scores).any(dim=1)
        keep = (~done).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        parent = (keep.unsqueeze(1) * k + cont_beam[keep]).view(-1)  # rows in the current batch
        history = torch.cat([history[keep].gather(
            1, cont_beam[keep].unsqueeze(-1).expand(-1, -1, history.size(-1))),
            cont_tok[keep].unsqueeze(-1)], dim=-1)
        scores = cont_scores[keep]
        tokens = cont_tok[keep].view(-1)
        active = active[keep]
        cache.reorder(parent)
        step += 1

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]
