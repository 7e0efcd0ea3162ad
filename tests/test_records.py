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


def make_log(folder: Path, seed: int, code: str = CODE, total_bytes: int | None = None, train_ms: int = 599_870,
             final: bool = True, ttt: bool = False, source_extra_newline: bool = True) -> tuple[Path, dict]:
    """Write a log with train_gpt.py's layout; return its path and the values written into it."""
    code_bytes = len(shipped(code))
    model_bytes = 15_800_000 + seed % 1000
    total = model_bytes + code_bytes if total_bytes is None else total_bytes
    val_loss, val_bpb = 1.90 + (seed % 97) * 1e-4 + 0.123456789e-4, 1.12 + (seed % 89) * 1e-4 + 0.987654321e-4
    ttt_loss, ttt_bpb = val_loss - 0.0041, val_bpb - 0.0024
    steps = 7100 + seed % 50
    lines = [pr.SOURCE_START, code + ("\n" if source_extra_newline else "") + pr.SOURCE_END,
             "python 3.11.9 torch 2.11.0+cu128", "device NVIDIA H100 80GB HBM3 x8",
             f"setting run_id:run{seed}", "setting data_path:./data/datasets/fineweb10B_sp1024",
             f"setting seed:{seed}", "setting max_wallclock_seconds:600.0", "setting iterations:20000",
             f"setting ttt_enabled:{int(ttt)}", "model_params:27000000"]
    lines += [f"step:{s}/20000 train_loss:{6.9 - s * 1e-4:.4f} train_time:{s * 83}ms step_avg:83.00ms"
              for s in (1, 2, 500, 1000)]
    lines += [f"step:{steps}/20000 val_loss:{val_loss - 0.02:.4f} val_bpb:{val_bpb - 0.01:.4f} "
              f"train_time:{train_ms}ms step_avg:{train_ms / steps:.2f}ms",
              f"stopping_early: wallclock_cap train_time:{train_ms}ms step:{steps}/20000",
              f"train_done steps:{steps} train_time:{train_ms}ms",
              "peak memory allocated: 22201 MiB reserved: 23000 MiB",
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


def test_packages_a_real_tiny_cpu_run(tmp_path, dataset, tokenizer_path):
    """The tool against logs that train_gpt.py really wrote: two seeds of a tiny CPU run."""
    from conftest import run_script, tiny_env
    logs = []
    for seed in (1, 2):
        res = run_script(tiny_env(dataset, tokenizer_path, SEED=seed, RUN_ID=f"real{seed}", ITERATIONS=4,
                                  EVAL_STRIDE=32), tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        logs.append(tmp_path / "logs" / f"real{seed}.txt")
    assert run_cli(tmp_path, logs) == 0
    out = record_dir(tmp_path)
    sub = json.loads((out / "submission.json").read_text())
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
