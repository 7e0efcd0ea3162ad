"""GPU training-step benchmark for any config (settings are train_gpt.py's environment variables).

    python3 tools/bench_gpu.py [--steps 20] [--profile]                  (one GPU)
    torchrun --standalone --nproc_per_node=N tools/bench_gpu.py ...      (N GPUs)

Runs the script's own warmup (compile, graph capture, then full restore), then N timed steps of the
script's own Trainer.step (real loader, optimizer) and EMA update, and prints (rank 0): ms/step, tokens/s,
achieved TFLOP/s and % of the bf16 floor, peak memory, compile time, and per step by CUDA events: the
step and the EMA update; then the optimizer alone on one step's gradients (GPU time with the host ahead,
and host launch time). --profile adds, over 3 more steps, a torch.profiler table and kernel_summary() of
its trace (GPU time by kind, idle gaps, top kernels, the optimizer's span, memset issuers). --curve N
prints N trained steps' losses instead of timing (also on the CPU). tests/test_bench.py tests its pieces.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's train_gpt.py
import train_gpt as tg  # noqa: E402

BF16_PEAK_TFLOPS = 790.0  # dense bf16 matmul rate measured on one of this project's H200s


def step_flops(cfg: tg.Hyperparameters, model: torch.nn.Module) -> float:
    """Training FLOPs per optimizer step: 6 x matmul params x tokens, plus causal attention
    (QK^T and PV: 2 x 2 x T x T x d per layer per sequence, halved by causality, x3 fwd+bwd); a looped
    model (NUM_LOOPS) runs its layers' matrices once per position."""
    positions = len(tg.layer_order(cfg, True)) / cfg.num_layers  # 1 without NUM_LOOPS
    banks = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_bank"))
    matmul = positions * banks + sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    matmul += cfg.vocab_size * cfg.model_dim  # output head
    tokens = cfg.train_batch_tokens
    attn = 3 * 2 * cfg.train_seq_len * cfg.model_dim * tokens * cfg.num_layers * positions
    return 6.0 * matmul * tokens + attn


KERNEL_KINDS = (("nccl", ("nccl",)), ("own", ("_qk_norm_rope", "_xsa_")),  # own: train_gpt.py's Triton kernels
                ("attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
                ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "splitk")))
PROFILE_STEPS = 3


def kernel_kind(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):  # before the others: inductor names kernels after what they fuse (..._attention_...)
        return "triton"
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of a union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def kernel_summary(trace_path: str, steps: int, top: int = 70) -> list[str]:
    """Per-step GPU time from a torch.profiler chrome trace: by kind (attention, gemm, triton, memset,
    memcpy, other), idle time between GPU ops, the top kernels by full name, and for each memset the
    innermost CPU op that issued it (through the runtime call's correlation id)."""
    import bisect
    import json
    from collections import Counter, defaultdict
    ev = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    if not gpu:
        return ["kernels none: the trace holds no GPU activity"]
    kinds, names = Counter(), Counter()
    for e in gpu:
        kind = {"gpu_memset": "memset", "gpu_memcpy": "memcpy"}.get(e["cat"]) or kernel_kind(e["name"])
        kinds[kind] += e["dur"]
        names[(kind, e["name"])] += e["dur"]
    gpu.sort(key=lambda e: e["ts"])
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    end, last, gaps = gpu[0]["ts"], gpu[0], []
    for e in gpu:
        a, b = e["ts"], e["ts"] + e["dur"]
        if a > end:
            gaps.append((a - end, last["name"][:60], e["name"][:60]))
        if b > end:
            end, last = b, e
    wall = end - gpu[0]["ts"]
    small = sum(g for g, _, _ in gaps if g < 20)
    # communication hidden behind compute: NCCL kernel time, and the part of it when no other kernel ran
    # (the time this rank only communicated or waited for the others)
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if kernel_kind(e["name"]) == "nccl"]
    exposed = busy - union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu if kernel_kind(e["name"]) != "nccl"])
    out = [f"kernels per_step_ms wall:{wall / steps / 1e3:.2f} busy:{busy / steps / 1e3:.2f} idle:{(wall - busy) / steps / 1e3:.2f} "
           + " ".join(f"{k}:{v / steps / 1e3:.2f}" for k, v in kinds.most_common())
           + f" gpu_ops:{len(gpu) // steps} gaps:{len(gaps) // steps} idle_in_gaps_under_20us:{small / steps / 1e3:.2f}"]
    if nccl:
        out.append(f"comm per_step_ms nccl_busy:{union_us(nccl) / steps / 1e3:.3f} "
                   f"exposed:{exposed / steps / 1e3:.3f} exposed_pct_of_wall:{100 * exposed / wall:.2f}")
    for g, before, after in sorted(gaps, reverse=True)[:8]:
        out.append(f"gap {g:8.1f} us after {before} before {after}")
    counts = Counter(e["name"] for e in gpu)
    for (kind, name), t in names.most_common(top):
        out.append(f"kernel {kind} {t / steps / 1e3:8.3f} ms/step {counts[name] // steps:5d}/step {name[:160]}")
    # the optimizer's GPU work: kernels whose launch (runtime call, by correlation id) happened inside the
    # host range of record_function("optimizer") in Trainer.step. Its GPU-side annotation spans are not used:
    # they covered 0.6 of the 2.3 ms the CUDA events gave and held none of the Newton-Schulz GEMMs.
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "user_annotation" and e["name"] == "optimizer"]
    launched = {}  # correlation id -> index of the host range that launched it
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") is not None:
            for i, (a, b) in enumerate(ranges):
                if a <= e["ts"] < b:
                    launched[e["args"].get("correlation")] = i
    ops = [e for e in gpu if e.get("args", {}).get("correlation") in launched]
    if ops:
        inside, n_inside, first, last = Counter(), Counter(e["name"] for e in ops), {}, {}
        for e in ops:
            inside[e["name"]] += e["dur"]
            i = launched[e["args"]["correlation"]]
            first[i], last[i] = min(first.get(i, e["ts"]), e["ts"]), max(last.get(i, 0), e["ts"] + e["dur"])
        span = sum(last[i] - first[i] for i in first)
        busy_opt = union_us([(e["ts"], e["ts"] + e["dur"]) for e in ops])
        out.append(f"optimizer per_step_ms busy:{busy_opt / steps / 1e3:.3f} first_to_last:{span / steps / 1e3:.3f} "
                   f"ops:{len(ops) // steps}")
        for name, t in inside.most_common(40):
            out.append(f"optimizer_kernel {t / steps / 1e3:7.3f} ms/step {n_inside[name] // steps:4d}/step {name[:110]}")
    # who issues the memsets: correlation id -> runtime call -> innermost enclosing CPU op on its thread
    ops = defaultdict(list)
    for e in ev:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append((e["ts"], -(e["ts"] + e["dur"]), e["name"]))  # outer before inner
    for v in ops.values():
        v.sort()
    runtime = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    issuers, sizes = Counter(), Counter()
    for e in gpu:
        if e["cat"] != "gpu_memset":
            continue
        sizes[e.get("args", {}).get("bytes", -1)] += 1
        r, who = runtime.get(e.get("args", {}).get("correlation")), "?"
        if r is not None:
            lst = ops[r["tid"]]
            first = i = bisect.bisect_right(lst, (r["ts"], float("inf"), "")) - 1
            chain = []
            while i >= 0 and len(chain) < 3 and first - i < 20000:  # the innermost three enclosing ops
                if -lst[i][1] >= r["ts"]:
                    chain.append(lst[i][2][:50])
                i -= 1
            who = " < ".join(chain) or "?"
        issuers[who] += e["dur"]
    for who, t in issuers.most_common(10):
        out.append(f"memset_issuer {t / steps / 1e3:8.3f} ms/step {who}")
    out.append("memset_bytes " + " ".join(f"{b}x{n // steps}" for b, n in sizes.most_common(12)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--qat-check", action="store_true", help="compiled loss with late QAT off vs on, same batch")
    ap.add_argument("--sync", action="store_true", help="host waits for the GPU at each step's start, as under the "
                    "wallclock cap")
    ap.add_argument("--curve", type=int, default=0, help="instead of timing: N trained steps, print each step's loss")
    args = ap.parse_args()
    cfg, _ = tg.Hyperparameters.from_env()
    rt = tg.init_runtime(cfg)
    if rt.device.type != "cuda" and not args.curve:
        raise SystemExit("bench_gpu.py needs CUDA (only --curve runs on the CPU)")
    torch.manual_seed(cfg.seed)  # as train_gpt.main: every rank builds the same initial weights
    model = tg.build_model(cfg, rt)
    loader = tg.TrainLoader(tg.shard_files(cfg.data_path, "train"), cfg, rt)
    trainer = tg.Trainer(cfg, rt, model, loader, tg.Logger(cfg.run_id, False))
    t0 = tg.now_ms(rt.device)
    trainer.warmup()
    compile_s = (tg.now_ms(rt.device) - t0) / 1000
    if args.curve:  # the schedule as train_gpt.py runs it without a wallclock cap; mean loss over ranks
        for step in range(args.curve):
            loss = trainer.mean_loss(trainer.step(step, tg.lr_scale_at(cfg, step, 0.0)))
            if rt.is_main:
                print(f"curve step:{step + 1} loss:{loss:.6f}")
        if tg._distributed():
            torch.distributed.destroy_process_group()
        return
    trainer.mode = tg.Mode(cfg.num_loops > 0)  # NUM_LOOPS: time the step after ENABLE_LOOPING_AT (warmup compiled it)
    ema = tg.EMA(model, cfg.ema_horizon, cfg.ema_decay) if cfg.ema_enabled else None
    if not trainer.graphed:  # with graphs the activations live in the graph's pool, allocated at capture (warmup)
        torch.cuda.reset_peak_memory_stats()

    def one_step(step: int, ev: list | None) -> None:
        if args.sync:  # as the training loop under the wallclock cap: the host waits for the GPU each step
            torch.cuda.synchronize()
        if ev:
            ev[0].record()
        trainer.step(step, 1.0)
        if ev:
            ev[1].record()
        if ema is not None:
            ema.update(1.0 / args.steps)
        if ev:
            ev[2].record()

    times = {k: 0.0 for k in ("step", "ema")}
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(args.steps)]
    torch.cuda.synchronize()
    if tg._distributed():
        torch.distributed.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        one_step(i, events[i])
    torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - start) / args.steps
    for ev in events:
        for k, (a, b) in zip(times, ((0, 1), (1, 2))):
            times[k] += ev[a].elapsed_time(ev[b]) / args.steps
    flops = step_flops(cfg, model) / rt.world_size
    if rt.is_main:
        tps = cfg.train_batch_tokens / (wall_ms / 1000)
        tflops = flops / (wall_ms / 1000) / 1e12
        print(f"bench {rt.describe().removeprefix('layout ')} batch_tokens:{cfg.train_batch_tokens} "
              f"micro_batch_tokens:{cfg.train_batch_tokens // (rt.world_size * rt.grad_accum_steps)}")
        print(f"bench ms_per_step:{wall_ms:.2f} tokens_per_s:{tps:,.0f} tflops_per_gpu:{tflops:.1f} "
              f"pct_of_bf16_floor:{100 * tflops / BF16_PEAK_TFLOPS:.1f} floor_ms:{flops / BF16_PEAK_TFLOPS / 1e9:.1f} "
              f"compile_s:{compile_s:.1f} peak_mem_mib:{torch.cuda.max_memory_allocated() // 2**20} "
              f"peak_reserved_mib:{torch.cuda.max_memory_reserved() // 2**20} cuda_graphs:{int(trainer.graphed)}")
        print("bench breakdown_ms " + " ".join(f"{k}:{v:.2f}" for k, v in times.items()))
    # The optimizer alone on one step's gradients: its GPU time with the host far ahead (a sleep kernel is
    # queued first), and the host's time to launch it. The in-step figure above is the larger of the two
    # when the host falls behind. These 10 extra steps change the weights that --qat-check and --profile
    # then run on; that changes no kernel's work.
    for x, y in loader.next_batch():  # one step's gradients
        trainer.fwd_bwd(x, y)
    saved = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    gpu_ms = host_ms = 0.0
    reps = 10
    for _ in range(reps):
        for p, g in saved.items():
            p.grad.copy_(g)  # in place: with CUDA_GRAPHS=1 the graphs accumulate into these buffers
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time: the launches below all queue behind it
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        trainer.opt.step()
        b.record()
        host_ms += 1000 * (time.perf_counter() - t) / reps
        torch.cuda.synchronize()
        gpu_ms += a.elapsed_time(b) / reps
    trainer.opt.zero_grad()
    if rt.is_main:
        print(f"bench optimizer_alone gpu_ms:{gpu_ms:.3f} host_ms:{host_ms:.3f} reps:{reps}")
    if args.qat_check:  # after the timed steps, so out/down banks are non-zero and QAT can matter
        x, y = loader.next_batch()[0]
        losses = []
        with tg.autocast(rt.device):  # grad mode on, as in training: the modes warmup compiled
            for qat in (0, trainer.qat_grid, 0):
                t = time.perf_counter()
                losses.append((trainer.fwd(x, y, trainer.mode._replace(qat=qat)).item(),
                               1000 * (time.perf_counter() - t)))
        if rt.is_main:
            print("qat_check " + " ".join(f"{name}_loss:{l:.6f} {name}_ms:{ms:.1f}" for name, (l, ms)
                                          in zip(("off", "on", "off_again"), losses)))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(PROFILE_STEPS):
                one_step(i, None)
            torch.cuda.synchronize()
        if rt.is_main:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", 30)),
                                            max_name_column_width=70))
            trace = os.environ.get("PROFILE_TRACE", "/tmp/bench_trace.json")
            prof.export_chrome_trace(trace)
            for line in kernel_summary(trace, PROFILE_STEPS):
                print(line)
    if tg._distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
