# micro-check of FP8_ENABLED's matmul on CUDA at the record micro-batch (98,304 tokens; the four bank shapes):
# train_gpt.fp8_linear eager and compiled against a float64 matmul of the hand-dequantised e4m3 operands (is the
# rowwise scale layout of torch._scaled_mm the one we assume?), its gradients against bf16 F.linear autograd,
# and fwd / fwd+bwd times against compiled bf16 F.linear. Run from the repository root: python3 tests/gpu/fp8_micro.py
import sys
from pathlib import Path
import torch, torch.nn.functional as F
from triton.testing import do_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg
E4M3 = torch.float8_e4m3fn
def dequantised(t):
    s = t.double().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448
    return (t.double() / s).float().to(E4M3).double() * s
torch.manual_seed(0)
print(f"fp8_micro torch:{torch.__version__} device:{torch.cuda.get_device_name().replace(' ', '_')} cc:{torch.cuda.get_device_capability()}")
fns = {"fp8_eager": tg.fp8_linear, "fp8_compiled": torch.compile(tg.fp8_linear, fullgraph=True),
       "bf16_compiled": torch.compile(F.linear, fullgraph=True)}
M = 98304
for N, K in ((512, 512), (256, 512), (1536, 512), (512, 1536)):  # Q/out, K/V, MLP up, MLP down
    x = (torch.randn(M, K, device="cuda") * torch.randn(M, 1, device="cuda").exp()).bfloat16()
    w = (torch.randn(N, K, device="cuda") * torch.randn(N, 1, device="cuda").exp() / K ** 0.5).bfloat16()
    g = torch.randn(M, N, device="cuda").bfloat16()
    ref, exact = dequantised(x) @ dequantised(w).T, x.double() @ w.double().T
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(x2, w2).backward(g)
    for name, f in fns.items():
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(x1, w1)
        y.backward(g)
        vs_deq = ((y.double() - ref).abs() / (ref.abs() + 1e-6 * ref.abs().max())).max().item()
        vs_exact = ((y.double() - exact).norm() / exact.norm()).item()
        grad = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() for a, b in ((x1, x2), (w1, w2)))
        fwd = do_bench(lambda: f(x, w))
        fwd_bwd = do_bench(lambda: f(x1, w1).backward(g))
        print(f"fp8_micro N:{N} K:{K} {name} vs_dequantised_maxrel:{vs_deq:.2e} vs_exact_rel:{vs_exact:.4f} "
              f"grad_maxdiff_rel:{grad:.2e} fwd_ms:{fwd:.3f} fwd_bwd_ms:{fwd_bwd:.3f}", flush=True)
