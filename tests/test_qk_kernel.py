"""The Triton q/k RMSNorm + RoPE + gain kernels (QK_KERNEL=triton) against a float64 reference, forward
and backward, and the whole model with them against the PyTorch-ops model. On the CPU the kernels run
in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU machine compiled (`python3 -m pytest
tests/test_qk_kernel.py` there). Without the triton package these tests are skipped; .ci/run installs it
and checks the import, so CI never skips them."""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

import train_gpt as tg  # noqa: E402
from test_train_core import make_cfg, random_model, rope_reference  # noqa: E402

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
    y = tg.qk_norm_rope(x, cos, sin, gain)
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
    else:
        torch.testing.assert_close(y.double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-4, atol=1e-5)
    if with_gain:  # fp32 sums of the per-row partials; inputs are the same rounded dy and x
        torch.testing.assert_close(gain.grad.cpu().double(), g64.grad, rtol=1e-4, atol=1e-4)


def test_kernel_reads_a_strided_token_row():
    """q as a slice of a wider projection output (e.g. fused q|k|v): heads packed, token stride larger."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 10, 2, 32
    wide = torch.randn(B, T, 3 * H * D, generator=g).to(DEV).requires_grad_()
    cos, sin = (t.to(DEV) for t in tg.rope_tables(T, 8, 10000.0))
    x = wide[..., H * D: 2 * H * D].view(B, T, H, D)
    y = tg.qk_norm_rope(x, cos, sin, None)
    y.sum().backward()
    want = reference(x.detach().cpu(), 8, 10000.0, None)
    torch.testing.assert_close(y.detach().cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert wide.grad[..., : H * D].abs().max() == 0 and wide.grad[..., H * D: 2 * H * D].abs().max() > 0


def test_kernel_refuses_what_it_cannot_index():
    """Unpacked heads, tables shorter than the sequence or wider than half a head, a gain of the wrong size:
    errors, not reads past the end."""
    x = torch.randn(1, 4, 8, 2, device=DEV).transpose(2, 3)  # (1, 4, 2, 8) with head dim not contiguous
    cos, sin = (t.to(DEV) for t in tg.rope_tables(4, 4, 10000.0))
    with pytest.raises(ValueError, match="heads packed"):
        tg.qk_norm_rope(x, cos, sin, None)
    x = torch.randn(1, 4, 2, 8, device=DEV)
    for T, dims in ((3, 4), (4, 10)):
        cos, sin = (t.to(DEV) for t in tg.rope_tables(T, dims, 10000.0))
        with pytest.raises(ValueError, match="tables"):
            tg.qk_norm_rope(x, cos, sin, None)
    cos, sin = (t.to(DEV) for t in tg.rope_tables(4, 4, 10000.0))
    with pytest.raises(ValueError, match="gain of shape"):
        tg.qk_norm_rope(x, cos, sin, torch.ones(3, device=DEV))


@pytest.mark.parametrize("name", ["full", "plain"])
def test_model_with_triton_kernel_equals_model_with_torch_ops(name):
    """Same weights, QK_KERNEL=triton vs torch: logits, loss and every gradient (fp32, CPU)."""
    ref = random_model(name).to(DEV)
    model = tg.GPT(ref.cfg, "math", "triton").to(DEV)
    model.load_state_dict(ref.state_dict())
    V = ref.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    ids, targets = (torch.randint(0, V, (2, 32), generator=g).to(DEV) for _ in range(2))
    losses = [m(ids, targets) for m in (model, ref)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    assert all(b.q_gain.grad.abs().max() > 0 for b in model.blocks)


def test_qk_kernel_setting_resolves_and_refuses_what_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only read by resolve_qk_kernel here
    assert tg.resolve_qk_kernel(make_cfg(), cpu) == "torch"  # the CPU default: no interpreter needed
    assert tg.resolve_qk_kernel(make_cfg(QK_KERNEL="triton"), cpu) == "triton"
    assert tg.build_model(make_cfg(QK_KERNEL="triton", NUM_LAYERS=2, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1,
                                   VOCAB_SIZE=64, VE_LAYERS="1"), cpu, "math").qk_kernel == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU without the interpreter cannot run the kernels
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tg.resolve_qk_kernel(make_cfg(QK_KERNEL="triton"), cpu)
    monkeypatch.setattr(tg, "triton", None)
    with pytest.raises(ValueError, match="QK_KERNEL=triton needs the triton package"):
        tg.resolve_qk_kernel(make_cfg(QK_KERNEL="triton"), cpu)
    assert tg.resolve_qk_kernel(make_cfg(), torch.device("cuda")) == "torch"
