"""Models ready to decode: loaded (one or an ensemble), cast to a dtype, and packed for the CPU.

Decoding runs the same few matrix shapes thousands of times, so work done once at load time pays:
on CPU the linear layers are handed to oneDNN pre-packed (``PackedLinear``), with the FFN's ReLU
fused into its first product (``PackedFeedForward``). What comes out is for inference only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import torch
from torch import nn

from mt.incremental import Ensemble
from mt.kvcache import amx_tiles
from mt.model import FeedForward, Transformer, avoid_cudnn_attention
from mt.optim import cpu_has_fast_bf16
from mt.textio import first_line

log = logging.getLogger("mt.inference")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.float32}  # int8: float32 with int8 linear layers (quantize_int8)
PACK_ROWS = 128  # the batch rows oneDNN packs a weight for (PackedLinear)
KERNEL_CACHE_CAPACITY = 64  # kernels and weight layouts each CPU cache keeps (cap_kernel_caches)
BFLOAT16_KERNELS = 256  # oneDNN kernels kept when decoding in bfloat16 (cap_kernel_caches)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight is stored in oneDNN's blocked layout.

    ``F.linear`` hands the weight to the GEMM in its plain layout, which the GEMM re-packs on every
    call; for the hundred-odd rows of a decoding step that re-packing is a large share of the work.
    Packed once here, a bfloat16 product runs up to 2x faster, a float32 one about 10%.
    ``activation="relu"`` applies the ReLU inside the same call.
    """

    def __init__(self, linear: nn.Linear, activation: str = "none", keep_plain: bool = False
                 ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activation = activation
        # Plain attributes, not parameters or buffers: never trained, never saved.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # The output layer keeps its plain weight for ``rows`` (a shortlist); a tied one shares
        # it with the target embedding, so it costs no memory there.
        self.plain = linear.weight.detach() if keep_plain else None

    def rows(self, index: torch.Tensor) -> PackedLinear:
        """A packed layer computing only the outputs ``index`` (the output layer over a
        shortlist's pieces: ``mt.shortlist``)."""
        if self.plain is None:
            raise ValueError("this packed layer kept no plain weight (keep_plain=False)")
        bias = None if self.bias is None else self.bias[index]
        return PackedLinear(_linear(self.plain[index], bias), self.activation)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.cuda()``... would leave the packed weight as it is and end
        in an opaque oneDNN error at the next product: an error in words instead. Layers before
        this one (the embeddings) are cast by then, so the model must be loaded again."""
        probe = torch.empty(0, dtype=self.weight.dtype)
        moved = fn(probe)
        if (moved.dtype, moved.device) != (probe.dtype, probe.device):
            raise RuntimeError("a packed model cannot change its dtype or device, and its layers "
                               "before the packed ones may have been cast already: load it again "
                               "with the dtype and device wanted (load_models(..., dtype=...)), "
                               "or with pack=False")
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.activation, [],
                                                  "")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these tensors (no copy, no initialisation)."""
    layer = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


class PackedFeedForward(nn.Module):
    """FeedForward with packed layers; a ReLU runs inside the first product (no dropout: eval)."""

    def __init__(self, ffn: FeedForward) -> None:
        super().__init__()
        fused = ffn.activation is torch.nn.functional.relu
        self.fc1 = PackedLinear(ffn.fc1, "relu" if fused else "none")
        self.fc2 = PackedLinear(ffn.fc2)
        self.activation = None if fused else ffn.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h if self.activation is None else self.activation(h))


def bfloat16_row_buckets() -> bool:
    """Whether packed bfloat16 models decode in bucketed row counts (``mt.kvcache.bucket_rows``)
    here, with room for their kernels (``cap_kernel_caches``): on CPUs with AMX.

    oneDNN builds a kernel for every new row count of a product. On the AMX machine that cost
    0.3-4.5 ms per bfloat16 layer and the buckets made ``translate`` 1.09-1.12x faster; float32
    and int8 build theirs 2-4x faster, and there the padding rows cost what the kernels saved.
    On CPUs with bfloat16 but no AMX it was never measured: they compute the rows they have.
    """
    return bool(amx_tiles())


def can_pack(dtype: str, device: str) -> bool:
    """oneDNN packing applies to float32 models on a CPU build with oneDNN, and to bfloat16 ones
    where oneDNN has bf16 kernels (AVX512 and newer)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == "bfloat16":
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == "float32"


def prepare_model(model: nn.Module, dtype: str = "float32", device: str = "cpu",
                  pack: bool = True) -> nn.Module:
    """Readies a loaded model for decoding: eval mode, cast to ``dtype`` and, on CPU, linear layers
    packed for oneDNN. The result is for inference only (no training, no saving)."""
    avoid_cudnn_attention(device)
    if dtype == "int8":
        return quantize_int8(model, device).eval()
    model = model.to(DTYPES[dtype])
    if pack and can_pack(dtype, device):
        model.pad_step_rows = (isinstance(model, Transformer) and dtype == "bfloat16"
                               and bfloat16_row_buckets())
        for module in list(model.modules()):
            for name, child in module.named_children():
                if type(child) is FeedForward:
                    setattr(module, name, PackedFeedForward(child))
                elif type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child, keep_plain=name == "output_proj"))
    return model.eval()  # the new modules too


@functools.cache
def int8_weight_levels() -> int:
    """The largest int8 weight magnitude whose products ``torch._int_mm`` sums exactly here: 127,
    or 63 on x86 CPUs without VNNI.

    There oneDNN's int8 x int8 product shifts the inputs to unsigned and adds pairs of products
    in 16 bits, which overflow with 8-bit weights (2 x 255 x 127 > 32,767): on an AVX2 CPU a
    layer's output was off by 13% of its range. 7-bit weights keep every sum exact, as fbgemm's
    ``reduce_range`` does. Found by trying both on extreme inputs, once per process.

    Raises:
        ValueError: when neither is exact (int8 cannot be trusted on this CPU).
    """
    g = torch.Generator().manual_seed(0)
    for levels in (127, 63):
        exact = True
        for m, k, n in ((1, 64, 16), (64, 512, 256)):
            a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
            b = torch.randint(-levels, levels + 1, (k, n), generator=g, dtype=torch.int8)
            a[0], b[:, 0], b[:, 1] = 127, levels, -levels  # the largest sums of either sign
            exact &= torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
        if exact:
            return levels
    raise ValueError("int8 decoding: torch._int_mm does not sum int8 products exactly on this "
                     "CPU; use bfloat16 or float32")


class Int8Linear(nn.Module):
    """An inference-only nn.Linear computed in int8: weights rounded once per output channel,
    inputs per row at every call, both symmetric (scale = largest magnitude / levels), products
    summed in int32 (``torch._int_mm``) and scaled back to float32. Weights use ``levels`` (127,
    or 63 where the CPU's product would overflow: ``int8_weight_levels``), inputs 127.

    Scales per *row* make a sentence's result independent of the others in its batch, as
    search promises, up to one quantum: float32 rounding differs between batch shapes by ~5e-7,
    which can move a value across a rounding boundary (a score by up to ~1e-2).
    torch.ao's dynamic quantization (this class's predecessor) scales each
    call's input as a whole: a row with a large activation coarsened every other row, Multi30k
    BLEU moved with the batch composition (test2016 40.28-40.63 and valid 41.19-41.68 over
    batch sizes and workers; float32 40.73 and 41.75), and near-ties flipped between batch sizes.
    Per row: 40.51 and 41.67 whatever the batches, at 0.90x torch.ao's speed on the fixed-length
    benchmark and 0.97x on real text (docs/decoding-history.md).
    """

    def __init__(self, linear: nn.Linear, levels: int = 127) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        # Plain attributes, not parameters or buffers: never trained, never saved.
        self.scale = w.abs().amax(dim=1).clamp(min=1e-12) / levels  # (out,)
        self.weight_t = torch.round(w / self.scale[:, None]).to(torch.int8).t().contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """The layer computing only the outputs ``index`` (the output layer over a shortlist's
        pieces: ``mt.shortlist``), with their rounded weights and scales as they are."""
        sub = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(sub)
        sub.in_features, sub.out_features = self.in_features, index.numel()
        sub.scale, sub.weight_t = self.scale[index], self.weight_t[:, index].contiguous()
        sub.bias = None if self.bias is None else self.bias[index]
        return sub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)  # (rows, 1)
        products = torch._int_mm(rows.div(scale).round_().to(torch.int8), self.weight_t)
        out = (products * scale).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module, device: str = "cpu") -> nn.Module:
    """A float32 model whose linear layers compute in int8 (``Int8Linear``), CPU only.

    On a CPU without a fast bfloat16 path this is the fast one; on this project's AVX512-BF16 CPU
    it decodes about as fast as bfloat16 at a fixed output length and about 0.85x as fast on real
    text (docs/benchmarks.md), with Multi30k BLEU about 0.1-0.2 below float32. Attention,
    LayerNorm, embeddings and the cache stay float32.
    """
    if torch.device(device).type != "cpu":
        raise ValueError(f"int8 decoding runs on CPU only (got device {device!r}); on a GPU use "
                         "bfloat16")
    if not hasattr(torch, "_int_mm"):
        raise ValueError(f"int8 decoding needs torch._int_mm, which this torch "
                         f"({torch.__version__}) lacks; use bfloat16")
    levels = int8_weight_levels()
    model = model.float().eval()
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child, levels))
    return model


_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    glibc serves large blocks (above 32 MB always, and above a threshold that adapts up to that)
    with fresh pages from mmap and unmaps them when they are freed; it also trims free memory
    at the top of the heap. Every fresh page costs a page fault and the kernel zeroes it.
    Decoding frees and allocates such blocks all the time: the key/value cache at every growth,
    the logits buffer and the encoder's activations at every batch. Decoding a Multi30k test set
    touched about 1.2 GB of fresh pages (1.2 million faults); with freed memory kept in the heap
    (and one heap for all threads: a thread's own heap still maps large blocks afresh) it
    decoded 1.09x faster on one thread, 1.05x with two workers (docs/decoding.md). The price:
    the process keeps its peak heap until it exits, which suits a command (``translate``,
    ``mt-eval`` and the benchmarks call this); the library never calls it on its own, so a
    program that imports mt keeps its own setting.

    Returns whether the setting took (False where the C library is not glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(param, value) for param, value in
            ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1))]
    return all(took)


def cap_kernel_caches(dtype: str | None = None) -> None:
    """Caps the two per-shape caches that CPU products fill, unless the user has set them;
    ``dtype``: the one a command decodes in (None: it trains).

    oneDNN keeps every primitive it builds (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 by default)
    and PyTorch's ideep every weight layout it reorders to (``LRU_CACHE_CAPACITY``, 1,024). Training
    batches and decoding steps come in hundreds of shapes that seldom repeat soon, so both caches
    only grow: the CPU training recipe grew by 1.3 GB in 200 steps, ``translate`` of 10,000
    Multi30k lines peaked at 3.0 GB in float32 and 2.2 GB in bfloat16; capped at 64, 1.6 GB flat,
    2.1 GB and 1.3 GB, at the same speed and with the same output (docs/benchmarks.md). A process
    that decodes the same input again and again (a benchmark's rounds) would reuse more kernels
    with more room: the decoding benchmarks (``set_up_process`` in scripts/bench_decode.py) keep
    8,192 oneDNN primitives and ideep's 1,024 layouts. Both are read at their first use, so a
    command calls this before its first product.

    Decoding in bfloat16 with row buckets (``bfloat16_row_buckets``) keeps ``BFLOAT16_KERNELS``
    oneDNN primitives: its steps come in a bounded set of row counts (``mt.kvcache.bucket_rows``),
    about 170 kernels for a Multi30k model, each 0.3-4.5 ms to build. With the buckets and room
    for them all, ``translate`` of those 10,000 lines took 30.7-30.9 s, not 33.7-34.3 s, at 1.55 GB
    instead of 1.22-1.28 GB (docs/benchmarks.md).
    """
    bucketed = dtype == "bfloat16" and bfloat16_row_buckets()
    kernels = BFLOAT16_KERNELS if bucketed else KERNEL_CACHE_CAPACITY
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(kernels))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))


def device_mistake(device: str) -> str | None:
    """Why ``--device`` cannot run a model here, in one line; None if it can.

    Commands check it before loading: loading maps the weights onto the device, so a misspelt
    device read as a broken model file, and a GPU that torch cannot use ended in a traceback.
    """
    try:
        where = torch.device(device)
    except RuntimeError:
        return f"--device {device}: not a device (cpu, cuda, cuda:1, ...)"
    if where.type == "meta":  # shapes without data: loading "worked", the search then failed
        return f"--device {device}: holds no data (shapes only); use cpu or cuda"
    try:
        torch.empty(0, device=where)
    # no CUDA build, no GPU, no such GPU; a backend whose module is missing (hpu:
    # ModuleNotFoundError)
    except (RuntimeError, AssertionError, ImportError) as err:
        text = str(err).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
        return f"--device {device}: torch cannot use it here ({first})"
    return None


def load_models(paths: list[str], device: str, dtype: str = "float32", pack: bool = True,
                weights: list[float] | None = None):
    """Loads one model or an ensemble (``weights``: one per path), ready to decode (see
    prepare_model); returns (model or Ensemble, tokenizer, checkpoint paths).

    Raises:
        ValueError: with the file's name, for a missing, corrupt or incompatible model; for a
        ``dtype`` or ``device`` that cannot be used.
    """
    from mt.checkpoint import load_model

    if isinstance(paths, str | os.PathLike):  # one path, not its characters
        paths = [paths]
    if weights is not None and len(weights) != len(paths):  # one weight per model, in order
        raise ValueError(f"{len(weights)} weights for {len(paths)} models")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    mistake = device_mistake(device)
    if mistake:
        raise ValueError(mistake.removeprefix("--"))
    if dtype == "bfloat16" and torch.device(device).type == "cpu" and not cpu_has_fast_bf16():
        # an AVX2 CPU: a transformer_base-sized bfloat16 product ran at 1/6 of float32's rate
        log.warning("bfloat16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): "
                    "its products are emulated, several times slower than float32 here; "
                    "--dtype float32 (or int8) decodes faster")
    models, tokenizer, names = [], None, []
    for path in paths:
        try:
            model, tok, ckpt = load_model(path, device)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(str(err)) from None
        except (RuntimeError, KeyError, TypeError) as err:  # weights that do not fit the config
            raise ValueError(f"{path}: not a loadable mt model ({first_line(err)})") from None
        if tokenizer is not None and tok.fingerprint != tokenizer.fingerprint:
            raise ValueError(f"{ckpt['path']}: its tokenizer differs from {names[0]}'s; ensemble "
                             "members must share the vocabulary")
        tokenizer = tokenizer or tok
        models.append(prepare_model(model, dtype, device, pack))
        names.append(ckpt["path"])
    return (models[0] if len(models) == 1 else Ensemble(models, weights)), tokenizer, names
