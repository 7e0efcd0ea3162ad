# micro-benchmark: causal GQA attention fwd+bwd at the record micro-batch (48 x 2048, 8 q / 4 kv heads, d 64)
import torch, torch.nn.functional as F, time
from torch.nn.attention import sdpa_kernel, SDPBackend
B, T, H, K, D = 48, 2048, 8, 4, 64
q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, K, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, K, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
def run(name, backend, gqa):
    def f():
        kk, vv = (k, v) if gqa else (k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1))
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
        y.sum().backward()
    try:
        for _ in range(3): f()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        for _ in range(10): f()
        torch.cuda.synchronize(); ms = (time.perf_counter() - t) * 100
        print(f"attn_micro {name}: {ms:.2f} ms fwd+bwd per micro-batch, x88/step = {ms*88:.0f} ms, peak {torch.cuda.max_memory_allocated()>>20} MiB")
    except Exception as e:
        print(f"attn_micro {name}: unsupported ({type(e).__name__}: {str(e)[:150]})")
run("flash_gqa", SDPBackend.FLASH_ATTENTION, True)
run("cudnn_gqa", SDPBackend.CUDNN_ATTENTION, True)
run("cudnn_repeat", SDPBackend.CUDNN_ATTENTION, False)
run("efficient_gqa", SDPBackend.EFFICIENT_ATTENTION, True)
