"""Greedy, beam and sampling search over the model's incremental interface.

Search knows the model only through ``mt.incremental.Decoder`` (the model's ``encode``,
``init_cache``, ``decode_step``, ``project`` and ``cfg``, and the cache's ``reorder``); it never
sees the trainer. Every search drops finished sentences from the active batch, so a long sentence
does not make the short ones pay for its steps, and keeps the per-step work in a handful of
batched tensor operations (no Python loop over rows in the hot path).

Scores: ``Hypothesis.logprob`` is the sum of the model's log-probabilities of the generated tokens,
EOS included; ``Hypothesis.score`` is that sum divided by the GNMT length penalty
``((5 + len) / 6) ** alpha`` with ``len`` counting EOS (alpha = 0: no normalisation). Beam search
ranks finished hypotheses by ``score``. Constraints (no EOS before ``min_len``, EOS forced when the
budget is spent, a forced prefix, no repeated n-gram) remove alternatives but never change the
chosen token's own log-probability, so a score always equals a teacher-forced re-scoring of the
same tokens.

Any search also takes an :class:`mt.incremental.Ensemble` in place of a model: the members'
log-probabilities are averaged (and renormalised), each member with its own cache.
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from mt.config import BOS_ID, EOS_ID, PAD_ID
from mt.incremental import Decoder, Restricted, max_positions
from mt.kvcache import float32_products_on_onednn


def inference_search(fn):
    """Runs a search under ``torch.inference_mode`` with float32 products in oneDNN where that
    keeps float32 (``mt.kvcache.float32_products_on_onednn``) for the whole of a CPU search.

    The switch is process-wide: flipped around single operators, it would send the products of
    a search running in another thread (``translate --workers``) to one library or the other by
    timing, and their last bits (hence near-ties) would depend on the number of workers.
    """

    @functools.wraps(fn)
    def run(model, src: Tensor, *args, **kwargs):
        # CPU only: a GPU search has no use for it, and while it is on, the process's
        # torch.get_float32_matmul_precision() raises.
        onednn = float32_products_on_onednn() if src.device.type == "cpu" else nullcontext()
        with torch.inference_mode(), onednn:
            return fn(model, src, *args, **kwargs)

    return run


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS and EOS; a forced prefix included
    score: float  # logprob / length_penalty (what the beam ranks by)
    logprob: float  # raw sum of token log-probabilities, EOS included
    # each token's log-probability, EOS's last (len(tokens) + 1): word-level scores, confidence
    token_logprobs: list[float] = field(default_factory=list, compare=False, repr=False)


# What every search raises when the model's scores are NaN: its weights are finite (loading
# refuses others), so an activation overflowed (float16's can; huge weights can in any dtype).
# A search must not return an empty or short n-best list (translate would write no line for
# the sentence) nor tokens picked from NaN. Commands add what to change (``nan_hint``).
NOT_A_NUMBER = "the model's scores are not numbers (NaN): an activation overflowed"


def nan_hint(dtype: str) -> str:
    """What to change after NOT_A_NUMBER, by the dtype the model ran in."""
    if dtype in ("float16", "fp16"):
        return "; --dtype bfloat16 or float32 keeps activations finite"
    return "; the model's weights are likely damaged or diverged (huge values)"


def length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """GNMT length penalty (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src: Tensor, max_len_a: float, max_len_b: int, limit: int) -> Tensor:
    """Per-sentence output budget ``a * src_len + b`` (EOS included), capped by ``limit``."""
    src_len = (src != PAD_ID).sum(dim=1)
    # Clamped before the cast: a huge budget (inf: no limit but the model's) cast first
    # would wrap to a negative one; b past what a tensor holds (10**20) failed as a traceback.
    # In float64, as the formula reads in Python: in float32, 1.3 * 90 + 10 came to 126.99999
    # and a budget of 126. On the CPU: Apple's MPS has no float64 (once per batch).
    budget = src_len.to("cpu", torch.float64) * max_len_a + min(max_len_b, limit)
    return budget.clamp(min=1, max=limit).long().to(src.device)


class Prefix:
    """Per-sentence target prefixes, forced token by token before the free search starts."""

    def __init__(self, prefixes: list[list[int]] | None, b: int, device: torch.device) -> None:
        if prefixes is not None and len(prefixes) != b:
            raise ValueError(f"got {len(prefixes)} prefixes for {b} sentences")
        self.steps = max((len(p) for p in prefixes), default=0) if prefixes else 0
        self.lengths = torch.zeros(b, dtype=torch.long, device=device)
        self.tokens = torch.full((b, max(self.steps, 1)), PAD_ID, dtype=torch.long, device=device)
        for i, p in enumerate(prefixes or []):
            if any(t in (PAD_ID, BOS_ID, EOS_ID) for t in p):
                raise ValueError(f"prefix {i} contains a special token (PAD, BOS or EOS): {p}")
            self.lengths[i] = len(p)
            self.tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)

    def force(self, lprobs: Tensor, rows: Tensor, step: int, original: Tensor | None) -> None:
        """In place: rows (N,) of sentences still inside their prefix may only take its next token.

        ``original`` holds the unconstrained log-probabilities of the forced tokens, so the
        hypothesis score stays the model's own.
        """
        forced = self.lengths[rows] > step
        tok = self.tokens[rows, step]
        lp = original if original is not None else lprobs.gather(1, tok[:, None])[:, 0]
        lprobs[forced] = -torch.inf
        lprobs[forced, tok[forced]] = lp[forced]


def _ban_repeats(lprobs: Tensor, history: Tensor, n: int) -> None:
    """In place: -inf for every token that would repeat an n-gram of its row's output so far.

    lprobs (R, V) of the next token, history (R, t) the tokens generated so far (prefix included,
    BOS and EOS not). A token x is banned when ``history[-(n-1):] + [x]`` already occurs in
    history; n = 1 bans every token already generated. As fairseq's ``--no-repeat-ngram-size``
    and CTranslate2's ``no_repeat_ngram_size``: a guard against an under-trained model's loops.
    """
    t = history.size(1)
    if t < n:
        return
    grams = history.unfold(1, n, 1)  # (R, t - n + 1, n): every n-gram so far
    same = (grams[:, :, :-1] == history[:, t - n + 1 :].unsqueeze(1)).all(dim=-1)
    rows, j = same.nonzero(as_tuple=True)
    lprobs[rows, grams[rows, j, -1]] = -torch.inf


def constrain_step(lprobs: Tensor, step: int, min_len: int, force_eos: Tensor,
                   prefix: Prefix | None = None, rows: Tensor | None = None,
                   history: Tensor | None = None, no_repeat_ngram: int = 0,
                   hold_eos: Tensor | None = None) -> None:
    """In place: no PAD/BOS ever, no EOS before min_len (nor in the ``hold_eos`` rows, unless
    nothing else is left), no repeated n-gram of ``history`` (with ``no_repeat_ngram``), only EOS
    where the budget is spent, only the prefix token while a sentence is inside its prefix
    (``rows``: lprobs row -> sentence)."""
    original = None
    if prefix is not None and step < prefix.steps:
        original = lprobs.gather(1, prefix.tokens[rows, step][:, None])[:, 0]
    ban = no_repeat_ngram and history is not None and history.size(1) >= no_repeat_ngram
    # The model's own EOS log-probability, for rows that end whatever the constraints below say.
    eos = lprobs[:, EOS_ID].clone()
    lprobs[:, PAD_ID] = -torch.inf
    lprobs[:, BOS_ID] = -torch.inf
    if step < min_len:
        lprobs[:, EOS_ID] = -torch.inf
    if hold_eos is not None:
        lprobs[hold_eos, EOS_ID] = -torch.inf
    if ban:
        _ban_repeats(lprobs, history, no_repeat_ngram)
        # A row with nothing left (a tiny vocabulary, or min_len) may still end: EOS is never
        # part of an n-gram, so this only undoes min_len (or hold_eos), and keeps the model's own
        # score. Without the ban some token other than EOS is always left.
        stuck = ~torch.isfinite(lprobs.amax(dim=-1))
        if stuck.any():
            lprobs[stuck, EOS_ID] = eos[stuck]
    if original is not None:
        prefix.force(lprobs, rows, step, original)
    if force_eos.any():  # after the prefix: a prefix longer than the model's limit is cut
        own = eos[force_eos]
        lprobs[force_eos] = -torch.inf
        # EOS keeps its own probability (the hypothesis score stays honest, min_len, a prefix or
        # not) but is the only option; 0 only where the model's own underflowed.
        lprobs[force_eos, EOS_ID] = torch.where(torch.isfinite(own), own, torch.zeros_like(own))


def check_beam(beam_size: int, nbest: int, no_repeat_ngram: int) -> None:
    """The arguments every beam search refuses (beam_search, constrained_beam_search)."""
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    if no_repeat_ngram < 0:
        raise ValueError(f"no_repeat_ngram must be 0 (off) or positive, got {no_repeat_ngram}")


def length_limits(model, src: Tensor, max_len_a: float, max_len_b: int,
                  prefix: Prefix) -> Tensor:
    """Output budgets; a forced prefix always leaves room for EOS after it."""
    limit = max_positions(model)
    limits = max_lengths(src, max_len_a, max_len_b, limit)
    return torch.maximum(limits, (prefix.lengths + 1).clamp(max=limit))


def _sample(lprobs: Tensor, temperature: float, top_k: int, top_p: float,
            generator: torch.Generator | None, epsilon: float = 0.0) -> Tensor:
    """Draws one token per row (N, V) -> (N,) from the tempered, top-k / top-p / epsilon
    truncated distribution (Holtzman et al., 2020: the smallest set of tokens with mass >= top_p;
    Hewitt et al., 2022: no token of probability below epsilon, the most probable one always
    kept)."""
    # Less the row's best first: a tiny temperature then sends the best to 0, not to -inf
    # with every other token (which left multinomial nothing to draw from).
    logits = (lprobs - lprobs.amax(dim=-1, keepdim=True)) / temperature
    if epsilon > 0:
        rare = logits.softmax(dim=-1) < epsilon
        rare &= logits < logits.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(rare, -torch.inf)
    if 0 < top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p; the first always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[..., 0] = False  # even for top_p <= 0 (greedy)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    # A NaN row is drawn from uniformly, not refused: on a GPU, multinomial's check is a
    # device-side assert that no except can catch. Its NaN log-probability, recorded with the
    # token, makes greedy_search raise NOT_A_NUMBER at the end.
    probs = logits.softmax(dim=-1)
    probs = probs.masked_fill(probs.isnan(), 1.0)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@inference_search
def greedy_search(model, src: Tensor, max_len_a: float = 1.5, max_len_b: int = 10,
                  min_len: int = 0, lenpen: float = 0.0,
                  prefixes: list[list[int]] | None = None, sampling: bool = False,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  epsilon: float = 0.0, generator: torch.Generator | None = None,
                  no_repeat_ngram: int = 0) -> list[Hypothesis]:
    """Arg-max decoding, or ancestral sampling with ``sampling=True``.

    Args:
        model: a Transformer (mt.model) in eval mode, or an Ensemble.
        src: (B, S) source ids, right-padded.
        max_len_a, max_len_b: each output has at most ``a * src_len + b`` tokens, EOS included.
        min_len: EOS is forbidden before this many tokens.
        lenpen: GNMT alpha, only for the reported ``score`` (it does not change the search).
        prefixes: per sentence, target ids forced before the search goes free (or None).
        sampling: draw each token from the model's distribution instead of taking the arg-max.
        temperature, top_k, top_p, epsilon: the sampling distribution (softmax(logits / T), keep
            the k best tokens, keep the smallest set holding top_p of the mass, drop the tokens
            of probability below epsilon); 0 / 1.0 / 0 disable the cuts.
        generator: the random stream for sampling (seed it for reproducible samples; the samples
            then depend on the batch composition too).
        no_repeat_ngram: n > 0: no output repeats an n-gram of its own tokens (prefix included);
            a row left with no token may end with EOS even before ``min_len``.
    Returns:
        one Hypothesis per sentence, in input order. Its scores are the model's own
        log-probabilities (untempered) of the chosen tokens.
    """
    if sampling and not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if not 0 <= epsilon < 1:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon}")
    if no_repeat_ngram < 0:
        raise ValueError(f"no_repeat_ngram must be 0 (off) or positive, got {no_repeat_ngram}")
    b, device = src.size(0), src.device
    prefix = Prefix(prefixes, b, device)
    limits = length_limits(model, src, max_len_a, max_len_b, prefix)
    max_len = int(limits.max())
    dec = Decoder(model, src, max_len)
    active = torch.arange(b, device=device)  # original row of each active row
    tokens = torch.full((b,), BOS_ID, dtype=torch.long, device=device)
    out = torch.full((b, max_len), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)  # generated tokens, EOS included
    token_lp = torch.zeros((b, max_len), device=device)
    step = 0
    while active.numel():
        lprobs = dec.log_probs(tokens)
        constrain_step(lprobs, step, min_len, limits[active] <= step + 1, prefix, active,
                       out[active, :step] if no_repeat_ngram else None, no_repeat_ngram)
        if sampling:
            tokens = _sample(lprobs, temperature, top_k, top_p, generator, epsilon)
            scores = lprobs.gather(1, tokens[:, None])[:, 0]
        else:
            scores, tokens = lprobs.max(dim=-1)
        token_lp[active, step] = scores
        out[active, step] = tokens
        done = tokens == EOS_ID
        if done.any():
            lengths[active[done]] = step + 1
            keep = (~done).nonzero().squeeze(1)
            active, tokens = active[keep], tokens[keep]
            dec.reorder(keep)
        step += 1
    logprob = token_lp.sum(dim=1)  # zeros after EOS
    if torch.isnan(logprob).any():  # checked once here, not at every step
        raise FloatingPointError(NOT_A_NUMBER)
    norm = length_penalty(lengths.float(), lenpen) if lenpen else torch.ones_like(logprob)
    rows, n, lps, ss = out.tolist(), lengths.tolist(), logprob.tolist(), (logprob / norm).tolist()
    return [Hypothesis(r[: n_i - 1], s, lp, t[:n_i])
            for r, n_i, lp, s, t in zip(rows, n, lps, ss, token_lp.tolist(), strict=True)]


def sample_search(model, src: Tensor, nbest: int = 1, lenpen: float = 0.0, **kwargs
                  ) -> list[list[Hypothesis]]:
    """``nbest`` independent samples per sentence, best score first.

    Args:
        model, src: as in greedy_search.
        nbest: samples per sentence (each source row is repeated ``nbest`` times).
        lenpen: GNMT alpha for the scores the samples are sorted by.
        kwargs: greedy_search's (``temperature``, ``top_k``, ``top_p``, ``epsilon``,
            ``generator``, lengths, ``prefixes``).
    """
    prefixes = kwargs.pop("prefixes", None)
    if prefixes is not None:
        prefixes = [p for p in prefixes for _ in range(nbest)]
    if isinstance(model, Restricted):  # a shortlist's sentences, repeated as the sources are
        model = model.repeat_interleave(nbest)
    hyps = greedy_search(model, src.repeat_interleave(nbest, dim=0), lenpen=lenpen,
                         prefixes=prefixes, sampling=True, **kwargs)
    return [sorted(hyps[i : i + nbest], key=lambda h: -h.score)
            for i in range(0, len(hyps), nbest)]


def _block_size(vocab: int) -> int | None:
    """A block of tokens for ``_best`` that divides the vocabulary (a multiple of 16, for the
    vector units), or None."""
    return next((size for size in range(64, 257, 16) if vocab % size == 0), None)


def _best(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best continuations of each sentence: lprobs (n, beams, V) of the next token plus
    each beam's score (n, beams) -> values (n, k), best first, and their indices into beams * V.
    May modify lprobs (the decoder's buffer, not needed after this).

    ``topk`` over a sentence's 40,000 candidates (5 beams x 8,000 tokens) copies each row into a
    list of (value, index) pairs before it selects. Two steps select the same k: the best k
    blocks of 64 tokens by their maximum (a fast vector reduction), then the best k tokens
    within those k blocks (any token among the k best lies in one of them: otherwise k blocks
    would each hold a better one). The beams' scores are added to block maxima and to the
    picked blocks only. On real log-probabilities (240 sentences x 40,000) 7.7 ms became 2.5.
    """
    n, beams, vocab = lprobs.shape
    size = _block_size(vocab)
    if size is None or beams * vocab // size < k:  # one plain selection over all candidates
        cand = lprobs.add_(scores.unsqueeze(-1)).view(n, beams * vocab)
        if cand.size(1) < k:  # a tiny vocabulary at step 0: pad with impossible candidates
            cand = F.pad(cand, (0, k - cand.size(1)), value=-torch.inf)
        return cand.topk(k, dim=1)
    per_beam = vocab // size
    blocks = lprobs.view(n, beams * per_beam, size)
    maxima = blocks.amax(-1).view(n, beams, per_beam).add_(scores.unsqueeze(-1))
    which = maxima.view(n, beams * per_beam).topk(k, dim=1).indices  # (n, k) blocks
    picked = blocks.gather(1, which.unsqueeze(-1).expand(-1, -1, size))  # (n, k, size)
    picked += scores.gather(1, which // per_beam).unsqueeze(-1)
    values, j = picked.view(n, k * size).topk(k, dim=1)
    return values, which.gather(1, j // size) * size + j % size


@inference_search
def beam_search(model, src: Tensor, beam_size: int = 5, lenpen: float = 0.6, nbest: int = 1,
                max_len_a: float = 1.5, max_len_b: int = 10, min_len: int = 0,
                prefixes: list[list[int]] | None = None,
                no_repeat_ngram: int = 0) -> list[list[Hypothesis]]:
    """Batched beam search.

    Each step scores ``beam_size * V`` continuations per sentence and keeps the best
    ``2 * beam_size``: those ending in EOS become finished hypotheses (if they rank within the
    first ``beam_size``), the best ``beam_size`` others stay on the beam. A sentence is done when it
    has ``beam_size`` finished hypotheses (early stop), then it leaves the active batch. Without
    a length penalty (``lenpen=0``) it is done sooner, as soon as its ``nbest`` best finished
    hypotheses score at least its best live one: scores only fall as hypotheses grow, so no live
    one can overtake them, and the result is the one the longer search would return (this
    exact stop is CTranslate2's early exit; on Multi30k test2016 float32 took 3.0-3.1 s, not 3.55).

    Args:
        model: a Transformer in eval mode, or an Ensemble.
        src: (B, S) source ids, right-padded.
        beam_size: hypotheses kept per sentence.
        lenpen: GNMT alpha for ranking finished hypotheses.
        nbest: how many hypotheses to return per sentence (<= beam_size).
        max_len_a, max_len_b, min_len, prefixes, no_repeat_ngram: as in greedy_search.
    Returns:
        per sentence (input order), its ``nbest`` hypotheses, best first.
    """
    check_beam(beam_size, nbest, no_repeat_ngram)
    b, k, device = src.size(0), beam_size, src.device
    prefix = Prefix(prefixes, b, device)
    limits = length_limits(model, src, max_len_a, max_len_b, prefix)
    # Step 0 runs on B rows (every beam would start from the same BOS); the first reorder
    # expands the self-attention cache to B * k rows (cross-attention stays one per sentence).
    dec = Decoder(model, src, int(limits.max()))

    active = torch.arange(b, device=device)  # original sentence of each active sentence
    beams = 1  # live beams per sentence: 1 at step 0, k after
    scores = torch.zeros((b, 1), device=device)  # (n, beams) cumulative log-probabilities
    history = torch.empty((b, 1, 0), dtype=torch.long, device=device)  # generated tokens
    history_lp = torch.empty((b, 1, 0), device=device)  # and their log-probabilities
    tokens = torch.full((b,), BOS_ID, dtype=torch.long, device=device)
    n_finished = torch.zeros(b, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    exact_stop = lenpen == 0
    if exact_stop:  # per sentence, the scores of its nbest best finished hypotheses
        kept = torch.full((b, nbest), -torch.inf, device=device)
    step = 0
    while active.numel():
        n = active.numel()
        lprobs = dec.log_probs(tokens)
        force_eos = (limits[active] <= step + 1).repeat_interleave(beams)
        rows = active.repeat_interleave(beams) if step < prefix.steps else None
        constrain_step(lprobs, step, min_len, force_eos, prefix, rows,
                       history.view(n * beams, step) if no_repeat_ngram else None,
                       no_repeat_ngram)
        vocab = lprobs.size(-1)
        top_scores, top_idx = _best(lprobs.view(n, beams, vocab), scores, 2 * k)  # (n, 2k)
        top_beam, top_tok = (top_idx // vocab).clamp(max=beams - 1), top_idx % vocab
        top_lp = top_scores - scores.gather(1, top_beam)  # each candidate token's own

        # Finished candidates: EOS within the first k ranks and a finite score; a sentence takes
        # them in rank order while it has room (k finished at most).
        is_eos = (top_tok == EOS_ID) & torch.isfinite(top_scores)
        eos_ranked = is_eos[:, :k]
        if eos_ranked.any():
            room = (k - n_finished[active]).unsqueeze(1)
            accept = eos_ranked & (eos_ranked.cumsum(dim=1) <= room)
            n_finished[active] += accept.sum(dim=1)
            where = accept.nonzero()  # (F, 2): row in the active batch, rank
            lps = top_scores[:, :k][accept]
            parents = top_beam[:, :k][accept]
            toks = history[where[:, 0], parents]
            tok_lps = torch.cat([history_lp[where[:, 0], parents],
                                 top_lp[:, :k][accept].unsqueeze(1)], dim=1)
            if exact_stop:
                fresh = top_scores[:, :k].masked_fill(~accept, -torch.inf)
                kept[active] = torch.cat([kept[active], fresh], 1).topk(nbest, dim=1).values
            norm = length_penalty(step + 1, lenpen)  # generated tokens, EOS included
            for row, lp, t, t_lp in zip(active[where[:, 0]].tolist(), lps.tolist(),
                                        toks.tolist(), tok_lps.tolist(), strict=True):
                finished[row].append(Hypothesis(t, lp / norm, lp, t_lp))

        # The best k non-EOS candidates continue.
        cont_scores = top_scores.masked_fill(is_eos, -torch.inf)
        cont_scores, order = cont_scores.topk(k, dim=1)  # (n, k)
        cont_beam = top_beam.gather(1, order)
        cont_tok = top_tok.gather(1, order)
        cont_lp = top_lp.gather(1, order)

        # Done: k finished, or every live beam is -inf (the budget is spent), or (lenpen 0) no
        # live beam can overtake the nbest best finished.
        done = (n_finished[active] >= k) | ~torch.isfinite(cont_scores[:, 0])
        if exact_stop:
            done |= kept[active, -1] >= cont_scores[:, 0]
        if done.any():
            # topk ranks NaN first: one NaN beam made a sentence "done" with what it had
            if torch.isnan(cont_scores[:, 0]).any():  # (a step that waits on the device anyway)
                raise FloatingPointError(NOT_A_NUMBER)
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            cont_scores, cont_beam, cont_tok = cont_scores[keep], cont_beam[keep], cont_tok[keep]
            cont_lp, history, history_lp = cont_lp[keep], history[keep], history_lp[keep]
            active = active[keep]
            base = keep.unsqueeze(1) * beams
        else:
            base = torch.arange(0, n * beams, beams, device=device).unsqueeze(1)
        parent = (base + cont_beam).view(-1)  # rows in the current batch
        ancestry = cont_beam.unsqueeze(-1).expand(-1, -1, history.size(-1))
        history = torch.cat([history.gather(1, ancestry), cont_tok.unsqueeze(-1)], dim=-1)
        history_lp = torch.cat([history_lp.gather(1, ancestry), cont_lp.unsqueeze(-1)], dim=-1)
        scores = cont_scores
        tokens = cont_tok.view(-1)
        dec.reorder(parent, k)
        beams = k
        step += 1

    if not all(finished):  # NaN scores: no EOS is ever finite, so nothing finished
        raise FloatingPointError(NOT_A_NUMBER)
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]
