"""tools/sweep.py on the CPU: a tiny 2-variant x 2-seed sweep (plus a crashing variant) whose table must equal
what the runs' own logs say, refusals before any run starts, GPU placement in dry runs, and the Welch p against
a published example."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from conftest import ROOT, tiny_env

SWEEP = ROOT / "tools" / "sweep.py"
sys.path.insert(0, str(ROOT / "tools"))
import sweep as sw  # noqa: E402

def tiny_base(dataset, tokenizer_path, **overrides) -> str:
    env = tiny_env(dataset, tokenizer_path, ITERATIONS="10", **overrides)
    return " ".join(f"{k}={v}" for k, v in env.items() if k not in sw.RUNNER_SETTINGS)  # the runner sets those


SWEEP_OUTER_ONLY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "OMP_NUM_THREADS", "TRITON_INTERPRET")


def run_sweep(args: list[str], cwd: Path, gpus: str = "", timeout: int = 600, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SWEEP_OUTER_ONLY)}
    env.update(CUDA_VISIBLE_DEVICES=gpus, PYTHONUNBUFFERED="1", **env_extra)
    return subprocess.run([sys.executable, str(SWEEP), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def dry_run(monkeypatch, capsys, args: list[str], cwd: Path, gpus: str = "", **env_extra):
    """run_sweep(["--dry-run", *args], ...) in this process, with run_sweep's environment: a dry run starts no run,
    and a new interpreter would spend a second importing torch."""
    monkeypatch.chdir(cwd)
    for k in [k for k in os.environ if k.startswith(SWEEP_OUTER_ONLY)]:
        monkeypatch.delenv(k)
    for k, v in dict(CUDA_VISIBLE_DEVICES=gpus, **env_extra).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    try:
        rc = sw.main(["--dry-run", *args])
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([str(SWEEP)], rc, out, err)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, dataset, tokenizer_path):
    """2 variants x 2 seeds on the CPU, and a third variant whose runs crash at start-up."""
    cwd = tmp_path_factory.mktemp("sweep")
    r = run_sweep(["--name", "t", "--seeds", "1337,42", "--base", tiny_base(dataset, tokenizer_path, COMPRESSOR="fast"),
                   "--variant", "base=", "--variant", "lr=MATRIX_LR=0.05",
                   "--variant", "crash=TOKENIZER_PATH=/nonexistent/tok.model"], cwd, OMP_NUM_THREADS="1")
    return cwd, r


def _exact(log: Path, event: str) -> float | None:
    """The val_bpb of a `<event> val_loss:X val_bpb:Y` line, read independently of the runner's parser."""
    hits = re.findall(rf"^{event} val_loss:\S+ val_bpb:(\S+)$", log.read_text(), flags=re.M)
    return float(hits[-1]) if hits else None


def test_table_equals_what_the_logs_say(tiny_sweep):
    cwd, r = tiny_sweep
    assert r.returncode == 1, r.stdout + r.stderr  # the crash variant failed, so the sweep says so
    result = json.loads((cwd / "logs" / "t.json").read_text())
    rows = {row["variant"]: row for row in result["table"]}
    table = [line for line in r.stdout.splitlines() if line.startswith("|")]
    tg = sw.load_script(ROOT / "train_gpt.py")
    assert table[0].startswith("| variant | runs | score | diff | p | post_ema | roundtrip | sliding |")
    for name in ("base", "lr"):
        logs = [cwd / "logs" / f"t_{name}_s{seed}.txt" for seed in (1337, 42)]
        sliding = [_exact(p, "final_int6_sliding_window_exact") for p in logs]
        post_ema = [_exact(p, "post_ema_exact") for p in logs]
        steps = [int(re.search(r"^train_done steps:(\d+)", p.read_text(), flags=re.M)[1]) for p in logs]
        total = [int(re.search(r"^Total submission size int6\+zstd: (\d+) bytes", p.read_text(), flags=re.M)[1])
                 for p in logs]
        code = [int(re.search(r"^code_bytes:(\d+)$", p.read_text(), flags=re.M)[1]) for p in logs]
        # the size the runner reports: the zstd artifact's payload coded as COMPRESSOR=rans would have
        auto = [c + len(tg.compress(zstandard.ZstdDecompressor().decompress(
                (cwd / "logs" / f"t_{name}_s{seed}.int6.ptz").read_bytes()[5:]), "rans")[0])
                for c, seed in zip(code, (1337, 42))]
        row = rows[name]
        assert row["ok"] == row["runs"] == 2
        assert row["score"]["mean"] == pytest.approx(statistics.mean(sliding), abs=1e-12)  # no TTT: sliding scores
        assert row["score"]["std"] == pytest.approx(statistics.stdev(sliding), abs=1e-12)
        assert row["score"]["spread"] == pytest.approx(max(sliding) - min(sliding), abs=1e-12)  # the rule's
        needed = 2 * max(max(sliding) - min(sliding), sw.RERUN_SPREAD)
        assert f"seed spread {name}: {max(sliding) - min(sliding):.5f} (max - min; " in r.stdout
        assert f"a default changes on a difference beyond {needed:.5f})" in r.stdout
        assert row["post_ema"]["mean"] == pytest.approx(statistics.mean(post_ema), abs=1e-12)
        assert row["steps"]["mean"] == statistics.mean(steps) == 10
        assert row["bytes"]["mean"] == pytest.approx(statistics.mean(total))
        assert row["bytes_auto"]["values"] == auto and auto != total
        line = next(t for t in table if t.startswith(f"| {name} |"))
        assert f"{statistics.mean(sliding):.5f} ± {statistics.stdev(sliding):.5f}" in line
        assert "legal_ttt" not in row
    base, lr = rows["base"], rows["lr"]
    assert lr["diff"] == pytest.approx(lr["score"]["mean"] - base["score"]["mean"], abs=1e-12)
    assert lr["p"] == pytest.approx(sw.pr.welch_margin_test(lr["score"]["values"], base["score"]["values"], 0.0).p_value)
    assert base["p"] is None and base["diff"] == 0.0
    lr_line = next(t for t in table if t.startswith("| lr |")).split(" | ")
    assert lr_line[3] == f"{lr['diff']:+.5f}" and lr_line[4] == f"{lr['p']:.3g}"
    assert lr["score"]["mean"] != base["score"]["mean"]  # the variant's setting reached its runs
    for run in result["runs"]:
        if run["variant"] != "crash":  # every phase's marker came, and the phases add up to the wall time
            assert set(run["phases_s"]) == {"startup", "warmup", "train", "score_export", "final_scoring"}
            assert sum(run["phases_s"].values()) == pytest.approx(run["wall_s"], rel=1e-6)
            assert (cwd / "logs" / f"{run['run_id']}.int6.ptz").is_file()  # its own artifact path


def test_a_crashing_run_is_reported_and_the_others_finish(tiny_sweep):
    cwd, r = tiny_sweep
    failed = [line for line in r.stdout.splitlines() if line.startswith("run crash ")]
    assert len(failed) == 2 and all("FAILED" in line for line in failed)
    assert "TOKENIZER_PATH /nonexistent/tok.model does not exist" in r.stdout  # its last log lines are shown
    assert re.search(r"^\| crash \| 0/2 \| - \|", r.stdout, flags=re.M)
    assert len(re.findall(r"^run (base|lr) seed:\d+ cpu score:", r.stdout, flags=re.M)) == 4


@pytest.mark.parametrize("bad, named", [("MUON_MOMENTM=0.9", "closest valid setting: MUON_MOMENTUM"),
                                        ("MATRIX_LR=fast", "malformed value for MATRIX_LR"),
                                        ("LR=0.1", "unknown setting LR"),
                                        ("SWA_ENABLED=1", "SWA_ENABLED is ignored"),
                                        ("SEED=3", "SEED is set by the runner")])
def test_a_bad_setting_in_any_variant_stops_the_sweep_before_any_run(tmp_path, dataset, tokenizer_path, bad, named):
    r = run_sweep(["--base", tiny_base(dataset, tokenizer_path), "--variant", "a=", "--variant", f"b={bad}"],
                  tmp_path, timeout=120)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert not (tmp_path / "logs").exists()  # nothing ran


def test_a_preset_refuses_data_without_its_train_shards(tmp_path, dataset, tokenizer_path):
    r = run_sweep(["--preset", "pqb", "--base", f"DATA_PATH={dataset}"], tmp_path, timeout=120)
    assert r.returncode == 2 and "needs 8 train shards" in r.stderr and "found 2" in r.stderr, r.stderr


def _placements(stdout: str) -> dict[tuple[str, int], str]:
    return {(m[1], int(m[2])): m[3] for m in re.finditer(r"^# (\S+) seed (\d+): (.*)$", stdout, flags=re.M)}


def test_dry_run_places_runs_on_both_gpus_swapped_across_seeds(tmp_path, monkeypatch, capsys):
    parity = "parity=BIGRAM_VOCAB_SIZE=2048 ROPE_BASE=22082 LATE_QAT_THRESHOLD=0 EMA_DECAY=0.997"
    r = dry_run(monkeypatch, capsys, ["--preset", "pqb-t", "--variant", "base=", "--variant", parity], tmp_path,
                gpus="0,1")
    assert r.returncode == 0, r.stderr
    assert _placements(r.stdout) == {("base", 1337): "gpu 0", ("parity", 1337): "gpu 1",
                                     ("base", 42): "gpu 1", ("parity", 42): "gpu 0"}
    commands = [line for line in r.stdout.splitlines() if "train_gpt.py" in line]
    assert len(commands) == 4 and all("MAX_WALLCLOCK_SECONDS=120" in c for c in commands)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the host's cores shared by the two runs of a round
    assert all(f"OMP_NUM_THREADS={threads} " in c for c in commands)
    assert sum("CUDA_VISIBLE_DEVICES=0 " in c and "RUN_ID=" in c and "ARTIFACT_PATH=logs/" in c for c in commands) == 2
    assert not (tmp_path / "logs").exists()


def test_dry_run_with_several_gpus_per_run_uses_torchrun(tmp_path, monkeypatch, capsys):
    r = dry_run(monkeypatch, capsys, ["--gpus-per-run", "2", "--variant", "a=", "--variant", "b=MATRIX_LR=0.03",
                                      "--seeds", "1,2"], tmp_path, gpus="4,5,6,7", OMP_NUM_THREADS="3")
    assert r.returncode == 0, r.stderr
    assert "OMP_NUM_THREADS" not in r.stdout  # the caller's setting stands
    assert _placements(r.stdout) == {("a", 1): "gpu 4,5", ("b", 1): "gpu 6,7", ("a", 2): "gpu 6,7",
                                     ("b", 2): "gpu 4,5"}
    assert r.stdout.count("torch.distributed.run --standalone --nproc_per_node=2") == 4
    r = dry_run(monkeypatch, capsys, ["--gpus-per-run", "3"], tmp_path, gpus="0,1")
    assert r.returncode == 2 and "only 2 GPU(s) visible" in r.stderr


def test_dry_run_without_gpus_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    r = dry_run(monkeypatch, capsys, ["--variant", "a=", "--variant", "b=MATRIX_LR=0.03"], tmp_path)
    assert r.returncode == 0 and "on cpu (no visible GPU)" in r.stdout
    assert set(_placements(r.stdout).values()) == {"cpu"} and "CUDA_VISIBLE_DEVICES" not in r.stdout


def test_welch_p_against_a_published_example():
    # Wikipedia, "Welch's t-test", Examples, example 1: t = 2.46 (in magnitude), df = 25.0, two-sided p = 0.021.
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    w = sw.pr.welch_margin_test(a1, a2, margin=0.0)
    assert round(w.t, 2) == 2.46 and round(w.df, 1) == 25.0 and round(2 * w.p_value, 3) == 0.021
    # In a sweep the lower scores (a1) are the variant, judged against the first variant (a2): p is one-sided.
    runs = [sw.Run(name, i, 0, [], f"{name}{i}", {}, [], rc=0, wall_s=1.0, metrics={"score": x})
            for name, xs in (("first", a2), ("lower", a1)) for i, x in enumerate(xs)]
    rows = sw.summarize(runs, ["first", "lower"])
    assert rows[1]["p"] == pytest.approx(w.p_value, rel=1e-12) and 0.0105 < rows[1]["p"] < 0.0110
    assert rows[1]["diff"] == pytest.approx(statistics.mean(a1) - statistics.mean(a2))
    rows = sw.summarize(runs, ["lower", "first"])  # the higher scores are not lower: p near 1
    assert rows[1]["p"] == pytest.approx(1 - w.p_value, rel=1e-9)


def test_plot_writes_both_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (tools/sweep.py --plot's optional "
                        "extra): python3 -m pip install matplotlib runs this test")
    runs = [sw.Run(v, s, 0, [], f"{v}{s}", {}, [], rc=0, wall_s=1.0, metrics={"score": 1.5 + 0.01 * s + 0.1 * (v == "b")},
                   curve=[(i, 3.0 / i + s * 1e-3, 100.0 * i) for i in range(1, 6)]) for v in "ab" for s in (1, 2)]
    pngs = sw.plot(runs, sw.summarize(runs, ["a", "b"]), tmp_path, "p")
    assert [p.name for p in pngs] == ["p_curves.png", "p_scores.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert sw.main(["--plot", "--seeds", "1"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name", sorted(sw.PRESETS))
def test_presets_pass_the_scripts_parsing_and_are_in_the_readme(name):
    tg = sw.load_script(ROOT / "train_gpt.py")
    settings = sw.parse_assignments(sw.PRESETS[name].settings, name)
    sw.check_settings(tg, name, settings, 1)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`{name}`: `{sw.PRESETS[name].settings}`" in readme


# ---------------------------------------------------------------------------------------------------
# How a run ends: the runner's execute/collect on stand-in commands that write a log and exit
# ---------------------------------------------------------------------------------------------------

FAKE_RUN = """
import os, sys, time
from pathlib import Path
log = Path("logs") / (os.environ["RUN_ID"] + ".txt")
lines = {lines!r}
log.write_text("\\n".join(lines) + "\\n")
print("last words of", os.environ["RUN_ID"])
time.sleep({sleep})
sys.exit({rc})
"""
SCORED = ["setting ttt_enabled:{ttt}", "model_params:1", "warmup_step:1/1",
          "train_done steps:10 train_time:100ms step_avg:10.00ms", "Serialized model int6+rans: 900 bytes",
          "code_bytes:100", "Total submission size int6+rans: 1000 bytes limit:16000000 headroom:15999000",
          "final_int6_sliding_window_exact val_loss:2.00000000 val_bpb:1.50000000"]


def fake_run(tmp_path, name: str, lines: list[str], rc: int = 0, sleep: float = 0.0) -> sw.Run:
    code = FAKE_RUN.format(lines=lines, sleep=sleep, rc=rc)
    return sw.Run(name, 1, 0, [], name, {"RUN_ID": name}, [sys.executable, "-c", code])


def test_an_eval_only_run_of_a_zstd_artifact_has_no_default_coder_size(tmp_path, monkeypatch):
    """bytes_auto follows the coder the artifact used (its Total line), not the variant's COMPRESSOR: an EVAL_ONLY
    run of a zstd artifact, COMPRESSOR unset (rans), reported the zstd size as rANS's."""
    (tmp_path / "logs").mkdir()
    monkeypatch.delenv("COMPRESSOR", raising=False)
    lines = ["setting ttt_enabled:False", "setting eval_only:logs/old.int6.ptz", "model_params:1", "code_bytes:100",
             "Total submission size int6+zstd: 1000 bytes limit:16000000 headroom:15999000",
             "final_int6_sliding_window_exact val_loss:2.00000000 val_bpb:1.50000000"]
    run = fake_run(tmp_path, "evalonly", lines)
    sw.Executor(None, tmp_path, None, 1).run_slot([run])
    assert run.ok and run.metrics["bytes"] == 1000.0 and "bytes_auto" not in run.metrics


def test_a_run_under_a_coder_set_in_the_environment_is_recoded(tmp_path, monkeypatch):
    """COMPRESSOR from the sweep's environment reaches the runs: their bytes are not the default coder's."""
    (tmp_path / "logs").mkdir()
    monkeypatch.setenv("COMPRESSOR", "fast")
    run = fake_run(tmp_path, "envfast", [line.format(ttt="False").replace("int6+rans", "int6+zstd") for line in SCORED])
    assert sw.coder_setting(run.settings) == "fast"
    assert sw.coder_setting({"COMPRESSOR": "auto"}) == "auto"  # a variant's own setting wins
    sw.Executor(None, tmp_path, None, 1).run_slot([run])
    assert run.ok and "bytes_auto" not in run.metrics  # its bytes are zstd-3's, not the default coder's


@pytest.mark.parametrize("lines, rc, ok, why", [
    (SCORED, 0, True, None),
    (SCORED + ["ERROR submission_over_limit total:1000 limit:900 over_by:100"], 1, True, None),
    (SCORED, 1, False, "exit status 1 after its last score"),  # e.g. TTT died after the sliding score
    ([line.format(ttt="True") for line in SCORED], 0, False, "TTT_ENABLED but no legal_ttt line"),
    (SCORED[:4], 1, False, "exit status 1, no final score line"),
    (["==== source: train_gpt.py ===="], 0, False, "runner error"),  # unreadable log: parse_log raises
])
def test_how_a_run_ends_decides_whether_it_counts(tmp_path, lines, rc, ok, why):
    (tmp_path / "logs").mkdir()
    runs = [fake_run(tmp_path, "first", [line.format(ttt="False") for line in lines], rc),
            fake_run(tmp_path, "after", [line.format(ttt="False") for line in SCORED])]
    ex = sw.Executor(None, tmp_path, None, 1)
    ex.run_slot(runs)
    first, after = runs
    assert first.ok == ok and after.ok  # whatever happened to a run, the slot's next run still ran
    if ok:
        assert first.metrics["score"] == 1.5 and first.metrics["bytes_auto"] == 1000.0  # auto run: its own size
        assert sw.finish_line(first).count("OVER_LIMIT") == rc
    else:
        assert why in first.error and "score" not in first.metrics
        assert "last words of first" in first.error or why == "runner error"


def test_run_timeout_kills_the_run(tmp_path):
    (tmp_path / "logs").mkdir()
    run = fake_run(tmp_path, "slow", SCORED, sleep=60)
    t0 = time.monotonic()
    sw.Executor(None, tmp_path, 1.0, 1).run_slot([run])
    assert time.monotonic() - t0 < 20 and not run.ok and run.error.startswith("timed out")


def test_a_terminated_sweep_kills_its_runs(tmp_path):
    """SIGTERM to the runner ends the run it started, although the run lives in its own session."""
    script = tmp_path / "sleepy.py"  # train_gpt.py whose run only records its pid and sleeps
    src = (ROOT / "train_gpt.py").read_text()
    script.write_text(src[: src.index('if __name__ == "__main__":')] + 'if __name__ == "__main__":\n'
                      '    Path("pid").write_text(str(os.getpid()))\n    time.sleep(120)\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_NUM_THREADS", "TRITON_INTERPRET"))}
    proc = subprocess.Popen([sys.executable, str(SWEEP), "--script", str(script), "--seeds", "1"], cwd=tmp_path,
                            env=dict(env, CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = int((tmp_path / "pid").read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    time.sleep(0.5)
    stat = Path(f"/proc/{pid}/stat")  # gone, or a zombie nobody reaped yet (this container's init may not)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_ctrl_c_stops_the_runs_at_a_checkpoint_and_says_how_to_resume(tmp_path, dataset, tokenizer_path):
    """Ctrl-C to a sweep used to SIGKILL its runs, their trained steps lost: now each running run gets SIGINT, writes
    logs/<RUN_ID>.ckpt at its next step and ends, and the sweep prints its last line and the command that resumes it."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS="1000000", MAX_WALLCLOCK_SECONDS="0", TRAIN_LOG_EVERY="1")
    base = " ".join(f"{k}={v}" for k, v in env.items() if k not in sw.RUNNER_SETTINGS)
    proc = subprocess.Popen([sys.executable, str(SWEEP), "--name", "c", "--seeds", "1", "--base", base], cwd=tmp_path,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = tmp_path / "logs" / "c_base_s1.txt", time.monotonic() + 180
    try:
        while not (log.is_file() and re.search(r"^step:\d+/1000000 train_loss:", log.read_text(), flags=re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, "the run logged no training step"
            time.sleep(0.2)  # polling the log: the run has trained a step once the line is there
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=sw.STOP_WAIT_S + 60)
    finally:
        if proc.poll() is None:  # the test failed: the sweep stops its run as for Ctrl-C
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=sw.STOP_WAIT_S + 60)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    said = re.search(r"^sweep: run base seed:1 cpu stopped: interrupted by SIGINT at step (\d+): resume with "
                     r"RESUME=logs/c_base_s1.ckpt and the same settings$", err, flags=re.M)
    assert said, err
    ckpt = tmp_path / "logs" / "c_base_s1.ckpt"
    assert sw.load_script(ROOT / "train_gpt.py").read_checkpoint(str(ckpt))["clock"]["step"] == int(said[1])
    resume = next(ln for ln in err.splitlines() if ln.startswith("  resume it: "))
    words = shlex.split(resume.removeprefix("  resume it: "))
    settings = dict(w.split("=", 1) for w in words[:-2])  # the run's own command, with RESUME= its checkpoint
    assert settings == {"RESUME": "logs/c_base_s1.ckpt", **sw.parse_assignments(base, "base"), "RUN_ID": "c_base_s1",
                        "SEED": "1", "ARTIFACT_PATH": "logs/c_base_s1.int6.ptz"}
    assert words[-2:] == [sys.executable, str(ROOT / "train_gpt.py")]


def test_a_killed_torchrun_takes_its_workers_with_it(tmp_path):
    """torchrun starts each worker in a session of its own: SIGKILL to its process group (a run past --run-timeout,
    or one that outlived Ctrl-C's wait) left the workers running, holding their GPUs and the runner's pipe."""
    (tmp_path / "logs").mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\n"
                      "open(f'pid{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    run = sw.Run("tr", 1, 0, [], "tr", {"RUN_ID": "tr"}, cmd)
    ex = sw.Executor(None, tmp_path, None, 1)
    ex.start([[run]])
    deadline = time.monotonic() + 60
    try:
        while not all((tmp_path / f"pid{r}").is_file() and (tmp_path / f"pid{r}").read_text() for r in (0, 1)):
            assert time.monotonic() < deadline, "torchrun started no workers"
            time.sleep(0.2)
        workers = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    finally:
        ex.kill()
    assert ex.wait(30)  # the pipe closed: no worker holds it
    for pid in workers:
        stat = Path(f"/proc/{pid}/stat")  # gone, or a zombie nobody reaped yet
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid


def test_presets_layer_the_same_in_either_order(monkeypatch):
    """The README said --preset sp1024,pqb-t and the sweep's help pqb-t,sp1024: left to right, they ran WARMDOWN_ITERS
    750 and 3500. A settings preset (sp1024) goes under the run preset whatever the order named."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def plan(preset: str) -> list[dict]:
        args = sw.parse_args(["--dry-run", "--name", "o", "--seeds", "1", "--preset", preset, "--variant", "a=",
                              "--variant", "b=MATRIX_LR=0.03"])
        return [r.settings for r in sw.build(args)[4]]
    for run in ("pqb-t", "pqb", "timing"):
        runs = plan(f"sp1024,{run}")
        assert runs == plan(f"{run},sp1024")
        want = sw.parse_assignments(sw.SP1024_STACK, "sp1024") | sw.parse_assignments(sw.PRESETS[run].settings, run)
        assert runs[0].items() >= want.items()  # the run preset's settings over the stack's
    assert plan("pqb-t,sp1024")[0]["WARMDOWN_ITERS"] == "750"
    with pytest.raises(sw.SweepError, match="pqb and timing are both run presets"):
        plan("pqb,sp1024,timing")


def test_placement_fills_every_gpu_and_moves_every_variant():
    for V in range(1, 7):
        for G in range(1, 6):
            variants = {f"v{i}": {} for i in range(V)}
            gpus = [str(i) for i in range(G)]
            runs, slots = sw.plan_runs("p", variants, [1, 2, 3], dict.fromkeys(variants, Path("x.py")), 1, gpus)
            load = [sum(r.slot == i for r in runs) for i in range(G)]
            assert max(load) - min(load) <= 1, (V, G, load)  # balanced: no GPU idle while another queues
            for name in variants:
                mine = [r.slot for r in runs if r.variant == name]
                assert G == 1 or all(a != b for a, b in zip(mine, mine[1:])), (V, G, name, mine)


def test_an_eval_only_run_is_given_no_artifact_path(monkeypatch):
    """EVAL_ONLY (a variant's or the environment's) writes no artifact and warns about an ARTIFACT_PATH it is given."""
    variants = {"made": {}, "scored": {"EVAL_ONLY": "logs/x.int6.ptz"}}
    monkeypatch.delenv("EVAL_ONLY", raising=False)
    runs = sw.plan_runs("p", variants, [1], dict.fromkeys(variants, Path("x.py")), 1, [])[0]
    assert [r.settings.get("ARTIFACT_PATH") for r in runs] == ["logs/p_made_s1.int6.ptz", None]
    monkeypatch.setenv("EVAL_ONLY", "logs/x.int6.ptz")
    runs = sw.plan_runs("p", variants, [1], dict.fromkeys(variants, Path("x.py")), 1, [])[0]
    assert [r.settings.get("ARTIFACT_PATH") for r in runs] == [None, None]


def test_a_coder_the_python_lacks_is_refused_before_any_run(monkeypatch):
    tg = sw.load_script(ROOT / "train_gpt.py")
    monkeypatch.setattr(tg, "_zstd", lambda: None)
    with pytest.raises(sw.SweepError, match="COMPRESSOR=fast needs the zstandard package"):
        sw.check_settings(tg, "x", {"COMPRESSOR": "fast"}, 1)
    sw.check_settings(tg, "x", {"COMPRESSOR": "rans"}, 1)


def test_an_older_script_without_the_batch_check_is_still_checked_for_its_settings(monkeypatch):
    """--script may name an older train_gpt.py (a before/after A/B): its own parser still refuses typos."""
    tg = sw.load_script(ROOT / "train_gpt.py")
    monkeypatch.delattr(tg, "resolve_grad_accum_steps")
    sw.check_settings(tg, "old", {"TRAIN_BATCH_TOKENS": "1000"}, 1)  # the divisibility check needs the new API
    with pytest.raises(sw.SweepError, match="closest valid setting: MATRIX_LR"):
        sw.check_settings(tg, "old", {"MATRX_LR": "0.1"}, 1)


def test_a_variant_can_run_another_script_checked_by_its_own_parser(tmp_path, monkeypatch, capsys):
    """SCRIPT=path (a before/after A/B of a code change): that variant's command runs the copy, and its settings
    go through the copy's parser, which here knows one more setting than the repository's script."""
    src = (ROOT / "train_gpt.py").read_text()
    field = next(line + "\n" for line in src.splitlines() if line.startswith("    seed: int = setting(1337, "))
    assert field in src
    copy = tmp_path / "after.py"
    copy.write_text(src.replace(field, field + '    extra_knob: int = setting(0, "a setting only the copy has")\n'))
    r = dry_run(monkeypatch, capsys, ["--name", "ab", "--seeds", "1", "--variant", "before=", "--variant",
                                      f"after=SCRIPT={copy} EXTRA_KNOB=2"], tmp_path)
    assert r.returncode == 0, r.stderr
    commands = {name: next(line for line in r.stdout.splitlines() if f"RUN_ID=ab_{name}_s1 " in line)
                for name in ("before", "after")}
    assert commands["after"].endswith(str(copy)) and "EXTRA_KNOB=2" in commands["after"]
    assert commands["before"].endswith(str(ROOT / "train_gpt.py")) and "SCRIPT=" not in r.stdout
    r = dry_run(monkeypatch, capsys, ["--seeds", "1", "--variant", "before=EXTRA_KNOB=2", "--variant",
                                      f"after=SCRIPT={copy}"], tmp_path)
    assert r.returncode == 2 and "variant before: unknown setting EXTRA_KNOB" in r.stderr


def test_export_only_sweep_scores_one_trained_model_with_each_export(tmp_path, dataset, tokenizer_path, monkeypatch,
                                                                     capsys):
    """--export-only: the first variant trains and leaves its final checkpoint; the others export and score it again
    on the same slot after it (no training: the same post-EMA weights), so their difference is the quantiser's
    alone. Dry run: the runner's settings and the order; then a real tiny sweep of one seed."""
    args = ["--name", "x", "--seeds", "1,2", "--export-only", "--base", tiny_base(dataset, tokenizer_path),
            "--variant", "base=", "--variant", "sd=MATRIX_CLIP_SIGMAS=12.85 COMPRESSOR=rans"]
    r = dry_run(monkeypatch, capsys, args, tmp_path, gpus="0,1")
    assert r.returncode == 0, r.stderr
    assert _placements(r.stdout) == {("base", 1): "gpu 0", ("sd", 1): "gpu 0", ("base", 2): "gpu 1",
                                     ("sd", 2): "gpu 1"}
    commands = [line for line in r.stdout.splitlines() if "train_gpt.py" in line]
    assert [("CHECKPOINT_EVERY=1e9" in c, "RESUME=logs/x_base_s1.ckpt" in c, "RESUME=logs/x_base_s2.ckpt" in c)
            for c in commands] == [(True, False, False), (False, True, False), (True, False, False),
                                   (False, False, True)]
    r = dry_run(monkeypatch, capsys, [*args[:-4], "--variant", "sd=MATRIX_CLIP_SIGMAS=10", "--variant", "plain="],
                tmp_path)
    plain = [c for c in r.stdout.splitlines() if "RUN_ID=x_plain_s1 " in c]
    assert len(plain) == 1 and "MATRIX_CLIP_SIGMAS=0 " in plain[0]  # set back to base's value, not inherited
    r = dry_run(monkeypatch, capsys, [*args[:-2], "--variant", "bad=RESUME=x.ckpt"], tmp_path)
    assert r.returncode == 2 and "none of them setting RESUME or CHECKPOINT_EVERY" in r.stderr
    r = run_sweep([*args[:3], "1", *args[5:]], tmp_path, OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads((tmp_path / "logs" / "x.json").read_text())["table"]}
    assert rows["sd"]["post_ema"]["mean"] == rows["base"]["post_ema"]["mean"]  # the same weights
    assert rows["sd"]["roundtrip"]["mean"] != rows["base"]["roundtrip"]["mean"]  # another quantiser
    assert "Total submission size int6+rans" in (tmp_path / "logs" / "x_sd_s1.txt").read_text()


RECORDER = '''
def run(cfg, *more):  # trains nothing: records the settings this run ended up with
    Path(f"logs/{cfg.run_id}.settings.json").write_text(json.dumps(asdict(cfg)))
    if cfg.checkpoint_every > 0:  # the first variant's "final checkpoint": RESUME takes the settings from it
        Path(f"logs/{cfg.run_id}.ckpt").write_text(json.dumps(dict(settings=asdict(cfg), clock=dict(done=True))))
    return 0


def read_checkpoint(path):  # main() reads the recorder's checkpoint: its settings alone
    return json.loads(Path(path).read_text())


if __name__ == "__main__":
    sys.exit(main())
'''


def test_export_only_runs_see_the_calling_environment_as_training_runs_do(tmp_path, dataset, tokenizer_path):
    """Every run of an --export-only sweep ends up with the settings a training run of its variant would have,
    calling environment < --base < --variant, although the export runs take what their environment leaves unset
    from the first variant's checkpoint. train_gpt.py's own main() (settings, RESUME) with a run() that only
    records them: EMBED_BITS=6 of the environment reaches b, though c sets EMBED_BITS; MLP_CLIP_SIGMAS=9 of the
    first variant does not (the environment's 7 does), nor its MATRIX_CLIP_SIGMAS=13 (c has the default)."""
    src = (ROOT / "train_gpt.py").read_text()
    script = tmp_path / "recorder.py"
    script.write_text(src[: src.index('if __name__ == "__main__":')] + RECORDER)
    calling = dict(EMBED_BITS="6", MLP_CLIP_SIGMAS="7", ATTN_CLIP_SIGMAS="10")
    base = " ".join(w for w in tiny_base(dataset, tokenizer_path).split() if w.split("=")[0] not in calling)
    base += " ATTN_CLIP_SIGMAS=11"
    variants = {"a": "MLP_CLIP_SIGMAS=9 MATRIX_CLIP_SIGMAS=13", "b": "MATRIX_CLIP_SIGMAS=12.85",
                "c": "EMBED_BITS=5 ATTN_CLIP_SIGMAS=12"}
    r = run_sweep(["--name", "e", "--seeds", "1", "--export-only", "--script", str(script), "--base", base,
                   *(f"--variant={name}={s}" for name, s in variants.items())], tmp_path, timeout=300,
                  OMP_NUM_THREADS="1", **calling)
    tg = sw.load_script(ROOT / "train_gpt.py")
    runner = ("run_id", "artifact_path", "resume", "checkpoint_every")
    seen, want = {}, {}
    for name, settings in variants.items():
        path = tmp_path / "logs" / f"e_{name}_s1.settings.json"
        assert path.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
        seen[name] = {k: v for k, v in json.loads(path.read_text()).items() if k not in runner}
        cfg = tg.Hyperparameters.from_env(os.environ | calling | sw.parse_assignments(base, "base")
                                          | sw.parse_assignments(settings, name) | {"SEED": "1"})[0]
        want[name] = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in runner}
    assert [(s["embed_bits"], s["mlp_clip_sigmas"], s["attn_clip_sigmas"], s["matrix_clip_sigmas"])
            for s in seen.values()] == [(6, 9.0, 11.0, 13.0), (6, 7.0, 11.0, 12.85), (5, 7.0, 12.0, 0.0)]
    assert seen == want  # every other setting too


def test_export_only_refuses_a_variant_that_changes_the_model_before_any_run(tmp_path, monkeypatch, capsys):
    """A model setting (train_gpt.py's MODEL_SETTINGS) of an export variant that differs from the first variant's
    (after calling environment < --base < --variant) is refused, naming the variant and the setting; one that
    repeats the first variant's value is not. (Dry runs: the refusal comes before any run, dry or not.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for key in ("NUM_LAYERS", "MODEL_DIM", "MLP_MULT", "AUTO_SIZE", "EMBED_BITS"):
        monkeypatch.delenv(key, raising=False)

    def sweep(*variants: str) -> int:
        return sw.main(["--dry-run", "--export-only", "--seeds", "1", "--name", "m",
                        *(w for v in variants for w in ("--variant", v))])

    def refused(*variants: str) -> str:
        assert sweep(*variants) == 2
        return capsys.readouterr().err
    # the first variant's own NUM_LAYERS=9: b, with NUM_LAYERS unset, would have the default 11
    err = refused("a=NUM_LAYERS=9", "b=EMBED_BITS=6")
    assert "variant b: NUM_LAYERS=11 (unset: the default)" in err and "has NUM_LAYERS=9" in err, err
    err = refused("a=", "b=EMBED_BITS=6", "c=MODEL_DIM=256")  # one that sets a model setting of its own
    assert "variant c: MODEL_DIM=256," in err and "has MODEL_DIM=512" in err, err
    err = refused("a=AUTO_SIZE=0.9", "b=MLP_MULT=3")  # AUTO_SIZE fits MLP_MULT in training: not known before
    assert "variant b: MLP_MULT=3" in err and "AUTO_SIZE=0.9" in err, err
    assert not (tmp_path / "logs").exists()
    for ok in (["a=NUM_LAYERS=9", "b=NUM_LAYERS=9 EMBED_BITS=6"], ["a=", "b=NUM_LAYERS=11 EMBED_BITS=6"],
               ["a=AUTO_SIZE=0.9", "b=EMBED_BITS=6"]):
        assert sweep(*ok) == 0, capsys.readouterr().err
    monkeypatch.setenv("NUM_LAYERS", "9")  # the environment's 9 reaches b as it reaches a
    assert sweep("a=", "b=EMBED_BITS=6") == 0, capsys.readouterr().err
    assert sweep("a=", "b=NUM_LAYERS=9 EMBED_BITS=6") == 0, capsys.readouterr().err
    assert "variant b: NUM_LAYERS=10," in refused("a=", "b=NUM_LAYERS=10")


@pytest.mark.parametrize("stale", ["st_a_s1337.txt", "st_a_s1337.ckpt", "st_a_s1337.int6.ptz"])
def test_a_run_name_whose_log_checkpoint_or_artifact_exists_stops_the_sweep(tmp_path, monkeypatch, capsys, stale):
    """train_gpt.py moves a RUN_ID whose log, checkpoint or artifact exists to a suffix; the sweep reads the names
    it set (an --export-only variant would resume a stale checkpoint), so it refuses them all before any run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / stale).write_bytes(b"an earlier sweep's")
    assert sw.main(["--name", "st", "--seeds", "1337", "--variant", "a="]) == 2
    assert f"sweep: error: logs/{stale} exists already: pick another --name" in capsys.readouterr().err
