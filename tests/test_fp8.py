"""CPU tests of FP8_ENABLED: the e4m3 bank matmul against a hand dequantisation and against autograd of the
plain bf16 matmul, a GPT with FP8 on against the same weights with it off, and a whole tiny run. Each test
states its tolerance."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import run_script, tiny_env

import train_gpt as tg

E4M3 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("one_thread")


def dequantised(t: torch.Tensor) -> torch.Tensor:
    """What the FP8 forward should see of t (2-D): each row scaled so its largest |value| is 448, rounded
    to e4m3, scaled back; fp64."""
    scale = t.double().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.double() / scale).float().to(E4M3).double() * scale


def operands(dtype: torch.dtype):
    """x (2,32,64) with row norms spread over 4 decades and one all-zero token; w (48,64) likewise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 64, generator=g) * torch.exp(2 * torch.randn(2, 32, 1, generator=g))
    x[1, 7] = 0.0
    w = torch.randn(48, 64, generator=g) * torch.exp(2 * torch.randn(48, 1, generator=g)) / 8
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_forward_is_the_dequantised_matmul(dtype):
    x, w = operands(dtype)
    y = tg.fp8_linear(x, w)
    assert y.shape == (2, 32, 48) and y.dtype == dtype
    ref = (dequantised(x.flatten(0, 1)) @ dequantised(w).T).view(2, 32, 48)
    # the only differences: the output rounding (half an ulp of bf16: 2^-8 relative) and the fp32 accumulation
    # (1e-6 of the largest output absolute, for entries that cancel)
    rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
    assert (y.double() - ref).abs().le(rtol * ref.abs() + 1e-6 * ref.abs().max()).all()
    assert torch.all(y[1, 7] == 0)  # the zero token: no division by zero
    # and it is a matmul: within a few % of the exact product, not equal to it (e4m3 keeps 3 mantissa bits)
    exact = x.double() @ w.double().T
    rel = (y.double() - exact).norm() / exact.norm()
    assert 0.005 < rel < 0.06, rel


def test_fp8_linear_backward_is_the_bf16_straight_through_gradient():
    x, w = operands(torch.bfloat16)
    g = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    tg.fp8_linear(x1, w1).backward(g)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(x2, w2).backward(g)
    assert x1.grad.dtype == w1.grad.dtype == torch.bfloat16
    # same bf16 products with fp32 accumulation; allow a 1-ulp difference of bf16 from summation order
    torch.testing.assert_close(x1.grad, x2.grad, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=2 ** -7, atol=0)


def tiny_gpt(fp8: bool) -> tg.GPT:
    """The tiny 4-layer GPT (GQA, XSA, VE) at its init, with the zero-initialised attention-out and MLP-down
    banks made random (std 1/sqrt(fan-in)) and larger token embeddings, so every bank matmul matters."""
    cfg, _ = tg.Hyperparameters.from_env(dict(
        NUM_LAYERS="4", MODEL_DIM="32", NUM_HEADS="4", NUM_KV_HEADS="2", ROPE_DIMS="4", VOCAB_SIZE="64",
        BIGRAM_VOCAB_SIZE="64", BIGRAM_DIM="16", VE_DIM="16", VE_LAYERS="2,3", XSA_LAST_N="2",
        FP8_ENABLED=str(int(fp8))))
    torch.manual_seed(0)
    model = tg.GPT(cfg)
    with torch.no_grad():
        for b in (model.qo_bank[cfg.num_layers:], model.mlp_down_bank):
            b.copy_(torch.randn_like(b) / math.sqrt(b.shape[-1]))
        model.tok_emb.weight.normal_(std=0.1)
    return model


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_fp8_gpt_trains_close_to_the_plain_gpt_and_scores_identically(autocast):
    ref, fp8 = tiny_gpt(False), tiny_gpt(True)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), fp8.state_dict().values()))
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 64, (2, 32), generator=g), torch.randint(0, 64, (2, 32), generator=g)
    losses, grads = [], []
    for m in (ref, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append([b.grad.flatten() for b in (m.qo_bank, m.kv_bank, m.mlp_up_bank, m.mlp_down_bank)])
    assert losses[0] != losses[1]  # FP8 is on in training mode
    assert abs(losses[1] - losses[0]) < 0.003 * losses[0], losses  # measured: 0.03-0.04%
    for a, b in zip(*grads):
        assert F.cosine_similarity(a.double(), b.double(), dim=0) > 0.99
    ref.eval(), fp8.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert torch.equal(ref.logits(ids), fp8.logits(ids))  # scoring never uses FP8


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    cfg, _ = tg.Hyperparameters.from_env(dict(FP8_ENABLED="1"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="FP8_ENABLED"):
        tg.build_model(cfg, torch.device("cuda"), "math")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="divisible by 16"):  # CUDA _scaled_mm needs dims % 16 == 0
        tg.build_model(dataclasses.replace(cfg, model_dim=520, num_heads=8, num_kv_heads=4), torch.device("cuda"), "math")
    small = dataclasses.replace(cfg, num_layers=1, model_dim=32, num_heads=2, num_kv_heads=1, rope_dims=8,
                                vocab_size=64, bigram_vocab_size=0, ve_enabled=False, xsa_last_n=0)
    assert tg.build_model(small, torch.device("cpu"), "math").cfg.fp8_enabled  # the CPU runs it (tests)


def test_fp8_tiny_run_end_to_end(dataset, tokenizer_path, tmp_path):
    r = run_script(tiny_env(dataset, tokenizer_path, FP8_ENABLED="1", RUN_ID="fp8"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "logs" / "fp8.txt").read_text()
    assert "setting fp8_enabled:True" in log
    m = re.search(r"^final_int6_sliding_window_exact val_loss:(\S+) val_bpb:(\S+)$", log, re.M)
    assert m and all(math.isfinite(float(v)) and float(v) > 0 for v in m.groups()), log[-2000:]


def test_fp8_is_off_while_late_qat_trains():
    """Late QAT must see exactly the exported int6 grid: with QAT on, the FP8 model's training loss equals the
    plain model's bit for bit (and differs from its own QAT-off loss)."""
    ref, fp8 = tiny_gpt(False), tiny_gpt(True)
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 64, (2, 32), generator=g), torch.randint(0, 64, (2, 32), generator=g)
    plain_fp8 = fp8(ids, targets)
    ref.qat_enabled = fp8.qat_enabled = True
    assert torch.equal(ref(ids, targets), fp8(ids, targets))
    assert not torch.equal(fp8(ids, targets), plain_fp8)


def test_fp8_linear_compiles_fullgraph_like_eager():
    """The trainer compiles the model with fullgraph=True: the autograd Function with _scaled_mm must trace, and
    the compiled forward and backward must equal eager (fp32 on CPU inductor)."""
    x, w = operands(torch.float32)
    g = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(3))
    results = []
    for f in (tg.fp8_linear, torch.compile(tg.fp8_linear, fullgraph=True, dynamic=False)):
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(x1, w1)
        y.backward(g)
        results.append((y.detach(), x1.grad, w1.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
