"""The Transformer encoder-decoder of Vaswani et al. (2017), with an incremental decoding interface.

Mask convention: a boolean tensor where ``True`` means *may attend*, which is what
``F.scaled_dot_product_attention`` takes (decoding's cache and shortlists add a 0/-inf bias
instead, for speed: ``mt.kvcache.block_attention`` says why). Padded *keys* are masked; a query
row is never fully masked because every source sentence ends with EOS and targets are
right-padded, so a real token always precedes the padding. The decoder's self-attention needs
only the causal mask for that reason: a right-padded target's real positions never look at the
pads after them.

Shapes in comments: B batch, S source length, T target length, D d_model, H heads, K head dim,
V vocabulary.

Inference shape (what every search uses, through ``mt.incremental.Decoder``): ``encode`` once,
``init_cache`` once (it computes every layer's cross-attention keys/values), then ``decode_step``
per token (``project``, the output layer, may run apart); the cache can be ``reorder``-ed by a
batch index for beams and for dropping finished sentences. ``cfg`` gives the vocabulary size and
the longest sequence. The cache and the attention that reads it during decoding are in
mt/kvcache.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mt.config import PAD_ID, ModelConfig
from mt.kvcache import KVCache, onednn_float32_active

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
    second; frequency i of d_model / 2 is 10000^(-2i / d_model), the paper's, so wavelengths run
    from 2*pi to just under 10000*2*pi (2*pi*9647 at d_model 512).

    The paper interleaves sin/cos; tensor2tensor, fairseq and Marian concatenate them. The two are a
    fixed permutation of each other (the same model up to relabelled dimensions); we follow the
    implementations so that weights move to and from Marian/Hugging Face unchanged. The
    frequencies are Marian's and Hugging Face's; tensor2tensor and fairseq space them by
    log(10000) / (d_model / 2 - 1) instead, so their weights need their own table.
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
    """softmax(q k^T / sqrt(K)) v as three operators, for bf16/fp16 on CPU (and for float32
    while a search runs float32 products in oneDNN: ``MultiHeadAttention.attend``).

    PyTorch's fused CPU kernel is slow in reduced precision at translation's short lengths:
    forward plus backward of one attention (2,048 tokens, 4 heads of 64, bf16, 2 cores) takes
    25 ms fused against 3 ms as matmul-softmax-matmul, which made bf16 training slower than fp32.
    Without gradients (decoding's encoder, scoring, alignments, validation) the softmax runs in
    float32 and back: PyTorch's bf16 CPU softmax took 2.4x as long (32 x 8 x 46 x 46 scores:
    1.73 against 0.72 ms). With gradients it stays in the scores' dtype, whose forward plus
    backward was the faster one under autocast (6.3 against 6.6 ms).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    if torch.is_grad_enabled():
        weights = scores.softmax(dim=-1)
    else:
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)
    if dropout:
        weights = F.dropout(weights, dropout)
    return torch.matmul(weights, v)


def avoid_cudnn_attention(device: torch.device | str) -> None:
    """On a CUDA device, turns PyTorch's cuDNN attention backend off for this process.

    On Hopper, ``scaled_dot_product_attention`` picks cuDNN for bf16/fp16, and cuDNN builds an
    execution plan for each new input shape, which takes hundreds of milliseconds. Batches cut by
    token count have a new (batch, source, target) shape nearly every training step, and a search
    a new one nearly every decoding step, so most steps paid for plans. On an H200 (torch 2.11,
    2026-11-27) transformer_big bf16 training took 0.44 s per 25k-token step on new shapes against
    0.12 s on shapes already seen, the same for Hugging Face's Marian, and bf16 decoding was
    slower than float32 (which cuDNN does not take), for mt and Marian alike. Flash and
    memory-efficient attention need no plan. Process-wide, as PyTorch's backend flags are."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


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
        # The fused CPU kernel is slower than matmul-softmax-matmul in bf16, and in float32 too
        # while float32 products go to oneDNN (a search: its inner products then take a slow
        # path, 5x slower for the encoder of a Multi30k batch).
        if q.device.type == "cpu" and (q.dtype != torch.float32 or onednn_float32_active()):
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
        """One target position y (P, 1, D) for layer i, appending its keys/values to the cache:
        the cache's R rows, then P - R padding rows (``KVCache.padded_rows``)."""
        attn, cross = self.self_attn, self.cross_attn
        r, heads, hd = cache.rows, attn.heads, attn.head_dim
        n = r // cache.beams
        qkv = attn.qkv_proj(self.self_sub.input(y)).view(-1, 3, heads, hd)[:r]
        k_t, v = cache.append(i, qkv[:, 1:])
        # The beams of a sentence query its keys together: (N, H, beams, K).
        q = qkv[:, 0].view(n, cache.beams, heads, hd).transpose(1, 2)
        y = self.self_sub.output(y, attn.out_proj(cache.attend(q, k_t, v, cache.self_bias)))
        q = cross.q_proj(self.cross_sub.input(y))[:r]
        q = q.view(n, cache.beams, heads, hd).transpose(1, 2)
        out = cache.attend(q, cache.cross_k[i], cache.cross_v[i], cache.src_bias)
        y = self.cross_sub.output(y, cross.out_proj(out))
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
        if cfg.max_positions < 2:  # a checkpoint's config is not check_values'd
            raise ValueError(f"model.max_positions must be at least 2 (a token and EOS), got "
                             f"{cfg.max_positions}")
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
        # Decoding steps compute a bucketed number of rows (mt.kvcache.bucket_rows): set for
        # packed bfloat16 models on AMX (mt.inference.prepare_model).
        self.pad_step_rows = False
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

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor,
               project: bool = True) -> Tensor:
        """Teacher-forced decoder: tgt_in (B, T) starting with BOS -> logits (B, T, V), or with
        ``project=False`` the final states (B, T, D), for a caller that projects them in blocks."""
        y = self.embed(tgt_in, self.tgt_embed, self.tgt_positions)
        for layer in self.decoder_layers:
            y = layer(y, memory, src_mask)
        y = self.decoder_norm(y)
        return self.project(y) if project else y

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)"""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    def init_cache(self, memory: Tensor, src_mask: Tensor, max_len: int) -> KVCache:
        """An empty cache for up to ``max_len`` target steps, with every layer's cross-attention
        keys/values computed from memory (B, S, D)."""
        cross = [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]
        pad = max(KVCache.MIN_KEYS - memory.size(1), 0)  # masked source positions, zero keys

        def dense(x: Tensor, spec: tuple[int, ...]) -> Tensor:  # padded, or one copy at most
            return F.pad(x, spec) if pad else x.contiguous()

        return KVCache(len(self.decoder_layers), memory.size(0), self.cfg.heads,
                       self.cfg.d_model // self.cfg.heads, max_len,
                       [dense(k.transpose(-1, -2), (0, pad)) for k, _ in cross],
                       [dense(v, (0, 0, 0, pad)) for _, v in cross],
                       F.pad(src_mask, (0, pad), value=False), bucket=self.pad_step_rows)

    def decode_step(self, tokens: Tensor, cache: KVCache, project: bool = True,
                    padded: bool = False) -> Tensor:
        """Next-token logits for the last tokens (B,) given the cache -> (B, V); advances it.

        ``project=False`` returns the decoder's final states (B, D) instead, for a caller that
        applies ``project`` itself (search does, a block of rows at a time); ``padded=True``
        returns them with the cache's padding rows after the B (``KVCache.padded_rows``).
        """
        if cache.length >= cache.max_len:
            raise ValueError(
                f"decode_step at target position {cache.length} is past the cache's "
                f"max_len={cache.max_len}: pass a larger max_len to init_cache"
            )
        if tokens.size(0) != cache.rows:
            raise ValueError(f"decode_step got {tokens.size(0)} tokens for a cache of "
                             f"{cache.rows} rows")
        rows, padded_rows = tokens.size(0), cache.padded_rows
        if padded_rows > rows:
            tokens = F.pad(tokens, (0, padded_rows - rows), value=PAD_ID)
        y = self.embed(tokens[:, None], self.tgt_embed, self.tgt_positions, offset=cache.length)
        cache.start_step()
        for i, layer in enumerate(self.decoder_layers):
            y = layer.step(y, cache, i)
        cache.end_step()
        y = self.decoder_norm(y[:, 0] if padded else y[:rows, 0])
        return self.project(y) if project else y


def build_model(cfg: ModelConfig) -> Transformer:
    """The one builder: every variant is a field of ModelConfig, no registry."""
    return Transformer(cfg)


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
