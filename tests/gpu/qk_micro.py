"""The q/k Triton kernels alone at the record shapes (48 x 2048 tokens; q: 8 heads with gain, k: 4
without), for several rows-per-program and warp counts: forward and backward microseconds and GB/s
(forward moves x and y, backward dy, x and dx). Picks QK_ROWS_PER_PROGRAM. Needs CUDA.

    python3 tests/gpu/qk_micro.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402


def bench(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1000


def main() -> None:
    dev = torch.device("cuda")
    cos, sin = (t.to(dev) for t in tg.rope_tables(2048, 16, 10000.0))
    for H, with_gain in ((8, True), (4, False)):
        x = torch.randn(48, 2048, H, 64, device=dev, dtype=torch.bfloat16)
        dy, y, dx = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        g = torch.rand(H, device=dev) + 0.5
        dg = torch.empty(x.numel() // 64, device=dev)
        _, n_rows, stride, T, meta = tg._qk_launch_args(x, cos, sin, g)
        for rows in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                grid, kw = ((n_rows + rows - 1) // rows,), dict(meta, BR=rows, HAS_GAIN=with_gain, num_warps=warps)
                tf = bench(lambda: tg._qk_norm_rope_fwd[grid](x, cos, sin, g, y, n_rows, stride, T, **kw))
                tb = bench(lambda: tg._qk_norm_rope_bwd[grid](dy, x, cos, sin, g, dx, dg, n_rows, stride, T, **kw))
                print(f"qk_micro H:{H} rows:{rows} warps:{warps} fwd_us:{tf:.1f} fwd_GBps:{2 * x.nbytes / tf / 1e3:.0f} "
                      f"bwd_us:{tb:.1f} bwd_GBps:{3 * x.nbytes / tb / 1e3:.0f}")


if __name__ == "__main__":
    main()
