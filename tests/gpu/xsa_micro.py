# XSA kernels at the record shape: us per call of fwd/bwd for rows per program x warps, vs the compiled
# reference (chose XSA_ROWS_PER_PROGRAM). Run from the repository root: PYTHONPATH=. python3 tests/gpu/xsa_micro.py
import torch, triton, train_gpt as tg
B, T, H, K, D = 48, 2048, 8, 4, 64
qkv = torch.randn(B, T, (H + 2 * K) * D, device="cuda", dtype=torch.bfloat16)
v = qkv[..., (H + K) * D:].view(B, T, K, D)
y = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
do = torch.randn_like(y)
out = torch.empty_like(y); dy = torch.empty_like(y); dv = torch.empty(B, T, K, D, device="cuda", dtype=torch.bfloat16)
def bench(f, n=50):
    for _ in range(5): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1000
n_rows = B * T * K
fb, bb = (y.numel() * 2 + v.numel()) * 2, (y.numel() * 3 + v.numel() * 2) * 2
for BR in (4, 8, 16, 32, 64):
    for nw in (1, 2, 4, 8):
        grid = (triton.cdiv(n_rows, BR),)
        meta = dict(K=K, G=H // K, D=D, BG=2, BD=64, BR=BR, EPS=1e-12, num_warps=nw)
        tf = bench(lambda: tg._xsa_fwd[grid](y, v, out, n_rows, qkv.stride(1), **meta))
        tb = bench(lambda: tg._xsa_bwd[grid](do, y, v, dy, dv, n_rows, qkv.stride(1), **meta))
        print(f"xsa BR={BR:3d} warps={nw} fwd {tf:6.1f} us ({fb/tf/1e6:.2f} TB/s)  bwd {tb:6.1f} us ({bb/tb/1e6:.2f} TB/s)")
yr = y.clone().requires_grad_(); vr = v.clone().requires_grad_()
ref = torch.compile(tg.exclusive_self_attention_reference)
def fb_ref():
    o = ref(yr, vr); o.backward(do)
def fb_op():
    o = tg.exclusive_self_attention(yr, vr); o.backward(do)
print(f"compiled reference fwd+bwd {bench(fb_ref):.1f} us; triton op eager fwd+bwd {bench(fb_op):.1f} us")
