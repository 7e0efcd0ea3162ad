"""The Triton kernels (KERNELS=triton: q/k RMSNorm + RoPE + gain, XSA, soft-capped cross entropy) against float64 references,
forward and backward, and the whole model with them against the PyTorch-ops model. On the CPU the kernels run
in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU machine compiled (`python3 -m pytest
tests/test_kernels.py` there). Without the triton package these tests are skipped; the README's install brings
it and .ci/run checks the import, so CI never skips them."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import train_gpt as tg  # noqa: E402
from conftest import feature_model, make_cfg, rope_reference, tiny_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FP32_EPS = torch.finfo(torch.float32).eps  # the kernel's and the compiled model's rms_norm epsilon
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(x, dims, base, gain):
    """float64: x / rms(x) (eps as in the kernel), complex-pair RoPE, per-head gain."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + FP32_EPS)
    y = rope_reference(y, dims, base)
    return y if gain is None else y * gain.double()[:, None]


def within_one_ulp(got, want):
    """bf16 outputs: the interpreter truncates to bf16 where the GPU rounds, so allow one ulp (2^-7 relative
    to the value's binade) rather than half."""
    bound = want.abs() * 2.0 ** -7 + 1e-6
    return bool(((got.double() - want).abs() <= bound).all())


# (B, T, H, D, rope_dims, gain): the record head shape, no RoPE, full RoPE, a head dim that is not a power
# of two (masked columns), odd head count with a row count that no block size divides
SHAPES = [(2, 24, 4, 64, 16, True), (1, 8, 2, 32, 0, True), (2, 9, 2, 16, 16, False), (3, 7, 3, 48, 8, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,H,D,dims,with_gain", SHAPES)
def test_kernel_forward_and_backward_equal_float64_reference(B, T, H, D, dims, with_gain, dtype):
    g = torch.Generator().manual_seed(B * 100 + T)
    cos, sin = (t.to(DEV) for t in tg.rope_tables(T + 5, dims, 10000.0))  # longer than the sequence, as in the model
    x = (torch.randn(B, T, H, D, generator=g) * 3).to(DEV, dtype).requires_grad_()
    gain = (torch.rand(H, generator=g) + 0.5).to(DEV).requires_grad_() if with_gain else None
    dy = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    y = tg.qk_norm_rope_triton(x, cos, sin, gain)
    y.backward(dy)
    x64 = x.detach().cpu().double().requires_grad_()  # the reference runs on the CPU in float64
    g64 = gain.detach().cpu().double().requires_grad_() if with_gain else None
    want = reference(x64, dims, 10000.0, g64)
    want.backward(dy.cpu().double())
    assert y.dtype == dtype and y.shape == x.shape
    assert want.abs().max() > 1.0
    y, dx = y.detach().cpu(), x.grad.cpu()
    if dtype == torch.bfloat16:
        assert within_one_ulp(y, want.detach())
        assert within_one_ulp(dx, x64.grad)
    else:  # the kernel computes in fp32: y (|y| <= ~5) a few ulps off (~1e-6), dx sums D <= 64 products per row;
        # each tolerance is 25-100x what was measured (avx512, avx2 and default dispatch)
        torch.testing.assert_close(y.double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-4, atol=1e-5)
    if with_gain:  # fp32 sums of the per-row partials (B*T*D <= 3,072 products); inputs are the same rounded dy and x
        torch.testing.assert_close(gain.grad.cpu().double(), g64.grad, rtol=1e-4, atol=1e-4)


def test_kernel_reads_a_strided_token_row():
    """q as a slice of a wider projection output (e.g. fused q|k|v): heads packed, token stride larger."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 10, 2, 32
    wide = torch.randn(B, T, 3 * H * D, generator=g).to(DEV).requires_grad_()
    cos, sin = (t.to(DEV) for t in tg.rope_tables(T, 8, 10000.0))
    x = wide[..., H * D: 2 * H * D].view(B, T, H, D)
    y = tg.qk_norm_rope_triton(x, cos, sin, None)
    y.sum().backward()
    want = reference(x.detach().cpu(), 8, 10000.0, None)
    torch.testing.assert_close(y.detach().cpu().double(), want, rtol=1e-5, atol=1e-5)  # fp32 kernel, as above
    assert wide.grad[..., : H * D].abs().max() == 0 and wide.grad[..., H * D: 2 * H * D].abs().max() > 0


def test_kernel_refuses_what_it_cannot_index():
    """Unpacked heads, tables shorter than the sequence or wider than half a head, a gain of the wrong size:
    errors, not reads past the end."""
    x = torch.randn(1, 4, 8, 2, device=DEV).transpose(2, 3)  # (1, 4, 2, 8) with head dim not contiguous
    cos, sin = (t.to(DEV) for t in tg.rope_tables(4, 4, 10000.0))
    with pytest.raises(ValueError, match="heads packed"):
        tg.qk_norm_rope_triton(x, cos, sin, None)
    x = torch.randn(1, 4, 2, 8, device=DEV)
    for T, dims in ((3, 4), (4, 10)):
        cos, sin = (t.to(DEV) for t in tg.rope_tables(T, dims, 10000.0))
        with pytest.raises(ValueError, match="tables"):
            tg.qk_norm_rope_triton(x, cos, sin, None)
    cos, sin = (t.to(DEV) for t in tg.rope_tables(4, 4, 10000.0))
    with pytest.raises(ValueError, match="gain of shape"):
        tg.qk_norm_rope_triton(x, cos, sin, torch.ones(3, device=DEV))


def xsa_reference64(y, v):
    """float64 XSA written out: y minus its projection on the token's unit v (eps as F.normalize)."""
    B, T, H, D = y.shape
    K = v.size(2)
    y, v = y.double().reshape(B, T, K, H // K, D), v.double()
    vn = (v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)).unsqueeze(-2)
    return (y - (y * vn).sum(-1, keepdim=True) * vn).reshape(B, T, H, D)


# (B, T, H, K, D): the record group (2 query heads per kv head), no grouping, a group of 3 and a head dim
# that are not powers of two (masked lanes), one kv head for all, and a row count no block size divides
XSA_SHAPES = [(2, 24, 8, 4, 64), (1, 8, 4, 4, 16), (2, 3, 6, 2, 48), (1, 9, 8, 1, 32), (3, 7, 2, 1, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,H,K,D", XSA_SHAPES)
def test_xsa_kernel_forward_and_backward_equal_float64_reference(B, T, H, K, D, dtype):
    """v as the slice of a q|k|v projection (token stride wider than its heads), one v row all zeros
    (the clamped branch of the normalisation)."""
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H)
    qkv = (torch.randn(B, T, (H + 2 * K) * D, generator=g) * 2).to(DEV, dtype)
    qkv[0, 0, (H + K) * D:(H + K + 1) * D] = 0
    qkv.requires_grad_()
    v = qkv[..., (H + K) * D:].view(B, T, K, D)
    y = torch.randn(B, T, H, D, generator=g).to(DEV, dtype).requires_grad_()
    dout = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    out = tg.exclusive_self_attention_triton(y, v)
    out.backward(dout)
    y64 = y.detach().cpu().double().requires_grad_()
    qkv64 = qkv.detach().cpu().double().requires_grad_()
    want = xsa_reference64(y64, qkv64[..., (H + K) * D:].view(B, T, K, D))
    want.backward(dout.cpu().double())
    assert out.dtype == dtype and out.shape == y.shape
    dv = qkv.grad.cpu()[..., (H + K) * D:]
    assert qkv.grad[..., :(H + K) * D].abs().max() == 0 and dv.abs().max() > 0.1
    assert dv[0, 0, :D].abs().max() == 0  # zero v: its unit vector is 0, so nothing to pass back
    got = (out.detach().cpu(), y.grad.cpu(), dv)
    wants = (want.detach(), y64.grad, qkv64.grad[..., (H + K) * D:])
    for a, b in zip(got, wants):
        if dtype == torch.bfloat16:
            assert within_one_ulp(a, b)
        else:  # fp32 kernel, outputs and grads O(1-10) from D <= 64-term dot products: ~1e-6; measured <= 0.03x
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_xsa_kernel_refuses_what_it_cannot_index():
    y = torch.randn(1, 4, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="K \\| H"):
        tg.exclusive_self_attention_triton(y, torch.randn(1, 4, 3, 8, device=DEV))
    with pytest.raises(ValueError, match="not \\(B,T,H,D\\)"):
        tg.exclusive_self_attention_triton(y, torch.randn(1, 4, 2, 4, device=DEV))
    with pytest.raises(ValueError, match="heads packed"):
        tg.exclusive_self_attention_triton(y, torch.randn(1, 4, 8, 2, device=DEV).transpose(2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's TTIR (the analysis's input) needs a GPU driver")
def test_inductor_sees_each_kernel_write_only_its_outputs():
    """torch.compile copies every tensor a user kernel may write (functionalisation). The first XSA kernels
    passed pointers to a jit helper; torch 2.11's analysis then counted y and v as written, and the XSA op's
    v, a slice of the q|k|v projection, cost two copies of the whole projection per call."""
    import torch._higher_order_ops.triton_kernel_wrap as tkw
    analyse = getattr(tkw, "identify_mutated_tensors", None)
    if analyse is None:  # newer torch
        analyse = lambda kernel, kwargs, tma: tkw.get_mutated_tensors(  # noqa: E731
            tkw.kernel_side_table.add_kernel(kernel), tkw.kernel_side_table.add_constant_args({}), kwargs, tma)
    B, T, H, K, D = 2, 4, 8, 4, 64
    qkv = torch.randn(B, T, (H + 2 * K) * D, device="cuda")
    q, v = qkv[..., :H * D].view(B, T, H, D), qkv[..., (H + K) * D:].view(B, T, K, D)
    y, out, dv = torch.randn(B, T, H, D, device="cuda"), torch.empty(B, T, H, D, device="cuda"), torch.empty_like(v)
    cos, sin = (t.cuda() for t in tg.rope_tables(T, 16, 10000.0))
    gain = torch.ones(H, device="cuda")
    _, n, stride, T_, fwd_meta, bwd_meta = tg._qk_launch_args(q, cos, sin, gain)
    qk = dict(cos_ptr=cos, sin_ptr=sin, g_ptr=gain, n_rows=n, x_stride=stride, T=T_, HAS_GAIN=True)
    _, n, v_stride, xmeta = tg._xsa_launch_args(y, v)
    xsa = dict(n_rows=n, v_stride=v_stride, **xmeta)
    cases = [(tg._qk_norm_rope_fwd, dict(x_ptr=q, y_ptr=out, **qk, **fwd_meta), ["y_ptr"]),
             (tg._qk_norm_rope_bwd, dict(dy_ptr=y, x_ptr=q, dx_ptr=out, dg_ptr=gain, **qk, **bwd_meta), ["dx_ptr", "dg_ptr"]),
             (tg._xsa_fwd, dict(y_ptr=y, v_ptr=v, out_ptr=out, **xsa), ["out_ptr"]),
             (tg._xsa_bwd, dict(dout_ptr=y, y_ptr=y, v_ptr=v, dy_ptr=out, dv_ptr=dv, **xsa), ["dy_ptr", "dv_ptr"])]
    found = {kernel.fn.__name__: sorted(analyse(kernel, kwargs, {})) for kernel, kwargs, _ in cases}
    assert found == {kernel.fn.__name__: sorted(written) for kernel, _, written in cases}


@pytest.mark.parametrize("name", ["full", "plain"])
def test_model_with_triton_kernel_equals_model_with_torch_ops(name):
    """Same weights, KERNELS=triton vs torch: logits, loss and every gradient (fp32, CPU)."""
    ref = feature_model(name).to(DEV)
    model = tg.GPT(ref.cfg, "math", tg.TRITON_OPS).to(DEV)
    model.load_state_dict(ref.state_dict())
    V = ref.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    ids, targets = (torch.randint(0, V, (2, 32), generator=g).to(DEV) for _ in range(2))
    losses = [m(ids, targets) for m in (model, ref)]
    for loss in losses:
        loss.backward()
    # both fp32 (the kernels have no float64), the same math in another order: the loss (~4-10, a mean of 64
    # rows) ~1e-6 apart, each gradient entry a few fp32 ulps of its terms; measured <= 0.08x these tolerances
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    assert all(b.q_gain.grad.abs().max() > 0 for b in model.blocks)


def test_the_largest_vocabulary_trains_through_the_triton_ops():
    """Issue 22: VOCAB_SIZE=65,536 (every uint16 id) with KERNELS=triton: the hash and tables take id 65,535, and
    loss and every gradient equal the torch-ops model's."""
    cfg = tiny_cfg(vocab_size=65536, bigram_vocab_size=4097)
    ref = tg.GPT(cfg).to(DEV)
    model = tg.GPT(cfg, "math", tg.TRITON_OPS).to(DEV)
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(59_000, 65536, (2, 32), generator=g).to(DEV)
    ids[0, :3] = torch.tensor([65535, 65535, 0])
    targets = torch.randint(0, 65536, (2, 32), generator=g).to(DEV)
    losses = [m(ids, targets) for m in (model, ref)]
    for loss in losses:
        loss.backward()
    assert torch.isfinite(losses[0])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)  # fp32 both, as in the test above
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    assert model.tok_emb.weight.grad[65535].abs().max() > 0 and model.bigram.embed.weight.grad.abs().sum() > 0


def test_kernels_setting_resolves_and_refuses_what_cannot_run(monkeypatch):
    tiny = dict(NUM_LAYERS=2, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1, VOCAB_SIZE=64, VE_LAYERS="1", DEVICE="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tg.init_runtime(make_cfg(**tiny), {}).kernels == "torch"  # the CPU default: no interpreter needed
    rt = tg.init_runtime(make_cfg(KERNELS="triton", **tiny), {})
    assert rt.kernels == "triton" and tg.build_model(make_cfg(KERNELS="triton", **tiny), rt).ops is tg.TRITON_OPS
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU without the interpreter cannot run the kernels
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tg.init_runtime(make_cfg(KERNELS="triton", **tiny), {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter, but no triton package
    monkeypatch.setattr(tg, "triton", None)
    with pytest.raises(ValueError, match="KERNELS=triton needs the triton package"):
        tg.init_runtime(make_cfg(KERNELS="triton", **tiny), {})
