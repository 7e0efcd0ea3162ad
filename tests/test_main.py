"""main: whole runs as a user makes them (python3 train_gpt.py, torchrun), same seed same results, 2 processes
== 1, the wallclock cap."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from conftest import SCRIPT, TINY_VOCAB, run_script, tiny_env

import train_gpt as tg

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


# =============================================================================================
# 8, 9, 10. Whole runs (python3 train_gpt.py / torchrun, as a user would)
# =============================================================================================

LOSS_LINE = re.compile(r"^step:(\d+)/(\d+) train_loss:(\S+) train_time:(\d+)ms step_avg:([\d.]+)ms$", re.M)


def parse_losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for m in LOSS_LINE.finditer(log)}


def one_line(log: str, prefix: str) -> str:
    lines = [x for x in log.splitlines() if x.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return lines[0]


@pytest.fixture(scope="module")
def seed_runs(dataset, tokenizer_path, tmp_path_factory):
    """Two 1-process runs of the tiny config with the same settings (RUN_ID aside)."""
    logs = {}
    for run_id in ("same_a", "same_b"):
        cwd = tmp_path_factory.mktemp(run_id)
        r = run_script(tiny_env(dataset, tokenizer_path, RUN_ID=run_id), cwd)
        assert r.returncode == 0, r.stderr[-3000:]
        logs[run_id] = (cwd / "logs" / f"{run_id}.txt").read_text()
    return logs


def test_same_seed_same_results(seed_runs, dataset, tokenizer_path, tmp_path):
    a, b = seed_runs["same_a"], seed_runs["same_b"]
    la = [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(a)]
    lb = [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(b)]
    assert len(la) == 20 and la == lb
    key = "final_int6_sliding_window_exact "
    assert one_line(a, key) == one_line(b, key)
    r = run_script(tiny_env(dataset, tokenizer_path, RUN_ID="seed2", SEED="2", ITERATIONS="2"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    first_other = parse_losses((tmp_path / "logs" / "seed2.txt").read_text())[1]
    assert abs(first_other - parse_losses(a)[1]) > 1e-3  # the seed sets the init


def test_two_process_run_matches_one_process_and_logs_everything(seed_runs, dataset, tokenizer_path, tmp_path):
    one = seed_runs["same_a"]
    r = run_script(tiny_env(dataset, tokenizer_path, RUN_ID="two"), tmp_path, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    two = (tmp_path / "logs" / "two.txt").read_text()
    l1, l2 = parse_losses(one), parse_losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, 21))
    for s in l1:  # relative difference per step < 1e-4 (different reduction order only)
        assert abs(l1[s] - l2[s]) <= 1e-4 * abs(l1[s]), (s, l1[s], l2[s])
    assert "world_size:2" in two and "grad_accum_steps:4" in two and "grad_accum_steps:8" in one

    for log in (one, two):
        assert log.startswith("==== source: train_gpt.py ====\n")
        source = log.split("==== source: train_gpt.py ====\n", 1)[1].split("\n==== end source ====", 1)[0]
        assert source == SCRIPT.read_text(encoding="utf-8")
        names = [ln.split()[1].split(":")[0] for ln in log.splitlines() if ln.startswith("setting ")]
        assert names == sorted(names) and set(names) == {f.name for f in dataclasses.fields(tg.Hyperparameters)}
        assert "setting num_layers:2" in log and "setting model_dim:32" in log
        tokens = sum(len(tg.open_shard(f, TINY_VOCAB)) for f in tg.shard_files(str(dataset), "train"))
        assert f"train_data shards:2 tokens:{tokens} epochs_at_max_iterations:{20 * 512 / tokens:.2f} " \
               "sampling:sequential" in log
        assert len(LOSS_LINE.findall(log)) == 20
        assert re.search(r"^train_done steps:20 train_time:\d+ms step_avg:[\d.]+ms$", log, re.M)
        assert re.search(r"^post_ema val_loss:[\d.]+ val_bpb:[\d.]+ ", log, re.M)
        assert re.search(r"^post_ema_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", log, re.M)
        assert re.search(r"^Total submission size int6\+(zstd|lzma): \d+ bytes", log, re.M)
        assert re.search(r"^final_int6_roundtrip val_loss:[\d.]+ val_bpb:[\d.]+ eval_time:\d+ms", log, re.M)
        assert re.search(r"^final_int6_roundtrip_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", log, re.M)
        assert re.search(r"^final_int6_sliding_window val_loss:[\d.]+ val_bpb:[\d.]+ stride:8 eval_time:\d+ms",
                         log, re.M)
        assert re.search(r"^final_int6_sliding_window_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", log, re.M)
    for key in ("final_int6_roundtrip_exact ", "final_int6_sliding_window_exact "):
        v1, v2 = (float(one_line(log, key).split("val_bpb:")[1]) for log in (one, two))
        assert v2 == pytest.approx(v1, rel=1e-4), key


def test_wallclock_cap_run(dataset, tokenizer_path, tmp_path):
    env = tiny_env(dataset, tokenizer_path, RUN_ID="cap", MAX_WALLCLOCK_SECONDS="1.5", ITERATIONS="100000",
                   TRAIN_LOG_EVERY="50", LAWA_K="5")
    r = run_script(env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "logs" / "cap.txt").read_text()
    m = re.search(r"^stopping_early: wallclock_cap train_time:(\d+)ms step:(\d+)/100000$", log, re.M)
    assert m, log[-3000:]
    done = re.search(r"^train_done steps:(\d+) train_time:(\d+)ms", log, re.M)
    assert done and int(done.group(1)) == int(m.group(2)) > 1
    assert int(done.group(2)) <= 1500
    assert "warning setting LAWA_K is not supported" in log  # dropped reference variables: logged, run goes on


def test_nan_loss_stops_the_run_naming_the_step(dataset, tokenizer_path, tmp_path):
    env = tiny_env(dataset, tokenizer_path, MATRIX_LR="1e30", TIED_EMBED_LR="1e30", SCALAR_LR="1e30", RUN_ID="nan")
    r = run_script(env, tmp_path)
    assert r.returncode != 0
    m = re.search(r"non-finite training loss at step (\d+)", r.stderr)
    assert m, r.stderr[-2000:]
    bad = int(m.group(1))
    losses = parse_losses((tmp_path / "logs" / "nan.txt").read_text())
    assert bad >= 2 and sorted(losses) == list(range(1, bad))  # every step before it was logged, finite
    assert all(math.isfinite(v) for v in losses.values())
