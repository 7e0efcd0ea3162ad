"""tools/bench_gpu.py on the CPU: its --curve trains as train_gpt.py does, and its trace summary on a synthetic trace."""
from __future__ import annotations

import re
import sys

from conftest import ROOT, run_inline, run_script, tiny_env


def test_bench_curve_equals_the_scripts_own_train_losses(dataset, tokenizer_path, tmp_path, monkeypatch):
    """bench_gpu.py --curve (the 1-vs-N-GPU loss comparison) must train exactly as train_gpt.py does:
    same seed, warmup restore, data order and schedule (2 steps at the peak lr, 2 in the warmdown, the Muon momentum
    warming up throughout), so its per-step losses equal the script's."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS="4", WARMDOWN_ITERS="3", LATE_QAT_THRESHOLD="0",
                   RUN_ID="curve_ref")
    ref = run_inline(monkeypatch, env, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = [float(x) for x in re.findall(r"^step:\d+/4 train_loss:([\d.]+)", ref.stdout, re.M)]
    out = run_script(env, tmp_path, script=ROOT / "tools/bench_gpu.py", args=("--curve", "4"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = [float(x) for x in re.findall(r"^curve step:\d+ loss:([\d.]+)$", out.stdout, re.M)]
    assert len(want) == len(got) == 4
    # the same losses, rounded by the script to 4 decimals and by the bench to 6: at most 5e-5 + 5e-7 apart
    assert all(abs(g - w) <= 5.05e-5 for g, w in zip(got, want)), (got, want)


def test_kernel_summary_on_a_synthetic_trace(tmp_path):
    """Busy time is the union of GPU intervals, idle the rest; an inductor kernel named after SDPA is
    Triton work; the optimizer's kernels are those launched inside its host range (by correlation id);
    a memset names the CPU ops around the runtime call that issued it."""
    import json
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_gpu
    X = dict(ph="X")
    ev = [dict(X, cat="cpu_op", name="outer", ts=0, dur=200, tid=1),
          dict(X, cat="cpu_op", name="aten::zero_", ts=5, dur=10, tid=1),
          dict(X, cat="cuda_runtime", name="cudaMemsetAsync", ts=8, dur=1, tid=1, args=dict(correlation=7)),
          dict(X, cat="gpu_memset", name="Memset (Device)", ts=20, dur=4, args=dict(correlation=7, bytes=64)),
          dict(X, cat="kernel", name="nvjet_sm90_gemm", ts=30, dur=10, args={}),
          dict(X, cat="kernel", name="triton_poi_fused__scaled_dot_product_cudnn_attention_0", ts=35, dur=10, args={}),
          dict(X, cat="kernel", name="cudnn_sdpa_fprop", ts=60, dur=10, args=dict(correlation=9)),
          dict(X, cat="user_annotation", name="optimizer", ts=50, dur=20, tid=1),
          dict(X, cat="cuda_runtime", name="cudaLaunchKernel", ts=55, dur=1, tid=1, args=dict(correlation=9)),
          dict(X, cat="cuda_runtime", name="cudaLaunchKernel", ts=75, dur=1, tid=1, args=dict(correlation=11)),
          dict(X, cat="kernel", name="after_the_optimizer", ts=80, dur=5, args=dict(correlation=11)),
          dict(X, cat="kernel", name="ncclDevKernel_ReduceScatter_Sum_bf16", ts=82, dur=8, args={})]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": ev}))
    lines = bench_gpu.kernel_summary(str(tmp_path / "t.json"), 1)
    # GPU ops cover [20,24) [30,45) [60,70) [80,90): busy 39 us of a 70 us wall; NCCL [82,90) runs alone
    # for its last 5 us
    assert lines[0].startswith("kernels per_step_ms wall:0.07 busy:0.04 idle:0.03 ")
    assert "triton:0.01" in lines[0] and "attention:0.01" in lines[0] and "gemm:0.01" in lines[0]
    assert "gpu_ops:6 gaps:3 " in lines[0]
    assert "comm per_step_ms nccl_busy:0.008 exposed:0.005 exposed_pct_of_wall:7.14" in lines
    assert "optimizer per_step_ms busy:0.010 first_to_last:0.010 ops:1" in lines
    assert any(l.startswith("optimizer_kernel   0.010 ms/step    1/step cudnn_sdpa_fprop") for l in lines)
    assert "memset_issuer    0.004 ms/step aten::zero_ < outer" in lines
    assert lines[-1] == "memset_bytes 64x1"
