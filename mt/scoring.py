"""Teacher-forced passes over given translations: their scores (``translate --score``) and a
decoder layer's cross-attention (``translate --alignment``, ``scripts/plot_attention.py``).

Nothing is searched here: the target is given, so one forward pass per model gives every token's
log-probability or attention. Scores are computed as the searches compute them (mt.search), so a
translation scores the same whether a search found it or it was given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mt.config import BOS_ID, PAD_ID
from mt.incremental import ensemble_members, mix_log_probs
from mt.search import Hypothesis, inference_search, length_penalty


@inference_search
def forced_scores(model, src: Tensor, tgt: Tensor, lenpen: float = 0.0) -> list[Hypothesis]:
    """Scores given translations as a search would have scored them, had it produced them.

    One teacher-forced pass per model (an Ensemble mixes its members' log-probabilities with
    its weights and renormalises, as the searches do), so ``score`` and ``logprob`` equal what
    ``--nbest`` reports for the same tokens, up to the order of sums. What people score given
    translations for: reranking n-best lists, filtering parallel data by model score, and the
    log-probability (hence perplexity) of references.

    Args:
        model: a Transformer or an Ensemble.
        src: (B, S) source ids, right-padded (each ending in EOS).
        tgt: (B, T) target ids, each ending in EOS, right-padded with PAD.
        lenpen: GNMT alpha for ``score`` (0: ``score`` is the log-probability).
    Returns:
        per sentence a Hypothesis of its tokens (EOS dropped).
    """
    bos = torch.full((tgt.size(0), 1), BOS_ID, dtype=tgt.dtype, device=tgt.device)
    tgt_in = torch.cat([bos, tgt[:, :-1]], dim=1)  # after EOS only padding, which no token sees
    members = ensemble_members(model)
    real = tgt != PAD_ID
    positions = real.flatten()  # padding is neither projected nor scored
    states = [m.decode(tgt_in, *m.encode(src), project=False).flatten(0, 1)[positions]
              for m in members]
    targets = tgt.flatten()[positions]
    target_lp = torch.empty(targets.shape, dtype=torch.float32, device=tgt.device)
    # The log-probabilities over the vocabulary a block of positions at a time (16 MB of float32),
    # keeping only the target's: (B, T, V) whole would be gigabytes for large batches.
    block = max(1, 2**22 // members[0].cfg.tgt_vocab_size)
    for i in range(0, targets.numel(), block):
        lps = [torch.log_softmax(m.project(y[i : i + block]), -1, dtype=torch.float32)
               for m, y in zip(members, states, strict=True)]
        total = lps[0] if len(members) == 1 else mix_log_probs(lps, model.weights)
        target_lp[i : i + block] = total.gather(-1, targets[i : i + block, None])[:, 0]
    token_lp = torch.zeros(tgt.shape, dtype=torch.float32, device=tgt.device)
    token_lp.masked_scatter_(real, target_lp)
    lengths = real.sum(dim=1)
    logprob = token_lp.sum(dim=1)
    score = logprob / length_penalty(lengths.float(), lenpen)
    return [Hypothesis(row[: n - 1], s, lp_, t_lp[:n])
            for row, n, s, lp_, t_lp in zip(tgt.tolist(), lengths.tolist(), score.tolist(),
                                            logprob.tolist(), token_lp.tolist(), strict=True)]


@inference_search
def cross_attention(model, src: Tensor, tgt: Tensor, layer: int = -1) -> Tensor:
    """Teacher-forced cross-attention weights of one decoder layer, averaged over heads.

    Computed here from the layer's own modules (``softmax(q k^T / sqrt(K))`` with the source mask),
    so the model needs no attention-returning code path. Row ``j`` is the attention of the decoder
    position that predicts target token ``j``.

    Args:
        model: a Transformer (not an Ensemble: take one member).
        src: (B, S) source ids, right-padded.
        tgt: (B, T) target ids as generated (EOS included), right-padded.
        layer: which decoder layer (Python index; -1 the last).
    Returns:
        (B, T, S) float32 attention weights; padded source positions get 0.
    """
    layers = model.decoder_layers
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"alignment layer {layer} does not exist: the decoder has {len(layers)} "
                         "layers")
    memory, src_mask = model.encode(src)
    bos = torch.full((tgt.size(0), 1), BOS_ID, dtype=tgt.dtype, device=tgt.device)
    y = model.embed(torch.cat([bos, tgt[:, :-1]], dim=1), model.tgt_embed, model.tgt_positions)
    index = layer % len(layers)
    for block in layers[:index]:
        y = block(y, memory, src_mask)
    block = layers[index]
    y = block.self_sub.output(y, block.self_attn(block.self_sub.input(y), causal=True))
    attn = block.cross_attn
    q = attn.split_heads(attn.q_proj(block.cross_sub.input(y))).float()  # (B, H, T, K)
    k, _ = attn.project_kv(memory)
    weights = q @ k.float().transpose(-1, -2) / math.sqrt(attn.head_dim)  # (B, H, T, S)
    weights = weights.masked_fill(~src_mask, -torch.inf)
    return F.softmax(weights, dim=-1).mean(dim=1)
