"""main: whole runs as a user makes them (python3 train_gpt.py, torchrun), same seed same results, 2 processes
== 1, the wallclock cap."""
from __future__ import annotations

import dataclasses
import math
import re
import shutil
import signal

import numpy as np
import pytest
import torch

from conftest import (SCRIPT, TINY_VOCAB, bos2_tokenizer, run_inline, run_script, run_script_interrupted, sample_text,
                      tiny_env, write_shard)

import train_gpt as tg

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


# =============================================================================================
# 8, 9, 10. Whole runs (python3 train_gpt.py / torchrun, as a user would)
# =============================================================================================

LOSS_LINE = re.compile(r"^step:(\d+)/(\d+) train_loss:(\S+) train_time:(\d+)ms step_avg:([\d.]+)ms eta:(\d+)s$", re.M)


def parse_losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for m in LOSS_LINE.finditer(log)}


def one_line(log: str, prefix: str) -> str:
    lines = [x for x in log.splitlines() if x.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return lines[0]


def sample_copy(dataset, to):
    """The shards of `dataset` in folder `to`, marked as data/make_sample.py marks its shards (the same tokens)."""
    to.mkdir()
    for f in dataset.glob("*.bin"):
        raw = bytearray(f.read_bytes())
        raw[12:16] = tg.SAMPLE_MARK.to_bytes(4, "little")
        (to / f.name).write_bytes(bytes(raw))
    return to


@pytest.fixture(scope="module")
def seed_runs(dataset, tokenizer_path, tmp_path_factory):
    """Two 1-process runs of the tiny config with the same settings, RUN_ID=same_a both, in one folder ("cwd"): the
    second, on a copy of the data marked as the offline sample (the same tokens), is same_a_2. Their logs, and the
    second's stdout ("same_a_2_stdout")."""
    cwd = tmp_path_factory.mktemp("same")
    runs = {"cwd": cwd}
    for run_id, data in (("same_a", dataset), ("same_a_2", sample_copy(dataset, cwd / "sample"))):
        r = run_script(tiny_env(data, tokenizer_path, RUN_ID="same_a"), cwd)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[run_id], runs[f"{run_id}_stdout"] = (cwd / "logs" / f"{run_id}.txt").read_text(), r.stdout
    return runs


def test_same_seed_same_results(seed_runs, dataset, tokenizer_path, tmp_path, monkeypatch):
    """The same settings give the same losses and scores; another SEED another initial model."""
    a, b = seed_runs["same_a"], seed_runs["same_a_2"]
    la = [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(a)]
    lb = [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(b)]
    assert len(la) == 20 and la == lb
    key = "final_int6_sliding_window_exact "
    assert one_line(a, key) == one_line(b, key)
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, RUN_ID="seed2", SEED="2", ITERATIONS="2"), tmp_path)
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
        assert re.search(r"^Total submission size int6\+rans: \d+ bytes", log, re.M)
        assert re.search(r"^final_int6_roundtrip val_loss:[\d.]+ val_bpb:[\d.]+ eval_time:\d+ms", log, re.M)
        assert re.search(r"^final_int6_roundtrip_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", log, re.M)
        assert re.search(r"^final_int6_sliding_window val_loss:[\d.]+ val_bpb:[\d.]+ stride:8 eval_time:\d+ms",
                         log, re.M)
        assert re.search(r"^final_int6_sliding_window_exact val_loss:\d+\.\d{8} val_bpb:\d+\.\d{8}$", log, re.M)
    for key in ("final_int6_roundtrip_exact ", "final_int6_sliding_window_exact "):
        v1, v2 = (float(one_line(log, key).split("val_bpb:")[1]) for log in (one, two))
        assert v2 == pytest.approx(v1, rel=1e-4), key


def test_issue_21_features_train_alike_on_one_and_three_ranks(dataset, tokenizer_path, tmp_path, monkeypatch):
    """Every issue-21 feature on (layers 1-2 twice from step 3, two lanes from layer 3, gated skips, the sparse
    attention gate, XSA everywhere, the BOS smear fix): 3 gloo ranks (slots that 2 would split evenly do not)
    train and score as 1 does, up to reduction order; the repeats start at the same step everywhere."""
    env = dict(NUM_LAYERS=4, VE_LAYERS="3", NUM_LOOPS=1, LOOP_START=1, LOOP_END=2, ENABLE_LOOPING_AT=0.5,
               PARALLEL_START_LAYER=3, SKIP_GATES_ENABLED=1, SPARSE_ATTN_GATE_ENABLED=1, XSA_LAST_N=4,
               SMEAR_BOS_FIX=1, ITERATIONS=6, TRAIN_BATCH_TOKENS=1536)  # 48 sequences: 8 slots of 6, 6 of 8
    logs = {}
    for n in (1, 3):
        run_env = tiny_env(dataset, tokenizer_path, RUN_ID=f"lp{n}", **env)
        r = run_script(run_env, tmp_path, nproc=n) if n > 1 else run_inline(monkeypatch, run_env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        logs[n] = (tmp_path / "logs" / f"lp{n}.txt").read_text()
        assert "layer_loop:enabled step:3 progress:0.500 layers:[0, 1, 2, 1, 2, 3]" in logs[n]
        assert "layers order:[0, 1, 2, 1, 2, 3] parallel:[3]" in logs[n]
    one = parse_losses(logs[1])
    for n in (3,):
        other = parse_losses(logs[n])
        assert sorted(other) == sorted(one) == list(range(1, 7))
        for s in one:
            assert abs(one[s] - other[s]) <= 1e-4 * abs(one[s]), (n, s, one[s], other[s])
        key = "final_int6_sliding_window_exact "
        assert float(one_line(logs[n], key).split("val_bpb:")[1]) == pytest.approx(
            float(one_line(logs[1], key).split("val_bpb:")[1]), rel=1e-4)


def test_a_run_that_stops_before_enable_looping_at_still_scores_the_repeats(dataset, tokenizer_path, tmp_path,
                                                                          monkeypatch):
    env = tiny_env(dataset, tokenizer_path, RUN_ID="early", NUM_LOOPS=1, LOOP_START=0, LOOP_END=1,
                   ENABLE_LOOPING_AT=0.9, ITERATIONS=4, LAWA_K="5")
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "logs" / "early.txt").read_text()
    assert "warning setting LAWA_K is not supported" in log  # dropped reference variables: logged, run goes on
    assert not re.search(r"^layer_loop:enabled step:", log, re.M)  # (the log opens with the source, hence ^)
    after = re.search(r"^layer_loop:enabled after training step:4 ", log, re.M)
    assert after and after.start() < re.search(r"^post_ema ", log, re.M).start()


def test_nan_loss_stops_the_run_naming_the_step(dataset, tokenizer_path, tmp_path, monkeypatch):
    env = tiny_env(dataset, tokenizer_path, MATRIX_LR="1e30", TIED_EMBED_LR="1e30", SCALAR_LR="1e30", RUN_ID="nan")
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode != 0
    m = re.search(r"non-finite training loss at step (\d+)", r.stderr)
    assert m, r.stderr[-2000:]
    bad = int(m.group(1))
    losses = parse_losses((tmp_path / "logs" / "nan.txt").read_text())
    assert bad >= 2 and sorted(losses) == list(range(1, bad))  # every step before it was logged, finite
    assert all(math.isfinite(v) for v in losses.values())


def test_run_says_where_its_outputs_go_and_ends_with_a_summary(seed_runs):
    log = seed_runs["same_a"]
    assert one_line(log, "outputs ") == "outputs log:logs/same_a.txt artifact:logs/same_a.int6.ptz"
    assert (seed_runs["cwd"] / "logs" / "same_a.int6.ptz").is_file()  # the default ARTIFACT_PATH
    predicted = int(re.fullmatch(r"predicted_size total:(\d+) limit:16000000 headroom:(-?\d+)",
                                 one_line(log, "predicted_size ")).group(1))
    assert predicted > int(one_line(log, "code_bytes:").split(":")[1])  # the code and the weights' estimate
    exact = one_line(log, "final_int6_sliding_window_exact ").split("val_bpb:")[1]
    total = one_line(log, "Total submission size").split(": ")[1].split()[0]
    summary = log.strip().splitlines()[-1]
    assert re.fullmatch(rf"summary score:final_int6_sliding_window val_bpb:{exact} artifact:logs/same_a.int6.ptz "
                        rf"total_bytes:{total} train_time:\d+\.\ds eval_time:\d+\.\ds eval_wall:\d+\.\ds "
                        rf"wall_time:\d+\.\ds", summary), summary
    assert "\nsample_data:" not in log
    etas = [int(m.group(6)) for m in LOSS_LINE.finditer(log)]
    assert etas[-1] == 0 and etas[0] >= etas[-1]  # the estimated time left counts down to 0


# =============================================================================================
# Checkpoints and resume
# =============================================================================================

def test_sigterm_writes_a_checkpoint_and_the_resumed_run_is_exact(seed_runs, dataset, tokenizer_path, tmp_path):
    """SIGTERM mid-run: a checkpoint at the next step's start, one line saying how to resume, exit 128+15. The
    resumed run (RESUME=..., the same settings) logs the losses, scores and artifact of the uninterrupted one."""
    env = tiny_env(dataset, tokenizer_path, RUN_ID="same_a")  # seed_runs' settings
    rc, out, err = run_script_interrupted(env, tmp_path, after="step:3/", sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    m = re.search(r"^interrupted by SIGTERM at step (\d+): resume with RESUME=logs/same_a.ckpt and the same settings$",
                  out, re.M)
    assert m and 3 <= int(m.group(1)) < 20, out[-2000:]
    k = int(m.group(1))
    assert f"checkpoint step:{k} path:logs/same_a.ckpt" in out and "final_int6" not in out
    assert not (tmp_path / "logs" / "same_a.int6.ptz").exists()
    r = run_script(dict(env, RESUME="logs/same_a.ckpt"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = (tmp_path / "logs" / "same_a_2.txt").read_text()  # one run, one log
    assert re.search(rf"^resumed_from:logs/same_a.ckpt step:{k} train_time:\d+ms$", resumed, re.M)
    base = seed_runs["same_a"]
    lines = lambda log: [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(log)]
    assert lines(resumed) == lines(base)[k:] and len(lines(resumed)) == 20 - k
    for key in ("post_ema_exact ", "final_int6_roundtrip_exact ", "final_int6_sliding_window_exact "):
        assert one_line(resumed, key) == one_line(base, key)
    assert (tmp_path / "logs" / "same_a_2.int6.ptz").read_bytes() == \
        (seed_runs["cwd"] / "logs" / "same_a.int6.ptz").read_bytes()


def test_bad_shard_mid_run_keeps_a_checkpoint_and_resumes_exactly_after_the_fix(dataset, tokenizer_path, tmp_path):
    """2 ranks. The second train shard holds a token id >= VOCAB_SIZE: the run used to crash after step 1; now the
    step under way completes, a checkpoint is written, one error line names the shard and how to resume. Fixed,
    the resumed run logs what an uninterrupted run on the fixed data logs."""
    train = np.asarray(tg.open_shard(dataset / "fineweb_train_000000.bin", TINY_VOCAB))
    good = train[1200:4000].copy()
    bad = good.copy()
    bad[700] = TINY_VOCAB
    for name, second in (("fixed", good), ("broken", bad)):  # 1,200 tokens: step 3 (513 a step) needs shard 2
        d = tmp_path / name
        d.mkdir()
        shutil.copy(dataset / "fineweb_val_000000.bin", d)
        write_shard(d / "fineweb_train_000000.bin", train[:1200])
        write_shard(d / "fineweb_train_000001.bin", second)
    env = lambda data, **kw: tiny_env(data, tokenizer_path, ITERATIONS="4", RUN_ID="shard", **kw)
    r0 = run_script(env(tmp_path / "fixed"), tmp_path / "a", nproc=2)
    assert r0.returncode == 0, r0.stderr[-3000:]
    r1 = run_script(env(tmp_path / "broken"), tmp_path / "b", nproc=2)
    assert r1.returncode != 0
    errors = [ln for ln in r1.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, r1.stderr[-3000:]  # one rank reports what every rank met
    assert "fineweb_train_000001.bin: token id 512 >= VOCAB_SIZE 512" in errors[0]
    assert "checkpoint logs/shard.ckpt written at step 2" in errors[0] and "RESUME=logs/shard.ckpt" in errors[0]
    log1 = (tmp_path / "b" / "logs" / "shard.txt").read_text()
    assert sorted(parse_losses(log1)) == [1, 2] and log1.strip().splitlines()[-1].startswith("error ShardError: ")
    write_shard(tmp_path / "broken" / "fineweb_train_000001.bin", good)
    r2 = run_script(env(tmp_path / "broken", RESUME="logs/shard.ckpt"), tmp_path / "b", nproc=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    base, resumed = ((tmp_path / d / "logs" / f).read_text() for d, f in (("a", "shard.txt"), ("b", "shard_2.txt")))
    lines = lambda log: [m.group(0).split(" train_time")[0] for m in LOSS_LINE.finditer(log)]
    assert lines(resumed) == lines(base)[2:] and len(lines(base)) == 4
    for key in ("post_ema_exact ", "final_int6_sliding_window_exact "):
        assert one_line(resumed, key) == one_line(base, key)


# =============================================================================================
# What a user does wrong: clear errors at the start, one run per log
# =============================================================================================

def test_errors_are_one_line_logged_too_and_debug_shows_the_traceback(dataset, tokenizer_path, tmp_path):
    env = tiny_env(tmp_path / "missing", tokenizer_path, RUN_ID="nodata")
    r = run_script(env, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]  # libraries may warn on stderr too
    assert errors == [
        f"error: FileNotFoundError: DATA_PATH {tmp_path / 'missing'} is not a directory: {tg.GET_DATA} "
        "(DEBUG=1 shows the traceback)"], r.stderr[-3000:]
    log = (tmp_path / "logs" / "nodata.txt").read_text().strip().splitlines()
    assert log[-1] == f"error FileNotFoundError: DATA_PATH {tmp_path / 'missing'} is not a directory: {tg.GET_DATA}"
    r = run_script(dict(env, DEBUG="1"), tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_bare_run_without_data_says_how_to_get_it(tmp_path):
    r = run_script({"DEVICE": "cpu"}, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"TOKENIZER_PATH {tg.Hyperparameters.tokenizer_path} does not exist" in r.stderr
    assert "data/cached_challenge_fineweb.py --variant sp8192_caseops" in r.stderr and "data/quickstart.sh" in r.stderr


def test_a_missing_artifact_folder_fails_at_the_start(dataset, tokenizer_path, tmp_path):
    """It used to fail after training and scoring (FileNotFoundError, no artifact)."""
    r = run_script(tiny_env(dataset, tokenizer_path, ARTIFACT_PATH="out/model.ptz", RUN_ID="noout"), tmp_path)
    assert r.returncode == 1 and "step:" not in r.stdout
    assert "error: FileNotFoundError: ARTIFACT_PATH's folder out does not exist" in r.stderr, r.stderr[-2000:]


def test_two_ranks_report_a_bad_setting_once(dataset, tokenizer_path, tmp_path):
    r = run_script(tiny_env(dataset, tokenizer_path, MATRIX_LR="-1", RUN_ID="neg"), tmp_path, nproc=2)
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert errors == ["error: ValueError: MATRIX_LR=-1.0 is out of range: it must be >= 0 (DEBUG=1 shows the "
                      "traceback)"], r.stderr[-3000:]


@pytest.mark.parametrize("rank, error, waits", [("0", ValueError("bad"), False), ("1", ValueError("bad"), True),
                                                 ("1", RuntimeError("CUDA error"), False)])
def test_only_rank_0_reports_an_error_every_rank_meets_at_once(monkeypatch, capsys, tmp_path, rank, error, waits):
    """The others wait to be ended by torchrun (an early exit got rank 0 killed before it printed), then report, in
    rank 0's log too (it logs only its own errors: a peer that failed alone showed there as a lost connection)."""
    log = tmp_path / "r.txt"
    log.write_text("step:3/6\n")
    error.log_path = log  # as main() leaves it
    slept = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(tg.time, "sleep", slept.append)
    handler = signal.signal(signal.SIGTERM, tg.raise_interrupted)  # main's, which the wait must not keep
    try:
        assert tg.report_error(error) == 1
        assert (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL) == waits  # the wait ends at torchrun's SIGTERM
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert slept == ([tg.ERROR_WAIT_SECONDS] if waits else [])
    who = "" if rank == "0" else f" (rank {rank})"
    assert capsys.readouterr().err == f"error{who}: {tg.error_text(error)} (DEBUG=1 shows the traceback)\n"
    assert log.read_text() == "step:3/6\n" + ("" if rank == "0" else f"error{who} {tg.error_text(error)}\n")


def test_a_reused_run_id_gets_its_own_log_and_sample_data_is_flagged(seed_runs):
    """A second run with the same RUN_ID used to append to the first one's log (and share its artifact path). The
    second of seed_runs reused the first's RUN_ID, on data marked as the offline sample: flagged, the first not."""
    assert "warning RUN_ID same_a is taken in logs/: this run is RUN_ID=same_a_2" in seed_runs["same_a_2_stdout"]
    for run_id in ("same_a", "same_a_2"):
        log = seed_runs[run_id]
        assert log.splitlines().count("==== source: train_gpt.py ====") == 1
        assert f"outputs log:logs/{run_id}.txt artifact:logs/{run_id}.int6.ptz" in log
        assert (seed_runs["cwd"] / "logs" / f"{run_id}.int6.ptz").is_file()
        sample = run_id == "same_a_2"
        assert ("\nsample_data: the offline sample" in log) == sample  # (the log opens with the source)
        assert log.strip().splitlines()[-1].endswith(" sample_data:not_comparable_to_FineWeb") == sample


def test_a_finished_runs_checkpoint_exports_again_without_training(dataset, tokenizer_path, tmp_path, monkeypatch):
    """CHECKPOINT_EVERY > 0 leaves the trained state at the end. RESUME=it with other export settings (GPTQ, SD
    clip) trains no step, scores the same post-EMA weights and writes a new artifact: quantisers compared on the
    same weights with no retraining. EVAL_ONLY reproduces the new artifact's scores."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS="6", RUN_ID="q", CHECKPOINT_EVERY="1000")
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    first = (tmp_path / "logs" / "q.txt").read_text()
    assert re.search(r"^checkpoint step:6 path:logs/q.ckpt bytes:\d+ time:\d+ms$", first, re.M)
    gptq = dict(GPTQ_CALIBRATION_BATCHES="2", MATRIX_CLIP_SIGMAS="12.85", COMPRESSOR="rans")
    r = run_inline(monkeypatch, dict(env, RESUME="logs/q.ckpt", **gptq), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    again = (tmp_path / "logs" / "q_2.txt").read_text()
    assert not LOSS_LINE.search(again) and "\nwarmup_step:" not in again
    assert "warning GPTQ_CALIBRATION_BATCHES=2 but checkpoint logs/q.ckpt was made with GPTQ_CALIBRATION_BATCHES=0; " \
           "the environment's value is used where it still acts (a finished run's checkpoint: export and scoring " \
           "only)" in again  # ITERATIONS=12 would train no more: the warning said it was used
    calib = re.search(r"^gptq_calibration batches:2 time:\d+ms reserved:0ms$", again, re.M)
    live = re.search(r"^step:6/6 val_loss:\S+ val_bpb:\S+ ", again, re.M)
    assert calib and live and calib.start() < live.start() < again.index("\npost_ema ")  # Hessians before any score
    assert re.search(r"^Total submission size int6\+rans: \d+ bytes", again, re.M)
    assert live.group(0) == re.search(r"^step:6/6 val_loss:\S+ val_bpb:\S+ ", first, re.M).group(0)
    assert one_line(again, "post_ema_exact ") == one_line(first, "post_ema_exact ")
    assert one_line(again, "final_int6_roundtrip_exact ") != one_line(first, "final_int6_roundtrip_exact ")
    assert one_line(first, "outputs ").endswith(" checkpoints:logs/q.ckpt")  # it trains no step, writes none:
    assert one_line(again, "outputs ") == "outputs log:logs/q_2.txt artifact:logs/q_2.int6.ptz"  # names none
    assert not (tmp_path / "logs" / "q_2.ckpt").exists()
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, EVAL_ONLY="logs/q_2.int6.ptz", RUN_ID="q_eval"),
                   tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = (tmp_path / "logs" / "q_eval.txt").read_text()
    key = "final_int6_sliding_window_exact "
    assert one_line(evaluated, key) == one_line(again, key)


def test_doc_isolation_trains_exports_and_scores_again_from_its_artifact(dataset, tokenizer_path, tmp_path,
                                                                        monkeypatch):
    """DOC_ISOLATION=1 end to end on the CPU (its one backend so far): training, export, and EVAL_ONLY, which
    takes the setting from the artifact (left unset there) and scores exactly as the training run did."""
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, DOC_ISOLATION=1, ITERATIONS=4, RUN_ID="iso"),
                   tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = (tmp_path / "logs" / "iso.txt").read_text()
    assert "setting doc_isolation:True" in trained
    env = tiny_env(dataset, tokenizer_path, EVAL_ONLY="logs/iso.int6.ptz", RUN_ID="iso_eval")
    del env["DOC_ISOLATION"]
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = (tmp_path / "logs" / "iso_eval.txt").read_text()
    assert "setting doc_isolation:True" in evaluated
    key = "final_int6_sliding_window_exact "
    assert one_line(evaluated, key) == one_line(trained, key)


def test_eval_only_refuses_isolation_the_artifact_was_not_trained_with(seed_runs, dataset, tokenizer_path):
    """DOC_ISOLATION is one of the artifact's model settings: EVAL_ONLY with another value is an error that says
    what to do (TTT_MODE=lora scores per document whatever it is, and then logs the per-document sliding score)."""
    cwd = seed_runs["cwd"]
    r = run_script(tiny_env(dataset, tokenizer_path, EVAL_ONLY="logs/same_a.int6.ptz", DOC_ISOLATION=1,
                            RUN_ID="same_a_iso"), cwd)
    assert r.returncode == 1 and "DOC_ISOLATION=True but artifact" in r.stderr and "leave DOC_ISOLATION unset" in r.stderr


def test_doc_isolation_refuses_a_tokenizer_whose_bos_is_not_1(dataset, tokenizer_path, tmp_path):
    """Documents are found by BOS id 1: with another tokenizer, isolation would split at the wrong token. The
    check holds with the SmearGate (and its BOS fix) off."""
    bos2 = bos2_tokenizer(tmp_path / "bos2.model", sample_text(200), TINY_VOCAB)
    env = tiny_env(dataset, tokenizer_path, DOC_ISOLATION=1, SMEAR_ENABLED=0, SMEAR_BOS_FIX=0, RUN_ID="bos2")
    r = run_script(env | {"TOKENIZER_PATH": str(bos2)}, tmp_path)
    assert r.returncode != 0 and "DOC_ISOLATION=1 find documents by BOS id 1; TOKENIZER_PATH's is 2" in r.stderr
