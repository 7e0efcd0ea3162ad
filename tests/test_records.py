"""Tests of records/package_record.py: Student-t tail, Welch test, and packaging of synthetic logs (CPU, offline)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "records"))
import package_record as pr  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Student-t upper tail
# ---------------------------------------------------------------------------------------------------


# Critical values from the standard one-sided t table (3 decimals), so p matches to ~1e-3 relative.
@pytest.mark.parametrize("df, t, p", [(1, 6.314, 0.05), (2, 2.920, 0.05), (5, 3.365, 0.01), (10, 2.764, 0.01),
                                      (30, 2.457, 0.01), (5, 2.015, 0.05), (10, 1.372, 0.10)])
def test_student_t_matches_textbook_table(df, t, p):
    assert pr.student_t_sf(t, df) == pytest.approx(p, rel=1e-3)


@pytest.mark.parametrize("t", [-7.0, -1.3, 0.2, 1.0, 2.5, 12.0, 300.0])
def test_student_t_matches_closed_forms(t):
    # df=1 is the Cauchy distribution; df=2 has sf = 1/2 - t / (2 sqrt(2 + t^2)).
    assert pr.student_t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-12, abs=1e-300)
    assert pr.student_t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), rel=1e-10, abs=1e-300)


def test_student_t_large_df_is_normal():
    normal = 0.5 * math.erfc(1.645 / math.sqrt(2))  # 0.04998
    assert pr.student_t_sf(1.645, 1e4) == pytest.approx(normal, abs=2e-5)
    assert pr.student_t_sf(1.645, 1e4) == pytest.approx(0.05, abs=1e-4)
    assert pr.student_t_sf(1.645, 1e9) == pytest.approx(normal, rel=1e-12)  # the normal-limit branch


@pytest.mark.parametrize("df", [0.7, 1, 3, 4.5, 29.3, 1e5])
def test_student_t_center_and_symmetry(df):
    assert pr.student_t_sf(0.0, df) == pytest.approx(0.5, abs=1e-15)
    for t in (0.3, 1.7, 4.0):
        assert pr.student_t_sf(-t, df) == pytest.approx(1 - pr.student_t_sf(t, df), abs=1e-14)
        assert pr.student_t_sf(-t, df) > 0.5


def test_student_t_non_integer_df():
    # Reference values: scipy 1.17.1, scipy.stats.t.sf(t, 4.5), computed while writing this test.
    assert pr.student_t_sf(2.0, 4.5) == pytest.approx(0.054128953590562495, rel=1e-12)
    assert pr.student_t_sf(3.5, 4.5) == pytest.approx(0.010270844984692789, rel=1e-12)


def test_incomplete_beta_closed_forms():
    # I_x(a, 1) = x^a and I_x(1, b) = 1 - (1 - x)^b, on both sides of the continued-fraction switch.
    for x in (0.01, 0.3, 0.7, 0.99):
        assert pr.regularized_incomplete_beta(3.7, 1.0, x) == pytest.approx(x ** 3.7, rel=1e-12)
        assert pr.regularized_incomplete_beta(1.0, 2.2, x) == pytest.approx(1 - (1 - x) ** 2.2, rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# Mean, std, Welch
# ---------------------------------------------------------------------------------------------------

def test_mean_and_sample_std():
    assert pr.mean([1.0, 2.0, 6.0]) == pytest.approx(3.0)
    assert pr.sample_std([1.0, 2.0, 6.0]) == pytest.approx(math.sqrt((4 + 1 + 9) / 2))
    with pytest.raises(ValueError):
        pr.sample_std([1.0])


def test_welch_worked_example():
    ours, prev = [2.00, 2.01, 2.02], [2.03, 2.05, 2.07]
    # By hand: means 2.01 / 2.05, variances 1e-4 / 4e-4, so s^2/n = 1e-4/3 and 4e-4/3 (sum 5e-4/3).
    # t = (2.05 - 2.01 - 0.005) / sqrt(5e-4/3) = 0.035 / 0.0129099 = 2.71109
    # df = (5e-4/3)^2 / ((1e-4/3)^2/2 + (4e-4/3)^2/2) = 25 / 8.5 = 2.941176
    w = pr.welch_margin_test(ours, prev)
    assert w.t == pytest.approx(0.035 / math.sqrt(5e-4 / 3), rel=1e-9)
    assert w.t == pytest.approx(2.71109, rel=1e-5)
    assert w.df == pytest.approx(50 / 17, rel=1e-12)
    # scipy 1.17.1: ttest_ind(prev, [x + 0.005 for x in ours], equal_var=False, alternative="greater").pvalue
    assert w.p_value == pytest.approx(0.037347801883190083, rel=1e-9)
    assert w.p_value > pr.RECORD_P_VALUE


def test_welch_edge_cases():
    far = pr.welch_margin_test([1.0, 1.001, 0.999], [2.0, 2.001, 1.999])
    assert far.p_value < 1e-6
    assert pr.welch_margin_test([1.0, 1.0], [2.0, 2.0]).p_value == 0.0  # no spread, clearly better
    assert pr.welch_margin_test([2.0, 2.0], [2.0, 2.0]).p_value == 1.0  # no spread, not 0.005 better
    with pytest.raises(ValueError):
        pr.welch_margin_test([1.0], [2.0, 2.1])


# ---------------------------------------------------------------------------------------------------
# Packaging synthetic logs
# ---------------------------------------------------------------------------------------------------

# The source carries decoy lines that look like log events: the parser must not read them.
CODE = '''"""Fake train_gpt.py for packaging tests.
final_int6_sliding_window_exact val_loss:9.99999999 val_bpb:9.99999999
legal_ttt_exact val_loss:9.99999999 val_bpb:9.99999999
setting seed:999999
Total submission size int6+lzma: 99999999 bytes
"""
import os


def shipped_code(source: str) -> bytes:
    return b"# shipped\\n" + source.encode("utf-8")[::-1]  # any deterministic rule: the packager runs this one


def main():
    print(f"train_done steps:{1} train_time:{2}ms")  # caf\u00e9 \u2581 non-ASCII bytes


if __name__ == "__main__":
    main()
'''


def shipped(code: str) -> bytes:
    """What CODE's shipped_code makes (written out here, independently of the packager)."""
    return b"# shipped\n" + code.encode("utf-8")[::-1]


def log_head(seed: int, code: str = CODE, source_extra_newline: bool = True, ttt: bool = False,
             settings: dict | None = None, hardware: tuple[str, int] = ("NVIDIA_H100_80GB_HBM3", 8)) -> list[str]:
    """The lines train_gpt.py logs before it reads any data: source, versions, device, settings."""
    values = {"artifact_path": f"logs/run{seed}.int6.ptz", "data_path": "./data/datasets/fineweb10B_sp1024",
              "eval_only": "", "iterations": 20000, "max_wallclock_seconds": 600.0, "num_layers": 11, "resume": "",
              "run_id": f"run{seed}", "seed": seed, "ttt_enabled": int(ttt), **(settings or {})}
    return [pr.SOURCE_START, code + ("\n" if source_extra_newline else "") + pr.SOURCE_END,
            "versions python:3.11.9 torch:2.11.0+cu128", f"device name:{hardware[0]} memory_mib:81000 count:8",
            f"world_size:{hardware[1]}", *(f"setting {k}:{v}" for k, v in sorted(values.items()))]


def make_log(folder: Path, seed: int, code: str = CODE, total_bytes: int | None = None, train_ms: int = 595_370,
             final: bool = True, ttt: bool = False, source_extra_newline: bool = True, val_docs: int | None = 50_000,
             settings: dict | None = None, checkpoint_ms: int = 1021, calibration_ms: int = 3500,
             eval_s: float | None = 498.2, warning: str | None = None,
             hardware: tuple[str, int] = ("NVIDIA_H100_80GB_HBM3", 8)) -> tuple[Path, dict]:
    """Write a log with train_gpt.py's layout; return its path and the values written into it. val_docs=None
    writes the `val_tokens:` line of an older train_gpt.py (no val_docs count); settings override `setting` lines."""
    code_bytes = len(shipped(code))
    model_bytes = 15_800_000 + seed % 1000
    total = model_bytes + code_bytes if total_bytes is None else total_bytes
    val_loss, val_bpb = 1.90 + (seed % 97) * 1e-4 + 0.123456789e-4, 1.12 + (seed % 89) * 1e-4 + 0.987654321e-4
    ttt_loss, ttt_bpb = val_loss - 0.0041, val_bpb - 0.0024
    score_bpb = ttt_bpb if ttt else val_bpb
    steps = 7100 + seed % 50
    docs = "" if val_docs is None else f" val_docs:{val_docs}"
    lines = [*log_head(seed, code, source_extra_newline, ttt, settings, hardware),
             f"val_tokens:62021846{docs} scored_targets:62021845 eval_batch_seqs:64", "model_params:27000000"]
    lines[-2:-2] = [] if warning is None else [f"warning {warning}"]
    lines += [f"step:{s}/20000 train_loss:{6.9 - s * 1e-4:.4f} train_time:{s * 83}ms step_avg:83.00ms"
              for s in (1, 2, 500, 1000)]
    # a checkpoint in the loop (CHECKPOINT_EVERY) counts on the training side; the final one, after the Hessians, not
    lines += [f"checkpoint step:1000 path:logs/run{seed}.ckpt bytes:270000000 time:{checkpoint_ms}ms",
              f"step:{steps}/20000 val_loss:{val_loss - 0.02:.4f} val_bpb:{val_bpb - 0.01:.4f} "
              f"train_time:{train_ms}ms step_avg:{train_ms / steps:.2f}ms",
              f"stopping_early: wallclock_cap train_time:{train_ms}ms step:{steps}/20000",
              f"train_done steps:{steps} train_time:{train_ms}ms",
              "peak memory allocated: 22201 MiB reserved: 23000 MiB",
              f"gptq_calibration batches:16 time:{calibration_ms}ms reserved:4500ms",
              f"checkpoint step:{steps} path:logs/run{seed}.ckpt bytes:270000000 time:2000ms",
              f"Serialized model int6+lzma: {model_bytes} bytes", f"code_bytes:{code_bytes}",
              f"Total submission size int6+lzma: {total} bytes",
              f"final_int6_roundtrip val_loss:{val_loss + 0.03:.4f} val_bpb:{val_bpb + 0.02:.4f} eval_time:6197ms",
              f"final_int6_roundtrip_exact val_loss:{val_loss + 0.03:.8f} val_bpb:{val_bpb + 0.02:.8f}",
              f"final_int6_sliding_window val_loss:{val_loss:.4f} val_bpb:{val_bpb:.4f} stride:64 eval_time:88000ms"]
    if final:
        lines.append(f"final_int6_sliding_window_exact val_loss:{val_loss:.8f} val_bpb:{val_bpb:.8f}")
    if ttt:
        lines += [f"legal_ttt val_loss:{ttt_loss:.4f} val_bpb:{ttt_bpb:.4f} eval_time:410000ms",
                  f"legal_ttt_exact val_loss:{ttt_loss:.8f} val_bpb:{ttt_bpb:.8f}"]
    if eval_s is not None:
        lines.append(f"summary score:{'legal_ttt' if ttt else 'final_int6_sliding_window'} val_bpb:{score_bpb:.8f} "
                     f"artifact:logs/run{seed}.int6.ptz total_bytes:{total} train_time:{train_ms / 1000:.1f}s "
                     f"eval_time:{eval_s:.1f}s eval_wall:{eval_s + 60:.1f}s wall_time:{train_ms / 1000 + eval_s:.1f}s")
    path = folder / f"run{seed}_{len(list(folder.glob('*.txt')))}.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    score = (ttt_loss, ttt_bpb) if ttt else (val_loss, val_bpb)
    return path, dict(seed=seed, val_loss=float(f"{score[0]:.8f}"), val_bpb=float(f"{score[1]:.8f}"), steps=steps,
                      train_time_ms=float(train_ms), bytes_total=total, bytes_code=code_bytes)


META = ["--name", "Test Record", "--author", "A. Person", "--github-id", "aperson", "--blurb", "A test.",
        "--date", "2026-04-01"]


def run_cli(tmp_path, logs, *extra):
    return pr.main([*META, "--root", str(tmp_path / "out"), *extra, "--", *map(str, logs)])


def record_dir(tmp_path):
    return tmp_path / "out" / "track_10min_16mb" / "2026-04-01_Test_Record"


@pytest.mark.parametrize("extra_newline", [True, False])
def test_package_three_seeds(tmp_path, extra_newline):
    made = [make_log(tmp_path, s, source_extra_newline=extra_newline) for s in (42, 1337, 2025)]
    assert run_cli(tmp_path, [p for p, _ in made]) == 0
    folder = record_dir(tmp_path)
    assert sorted(f.name for f in folder.iterdir()) == [
        "README.md", "submission.json", "train_gpt.py", "train_gpt_readable.py", "train_seed1337.log",
        "train_seed2025.log", "train_seed42.log"]
    assert (folder / "train_gpt_readable.py").read_bytes() == CODE.encode("utf-8")
    assert (folder / "train_gpt.py").read_bytes() == shipped(CODE)  # the log source's own shipped_code
    for path, info in made:
        assert (folder / f"train_seed{info['seed']}.log").read_bytes() == path.read_bytes()

    sub = json.loads((folder / "submission.json").read_text())
    infos = sorted((i for _, i in made), key=lambda i: i["seed"])
    assert sub["seeds"] == [42, 1337, 2025]
    assert (sub["name"], sub["author"], sub["github_id"], sub["blurb"], sub["date"]) == (
        "Test Record", "A. Person", "aperson", "A test.", "2026-04-01")
    for got, want in zip(sub["per_seed"], infos):
        for key in ("seed", "val_loss", "val_bpb", "steps", "train_time_ms", "bytes_total"):
            assert got[key] == want[key], key
    assert sub["val_loss"] == pytest.approx(sum(i["val_loss"] for i in infos) / 3, abs=1e-8)
    assert sub["val_bpb"] == pytest.approx(sum(i["val_bpb"] for i in infos) / 3, abs=1e-8)
    assert sub["val_bpb_std"] == pytest.approx(pr.sample_std([i["val_bpb"] for i in infos]), abs=1e-8)
    assert sub["bytes_total"] == max(i["bytes_total"] for i in infos)
    assert sub["bytes_code"] == len(shipped(CODE))
    assert sub["score_line"] == "final_int6_sliding_window_exact"
    assert "significance" not in sub

    readme = (folder / "README.md").read_text()
    assert all(f"{i['val_bpb']:.8f}" in readme for i in infos)
    assert f"**val_bpb: {sub['val_bpb']:.4f}**" in readme


def test_ttt_score_wins_and_significance_from_losses(tmp_path):
    made = [make_log(tmp_path, s, ttt=True) for s in (1, 2, 3)]
    prev = [1.93, 1.931, 1.929]
    assert run_cli(tmp_path, [p for p, _ in made], "--prev-record-losses", *map(str, prev)) == 0
    sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
    assert sub["score_line"] == "legal_ttt_exact"
    assert [s["val_bpb"] for s in sub["per_seed"]] == [i["val_bpb"] for _, i in made]
    want = pr.welch_margin_test([i["val_loss"] for _, i in made], prev)
    sig = sub["significance"]
    assert (sig["t"], sig["df"], sig["p_value"]) == pytest.approx((want.t, want.df, want.p_value), rel=1e-12)
    assert sig["significant"] == (want.p_value < 0.01)
    assert sig["prev_val_losses"] == prev
    assert "## Significance" in (record_dir(tmp_path) / "README.md").read_text()


def test_significance_from_previous_record_logs(tmp_path):
    ours = [make_log(tmp_path, s) for s in (1, 2)]
    prev_dir = tmp_path / "prev"
    prev_dir.mkdir()
    prev = [make_log(prev_dir, s, code="# an older script\n") for s in (50, 60, 70)]
    args = ["--prev-record-logs", *map(str, (p for p, _ in prev))]
    assert run_cli(tmp_path, [p for p, _ in ours], *args) == 0
    sig = json.loads((record_dir(tmp_path) / "submission.json").read_text())["significance"]
    assert sig["prev_val_losses"] == [i["val_loss"] for _, i in prev]
    want = pr.welch_margin_test([i["val_loss"] for _, i in ours], [i["val_loss"] for _, i in prev])
    assert sig["p_value"] == pytest.approx(want.p_value, rel=1e-12)


def test_script_runs_from_command_line(tmp_path):
    log, info = make_log(tmp_path, 7)
    # LOGs first, so the greedy --prev-record-losses list needs no `--` after it.
    out = subprocess.run([sys.executable, str(ROOT / "records" / "package_record.py"), str(log), *META,
                          "--root", str(tmp_path / "out"), "--prev-record-losses", "2.1", "2.2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
    assert sub["val_bpb"] == info["val_bpb"] and sub["significance"]["prev_val_losses"] == [2.1, 2.2]
    assert sub["significance"]["p_value"] is None  # one seed of ours: Welch needs two on each side
    assert f"val_bpb mean {info['val_bpb']:.8f}" in out.stdout


# Each refusal: exit 1, a message naming the offending log and the reason, and no record folder written.
@pytest.mark.parametrize("bad, reason", [
    (dict(code=CODE + "# changed\n"), "differs from the one in"),
    (dict(total_bytes=16_000_001), "over the 16,000,000 limit"),
    (dict(final=False), "no final score line"),
    (dict(train_ms=600_001), "over the 600,000 ms limit"),
    (dict(train_ms=596_000), "(with the loop's checkpoints and GPTQ's calibration on train data 600,521 ms) is over"),
    (dict(eval_s=600.1), "eval_time 600,100 ms is over the 600,000 ms limit"),
    (dict(warning="checkpoint logs/a.ckpt was written by another train_gpt.py: a record of this run ships this one, "
                  "which did not train all of it"), "resumed under other code"),
    (dict(seed=42), "seed 42 is also used by"),
    (dict(ttt=True), "scored by legal_ttt_exact but"),  # seeds must share one score line
])
def test_refusals(tmp_path, capsys, bad, reason):
    good, _ = make_log(tmp_path, 42)
    bad_log, _ = make_log(tmp_path, **{"seed": 43, **bad})
    assert run_cli(tmp_path, [good, bad_log]) == 1
    err = capsys.readouterr().err
    assert "REFUSED" in err and reason in err
    assert any(str(bad_log) in line and reason in line for line in err.splitlines())
    assert not (tmp_path / "out").exists()


def _not_a_log(tmp_path, name: str) -> tuple[Path, str]:
    """A file that is no train_gpt.py log, and why, as the packager must say it."""
    path = tmp_path / name
    if name == "artifact.int6.ptz":  # a binary file: the artifact instead of the log
        path.write_bytes(b"PGA\x01\xfd7zXZ\x00\x00")
        return path, "not a log: not UTF-8 text (byte 0xfd at offset 4)"
    if name == "notes.txt":  # some other text
        path.write_text("results of today\nseed 1 was best\n")
        return path, "not a log of train_gpt.py: no `==== source: train_gpt.py ====` line (its logs start with one)"
    if name == "README.md":  # text with log-like lines, as the README's table of them
        path.write_text("step:S/N train_loss:X\ntrain_done steps:S train_time:Tms step_avg:Ams\n")
        return path, "line 2 is not as train_gpt.py writes it (no number for steps): 'train_done steps:S train_time:Tms"
    if name == "cut.txt":  # a log whose score line was cut off mid-write
        log, _ = make_log(tmp_path, 5, eval_s=None)  # no summary line: the score line is the last
        log.write_text(log.read_text().rstrip("\n").rsplit(" ", 1)[0] + "\n")
        path = log.rename(path)
        last = len(path.read_text().splitlines())
        return path, f"line {last} is not as train_gpt.py writes it (no number for val_bpb): " \
                     "'final_int6_sliding_window_exact val_loss:"
    return path, "cannot read it (No such file or directory)"  # missing.txt


@pytest.mark.parametrize("name", ["artifact.int6.ptz", "notes.txt", "README.md", "cut.txt", "missing.txt"])
def test_a_file_that_is_no_log_is_one_line_naming_it(tmp_path, capsys, name):
    """A binary file, other text, a missing file or a malformed line ended in a traceback (or a list of every
    record rule the file broke): now one stderr line names the file and why, exit status 1."""
    good, _ = make_log(tmp_path, 1)
    bad, why = _not_a_log(tmp_path, name)
    assert run_cli(tmp_path, [good, bad]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"package_record: error: {bad}: {why}"), err
    assert not (tmp_path / "out").exists()


def test_significance_from_another_scripts_logs_takes_their_last_score_line(tmp_path):
    """The records' own logs (the 2026-04-27 record's tail: its TTT's progress, then its one final line)."""
    ours = [make_log(tmp_path, s) for s in (1, 2)]
    prev = []
    for i, loss in enumerate((2.31944212, 2.32239991, 2.32423994)):
        path = tmp_path / f"train_seed{i}.log"
        path.write_text(f"step:4945/20000 val_loss:2.3400 val_bpb:1.0700 train_time:599000ms\n"
                        f"diagnostic quantized val_loss:{loss + 0.02:.8f} val_bpb:1.07000000 eval_time:9000ms\n"
                        "ttp: b9/782 bl:2.7610 bb:1.2598 rl:2.3017 rb:1.0495 dl:105-107 gd:1\n"
                        f"quantized_ttt_phased val_loss:{loss:.8f} val_bpb:1.05989454 eval_time:508785ms\n"
                        "total_eval_time:508.8s\n", encoding="utf-8")
        prev.append(path)
    assert run_cli(tmp_path, [p for p, _ in ours], "--prev-record-logs", *map(str, prev)) == 0
    sig = json.loads((record_dir(tmp_path) / "submission.json").read_text())["significance"]
    assert sig["prev_val_losses"] == [2.31944212, 2.32239991, 2.32423994]
    (tmp_path / "none.log").write_text("step:1/2 val_loss:2.3400 val_bpb:1.0700\nno score here\n", encoding="utf-8")
    with pytest.raises(pr.Refusal, match="no final score line"):
        pr.prev_record_losses([tmp_path / "none.log"])


def test_our_own_log_without_a_final_score_is_no_previous_record(tmp_path):
    """Another script's last score line is for other scripts' logs: ours without its final line is refused (a review:
    its roundtrip loss, worse than the final one, was taken as the previous record's)."""
    path, _ = make_log(tmp_path, 5, final=False)
    with pytest.raises(pr.Refusal, match="no final score line"):
        pr.prev_record_losses([path])


def test_a_previous_record_log_that_is_no_log_is_one_line_naming_it(tmp_path):
    good, _ = make_log(tmp_path, 1)
    bad, why = _not_a_log(tmp_path, "artifact.int6.ptz")
    run = subprocess.run([sys.executable, str(ROOT / "records" / "package_record.py"), str(good), *META,
                          "--root", str(tmp_path / "out"), "--prev-record-logs", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (1, f"package_record: error: {bad}: {why}\n")


def test_refuses_a_log_of_two_runs_and_a_run_on_the_sample_data(tmp_path, capsys):
    """A reused RUN_ID used to append a second run to one log, and the packager took the mixed log; a run on the
    offline sample (data/make_sample.py) was accepted as a record."""
    twice, _ = make_log(tmp_path, 7)
    twice.write_text(twice.read_text() * 2)
    sample, _ = make_log(tmp_path, 8)
    text = sample.read_text().replace("model_params:", "sample_data: the offline sample (data/make_sample.py): "
                                      "scores are not comparable to FineWeb scores\nmodel_params:")
    sample.write_text(text)
    assert run_cli(tmp_path, [twice, sample]) == 1
    err = capsys.readouterr().err
    assert f"{twice}: the log holds 2 runs" in err and f"{sample}: trained or scored on the offline sample" in err
    assert not (tmp_path / "out").exists()


def test_refuses_existing_folder_unless_force(tmp_path, capsys):
    log, _ = make_log(tmp_path, 42)
    assert run_cli(tmp_path, [log]) == 0
    marker = record_dir(tmp_path) / "stale.txt"
    marker.write_text("left from an earlier packaging")
    assert run_cli(tmp_path, [log]) == 1
    assert "already exists" in capsys.readouterr().err and marker.exists()
    assert run_cli(tmp_path, [log], "--force") == 0
    assert not marker.exists() and (record_dir(tmp_path) / "train_seed42.log").exists()


def test_refuses_unfinished_ttt_and_mismatched_code_bytes(tmp_path, capsys):
    log, _ = make_log(tmp_path, 5)
    text = log.read_text().replace("setting ttt_enabled:0", "setting ttt_enabled:1")
    log.write_text(text.replace(f"code_bytes:{len(shipped(CODE))}", "code_bytes:12"))
    assert run_cli(tmp_path, [log]) == 1
    err = capsys.readouterr().err
    assert "no legal_ttt_exact line" in err and "code_bytes says 12" in err


def test_refuses_a_log_of_the_shipped_stub(tmp_path, capsys):
    """A run of the shipped stub logs the source it ran, which leaves shipped_code out: refused, saying why."""
    code = CODE.replace("def shipped_code(source: str) -> bytes:", "def packed(source: str) -> bytes:")
    assert code != CODE
    log, _ = make_log(tmp_path, 5, code=code)
    assert run_cli(tmp_path, [log]) == 1
    err = capsys.readouterr().err
    assert "has no shipped_code function" in err and "Package runs of the readable train_gpt.py" in err


def test_refuses_logs_whose_settings_differ(tmp_path, capsys):
    """A "3-seed record" of 2-layer and 3-layer runs used to be packaged (a stderr warning, exit 0): a setting other
    than the seed and what names the run and its files (run_id, artifact_path, resume) must be the same in all."""
    two, _ = make_log(tmp_path, 1, settings={"num_layers": 2})
    three, _ = make_log(tmp_path, 2, settings={"num_layers": 3})
    also_two, _ = make_log(tmp_path, 3, settings={"num_layers": 2})
    assert run_cli(tmp_path, [two, three, also_two]) == 1
    err = capsys.readouterr().err
    assert "REFUSED" in err
    line = next(x for x in err.splitlines() if "setting num_layers differs" in x)
    assert f"num_layers:2 in {two}, {also_two}" in line and f"num_layers:3 in {three}" in line
    assert not any("setting seed" in x or "setting run_id" in x for x in err.splitlines())
    assert not (tmp_path / "out").exists()


def test_per_run_settings_may_differ(tmp_path):
    """seed, run_id, artifact_path (logs/<RUN_ID>.int6.ptz) and resume (each run's own checkpoint) name the run."""
    made = [make_log(tmp_path, 1, settings={"resume": "logs/a.ckpt", "artifact_path": "/data/a.ptz"}),
            make_log(tmp_path, 2, settings={"resume": "logs/b.ckpt"}), make_log(tmp_path, 3)]
    assert run_cli(tmp_path, [p for p, _ in made]) == 0
    assert json.loads((record_dir(tmp_path) / "submission.json").read_text())["seeds"] == [1, 2, 3]


def test_refuses_an_eval_only_run(tmp_path, capsys):
    log, _ = make_log(tmp_path, 1, settings={"eval_only": "logs/other.int6.ptz"})
    assert run_cli(tmp_path, [log]) == 1
    assert f"{log}: an EVAL_ONLY run (it scored the artifact logs/other.int6.ptz" in capsys.readouterr().err


@pytest.mark.parametrize("val_docs, reason", [
    (49_999, "scored on 49,999 validation documents, fewer than the challenge's 50,000"),
    (None, "no `val_docs:` count on a `val_tokens:` line (a log of an older train_gpt.py)"),
])
def test_refuses_a_partial_validation_set_unless_allowed(tmp_path, capsys, val_docs, reason):
    """Scores on part of the FineWeb val set (a smaller val shard, a tiny test set) are not comparable to the
    challenge's, which scores all 50,000 documents; --allow-partial-val packages them marked not a submission."""
    full, _ = make_log(tmp_path, 1)
    part, _ = make_log(tmp_path, 2, val_docs=val_docs)
    assert run_cli(tmp_path, [full, part]) == 1
    err = capsys.readouterr().err
    assert "REFUSED" in err and f"{part}: {reason}" in err and str(full) not in err
    assert not (tmp_path / "out").exists()

    assert run_cli(tmp_path, [full, part], "--allow-partial-val") == 0
    assert "NOT A SUBMISSION: scored on fewer than" in capsys.readouterr().out
    sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
    want = "unknown (no val_docs line)" if val_docs is None else "49,999"
    assert sub["not_a_submission"].endswith(f"--allow-partial-val, for checks only): seed 2: {want}")
    assert [s["val_docs"] for s in sub["per_seed"]] == [50_000, val_docs]
    readme = (record_dir(tmp_path) / "README.md").read_text().splitlines()
    assert readme[2] == f"**NOT A SUBMISSION**: {sub['not_a_submission']}."


def test_full_validation_set_is_a_submission_with_or_without_the_flag(tmp_path):
    made = [make_log(tmp_path, s) for s in (1, 2)]
    for extra in ((), ("--allow-partial-val", "--force")):
        assert run_cli(tmp_path, [p for p, _ in made], *extra) == 0
        sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
        assert "not_a_submission" not in sub and [s["val_docs"] for s in sub["per_seed"]] == [50_000, 50_000]
        assert sub["hardware"] == ["8 x NVIDIA_H100_80GB_HBM3"]
        readme = (record_dir(tmp_path) / "README.md").read_text()
        assert "NOT A SUBMISSION" not in readme and "all 50,000 validation documents scored" in readme


def failed_log(folder: Path, seed: int, after: list[str] = (), error: str = "FileNotFoundError: TOKENIZER_PATH "
               "./nope.model does not exist: see data/README.md", code: str = CODE) -> Path:
    """The log of a run that raised after its header (train_gpt.py's main logs `error <Type>: <msg>`)."""
    path = folder / f"failed{seed}.txt"
    path.write_text("\n".join([*log_head(seed, code), *after, f"error {error}"]) + "\n", encoding="utf-8")
    return path


def test_skips_runs_that_failed_at_the_start(tmp_path, capsys):
    """`package_record.py ... logs/*.txt` used to be refused for any log of a run that stopped on a bad setting or a
    missing file: such a log (header, no step, no score, an error line) is left out with one line on stderr."""
    made = [make_log(tmp_path, s) for s in (1, 2)]
    early = failed_log(tmp_path, 3, after=["val_tokens:62021846 val_docs:50000 scored_targets:62021845",
                                           "model_params:27000000", "warmup_step:1/20"],
                       error="OutOfMemoryError: CUDA out of memory.\nTried to allocate 2.00 GiB")
    other = failed_log(tmp_path, 4)
    assert run_cli(tmp_path, [made[0][0], early, made[1][0], other]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"package_record: skipped {early}: the run failed at the start (no training step, no score): "
                   "error OutOfMemoryError: CUDA out of memory.",
                   f"package_record: skipped {other}: the run failed at the start (no training step, no score): "
                   "error FileNotFoundError: TOKENIZER_PATH ./nope.model does not exist: see data/README.md"]
    sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
    assert sub["seeds"] == [1, 2] and sorted(f.name for f in record_dir(tmp_path).glob("*.log")) == [
        "train_seed1.log", "train_seed2.log"]


def test_all_logs_failed_at_the_start(tmp_path, capsys):
    assert run_cli(tmp_path, [failed_log(tmp_path, 1), failed_log(tmp_path, 2)]) == 1
    err = capsys.readouterr().err
    assert err.count("package_record: skipped") == 2 and "no run left to package" in err


def test_refuses_a_log_cut_off_at_the_start_without_an_error_line(tmp_path, capsys):
    """Only a logged exception marks a start failure: a run killed (or still running) after its header, and a log of
    two runs that both failed at the start, are refused, not skipped."""
    good, _ = make_log(tmp_path, 1)
    cut = failed_log(tmp_path, 2)
    cut.write_text(cut.read_text().rsplit("error ", 1)[0])
    twice = failed_log(tmp_path, 3, code="# no decoy lines: the second source block must not read as events\n")
    twice.write_text(twice.read_text() * 2)
    assert run_cli(tmp_path, [good, cut, twice]) == 1
    err = capsys.readouterr().err
    assert "skipped" not in err and f"{cut}: no `train_done` line" in err and f"{twice}: the log holds 2 runs" in err


@pytest.mark.parametrize("after", [
    ["step:1/20000 train_loss:6.9000 train_time:83ms step_avg:83.00ms"],  # trained a step
    ["step:500/20000 train_time:41500ms eta:540s"],  # a progress line of the training loop
    ["final_int6_roundtrip_exact val_loss:2.00000000 val_bpb:1.20000000"],  # scored
])
def test_refuses_runs_that_failed_after_the_start(tmp_path, capsys, after):
    good, _ = make_log(tmp_path, 1)
    late = failed_log(tmp_path, 2, after=after, error="RuntimeError: NCCL timeout")
    assert run_cli(tmp_path, [good, late]) == 1
    err = capsys.readouterr().err
    assert "skipped" not in err and f"{late}: the run failed: `error RuntimeError: NCCL timeout`" in err


def test_refuses_a_finished_run_that_logged_an_error(tmp_path, capsys):
    """An error after the final score (the process did not end cleanly) used to pass unnoticed."""
    good, _ = make_log(tmp_path, 1)
    late, _ = make_log(tmp_path, 2)
    late.write_text(late.read_text() + "error RuntimeError: CUDA error: an illegal memory access\n")
    assert run_cli(tmp_path, [good, late]) == 1
    assert f"{late}: the run failed: `error RuntimeError: CUDA error" in capsys.readouterr().err


def test_packages_a_real_tiny_cpu_run(tmp_path, capsys, dataset, tokenizer_path, monkeypatch):
    """The tool against logs that train_gpt.py really wrote: two seeds of a tiny CPU run (artifact paths differ,
    logs/real<seed>.int6.ptz), scored on the 40 documents of the tiny val set, and a run that failed at the start."""
    from conftest import run_inline, tiny_env
    logs = []
    for seed in (1, 2):
        env = tiny_env(dataset, tokenizer_path, SEED=seed, RUN_ID=f"real{seed}", ITERATIONS=4, EVAL_STRIDE=32)
        res = run_inline(monkeypatch, env, tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        logs.append(tmp_path / "logs" / f"real{seed}.txt")
    # a missing DATA_PATH fails after the log is written (tests/test_main.py checks its `error` line)
    res = run_inline(monkeypatch, tiny_env(tmp_path / "missing", tokenizer_path, SEED=3, RUN_ID="bad"), tmp_path)
    assert res.returncode == 1 and (tmp_path / "logs" / "bad.txt").is_file()
    all_logs = sorted((tmp_path / "logs").glob("*.txt"))  # as `logs/*.txt` would give them
    assert run_cli(tmp_path, all_logs) == 1
    err = capsys.readouterr().err
    assert f"package_record: skipped {tmp_path / 'logs' / 'bad.txt'}: the run failed at the start" in err
    assert f"error FileNotFoundError: DATA_PATH {tmp_path / 'missing'} is not a directory" in err
    assert all(f"{log}: scored on 40 validation documents, fewer than" in err for log in logs)
    assert run_cli(tmp_path, all_logs, "--allow-partial-val") == 0
    out = record_dir(tmp_path)
    sub = json.loads((out / "submission.json").read_text())
    assert sub["not_a_submission"].endswith("seed 1: 40; seed 2: 40") and sub["hardware"] == ["1 x cpu"]
    assert sub["not_a_submission"].startswith("trained on 1 x cpu, not the challenge's 8 x H100; ")
    assert [s["val_docs"] for s in sub["per_seed"]] == [40, 40]
    finals = []
    for log in logs:
        line = next(x for x in log.read_text().splitlines() if x.startswith("final_int6_sliding_window_exact "))
        finals.append(float(line.split("val_bpb:")[1].split()[0]))
        total = next(x for x in log.read_text().splitlines() if x.startswith("Total submission size"))
        assert int(total.split(": ")[1].split()[0]) <= sub["bytes_total"]
    assert sub["val_bpb"] == pytest.approx(sum(finals) / 2, abs=1e-8)
    script = Path(__file__).resolve().parents[1] / "train_gpt.py"
    assert (out / "train_gpt_readable.py").read_bytes() == script.read_bytes()
    import train_gpt as tg
    shipped = (out / "train_gpt.py").read_bytes()
    assert shipped == tg.shipped_code(script.read_text(encoding="utf-8")) and len(shipped) == sub["bytes_code"]
    assert len(shipped) < 0.4 * len(script.read_bytes())  # xz + base85 of the source


def test_runs_on_other_machines_are_marked_not_a_submission(tmp_path):
    """Four H200s (this project's GPU machine) are not the challenge's 8 H100s: packaged, marked, and said where."""
    logs = [make_log(tmp_path, s, hardware=("NVIDIA_H200", 4))[0] for s in (1, 2)]
    assert run_cli(tmp_path, logs) == 0
    sub = json.loads((record_dir(tmp_path) / "submission.json").read_text())
    assert sub["hardware"] == ["4 x NVIDIA_H200"]
    assert sub["not_a_submission"] == "trained on 4 x NVIDIA_H200, not the challenge's 8 x H100"
    assert "**NOT A SUBMISSION**: trained on 4 x NVIDIA_H200" in (record_dir(tmp_path) / "README.md").read_text()
