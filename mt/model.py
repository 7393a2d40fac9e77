"""The Transformer encoder-decoder of Vaswani et al. (2017), with an incremental decoding interface.

Mask convention (the only one in `mt`): a boolean tensor where ``True`` means *may attend*, which
is what ``F.scaled_dot_product_attention`` takes. Padded *keys* are masked; a query row is never
fully masked because every source sentence ends with EOS and targets are right-padded, so a real
token always precedes the padding. The decoder's self-attention needs only the causal mask for
that reason: a right-padded target's real positions never look at the pads after them.

Shapes in comments: B batch, S source length, T target length, D d_model, H heads, K head dim,
V vocabulary.

Inference shape (``search`` uses only these): ``encode`` once, ``init_cache`` once (it computes
every layer's cross-attention keys/values), then ``decode_step`` per token; the cache can be
``reorder``-ed by a batch index for beams and for dropping finished sentences.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.config import PAD_ID, ModelConfig

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal positions (``learned=False``) or a learned table (``learned=True``)."""

    def __init__(self, d_model: int, max_positions: int, learned: bool) -> None:
        super().__init__()
        self.learned = learned
        if learned:
            self.table = nn.Embedding(max_positions, d_model)
        else:
            self.register_buffer("table", sinusoids(max_positions, d_model), persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """Returns the encodings of positions offset..offset+length-1: (length, D)."""
        table = self.table.weight if self.learned else self.table
        if offset + length > table.size(0):
            raise ValueError(
                f"sequence of {offset + length} tokens is longer than model.max_positions="
                f"{table.size(0)}"
            )
        return table[offset : offset + length]


def sinusoids(length: int, d_model: int) -> Tensor:
    """Sinusoidal positions (paper, 3.5), sines in the first half of the dimensions, cosines in the
    second, wavelengths from 2*pi to 10000*2*pi.

    The paper interleaves sin/cos; tensor2tensor, fairseq and Marian concatenate them. The two are a
    fixed permutation of each other (the same model up to relabelled dimensions); we follow the
    implementations so that weights move to and from Marian/Hugging Face unchanged.
    """
    half = d_model // 2
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / half))
    table = torch.zeros(length, d_model)
    table[:, :half] = torch.sin(position * inv_freq)
    table[:, half : 2 * half] = torch.cos(position * inv_freq)
    return table


class Dropout(nn.Dropout):
    """nn.Dropout whose CPU mask comes from torch.rand: 2.5x faster than the bernoulli kernel
    (fwd+bwd on 2,100 x 256 activations, 2 cores: 2.5 ms against 5.2 ms), which was a fifth of a
    bf16 training step of a small model. On GPUs the fused kernel stays."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        keep = torch.rand(x.shape) >= self.p
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - self.p)))


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                       dropout: float) -> Tensor:
    """softmax(q k^T / sqrt(K)) v as three operators, for bf16/fp16 on CPU.

    PyTorch's fused CPU kernel is slow in reduced precision at translation's short lengths:
    forward plus backward of one attention (2,048 tokens, 4 heads of 64, bf16, 2 cores) takes
    25 ms fused against 3 ms as matmul-softmax-matmul, which made bf16 training slower than fp32.
    In float32 the fused kernel is the faster one and stays.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    weights = scores.softmax(dim=-1)
    if dropout:
        weights = F.dropout(weights, dropout)
    return torch.matmul(weights, v)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention.

    Self-attention projects queries, keys and values with one fused matrix; cross-attention
    projects queries from the decoder and keys/values (fused) from the encoder output, so that the
    keys/values can be computed once per source sentence during decoding.
    """

    def __init__(self, d_model: int, heads: int, dropout: float, self_attention: bool) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"model.d_model={d_model} is not divisible by model.heads={heads}")
        self.heads = heads
        self.head_dim = d_model // heads
        self.dropout = dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        else:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, H, L, K)"""
        b, length, _ = x.shape
        return x.view(b, length, self.heads, self.head_dim).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the encoder output: 2 x (B, H, S, K)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """q (B, H, Lq, K), k/v (B, H, Lk, K), mask broadcastable to (B, H, Lq, Lk) -> (B, Lq, D)"""
        dropout = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and q.dtype != torch.float32:
            out = explicit_attention(q, k, v, mask, causal, dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=causal)
        b, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, length, -1))

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False,
                memory: Tensor | None = None) -> Tensor:
        """Full (non-incremental) attention of x (B, L, D) over itself or over memory (B, S, D)."""
        if self.self_attention:
            q, k, v = (self.split_heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))
        else:
            q = self.split_heads(self.q_proj(x))
            k, v = self.project_kv(memory)
        return self.attend(q, k, v, mask, causal)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear -> activation -> dropout -> Linear."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str, dropout: float) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"model.activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class Sublayer(nn.Module):
    """Residual connection with LayerNorm: post-norm ``LN(x + f(x))``, pre-norm ``x + f(LN(x))``."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def input(self, x: Tensor) -> Tensor:
        """What the sublayer function sees."""
        return self.norm(x) if self.pre_norm else x

    def output(self, x: Tensor, fx: Tensor) -> Tensor:
        """Adds the sublayer's output to the residual stream."""
        y = x + self.dropout(fx)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, True)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.attn_sub = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.ffn_sub = Sublayer(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        """x (B, S, D), src_mask (B, 1, 1, S) -> (B, S, D)"""
        x = self.attn_sub.output(x, self.self_attn(self.attn_sub.input(x), mask=src_mask))
        return self.ffn_sub.output(x, self.ffn(self.ffn_sub.input(x)))


class KVCache:
    """The decoder's state for incremental decoding, every layer's.

    Self-attention keys/values of every layer live in one tensor ``self_kv`` of shape
    (T, layers, 2, R, H, K), position first: a new step writes one contiguous slab per layer, and
    a beam reorder moves the filled positions of all layers with a single ``index_select`` into a
    second buffer (double buffering), one pass over the cache instead of a gather and a copy per
    layer. Attention reads a layer's keys as a strided (R, H, t, K) view, which
    ``scaled_dot_product_attention`` takes without copying. The time axis starts at
    ``FIRST_CAPACITY`` steps and doubles when full (up to ``max_len``), so a generous length budget
    costs no memory until it is used. The buffer is allocated at the first step, in the dtype of
    the keys themselves (under autocast they are bf16 while the encoder output is float32).

    Cross-attention keys/values are computed once from the encoder output and kept once per
    *sentence* (keys transposed, ready for the product with the queries): the ``beams`` consecutive
    rows of a sentence share them (their queries are attended together, as a block), so beams never
    copy them. ``reorder(index, beams)`` selects hypothesis rows: beams follow their parents with
    it, and finished sentences leave the batch with it.
    """

    FIRST_CAPACITY = 32  # target steps the first buffer holds; most sentences need no growth

    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int,
                 cross_k: list[Tensor], cross_v: list[Tensor], src_mask: Tensor) -> None:
        self.max_len = max_len  # target positions this cache may hold
        self.length = 0  # target positions filled so far
        self.beams = 1  # consecutive rows per sentence
        self.rows = rows
        self.step_shape = (layers, 2, rows, heads, head_dim)  # one position of self_kv
        self.self_kv: Tensor | None = None  # (T, layers, 2, R, H, K), allocated at the first step
        self._storage: Tensor | None = None  # the flat buffer self_kv views
        self._spare: Tensor | None = None  # the other buffer of the double buffering
        self.cross_k, self.cross_v = cross_k, cross_v  # (N, H, K, S) and (N, H, S, K) per layer
        self.src_mask = src_mask  # (N, 1, 1, S)

    def append(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Stores the new step's keys/values kv (2, R, H, K) of ``layer``; returns the layer's keys
        and values so far, each (R, H, t + 1, K)."""
        t = self.length
        if self.self_kv is None:
            self._allocate(min(self.max_len, self.FIRST_CAPACITY), kv)
        elif t == self.self_kv.size(0):
            self._grow()
        self.self_kv[t, layer] = kv
        filled = self.self_kv[: t + 1, layer]  # (t + 1, 2, R, H, K)
        return filled[:, 0].permute(1, 2, 0, 3), filled[:, 1].permute(1, 2, 0, 3)

    def _allocate(self, capacity: int, like: Tensor) -> None:
        self._storage = like.new_empty(capacity * math.prod(self.step_shape))
        self.self_kv = self._storage.view(capacity, *self.step_shape)
        self._spare = None

    def _grow(self) -> None:
        """Doubles the time axis (capped at max_len); called when a step finds it full."""
        old = self.self_kv
        self._allocate(min(2 * old.size(0), self.max_len), old)
        self.self_kv[: self.length] = old[: self.length]

    def reorder(self, index: Tensor, beams: int = 1) -> None:
        """Keeps hypothesis rows ``index`` (R',) in that order; R' may be smaller or larger than R.

        Args:
            index: rows of the current batch.
            beams: rows per sentence after the reorder. Each run of ``beams`` consecutive entries
                of ``index`` must come from one sentence (beam search's parents do).

        Keeping a prefix ``0..R'-1`` (nothing changed, or the last rows finished) only takes
        views. Otherwise the filled steps are gathered into the spare buffer, which then becomes
        the cache. Cross-attention keys/values move only when sentences leave or are reordered.
        """
        m, n = index.numel(), self.length
        sentences = index.view(-1, beams)[:, 0] // self.beams  # (N',) source sentence per group
        self.beams, self.rows = beams, m
        self.step_shape = self.step_shape[:2] + (m,) + self.step_shape[3:]
        kv = self.self_kv
        if kv is None:
            pass  # nothing stored yet: the first step allocates for the new rows
        elif m <= kv.size(3) and torch.equal(index, torch.arange(m, device=index.device)):
            self.self_kv = kv[:, :, :, :m]
        else:
            shape = (kv.size(0), *self.step_shape)
            size = math.prod(shape)
            if self._spare is None or self._spare.numel() < size:
                self._spare = kv.new_empty(size)
            target = self._spare[:size].view(shape)
            torch.index_select(kv[:n], 3, index, out=target[:n])
            self._storage, self._spare = self._spare, self._storage
            self.self_kv = target
        k = sentences.numel()
        if k <= self.src_mask.size(0) and torch.equal(sentences,
                                                      torch.arange(k, device=index.device)):
            for buffers in (self.cross_k, self.cross_v):
                buffers[:] = [buf[:k] for buf in buffers]
            self.src_mask = self.src_mask[:k]
        else:
            for buffers in (self.cross_k, self.cross_v):
                buffers[:] = [buf.index_select(0, sentences) for buf in buffers]
            self.src_mask = self.src_mask.index_select(0, sentences)

    @property
    def batch_size(self) -> int:
        """Hypothesis rows (sentences x beams)."""
        return self.rows


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, False)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.self_sub = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.cross_sub = Sublayer(cfg.d_model, cfg.dropout, pre)
        self.ffn_sub = Sublayer(cfg.d_model, cfg.dropout, pre)

    def forward(self, y: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """y (B, T, D), memory (B, S, D), src_mask (B, 1, 1, S) -> (B, T, D)"""
        y = self.self_sub.output(y, self.self_attn(self.self_sub.input(y), causal=True))
        y = self.cross_sub.output(
            y, self.cross_attn(self.cross_sub.input(y), mask=src_mask, memory=memory)
        )
        return self.ffn_sub.output(y, self.ffn(self.ffn_sub.input(y)))

    def step(self, y: Tensor, cache: KVCache, i: int) -> Tensor:
        """One target position y (R, 1, D) for layer i, appending its keys/values to the cache."""
        attn = self.self_attn
        r, heads, hd = y.size(0), attn.heads, attn.head_dim
        qkv = attn.qkv_proj(self.self_sub.input(y)).view(r, 3, heads, hd)
        k, v = cache.append(i, qkv[:, 1:].transpose(0, 1))  # each (R, H, t + 1, K)
        # The fused kernel reads the cache's strided views as they are (no copy).
        out = F.scaled_dot_product_attention(qkv[:, 0, :, None], k, v)  # (R, H, 1, K)
        y = self.self_sub.output(y, attn.out_proj(out.view(r, 1, -1)))
        cross = self.cross_attn
        q = cross.q_proj(self.cross_sub.input(y))  # (R, 1, D)
        # The beams of a sentence query its keys together: (N, H, beams, K).
        q = q.view(r // cache.beams, cache.beams, heads, hd).transpose(1, 2)
        # A block of a few queries per sentence over its own keys: two small products and a softmax
        # cost less here than the fused kernel's set-up, which pays off for self-attention's many
        # rows (measured on CPU, float32 and bfloat16).
        scores = (q @ cache.cross_k[i]) * hd**-0.5  # (N, H, beams, S)
        scores = scores.masked_fill(~cache.src_mask, -torch.inf)
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ cache.cross_v[i]
        y = self.cross_sub.output(y, cross.out_proj(out.transpose(1, 2).reshape(r, 1, -1)))
        return self.ffn_sub.output(y, self.ffn(self.ffn_sub.input(y)))


class Transformer(nn.Module):
    """Encoder-decoder Transformer; the module docstring describes masks and decoding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.norm not in ("post", "pre"):
            raise ValueError(f"model.norm must be post or pre, got {cfg.norm!r}")
        if cfg.positions not in ("sinusoidal", "learned"):
            raise ValueError(
                f"model.positions must be sinusoidal or learned, got {cfg.positions!r}"
            )
        if cfg.tie_embeddings not in ("all", "decoder", "none"):
            raise ValueError(
                f"model.tie_embeddings must be all, decoder or none, got {cfg.tie_embeddings!r}"
            )
        if min(cfg.src_vocab_size, cfg.tgt_vocab_size) <= 0:
            raise ValueError(
                "model.src_vocab_size and model.tgt_vocab_size must be set (> 0), got "
                f"{cfg.src_vocab_size} and {cfg.tgt_vocab_size}"
            )
        if cfg.tie_embeddings == "all" and cfg.src_vocab_size != cfg.tgt_vocab_size:
            raise ValueError(
                "model.tie_embeddings=all needs a joint vocabulary (data.tokenizer.joint=true); "
                f"got source {cfg.src_vocab_size} and target {cfg.tgt_vocab_size} pieces"
            )
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = nn.Embedding(cfg.src_vocab_size, d, padding_idx=PAD_ID)
        if cfg.tie_embeddings == "all":
            self.tgt_embed = self.src_embed
        else:
            self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=PAD_ID)
        self.output_proj = nn.Linear(d, cfg.tgt_vocab_size, bias=False)
        if cfg.tie_embeddings != "none":
            self.output_proj.weight = self.tgt_embed.weight
        self.final_logits_bias = (
            nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.final_logits_bias else None
        )
        learned = cfg.positions == "learned"
        self.src_positions = PositionalEncoding(d, cfg.max_positions, learned)
        self.tgt_positions = PositionalEncoding(d, cfg.max_positions, learned)
        self.embed_scale = math.sqrt(d) if cfg.scale_embeddings else 1.0
        self.dropout = Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the residual stream un-normalised: a final LayerNorm closes each stack.
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(d) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d) if pre else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, zero biases, N(0, d^-0.5) embeddings (as in fairseq).

        The embedding scale makes sqrt(d) * N(0, d^-0.5) unit-variance inputs, and a tied output
        layer then produces logits of unit variance at initialisation. Embeddings are initialised
        after the projections: a tied output layer shares its weight with the target embedding,
        and that weight must end up with the embedding's init (and a zero padding row), not
        Xavier's, which for a large vocabulary is several times smaller.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.d_model**-0.5)
                if module.padding_idx is not None:
                    with torch.no_grad():
                        module.weight[module.padding_idx].zero_()
        if self.final_logits_bias is not None:
            nn.init.zeros_(self.final_logits_bias)

    def embed(self, tokens: Tensor, table: nn.Embedding, positions: PositionalEncoding,
              offset: int = 0) -> Tensor:
        """tokens (B, L) -> (B, L, D): scaled embeddings plus positions, then dropout."""
        x = table(tokens) * self.embed_scale + positions(tokens.size(1), offset)
        return self.dropout(x)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) ids, right-padded with PAD -> memory (B, S, D), src_mask (B, 1, 1, S)."""
        src_mask = (src != PAD_ID)[:, None, None, :]
        x = self.embed(src, self.src_embed, self.src_positions)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def project(self, y: Tensor) -> Tensor:
        """Decoder states (..., D) -> logits (..., V)."""
        logits = self.output_proj(y)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        return logits

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Teacher-forced decoder: tgt_in (B, T) starting with BOS -> logits (B, T, V)."""
        y = self.embed(tgt_in, self.tgt_embed, self.tgt_positions)
        for layer in self.decoder_layers:
            y = layer(y, memory, src_mask)
        return self.project(self.decoder_norm(y))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)"""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    def init_cache(self, memory: Tensor, src_mask: Tensor, max_len: int) -> KVCache:
        """An empty cache for up to ``max_len`` target steps, with every layer's cross-attention
        keys/values computed from memory (B, S, D)."""
        cross = [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]
        return KVCache(len(self.decoder_layers), memory.size(0), self.cfg.heads,
                       self.cfg.d_model // self.cfg.heads, max_len,
                       [k.transpose(-1, -2).contiguous() for k, _ in cross],
                       [v.contiguous() for _, v in cross], src_mask)

    def decode_step(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Next-token logits for the last tokens (B,) given the cache -> (B, V); advances it."""
        if cache.length >= cache.max_len:
            raise ValueError(
                f"decode_step at target position {cache.length} is past the cache's "
                f"max_len={cache.max_len}: pass a larger max_len to init_cache"
            )
        y = self.embed(tokens[:, None], self.tgt_embed, self.tgt_positions, offset=cache.length)
        for i, layer in enumerate(self.decoder_layers):
            y = layer.step(y, cache, i)
        cache.length += 1
        return self.project(self.decoder_norm(y[:, 0]))


def build_model(cfg: ModelConfig) -> Transformer:
    """The one builder: every variant is a field of ModelConfig, no registry."""
    return Transformer(cfg)


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
