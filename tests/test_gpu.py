"""The CUDA paths agree with the CPU ones: forward, gradients, the loss's hand-written backward,
fused Adam, and the searches. Skipped without a GPU (CI has none); run on a lent one with
``pytest tests/test_gpu.py``. TF32 is off here, so float32 on the GPU must match float32 on the
CPU to float rounding; bf16 autocast is held to bf16's rounding."""

import pytest
import torch

from mt.config import EOS_ID, PAD_ID, ModelConfig
from mt.inference import prepare_model
from mt.loss import label_smoothed_nll
from mt.model import build_model
from mt.scoring import forced_scores
from mt.search import beam_search, greedy_search

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V = 64


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(encoder_layers=2, decoder_layers=2, d_model=64, ffn_dim=128, heads=4, dropout=0.0,
               src_vocab_size=V, tgt_vocab_size=V, max_positions=128)
    cfg.update(kw)
    model = build_model(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        model.output_proj.weight.mul_(3.0)  # sharper distributions: fewer near-ties in search
    return model


def _batch(n: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (src, tgt_in, tgt_out) of varied lengths, padding included."""
    g = torch.Generator().manual_seed(seed)
    s_len = torch.randint(2, 20, (n,), generator=g)
    t_len = torch.randint(2, 20, (n,), generator=g)
    src = torch.full((n, int(s_len.max())), PAD_ID)
    tgt = torch.full((n, int(t_len.max()) + 1), PAD_ID)
    for i in range(n):
        src[i, : s_len[i]] = torch.randint(4, V, (int(s_len[i]),), generator=g)
        src[i, s_len[i] - 1] = EOS_ID
        tgt[i, : t_len[i] + 1] = torch.randint(4, V, (int(t_len[i]) + 1,), generator=g)
    tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_out[tgt_in == PAD_ID] = PAD_ID
    return src, tgt_in, tgt_out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_forward_and_gradients_match_the_cpu(norm):
    cpu = _model(norm=norm).train()
    gpu = _model(norm=norm).train().cuda()
    src, tgt_in, tgt_out = _batch()
    losses = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        logits = model(src.to(device), tgt_in.to(device))
        loss = label_smoothed_nll(logits, tgt_out.to(device), 0.1)[0]
        loss.backward()
        losses.append((logits, loss))
    assert _rel(losses[1][0], losses[0][0]) < 1e-5
    assert _rel(losses[1][1], losses[0][1]) < 1e-5
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        assert _rel(q.grad, p.grad) < 1e-4, name


def test_bf16_autocast_stays_near_float32():
    model = _model().cuda()
    src, tgt_in, _ = _batch()
    src, tgt_in = src.cuda(), tgt_in.cuda()
    with torch.no_grad():
        ref = model(src, tgt_in)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(src, tgt_in)
    assert low.isfinite().all()
    assert _rel(low.float(), ref) < 3e-2


def test_fused_adam_steps_match_the_cpu():
    """Elements whose gradient is zero in exact arithmetic (the attention keys' bias: softmax
    ignores a constant added to every logit) get rounding noise instead, which Adam scales to
    full-size steps of arbitrary sign on either device: they are left out of the comparison."""
    models = [_model().train(), _model().train().cuda()]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)
            for m in models]
    real = [torch.ones_like(p, dtype=torch.bool) for p in models[0].parameters()]
    src, tgt_in, tgt_out = _batch()
    for _ in range(3):
        for model, opt in zip(models, opts, strict=True):
            device = next(model.parameters()).device
            opt.zero_grad()
            logits = model(src.to(device), tgt_in.to(device))
            label_smoothed_nll(logits, tgt_out.to(device), 0.1)[0].backward()
            opt.step()
        for mask, p in zip(real, models[0].parameters(), strict=True):
            mask &= p.grad.abs() > 1e-6 * p.grad.abs().max()
    assert sum(int(m.sum()) for m in real) > 0.95 * sum(m.numel() for m in real)
    for mask, p, q in zip(real, *(m.parameters() for m in models), strict=True):
        assert _rel(q.detach().cpu()[mask], p.detach()[mask]) < 1e-4


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_search_on_the_gpu_returns_the_cpu_translations(search):
    cpu, gpu = _model(), _model().cuda()
    src = _batch(n=12, seed=3)[0]
    if search == "greedy":
        ours = greedy_search(cpu, src, max_len_a=1.0, max_len_b=8)
        theirs = greedy_search(gpu, src.cuda(), max_len_a=1.0, max_len_b=8)
        pairs = [([a], [b]) for a, b in zip(ours, theirs, strict=True)]
    else:
        ours = beam_search(cpu, src, beam_size=4, nbest=2, max_len_a=1.0, max_len_b=8)
        theirs = beam_search(gpu, src.cuda(), beam_size=4, nbest=2, max_len_a=1.0, max_len_b=8)
        pairs = list(zip(ours, theirs, strict=True))
    for a, b in pairs:
        assert [h.tokens for h in a] == [h.tokens for h in b]
        for x, y in zip(a, b, strict=True):
            assert y.score == pytest.approx(x.score, abs=1e-4)


def test_beam_scores_on_the_gpu_equal_a_forced_rescoring():
    model = _model().cuda()
    src = _batch(n=12, seed=4)[0].cuda()
    hyps = beam_search(model, src, beam_size=4, lenpen=0.6, max_len_a=1.0, max_len_b=8)
    tokens = [h[0].tokens for h in hyps]
    tgt = torch.full((len(tokens), max(map(len, tokens)) + 1), PAD_ID)
    for i, t in enumerate(tokens):
        tgt[i, : len(t) + 1] = torch.tensor(t + [EOS_ID])
    again = forced_scores(model, src, tgt.cuda(), lenpen=0.6)
    for h, r in zip(hyps, again, strict=True):
        assert r.score == pytest.approx(h[0].score, abs=1e-4)


def _cudnn_attention_ran(model, src: torch.Tensor, tgt_in: torch.Tensor) -> bool:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            model(src, tgt_in)
        torch.cuda.synchronize()
    return any("cudnn_attention" in e.key for e in prof.key_averages())


def test_decoding_on_the_gpu_leaves_cudnn_attention_out():
    """cuDNN builds an attention plan per new shape (hundreds of ms), and a search brings new
    shapes at nearly every step: prepare_model (translate, mt-eval) turns it off."""
    src, tgt_in, _ = _batch(n=16, seed=6)
    src, tgt_in = src.cuda(), tgt_in.cuda()
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        if not _cudnn_attention_ran(_model().cuda().to(torch.bfloat16), src, tgt_in):
            pytest.skip("this GPU's SDPA does not pick cuDNN here: nothing to turn off")
        model = prepare_model(_model().cuda(), "bfloat16", "cuda")
        assert not _cudnn_attention_ran(model, src, tgt_in)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
