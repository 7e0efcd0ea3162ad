"""The device-run tools that produce closing-note numbers, run on CPU with the tiny config."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

from conftest import ROOT, tiny_env


def test_ema_probe_matches_the_runs_own_ema(dataset, tokenizer_path, tmp_path):
    """tests/gpu/ema_probe.py keeps extra EMAs beside the run's own: the one with the run's horizon must score
    exactly what the run logs as post_ema, and a fixed decay differs."""
    shutil.copy(ROOT / "train_gpt.py", tmp_path)
    env = tiny_env(dataset, tokenizer_path, EMA_HORIZON="0.3", PROBE_HORIZONS="0.3,0.9", ITERATIONS="12")
    out = subprocess.run([sys.executable, str(ROOT / "tests/gpu/ema_probe.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probes = dict(re.findall(r"^probe_ema (\S+) val_loss:[\d.]+ val_bpb:([\d.]+)$", out.stdout, re.M))
    post = re.search(r"^post_ema_exact val_loss:[\d.]+ val_bpb:(\d+\.\d+)$", out.stdout, re.M).group(1)
    assert set(probes) == {"horizon:0.3", "decay:0.9"}
    assert abs(float(probes["horizon:0.3"]) - float(post)) < 1e-5
    assert probes["decay:0.9"] != probes["horizon:0.3"]
