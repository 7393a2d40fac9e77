"""Properties of mt.model: masks, incremental decoding, cache reordering, sizes, init, features.

Every test asserts an invariance or a known answer (no golden tensors). Models are tiny and in eval
mode (no dropout) unless a test is about training or dropout.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mt.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from mt.kvcache import (
    ONEDNN_FLOAT32,
    KVCache,
    block_attention,
    bucket_rows,
    float32_products_on_onednn,
)
from mt.model import (
    Dropout,
    FeedForward,
    MultiHeadAttention,
    PositionalEncoding,
    Transformer,
    build_model,
    count_parameters,
    explicit_attention,
    sinusoids,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 24
ATOL = 1e-5


def tiny_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, ffn_dim=64, heads=4, dropout=0.0,
        max_positions=64, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
    )
    return replace(cfg, **overrides)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return build_model(tiny_config(**overrides)).eval()


def random_tokens(b: int, length: int, seed: int = 1) -> torch.Tensor:
    """(b, length) ids of ordinary pieces (no specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (b, length), generator=g)


def padded_source(lengths: list[int], seed: int = 1) -> torch.Tensor:
    """Right-padded sources of the given lengths, each ending with EOS: (B, max(lengths))."""
    src = random_tokens(len(lengths), max(lengths), seed)
    for row, n in enumerate(lengths):
        src[row, n - 1] = EOS_ID
        src[row, n:] = PAD_ID
    return src


def target_in(b: int, length: int, seed: int = 2) -> torch.Tensor:
    """Decoder inputs starting with BOS: (b, length)."""
    tgt = random_tokens(b, length, seed)
    tgt[:, 0] = BOS_ID
    return tgt


NORMS = pytest.mark.parametrize("norm", ["post", "pre"])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; on a shared, busy CPU two threads made the overfit
    test 30x slower (thread hand-offs dominate kernels of a few microseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- masks --------------------------------------------------------------------------------------


@NORMS
def test_no_position_attends_to_the_future(norm: str) -> None:
    model = tiny_model(norm=norm)
    src, tgt = padded_source([7, 5, 6]), target_in(3, 8)
    with torch.no_grad():
        logits = model(src, tgt)
        for j in range(1, tgt.size(1)):
            changed = tgt.clone()
            changed[:, j:] = random_tokens(3, tgt.size(1) - j, seed=100 + j)
            assert not torch.equal(changed, tgt)
            other = model(src, changed)
            torch.testing.assert_close(other[:, :j], logits[:, :j], atol=ATOL, rtol=0)
            # ... and the changed positions do see the change (the comparison is not vacuous).
            assert (other[:, j:] - logits[:, j:]).abs().max() > 1e-3


@NORMS
def test_source_padding_changes_no_real_output(norm: str) -> None:
    model = tiny_model(norm=norm)
    src, tgt = padded_source([7, 4, 6]), target_in(3, 5)
    padded = torch.cat([src, torch.full((3, 5), PAD_ID)], dim=1)
    with torch.no_grad():
        memory, mask = model.encode(src)
        memory_p, mask_p = model.encode(padded)
        real = mask[:, 0, 0]  # (B, S)
        torch.testing.assert_close(memory_p[:, : src.size(1)][real], memory[real], atol=ATOL,
                                   rtol=0)
        torch.testing.assert_close(model(padded, tgt), model(src, tgt), atol=ATOL, rtol=0)


@NORMS
def test_target_padding_changes_no_real_output(norm: str) -> None:
    model = tiny_model(norm=norm)
    src, tgt = padded_source([7, 4, 6]), target_in(3, 5)
    padded = torch.cat([tgt, torch.full((3, 4), PAD_ID)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(src, padded)[:, :5], model(src, tgt), atol=ATOL, rtol=0)


def test_batch_equals_one_by_one() -> None:
    """A sentence's logits do not depend on the (padded) sentences beside it."""
    model = tiny_model()
    lengths = [3, 8, 5]
    src, tgt = padded_source(lengths), target_in(3, 6)
    with torch.no_grad():
        batch = model(src, tgt)
        for row, n in enumerate(lengths):
            alone = model(src[row : row + 1, :n], tgt[row : row + 1])
            torch.testing.assert_close(batch[row : row + 1], alone, atol=ATOL, rtol=0)


def _no_positions(self: PositionalEncoding, length: int, offset: int = 0) -> torch.Tensor:
    """Stands in for PositionalEncoding.forward: zero encodings for every position."""
    table = self.table.weight if self.learned else self.table
    return table.new_zeros(length, table.size(1))


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_encoder_without_positions_is_permutation_equivariant(
    positions: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(positions=positions)
    src = random_tokens(2, 9)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # With positions the encoder must see the order (else this test would prove nothing).
        with_pos = model.encode(src)[0]
        assert (model.encode(src[:, perm])[0] - with_pos[:, perm]).abs().max() > 1e-3
        # ModelConfig has no "no positions" option and mt/config.py is not ours to change, so the
        # test switches positions off by replacing PositionalEncoding.forward with zeros.
        monkeypatch.setattr(PositionalEncoding, "forward", _no_positions)
        memory = model.encode(src)[0]
        torch.testing.assert_close(model.encode(src[:, perm])[0], memory[:, perm], atol=ATOL,
                                   rtol=0)


# --- incremental decoding ------------------------------------------------------------------------


def step_logits(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits computed one step at a time with the cache: (B, T, V)."""
    memory, src_mask = model.encode(src)
    cache = model.init_cache(memory, src_mask, tgt.size(1))
    out = [model.decode_step(tgt[:, t], cache) for t in range(tgt.size(1))]
    assert cache.length == tgt.size(1)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize(
    "overrides",
    [
        {"norm": "post"},
        {"norm": "pre"},
        {"norm": "pre", "positions": "learned", "final_logits_bias": True},
        {"norm": "post", "tie_embeddings": "none", "activation": "gelu"},
    ],
    ids=["post", "pre", "pre-learned-bias", "post-untied-gelu"],
)
def test_cached_decoding_equals_full_forward(overrides: dict) -> None:
    model = tiny_model(**overrides)
    if model.final_logits_bias is not None:
        with torch.no_grad():
            model.final_logits_bias.normal_()  # zero at init; make it count
    src, tgt = padded_source([7, 3, 6]), target_in(3, 9)
    with torch.no_grad():
        full = model(src, tgt)
        steps = step_logits(model, src, tgt)
    assert (steps - full).abs().max().item() < 1e-5


@NORMS
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@pytest.mark.parametrize("tie", ["all", "decoder", "none"])
def test_cached_decoding_equals_full_forward_up_to_max_positions(norm: str, positions: str,
                                                                 tie: str) -> None:
    """Every variant of positions and tying, with a source and a target of exactly
    ``max_positions`` tokens: the cache's last step reads the last position of the table, as a
    full pass does (an offset one off would read the wrong row there, or past the table)."""
    model = tiny_model(norm=norm, positions=positions, tie_embeddings=tie, max_positions=10,
                       scale_embeddings=tie != "none")
    src, tgt = padded_source([10, 4, 7]), target_in(3, 10)
    with torch.no_grad():
        full = model(src, tgt)
        steps = step_logits(model, src, tgt)
    assert (steps - full).abs().max().item() < 1e-5


@NORMS
@pytest.mark.parametrize(
    "index",
    [[2, 0, 0, 1], [1, 0, 2], [2, 0], [0, 1], [0, 1, 2], [1]],
    ids=["expand", "permute", "shrink", "prefix", "identity", "single"],
)
def test_reordered_cache_equals_recomputation(norm: str, index: list[int]) -> None:
    """Decode 3 steps, reorder rows as beam search does, decode 3 more: the logits equal a fresh
    full forward pass on the reordered batch."""
    model = tiny_model(norm=norm)
    src, tgt = padded_source([7, 3, 6]), target_in(3, 6)
    idx = torch.tensor(index)
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.init_cache(memory, src_mask, 6)
        for t in range(3):
            model.decode_step(tgt[:, t], cache)
        cache.reorder(idx)
        assert cache.rows == len(index) and cache.length == 3
        later = torch.stack([model.decode_step(tgt[idx, t], cache) for t in range(3, 6)], dim=1)
        expected = model(src[idx], tgt[idx])[:, 3:]
    torch.testing.assert_close(later, expected, atol=ATOL, rtol=0)


def test_repeated_reorders_equal_recomputation() -> None:
    """Reorders compose: expand to beams, permute, shrink, step between each."""
    model = tiny_model(norm="pre")
    src, tgt = padded_source([5, 7]), target_in(2, 8)
    rows = torch.arange(2)  # the original row of each cache row
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.init_cache(memory, src_mask, 8)
        steps = [None, torch.tensor([0, 0, 1, 1]), None, torch.tensor([3, 1, 2, 0]), None,
                 torch.tensor([2, 0]), None, torch.tensor([1])]
        for t, index in enumerate(steps):
            if index is not None:
                cache.reorder(index)
                rows = rows[index]
            logits = model.decode_step(tgt[rows, t], cache)
        expected = model(src[rows], tgt[rows])[:, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_cache_grows_past_its_first_capacity_across_reorders() -> None:
    """The self-attention cache starts with room for a few steps and grows when full: 45 steps,
    with reorders before, at and after growths, still equal a full forward pass."""
    model = tiny_model(norm="post")
    src, tgt = padded_source([5, 7, 6]), target_in(3, 45)
    rows = torch.arange(3)
    reorders = {3: [2, 0, 1, 1], 32: [1, 0, 3, 2], 40: [3, 0]}
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.init_cache(memory, src_mask, 60)
        assert cache.self_k is None and KVCache.FIRST_STEPS < 45  # growth is exercised
        for t in range(45):
            if t in reorders:
                index = torch.tensor(reorders[t])
                cache.reorder(index)
                rows = rows[index]
            logits = model.decode_step(tgt[rows, t], cache)
        expected = model(src[rows], tgt[rows])[:, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # Attention reads every slot of the capacity: the unfilled ones must be exact zeros (garbage
    # there could be NaN, and a NaN value times a zero weight is NaN).
    assert cache.capacity > cache.slots
    assert not cache.self_k[..., cache.slots :].any()
    assert not cache.self_v[:, :, :, cache.slots :].any()


@pytest.mark.parametrize("capacity", [32, 2], ids=["no-growth", "growth"])
def test_beam_reorders_attend_only_along_each_rows_ancestry(monkeypatch, capacity: int) -> None:
    """Beams share their sentence's key slots and are masked to their own ancestry: after beam
    expansion, parent reorders (a beam taking another's history), a sentence leaving and a
    re-expansion, every row's logits equal a full forward pass on the tokens it was fed."""
    monkeypatch.setattr(KVCache, "FIRST_STEPS", capacity)
    model = tiny_model(norm="pre")
    src = padded_source([5, 7, 6])
    g = torch.Generator().manual_seed(5)
    # (index, beams) before each step; None: no reorder
    plan = [None, ([0, 0, 0, 1, 1, 1, 2, 2, 2], 3), ([2, 2, 0, 3, 4, 5, 8, 6, 6], 3), None,
            ([3, 3, 5, 6, 7, 8], 3), ([1, 1, 4, 3], 2), None]
    sentence = torch.arange(3)  # source sentence of each row
    fed = torch.empty(3, 0, dtype=torch.long)  # tokens each row has been fed, in its ancestry
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.init_cache(memory, src_mask, len(plan))
        for step in plan:
            if step is not None:
                index = torch.tensor(step[0])
                cache.reorder(index, step[1])
                sentence, fed = sentence[index], fed[index]
            tokens = torch.randint(4, VOCAB, (fed.size(0),), generator=g)
            logits = model.decode_step(tokens, cache)
            fed = torch.cat([fed, tokens[:, None]], dim=1)
        expected = model(src[sentence], fed)[:, -1]  # fed[:, 0] stands in for BOS
    assert cache.self_bias is not None  # the masked path ran
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_bucket_rows_known_answers() -> None:
    """Eight sizes per doubling above 16 rows, never fewer rows, at most 1/8 more from 128 on:
    the few kernel shapes a shrinking beam search needs."""
    assert [bucket_rows(r) for r in (1, 5, 16)] == [1, 5, 16]
    assert [bucket_rows(r) for r in (17, 100, 128, 129, 255, 256, 257)] == [
        32, 112, 128, 144, 256, 256, 288]
    assert [bucket_rows(r) for r in (1460, 1536, 1537)] == [1536, 1536, 1664]
    sizes = {bucket_rows(r) for r in range(1, 4097)}
    assert all(bucket_rows(r) >= r for r in range(1, 4097))
    assert all(bucket_rows(r) <= r * 9 / 8 for r in range(128, 4097))
    assert len(sizes) == 16 + 7 + 8 * 5  # 1-16, 32-128 by 16, then 8 per doubling to 4,096


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("pad", [False, True], ids=["rows", "bucketed"])
def test_padded_step_rows_leave_every_hypothesis_unchanged(pad: bool, grad: bool) -> None:
    """A model whose steps compute bucketed rows (``pad_step_rows``: padding rows after the
    hypotheses) gives every hypothesis the logits of a full forward pass: through beam expansion
    to 24 rows (32 computed), parents swapped within sentences, sentences finishing while they
    stay in the cache (``live``), one leaving it, and growth; with gradients on or off (a
    search runs without them, which lets attention gather into the padded rows directly)."""
    model = tiny_model(norm="pre")
    model.pad_step_rows = pad
    src = padded_source([5, 7, 6, 4, 8, 5, 6, 7])
    g = torch.Generator().manual_seed(7)
    beams = 3

    def rows_of(kept: list[int]) -> torch.Tensor:  # every beam of these sentence positions
        return torch.tensor([s * beams + b for s in kept for b in range(beams)])

    # (index, beams) before each step; None: no reorder
    plan = [None, (torch.arange(8).repeat_interleave(beams), beams), None,
            (torch.tensor([s * beams + b for s in range(8) for b in (2, 0, 0)]), beams),
            (rows_of([0, 1, 3, 4, 6, 7]), beams), None, (rows_of([0, 1, 2, 3, 4]), beams),
            None, None, None, None, None]
    sentence = torch.arange(8)
    fed = torch.empty(8, 0, dtype=torch.long)
    seen_live = seen_padding = False
    with torch.set_grad_enabled(grad):
        memory, src_mask = model.encode(src)
        cache = model.init_cache(memory, src_mask, len(plan) + 1)
        for step in plan:
            if step is not None:
                cache.reorder(*step)
                sentence, fed = sentence[step[0]], fed[step[0]]
            seen_live |= cache.live is not None
            seen_padding |= cache.padded_rows > cache.rows
            tokens = torch.randint(4, VOCAB, (fed.size(0),), generator=g)
            logits = model.decode_step(tokens, cache)
            assert logits.shape == (fed.size(0), VOCAB)
            fed = torch.cat([fed, tokens[:, None]], dim=1)
            expected = model(src[sentence], fed)[:, -1]  # fed[:, 0] stands in for BOS
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="got 3 tokens for a cache of 15 rows"):
            model.decode_step(tokens[:3], cache)
    assert seen_live and cache.capacity > KVCache.FIRST_STEPS * beams  # kept sentences, growth
    assert seen_padding == pad


def test_float32_attention_products_on_onednn_stay_float32() -> None:
    """Where oneDNN takes the float32 attention products it must not round them to bfloat16
    (its setting only *allows* that): a product at decoding shapes matches float64 to float32
    accuracy (bfloat16 operands would be off by about 1e-1 here). The setting is put back after
    the last user leaves, also with nested and concurrent users."""
    g = torch.Generator().manual_seed(0)
    q, k_t = torch.randn(256, 4, 64, generator=g), torch.randn(256, 64, 117, generator=g)
    before = torch.backends.mkldnn.matmul.fp32_precision
    with float32_products_on_onednn():
        with float32_products_on_onednn():
            product = q @ k_t
        if ONEDNN_FLOAT32:
            assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    error = (product.double() - q.double() @ k_t.double()).abs().max().item()
    assert error < 1e-4, error
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: block_attention(q.view(32, 8, 4, 64), k_t.view(32, 8, 64, 117),
                                                k_t.view(32, 8, 117, 64), None), range(8)))
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_sentences_leaving_reuse_the_caches_memory() -> None:
    """Dropping sentences moves the cache into the storage it used before the previous move (new
    memory of tens of MB costs more in page faults than the copy), and decoding stays exact."""
    model = tiny_model()
    src, tgt = padded_source([5, 7, 6, 4]), target_in(4, 4)
    rows = torch.arange(4)
    with torch.no_grad():
        cache = model.init_cache(*model.encode(src), 4)
        model.decode_step(tgt[rows, 0], cache)
        storages = [cache._storage]  # held, so that freed memory cannot come back by chance
        # never a prefix nor in order (sentences kept in order wait in the cache): a move each
        for t, index in ((1, [3, 1, 2]), (2, [2, 0]), (3, [1, 0])):
            cache.reorder(torch.tensor(index))
            rows = rows[index]
            storages.append(cache._storage)
            logits = model.decode_step(tgt[rows, t], cache)
        expected = model(src[rows], tgt[rows])[:, -1]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    ptr = [storage.data_ptr() for storage in storages]
    assert ptr[2] == ptr[0] and ptr[3] == ptr[1] != ptr[0]


def test_finished_sentences_wait_in_the_cache_until_half_are_gone() -> None:
    """Sentences leaving in order do not move the cache (it is copied whole) until half of it is
    finished: the live ones attend over their own keys and values among the finished ones, and
    decoding stays exact before and after the move."""
    model = tiny_model(norm="pre")
    src, tgt = padded_source([5, 7, 6, 4], seed=3), target_in(4, 4, seed=4)
    rows = torch.arange(4)
    with torch.no_grad():
        cache = model.init_cache(*model.encode(src), 4)
        model.decode_step(tgt[rows, 0], cache)
        storage = cache._storage
        for t, index, moved in ((1, [1, 2, 3], False), (2, [0, 2], False), (3, [1], True)):
            cache.reorder(torch.tensor(index))
            rows = rows[index]
            assert (cache._storage is not storage) == moved, t
            logits = model.decode_step(tgt[rows, t], cache)
            expected = model(src[rows], tgt[rows, : t + 1])[:, -1]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert cache.live is None and cache.self_k.size(1) == 1


def test_reorder_refuses_beams_drawn_from_two_sentences() -> None:
    """The beams of a group share one sentence's keys: a group mixing sentences is an error, not a
    silently wrong attention."""
    model = tiny_model()
    with torch.no_grad():
        cache = model.init_cache(*model.encode(padded_source([4, 5])), 4)
        model.decode_step(torch.full((2,), BOS_ID), cache)
        cache.reorder(torch.tensor([0, 0, 1, 1]), 2)  # fine: one sentence per group
        with pytest.raises(ValueError, match="one sentence"):
            cache.reorder(torch.tensor([0, 2, 1, 3]), 2)  # rows 0 and 2: sentences 0 and 1


def test_cache_takes_the_dtype_of_the_keys_under_autocast() -> None:
    """Under CPU bf16 autocast the encoder output is float32 but the keys are bf16: the cache is
    bf16 (a float32 one would be cast back for attention at every step), and decoding matches the
    float32 model closely."""
    model = tiny_model(seed=3)
    src, tgt = padded_source([6, 4], seed=7), target_in(2, 5, seed=8)
    with torch.no_grad():
        reference = model(src, tgt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            memory, src_mask = model.encode(src)
            cache = model.init_cache(memory, src_mask, 5)
            steps = torch.stack([model.decode_step(tgt[:, t], cache) for t in range(5)], dim=1)
    assert memory.dtype == torch.float32 and cache.self_k.dtype == torch.bfloat16
    assert (steps.float() - reference).abs().max().item() < 0.1


def test_decode_step_past_max_len_raises() -> None:
    model = tiny_model()
    src = padded_source([4, 2])
    with torch.no_grad():
        cache = model.init_cache(*model.encode(src), 2)
        tokens = torch.full((2,), BOS_ID)
        model.decode_step(tokens, cache)
        model.decode_step(tokens, cache)
        with pytest.raises(ValueError, match="max_len=2"):
            model.decode_step(tokens, cache)


def test_sequence_longer_than_max_positions_raises() -> None:
    model = tiny_model(max_positions=8)
    with pytest.raises(ValueError, match="model.max_positions=8"):
        model.encode(random_tokens(1, 9))


def test_bf16_decoding_runs_and_mostly_agrees_with_float32() -> None:
    """The CPU bf16 decoding path: encode / init_cache / decode_step on a bf16 copy of the model
    pick the same arg-max token as float32 on most positions."""
    model = tiny_model(seed=4)
    src, tgt = padded_source([9, 6, 8, 7], seed=5), target_in(4, 10, seed=6)
    with torch.no_grad():
        ref = model(src, tgt).argmax(-1)
        bf16 = model.to(torch.bfloat16)
        steps = step_logits(bf16, src, tgt)
    assert steps.dtype == torch.bfloat16
    assert torch.isfinite(steps.float()).all()
    agreement = (steps.argmax(-1) == ref).float().mean().item()
    assert agreement >= 0.8, agreement


# --- sizes ---------------------------------------------------------------------------------------


def expected_parameters(cfg: ModelConfig) -> int:
    """The analytic parameter count of the Transformer as built by mt.model."""
    d, f = cfg.d_model, cfg.ffn_dim
    attention = 4 * d * d + 4 * d  # q, k, v, out projections with biases
    ffn = 2 * d * f + f + d
    norm = 2 * d
    encoder = cfg.encoder_layers * (attention + ffn + 2 * norm)
    decoder = cfg.decoder_layers * (2 * attention + ffn + 3 * norm)
    src, tgt = cfg.src_vocab_size * d, cfg.tgt_vocab_size * d
    embeddings = {"all": src, "decoder": src + tgt, "none": src + 2 * tgt}[cfg.tie_embeddings]
    positions = 2 * cfg.max_positions * d if cfg.positions == "learned" else 0
    final_norms = 2 * norm if cfg.norm == "pre" else 0
    bias = cfg.tgt_vocab_size if cfg.final_logits_bias else 0
    return encoder + decoder + embeddings + positions + final_norms + bias


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm": "pre"},
        {"tie_embeddings": "decoder", "tgt_vocab_size": 30},
        {"tie_embeddings": "none", "src_vocab_size": 20, "tgt_vocab_size": 30},
        {"positions": "learned", "norm": "pre"},
        {"final_logits_bias": True, "tie_embeddings": "none"},
        {"encoder_layers": 3, "decoder_layers": 1, "ffn_dim": 48},
    ],
)
def test_parameter_count_matches_formula(overrides: dict) -> None:
    cfg = tiny_config(**overrides)
    model = build_model(cfg)
    assert count_parameters(model) == expected_parameters(cfg)
    # Tied weights are counted once: the count equals the distinct storages.
    distinct = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert count_parameters(model) == sum(distinct.values())


def test_transformer_base_has_63_1m_parameters() -> None:
    cfg = ModelConfig(
        name="transformer_base", encoder_layers=6, decoder_layers=6, d_model=512, ffn_dim=2048,
        heads=8, norm="post", positions="sinusoidal", tie_embeddings="all",
        src_vocab_size=37000, tgt_vocab_size=37000,
    )
    with torch.device("meta"):  # sizes only: no memory, no initialisation cost
        model = build_model(cfg)
    n = count_parameters(model)
    assert n == expected_parameters(cfg) == 63_082_496
    assert round(n / 1e6, 1) == 63.1


# --- training ------------------------------------------------------------------------------------


@NORMS
def test_overfits_a_tiny_batch(norm: str) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config(norm=norm, d_model=32, ffn_dim=64, heads=2))
    src = padded_source([6, 5, 4, 6], seed=7)
    tgt = torch.cat([torch.full((4, 1), BOS_ID), random_tokens(4, 5, seed=8),
                     torch.full((4, 1), EOS_ID)], dim=1)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.02, loss.item()
    # Training keeps the three-way tie (one Parameter, not copies that drift apart).
    assert model.output_proj.weight is model.src_embed.weight


# --- features ------------------------------------------------------------------------------------


def test_attention_uses_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(encoder_layers=2, decoder_layers=3)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        model(padded_source([5, 3]), target_in(2, 4))
    # 2 encoder self, 3 decoder self (causal), 3 decoder cross
    assert len(calls) == 2 + 3 + 3
    assert calls.count(True) == 3


def test_attention_matches_the_textbook_formula() -> None:
    """softmax(q k^T / sqrt(K) + mask) v with the mask convention True = may attend."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 0.0, self_attention=True).eval()
    b, h, lq, lk, k = 2, 4, 3, 5, 4
    q, key, v = torch.randn(b, h, lq, k), torch.randn(b, h, lk, k), torch.randn(b, h, lk, k)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])[:, None, None, :]
    scores = q @ key.transpose(-1, -2) / math.sqrt(k)
    scores = scores.masked_fill(~mask, -torch.inf)
    manual = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, lq, 16)
    expected = attn.out_proj(manual)
    torch.testing.assert_close(attn.attend(q, key, v, mask, False), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_explicit_attention_equals_the_fused_kernel(causal: bool, grad: bool) -> None:
    """The matmul-softmax-matmul path taken for bf16 on CPU computes what SDPA computes, padded
    keys and the causal mask included (compared in float32, where both are exact), in training
    and without gradients (where its softmax runs in float32 whatever the dtype)."""
    torch.manual_seed(0)
    b, h, length, k = 3, 2, 6, 8
    q, key, v = (torch.randn(b, h, length, k) for _ in range(3))
    mask = None if causal else (torch.arange(length) < torch.tensor([6, 4, 1])[:, None])[:, None,
                                                                                           None]
    expected = F.scaled_dot_product_attention(q, key, v, attn_mask=mask, is_causal=causal)
    with torch.set_grad_enabled(grad):
        got = explicit_attention(q, key, v, mask, causal, 0.0)
        low = explicit_attention(*(t.bfloat16() for t in (q, key, v)), mask, causal, 0.0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # bf16: the same attention to bf16 accuracy, and bit for bit the operators spelt out with a
    # float32 softmax rounded once to bf16 (what the bf16 softmax of the gradient branch gives
    # too, faster backward aside)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=0.05, rtol=0)
    qb, kb, vb = (t.bfloat16() for t in (q, key, v))
    scores = (qb @ kb.transpose(-1, -2)) * k**-0.5
    keep = torch.ones(length, length, dtype=torch.bool).tril() if causal else mask
    weights = scores.masked_fill(~keep, -torch.inf).softmax(-1, dtype=torch.float32).bfloat16()
    assert torch.equal(low, weights @ vb)


def test_bf16_cpu_training_takes_the_explicit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CPU bf16 autocast no attention goes to the fused kernel (slow there), and the
    gradients match float32 to bf16 accuracy."""
    model = tiny_model(encoder_layers=2, decoder_layers=2).train()
    src, tgt = padded_source([5, 3]), target_in(2, 4)
    model(src, tgt).float().square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    def refuse(*args, **kwargs):
        raise AssertionError("fused attention called in bf16 on CPU")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(src, tgt)
    out.float().square().mean().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    reference = torch.cat([g.flatten() for g in reference])
    assert (grad - reference).norm() <= 0.05 * reference.norm()


def test_dropout_keeps_the_expectation_and_masks_the_gradient() -> None:
    """The CPU dropout zeroes a fraction p, scales the rest by 1/(1-p), and lets the gradient
    through exactly where it kept the input."""
    torch.manual_seed(0)
    drop = Dropout(0.3).train()
    x = torch.ones(400, 500, requires_grad=True)
    y = drop(x)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - 0.3) < 0.01
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())
    assert drop.eval()(x) is x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert drop.train()(x.bfloat16()).dtype == torch.bfloat16


@NORMS
def test_norm_placement(norm: str) -> None:
    model = tiny_model(norm=norm)
    final = (model.encoder_norm, model.decoder_norm)
    layer = model.encoder_layers[0]
    if norm == "pre":
        assert all(isinstance(m, nn.LayerNorm) for m in final)
        assert layer.attn_sub.pre_norm
    else:
        assert all(isinstance(m, nn.Identity) for m in final)
        assert not layer.attn_sub.pre_norm
    # The residual formula itself: post LN(x + f(x)), pre x + f(LN(x)).
    x, fx = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    sub = layer.attn_sub
    if norm == "pre":
        torch.testing.assert_close(sub.input(x), sub.norm(x))
        torch.testing.assert_close(sub.output(x, fx), x + fx)
    else:
        torch.testing.assert_close(sub.input(x), x)
        torch.testing.assert_close(sub.output(x, fx), sub.norm(x + fx))


def test_sinusoids_known_values() -> None:
    d = 8
    table = sinusoids(50, d)
    half = d // 2
    torch.testing.assert_close(table[0], torch.tensor([0.0] * half + [1.0] * half))
    p = torch.arange(50, dtype=torch.float32)
    torch.testing.assert_close(table[:, 0], torch.sin(p))  # wavelength 2*pi
    torch.testing.assert_close(table[:, half], torch.cos(p))
    slowest = 10000.0 ** (-(half - 1) / half)
    torch.testing.assert_close(table[:, half - 1], torch.sin(p * slowest))


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_positions_and_embedding_scale(positions: str) -> None:
    """embed = table(tokens) * sqrt(d) + positions (scale_embeddings) or without the scale."""
    tokens = random_tokens(2, 6)
    for scale in (True, False):
        model = tiny_model(positions=positions, scale_embeddings=scale)
        pe = model.src_positions
        learned_params = [n for n, _ in model.named_parameters() if "positions" in n]
        if positions == "learned":
            assert learned_params == ["src_positions.table.weight", "tgt_positions.table.weight"]
            table = pe.table.weight
        else:
            assert learned_params == []
            table = pe.table
            torch.testing.assert_close(table, sinusoids(64, 32))
        factor = math.sqrt(32) if scale else 1.0
        expected = model.src_embed(tokens) * factor + table[:6]
        with torch.no_grad():
            torch.testing.assert_close(model.embed(tokens, model.src_embed, pe), expected)
            offset = model.embed(tokens[:, :2], model.tgt_embed, model.tgt_positions, offset=3)
            torch.testing.assert_close(
                offset, model.tgt_embed(tokens[:, :2]) * factor + model.tgt_positions(2, 3)
            )


def test_tying() -> None:
    all_ = tiny_model(tie_embeddings="all")
    assert all_.src_embed is all_.tgt_embed
    assert all_.output_proj.weight is all_.tgt_embed.weight
    dec = tiny_model(tie_embeddings="decoder", tgt_vocab_size=30)
    assert dec.src_embed.weight is not dec.tgt_embed.weight
    assert dec.output_proj.weight is dec.tgt_embed.weight
    none = tiny_model(tie_embeddings="none", tgt_vocab_size=30)
    weights = [none.src_embed.weight, none.tgt_embed.weight, none.output_proj.weight]
    assert len({w.data_ptr() for w in weights}) == 3
    with pytest.raises(ValueError, match="tie_embeddings=all needs a joint vocabulary"):
        build_model(tiny_config(tie_embeddings="all", tgt_vocab_size=30))


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"norm": "middle"}, "model.norm"),
        ({"positions": "rotary"}, "model.positions"),
        ({"tie_embeddings": "both"}, "model.tie_embeddings"),
        ({"activation": "tanh"}, "model.activation"),
        ({"heads": 5}, "model.heads"),
        ({"src_vocab_size": 0}, "model.src_vocab_size"),
    ],
)
def test_bad_config_raises_with_the_key(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(tiny_config(**overrides))


@pytest.mark.parametrize("name, fn", [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu)])
def test_activations(name: str, fn) -> None:
    torch.manual_seed(0)
    ffn = FeedForward(8, 16, name, 0.0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(ffn(x), ffn.fc2(fn(ffn.fc1(x))))
    model = tiny_model(activation=name)
    assert model.decoder_layers[0].ffn.activation is fn


@pytest.mark.parametrize("knob", ["dropout", "attention_dropout", "activation_dropout"])
def test_each_dropout_is_wired(knob: str) -> None:
    """Each dropout alone makes two training-mode passes differ; none at all makes them equal;
    eval mode switches it off."""
    src, tgt = padded_source([6, 4]), target_in(2, 5)
    model = tiny_model(**{knob: 0.5}).train()
    layer = model.decoder_layers[0]
    seen = {
        "dropout": layer.ffn_sub.dropout.p,
        "attention_dropout": layer.self_attn.dropout,
        "activation_dropout": layer.ffn.dropout.p,
    }
    assert seen == {k: (0.5 if k == knob else 0.0) for k in seen}
    assert (model(src, tgt) - model(src, tgt)).abs().max() > 1e-4
    model.eval()
    torch.testing.assert_close(model(src, tgt), model(src, tgt))
    quiet = tiny_model().train()
    torch.testing.assert_close(quiet(src, tgt), quiet(src, tgt))


@pytest.mark.parametrize("tie", ["all", "decoder", "none"])
def test_initialisation_statistics(tie: str) -> None:
    d, vocab = 64, 2000
    torch.manual_seed(0)
    model = build_model(tiny_config(d_model=d, ffn_dim=128, src_vocab_size=vocab,
                                    tgt_vocab_size=vocab, tie_embeddings=tie))
    for table in (model.src_embed, model.tgt_embed):
        w = table.weight.detach()
        assert w[PAD_ID].abs().max() == 0  # the padding row embeds to zero
        assert abs(w[1:].std().item() - d**-0.5) < 0.1 * d**-0.5
        assert abs(w[1:].mean().item()) < 0.1 * d**-0.5
    if tie != "none":
        assert model.output_proj.weight is model.tgt_embed.weight
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not (tie != "none" and name == "output_proj"):
            fan_out, fan_in = module.weight.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))  # Xavier uniform
            w = module.weight.detach()
            assert w.abs().max() <= bound, name
            assert abs(w.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3), name
            if module.bias is not None:
                assert module.bias.abs().max() == 0, name
        if isinstance(module, nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert module.bias.abs().max() == 0, name
