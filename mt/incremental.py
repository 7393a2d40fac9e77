"""Incremental decoding, what every search steps through: each model's encoder output and cache,
and the next token's log-probabilities, averaged over the members of an :class:`Ensemble`.

The searches (``mt.search``, ``mt.constraints``) see a model only through ``Decoder``; the teacher-
forced passes (``mt.scoring``) and the loaders (``mt.inference``) use ``Ensemble`` and its helpers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


class Ensemble:
    """Several models that decode as one: per step, the (weighted) average of their
    log-probabilities.

    The average of log-probabilities is a product of experts; it is renormalised so that scores
    stay log-probabilities. Every member encodes the source and keeps its own cache, so members may
    differ in depth or width, but they must share the target vocabulary (a token id has to mean the
    same piece to all of them) and the source ids are given to all of them. ``weights`` (one per
    model, scaled to sum to 1; default equal) let a stronger member count more, as Marian's
    ``--weights``.
    """

    def __init__(self, models: list, weights: list[float] | None = None) -> None:
        if not models:
            raise ValueError("an ensemble needs at least one model")
        sizes = [m.cfg.tgt_vocab_size for m in models]
        if len(set(sizes)) > 1:
            raise ValueError(f"ensemble members must share the target vocabulary; got target "
                             f"vocabulary sizes {sizes}")
        weights = [1.0] * len(models) if weights is None else list(weights)
        if len(weights) != len(models):
            raise ValueError(f"{len(weights)} ensemble weights for {len(models)} models")
        if not all(0 < w < math.inf for w in weights):  # NaN fails too
            raise ValueError(f"ensemble weights must be above 0 and finite, got {weights}")
        self.models = list(models)
        top = max(weights)  # scaled first: a sum of huge weights would overflow to inf
        scaled = [w / top for w in weights]
        total = sum(scaled)
        self.weights = [w / total for w in scaled]


def mix_log_probs(log_probs: Iterable[Tensor], weights: list[float]) -> Tensor:
    """The renormalised weighted sum of the members' log-probabilities (..., V); each input is
    overwritten (they are the members' fresh float32 outputs)."""
    total = None
    for lp, w in zip(log_probs, weights, strict=True):
        lp = lp.mul_(w)
        total = lp if total is None else total.add_(lp)
    return torch.log_softmax(total, -1)


class Restricted:
    """A model (or an Ensemble) whose next token may only be one of some target pieces: a
    vocabulary shortlist (``mt.shortlist``) for one batch.

    ``vocab`` (V',) holds the pieces, sorted, the special ones (PAD, UNK, BOS, EOS: ids 0-3)
    first, so that a search over V' finds them at their usual ids and needs no other change: the
    searches see V' "tokens" and the caller maps ids in (``torch.searchsorted``) and out
    (``vocab[i]``). ``allowed`` (B, V') says which of them each sentence of the batch may use;
    the output layer computes V' logits, and each row's log-softmax runs over its own sentence's
    pieces only, so that a sentence's translation does not depend on the others in its batch (up
    to float rounding: the output layer's shape does).
    """

    def __init__(self, model, vocab: Tensor, allowed: Tensor) -> None:
        if not torch.equal(vocab[:4].cpu(), torch.arange(4)):
            raise ValueError("a restricted vocabulary must start with the special pieces 0-3")
        self.model, self.vocab, self.allowed = model, vocab, allowed

    def repeat_interleave(self, n: int) -> Restricted:
        """The same pieces for a batch whose every sentence comes n times in a row (sampling's
        n samples per sentence)."""
        return Restricted(self.model, self.vocab, self.allowed.repeat_interleave(n, dim=0))


def ensemble_members(model) -> list:
    """The models an Ensemble averages, or the one model."""
    if isinstance(model, Restricted):
        model = model.model
    return model.models if isinstance(model, Ensemble) else [model]


def first_member(model):
    """The model itself, or an Ensemble's first member: where one model is enough (its device,
    its layers, the attention that alignments read)."""
    return ensemble_members(model)[0]


def max_positions(model) -> int:
    """The longest sequence a model (or every member of an ensemble) accepts."""
    return min(m.cfg.max_positions for m in ensemble_members(model))


class Decoder:
    """The incremental state of one search: a cache per model, next-token log-probabilities.

    On a CPU the output layer and the log-softmax run a block of ``ROWS`` hypotheses at a time
    into one float32 buffer kept for the whole search. A step's logits are large (1,460 rows x
    8,000 tokens: 47 MB); produced whole, they and the log-probabilities were new memory every
    step and each passed through RAM, while a block stays in cache. The search then works on the
    buffer in place. Measured on those shapes (one thread): output layer, log-softmax, beam-score
    add and top-k 97 ms whole, 43 ms in blocks, as long as the output layer alone.
    """

    ROWS = 128

    def __init__(self, model, src: Tensor, max_len: int) -> None:
        self.models = ensemble_members(model)
        inner = model.model if isinstance(model, Restricted) else model
        self.weights = inner.weights if isinstance(inner, Ensemble) else [1.0]
        self.caches = []
        for m in self.models:
            memory, src_mask = m.encode(src)
            self.caches.append(m.init_cache(memory, src_mask, max_len))
        self.buffer: Tensor | None = None  # (rows, V) float32, reused across steps
        self.vocab: Tensor | None = None  # a shortlist's pieces (V',), or None: all of them
        self.projections = [m.project for m in self.models]
        self.size = self.models[0].cfg.tgt_vocab_size
        if isinstance(model, Restricted):
            if model.allowed.size(0) != src.size(0):
                raise ValueError(f"a restricted model for {model.allowed.size(0)} sentences was "
                                 f"given {src.size(0)}")
            self.vocab, self.size = model.vocab, model.vocab.numel()
            self.projections = [_restricted_projection(m, model.vocab) for m in self.models]
            # 0 or -inf per sentence and piece, added to the logits: its own pieces only
            self.bias = torch.zeros(model.allowed.shape, device=src.device
                                    ).masked_fill_(~model.allowed, -torch.inf)
            self.sentence = torch.arange(src.size(0), device=src.device)  # of each row

    def _logits(self, j: int, states: Tensor, rows: slice) -> Tensor:
        logits = self.projections[j](states)
        if self.vocab is not None:
            if self.bias.dtype != logits.dtype:  # once: the model's dtype (bf16 holds -inf)
                self.bias = self.bias.to(logits.dtype)
            logits.add_(self.bias[self.sentence[rows]])  # a fresh tensor: in place
        return logits

    def log_probs(self, tokens: Tensor) -> Tensor:
        """tokens (N,) -> float32 log-probabilities of the next token (N, V). The result is the
        decoder's buffer (valid until the next call), which the caller may modify. Under a
        shortlist (``Restricted``), tokens and the result's columns are indices into its pieces."""
        if self.vocab is not None:
            tokens = self.vocab[tokens]
        if len(self.models) == 1:
            m = self.models[0]
            # With the cache's padding rows (a shortlist's bias has none): the last block then
            # has one of a few sizes too (mt.kvcache.bucket_rows), its padding rows dropped.
            states = m.decode_step(tokens, self.caches[0], project=False,
                                   padded=self.vocab is None)
            rows = tokens.size(0)
            if self.buffer is None or self.buffer.size(0) < rows:
                self.buffer = states.new_empty(rows, self.size, dtype=torch.float32)
            out = self.buffer[:rows]
            cpu = states.device.type == "cpu"
            block = self.ROWS if cpu else max(rows, 1)
            for i in range(0, rows, block):
                part = out[i : i + block]
                logits = self._logits(0, states[i : i + block], slice(i, i + block))
                logits = logits[: part.size(0)]
                if cpu and logits.dtype != torch.float32:
                    # Cast first, then in place: on a CPU log_softmax(dtype=float32) of bf16
                    # logits took 1.3x as long as the two passes (128 x 8,000: 1.03 vs 0.78 ms).
                    logits = part.copy_(logits)
                torch.log_softmax(logits, -1, dtype=torch.float32, out=part)
            return out
        every = slice(None)
        return mix_log_probs((torch.log_softmax(
            self._logits(j, m.decode_step(tokens, cache, project=False), every), -1,
            dtype=torch.float32) for j, (m, cache) in enumerate(zip(self.models, self.caches,
                                                                   strict=True))),
            self.weights)

    def reorder(self, index: Tensor, beams: int = 1) -> None:
        for cache in self.caches:
            cache.reorder(index, beams)
        if self.vocab is not None:
            self.sentence = self.sentence[index]


def _restricted_projection(model, vocab: Tensor):
    """The model's output layer (and final logits bias) over the pieces ``vocab`` only: a plain
    layer's weight rows, or a packed or int8 layer's ``rows``."""
    layer = model.output_proj
    sub = (layer.rows(vocab) if hasattr(layer, "rows")
           else functools.partial(F.linear, weight=layer.weight[vocab],
                                  bias=None if layer.bias is None else layer.bias[vocab]))
    if model.final_logits_bias is None:
        return sub
    bias = model.final_logits_bias[vocab]
    return lambda y: sub(y) + bias
