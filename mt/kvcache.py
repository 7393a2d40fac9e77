"""The decoder's state for incremental decoding (``KVCache``) and the attention that reads it.

Beam search spends most of its time outside the linear layers here: appending one key/value slot
per hypothesis per step, attending over a sentence's slots, and re-indexing after each reorder.
Keeping that apart from the model's definition (mt/model.py) lets the model read as the paper's
architecture, and this module as the decoding-speed machinery it is; docs/decoding.md ("Speed")
says why each choice was made, docs/decoding-history.md how much each gained.
"""

from __future__ import annotations

import math
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


def amx_tiles() -> bool | None:
    """Whether this CPU has AMX (its tiles multiply bfloat16 and int8 matrices); None where this
    torch cannot tell."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return None if probe is None else bool(probe())


def _onednn_keeps_float32() -> bool:
    """Whether oneDNN may run float32 matrix products without changing their arithmetic.

    PyTorch sends float32 matrix products to MKL unless ``mkldnn.matmul.fp32_precision`` is
    "bf16", which hands them to oneDNN and *allows* it to round operands to bfloat16. oneDNN does
    that only with AMX (and on Arm); on other x86 CPUs it computes in float32, as MKL does up to
    the order of the sums. It matters because MKL runs its AVX2 code on AMD CPUs: at decoding
    shapes its batched products ran at 50 GFLOP/s on this project's Zen 5 core, oneDNN's 2-2.5x
    faster (docs/decoding-history.md).
    """
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.backends.mkldnn, "matmul")
            and amx_tiles() is False)


ONEDNN_FLOAT32 = _onednn_keeps_float32()
_onednn_users = 0  # threads inside float32_products_on_onednn (translate --workers)
_onednn_saved = "none"  # the setting before the first of them entered
_onednn_lock = threading.Lock()


@contextmanager
def float32_products_on_onednn() -> Iterator[None]:
    """Within it, float32 matrix products run in oneDNN, where that keeps their arithmetic.

    The switch is process-wide; a count of the threads inside keeps it on until the last leaves
    (concurrent searches do not turn it off under each other), which puts back what was there.
    """
    global _onednn_users, _onednn_saved
    if not ONEDNN_FLOAT32:
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    with _onednn_lock:
        _onednn_users += 1
        if _onednn_users == 1:
            _onednn_saved = matmul.fp32_precision
            matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        with _onednn_lock:
            _onednn_users -= 1
            if _onednn_users == 0:
                matmul.fp32_precision = _onednn_saved


def onednn_float32_active() -> bool:
    """Whether some thread is inside ``float32_products_on_onednn`` now (the switch is on)."""
    return _onednn_users > 0


def bucket_rows(rows: int) -> int:
    """The rows a decoding step computes for ``rows`` hypotheses, rounded up: 16 rows or fewer as
    they are, then a multiple of 16 up to 255 rows, of 32 up to 511, of 64 up to 1,023 and so on
    (eight sizes per doubling from 128 rows on, at most 1/8 more rows there).

    oneDNN builds a kernel (a primitive) for every new row count of a product, and beam search
    shrinks the batch by a few rows at almost every step. On the AMX CPU a new count cost 0.3-4.5
    ms per bfloat16 linear layer, more for more rows (0.5-1.2 float32, 0.2-1 int8) against
    0.1-0.6 ms for the product itself; ``translate`` of test2016 built 495 of them, 10% of its
    time. In buckets, a few dozen per layer shape serve every batch. The extra rows are padding:
    every operator outside attention works row by row, so they never touch a hypothesis's result.
    """
    if rows <= 16:
        return rows
    step = max(16, 1 << (rows.bit_length() - 4))
    return -(-rows // step) * step


def block_attention(q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor | None,
                    out: Tensor | None = None) -> Tensor:
    """Decoding attention, one sentence per batch entry: the queries of its beams together.

    q (N, H, Q, K) over keys given transposed, k_t (N, H, K, L), values v (N, H, L, K), bias
    broadcastable to (N, H, Q, L) and added to the scores (0: may attend, -inf: may not), in the
    scores' dtype -> (N * Q, 1, H * K), written into ``out`` when given. An added bias, not a
    boolean mask: ``masked_fill_`` with a mask broadcast over the heads took 10x as long as this
    add (0.46 vs 0.04 ms at 292 sentences x 4 heads x 5 beams x 81 slots).

    A block of a few queries over a few dozen keys: two small products and a softmax. The fused
    kernel costs more at these shapes: on CPU in bfloat16, with one query per row over the cache,
    replacing it by these products alone made beam search 1.22x faster (transformer_base, batch
    32 x beam 4, 30 steps, one thread; docs/decoding-history.md). Keys and values come as dense
    blocks (the cache's whole capacity), which oneDNN takes without a copy; search runs float32
    products in oneDNN too, where it keeps their arithmetic (``float32_products_on_onednn``).
    """
    # Scaled before the product: a contiguous copy (oneDNN would copy a strided operand, at a
    # cost larger than the product) and fewer elements to scale than the scores have.
    q = q * q.size(-1) ** -0.5
    scores = q @ k_t
    if bias is not None:
        scores.add_(bias)
    values = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    n, heads, queries, head_dim = values.shape
    if out is None:
        return values.transpose(1, 2).reshape(n * queries, 1, heads * head_dim)
    out.view(n, queries, heads, head_dim).copy_(values.transpose(1, 2))
    return out


class KVCache:
    """The decoder's state for incremental decoding, every layer's.

    Everything is kept once per *sentence* and beams never copy it. Row ``r`` of the batch (a
    hypothesis) is beam ``r % beams`` of sentence ``r // beams``. Each step appends one key/value
    *slot* per row to its sentence's slots: keys transposed in ``self_k`` (layers, N, H, K,
    capacity), values in ``self_v`` (layers, N, H, capacity, K); ``ancestors`` (R, t) records
    which slot holds each row's own key of each earlier step. A beam-search reorder then only
    re-indexes ``ancestors`` (a few hundred integers) instead of moving the keys: the beams of a
    sentence attend together over all of its slots (one small block product), each masked to the
    slots of its own ancestry. The wasted products are cheap; moving every layer's keys at every
    step was not (a seventh of a bfloat16 step). Both together made bfloat16 beam search 1.45x
    faster, float32 1.08x (docs/decoding.md). Sentences leaving the batch, or reordered, are the
    only time keys move.

    Attention reads every slot of the capacity, unfilled ones masked (they hold zeros, so that
    their zero weights give exact zeros): each layer's keys and values are then dense blocks,
    which oneDNN multiplies without first copying them (a slice of the filled slots is strided,
    and the copy cost more than the product). To keep the unfilled slots few, the capacity starts
    at ``FIRST_STEPS`` steps and grows by half when full; every growth copies the filled slots
    once, so the copies add up to about twice the final cache. With one slot per step and
    sentence (greedy search) and the capacity full, no mask is needed. Sentences that finish stay
    in the cache (``live`` maps the rows to their sentences; the finished ones get zero queries
    and their outputs are dropped) until half of it is finished, or a reorder permutes sentences:
    a move copies the whole cache, and in `translate` some sentence finishes at almost every step
    (waiting made a Multi30k test set decode 1.09x faster). A move (growth, or sentences leaving)
    writes into the storage the buffers had before the previous move when it is large enough:
    new memory costs page faults, which in `translate` cost more than the copies (reusing it made
    a Multi30k test set decode 1.13-1.22x faster together with the oneDNN products,
    docs/decoding-history.md).

    With ``bucket=True`` (set for packed bfloat16 models on AMX, ``mt.inference.prepare_model``)
    a step computes ``padded_rows`` rows (``bucket_rows``): the hypotheses, then padding rows that
    attention leaves out and gives zeros.

    The buffers are allocated at the first step, in the dtype of the keys themselves (under
    autocast they are bf16 while the encoder output is float32). Cross-attention keys/values are
    computed once from the encoder output, also per sentence (keys transposed, ready for the
    product with the queries).
    """

    FIRST_STEPS = 8  # steps the first buffer makes room for at the current beams
    GROWTH = 1.5  # capacity factor at each growth
    # Keys every attention row reads, at least: PyTorch's CPU softmax over fewer than 16 values
    # per row takes a scalar path, 5-10x slower than over 16 (1.0 vs 0.085 ms at 292 sentences
    # x 4 heads x 5 beams over 14 source words). Shorter sources are padded, masked.
    MIN_KEYS = 16

    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int,
                 cross_k: list[Tensor], cross_v: list[Tensor], src_mask: Tensor,
                 bucket: bool = False) -> None:
        self.max_len = max_len  # target positions this cache may hold
        self.bucket = bucket  # steps compute bucket_rows(rows) rows
        self.length = 0  # target positions filled so far
        self.slots = 0  # key/value slots filled per sentence (beams per step)
        self.beams = 1  # consecutive rows per sentence
        self.rows = rows
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.self_k: Tensor | None = None  # (layers, N, H, K, capacity), at the first step
        self.self_v: Tensor | None = None  # (layers, N, H, capacity, K)
        self.live: Tensor | None = None  # cache sentence of each row group; None: all, in order
        self._storage: Tensor | None = None  # the flat memory self_k and self_v are views of
        self._spare: Tensor | None = None  # the storage before the last move, for the next one
        self.capacity = 0  # slots per sentence the buffers hold (before the first step: 0)
        self.ancestors: Tensor | None = None  # (R, t): slot of each row's key at each step
        self.self_bias: Tensor | None = None  # (N, 1, beams, capacity) this step, or None
        self.cross_k, self.cross_v = cross_k, cross_v  # (N, H, K, S) and (N, H, S, K) per layer
        # of the keys, the scores and the attention biases (no decoder layer: no attention)
        self.dtype = cross_k[0].dtype if cross_k else torch.float32
        # (N, 1, 1, S): 0 where a source position may be attended, -inf where it is padding
        self.src_bias = torch.zeros(src_mask.shape, dtype=self.dtype, device=src_mask.device
                                    ).masked_fill_(~src_mask, -torch.inf)

    def start_step(self) -> None:
        """Claims this step's slots (one per row) and sets the ancestry bias of the step."""
        b, first = self.beams, self.slots
        n = self.rows // b
        if self.self_k is None:  # the buffers are made by the first append, this big
            self.capacity = self._wanted()
        elif first + b > self.capacity:
            self._resize(self._wanted(math.ceil(self.GROWTH * self.capacity)))
        own = first + torch.arange(b, device=self.src_bias.device).repeat(n)  # (R,)
        own = own[:, None]
        self.ancestors = own if self.ancestors is None else torch.cat([self.ancestors, own], 1)
        if first + b == self.length + 1 == self.capacity and self.live is None:
            self.self_bias = None  # every slot filled, all the row's own
        else:
            bias = torch.full((self.rows, self.capacity), -torch.inf, dtype=self.dtype,
                              device=own.device)
            bias = bias.scatter_(1, self.ancestors, 0.0).view(n, 1, b, self.capacity)
            if self.live is not None:  # finished sentences attend anywhere; their output is dropped
                full = bias.new_zeros(self.src_bias.size(0), 1, b, self.capacity)
                bias = full.index_copy_(0, self.live, bias)
            self.self_bias = bias

    @property
    def padded_rows(self) -> int:
        """The rows a step computes: the hypotheses, then (``bucket``) padding rows."""
        return bucket_rows(self.rows) if self.bucket else self.rows

    def end_step(self) -> None:
        self.length += 1
        self.slots += self.beams

    def append(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Stores this step's keys/values kv (R, 2, H, K) of ``layer``; returns its keys,
        transposed (N, H, K, capacity), and values (N, H, capacity, K), every slot of each
        sentence (the unfilled ones zero), both dense blocks."""
        b, first = self.beams, self.slots
        n = self.rows // b
        if self.self_k is None:
            self.self_k, self.self_v = self._buffers(kv, n, self.capacity)
            self.self_k.zero_()
            self.self_v.zero_()
        new = kv.view(n, b, 2, self.heads, self.head_dim)
        k, v = new[:, :, 0].permute(0, 2, 3, 1), new[:, :, 1].transpose(1, 2)
        if self.live is None:
            self.self_k[layer, :, :, :, first : first + b] = k
            self.self_v[layer, :, :, first : first + b] = v
        else:
            self.self_k[layer, :, :, :, first : first + b].index_copy_(0, self.live, k)
            self.self_v[layer, :, :, first : first + b].index_copy_(0, self.live, v)
        return self.self_k[layer], self.self_v[layer]

    def attend(self, q: Tensor, k_t: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
        """``block_attention`` of the rows' queries q (n, H, beams, K) over keys and values kept
        per cache sentence; with finished sentences still in the cache, they get zero queries
        and their outputs are dropped. -> (padded_rows, 1, H * K), the padding rows zero."""
        width = q.size(1) * q.size(3)
        padded = self.padded_rows
        out = None
        if padded > self.rows:
            out = q.new_empty(padded, 1, width)
            out[self.rows :].zero_()
        if self.live is None:
            if out is None:
                return block_attention(q, k_t, v, bias)
            block_attention(q, k_t, v, bias, out[: self.rows])
            return out
        full = q.new_zeros(k_t.size(0), *q.shape[1:]).index_copy_(0, self.live, q)
        every = block_attention(full, k_t, v, bias).view(k_t.size(0), -1, width)
        if out is None:
            return every[self.live].view(-1, 1, width)
        rows = out[: self.rows].view(-1, q.size(2), width)
        if torch.is_grad_enabled():  # out= records no gradient
            rows.copy_(every[self.live])
        else:
            torch.index_select(every, 0, self.live, out=rows)
        return out

    def _wanted(self, capacity: int = 0) -> int:
        """``capacity`` slots, but at least ``FIRST_STEPS`` more steps at the current beams, and
        no more than the remaining steps can fill (but ``MIN_KEYS``)."""
        most = self.slots + self.beams * (self.max_len - self.length)
        wanted = min(max(capacity, self.slots + self.beams * self.FIRST_STEPS), most)
        return max(wanted, self.MIN_KEYS)

    def _resize(self, capacity: int, sentences: Tensor | None = None) -> None:
        """New zeroed buffers of ``capacity`` slots with the filled ones copied (of
        ``sentences``)."""
        filled = self.slots
        old_k, old_v = self.self_k[..., :filled], self.self_v[:, :, :, :filled]
        n = old_k.size(1) if sentences is None else sentences.numel()
        k, v = self._buffers(old_k, n, capacity)
        if sentences is None:
            k[..., :filled], v[:, :, :, :filled] = old_k, old_v
        else:  # straight into the new buffers: no intermediate tensor
            torch.index_select(old_k, 1, sentences, out=k[..., :filled])
            torch.index_select(old_v, 1, sentences, out=v[:, :, :, :filled])
        k[..., filled:], v[:, :, :, filled:] = 0, 0
        self.self_k, self.self_v, self.capacity = k, v, capacity

    def _buffers(self, like: Tensor, n: int, capacity: int) -> tuple[Tensor, Tensor]:
        """Key and value buffers for ``n`` sentences and ``capacity`` slots, as views of one
        storage: the spare one (that of the buffers before the last move) where it is large
        enough, else a new one. The storage in use becomes the spare.

        Moving the cache into memory the process has already touched matters on CPU: a fresh
        allocation of tens of MB costs more in page faults than the copy itself (a 53 MB
        gather took 21 ms into new memory, 8 ms into reused memory).
        """
        size = self.layers * n * self.heads * self.head_dim * capacity
        store = self._spare
        if store is None or store.numel() < 2 * size or store.dtype != like.dtype:
            store = like.new_empty(2 * size)
        # A GPU's caching allocator reuses freed memory itself: no second cache held there.
        keep = self.self_k is not None and store.device.type == "cpu"
        self._spare = self._storage if keep else None
        self._storage = store
        return (store[:size].view(self.layers, n, self.heads, self.head_dim, capacity),
                store[size : 2 * size].view(self.layers, n, self.heads, capacity, self.head_dim))

    def reorder(self, index: Tensor, beams: int = 1) -> None:
        """Keeps hypothesis rows ``index`` (R',) in that order; R' may be smaller or larger than R.

        Args:
            index: rows of the current batch.
            beams: rows per sentence after the reorder. Each run of ``beams`` consecutive entries
                of ``index`` must come from one sentence (beam search's parents do).

        Rows only re-index ``ancestors``. Keys and values (self- and cross-attention) move only
        when sentences leave or are reordered, and not when the kept ones are a prefix.
        """
        index = index.long()  # index_copy_ (sentences waiting in the cache) takes int64 only
        groups = index.view(-1, beams) // self.beams  # source sentence of every new row
        if beams > 1 and not bool((groups == groups[:, :1]).all()):
            raise ValueError(f"KVCache.reorder: each run of {beams} rows of the index must come "
                             "from one sentence (they share its keys)")
        sentences = groups[:, 0]  # (N',) source sentence per group
        if self.live is not None:
            sentences = self.live[sentences]  # its place in the cache
        if self.ancestors is not None:
            self.ancestors = self.ancestors[index]
        more_beams = beams > self.beams
        self.beams, self.rows = beams, index.numel()
        # Beam search's first step runs one row per sentence: make room for its beams now, while
        # one slot is filled, not a few steps later with the whole cache to copy.
        capacity = self.capacity
        if more_beams and self.self_k is not None:
            capacity = max(capacity, self._wanted())
        k, cached = sentences.numel(), self.src_bias.size(0)
        self.live = None
        if k <= cached and torch.equal(sentences, torch.arange(k, device=index.device)):
            if self.self_k is not None:
                self.self_k, self.self_v = self.self_k[:, :k], self.self_v[:, :k]
                if capacity > self.capacity:
                    self._resize(capacity)
            for buffers in (self.cross_k, self.cross_v):
                buffers[:] = [buf[:k] for buf in buffers]
            self.src_bias = self.src_bias[:k]
        elif (self.self_k is not None and not more_beams and 2 * k >= cached
              and bool((sentences[1:] > sentences[:-1]).all())):
            # Sentences that finished stay in the cache until half are gone: a move copies the
            # whole cache, and in translate some sentence finishes at almost every step.
            self.live = sentences
        else:
            if self.self_k is not None:
                self._resize(capacity, sentences)
            for buffers in (self.cross_k, self.cross_v):
                buffers[:] = [buf.index_select(0, sentences) for buf in buffers]
            self.src_bias = self.src_bias.index_select(0, sentences)
