"""tools/artifact_report.py: where an artifact's bytes go (groups, order-0 entropy of the codes, coders)."""
from __future__ import annotations

import math
import sys
from collections import Counter

from conftest import ROOT, perturbed_model, tiny_cfg

import train_gpt as tg

sys.path.insert(0, str(ROOT / "tools"))
import artifact_report as ar  # noqa: E402


def entropy_bytes(values) -> float:
    """Order-0 entropy written out plainly: -sum c log2(c / n) / 8."""
    counts = Counter(values)
    n = sum(counts.values())
    return -sum(c * math.log2(c / n) for c in counts.values()) / 8


def test_report_groups_the_tensors_by_format_and_measures_each_codes_entropy(tmp_path):
    """LQER on (the default): every tensor in a group named by its FORMATS row, the LQER factors included."""
    cfg = tiny_cfg(vocab_size=4096, bigram_vocab_size=4097, lqer_enabled=True, lqer_top_k=2, lqer_rank=2)
    packed = tg.quantize_state(perturbed_model(cfg, 3, 0.05, 0.02).state_dict(), cfg)
    assert any(k.endswith(".lqA") for k in packed)
    path = tmp_path / "a.int6.ptz"
    path.write_bytes(tg.compress(tg.pack_tensors(packed, cfg), "rans")[0])
    lines = ar.report(path, per_tensor=True)
    groups = {ln[len("group "):ln.index(" elements:")].strip(): ln for ln in lines if ln.startswith("group ")}
    lq = tg.FORMATS["lqA"]
    assert set(groups) == {f"int6 {m}" for m in tg.MATRICES} | {"int6 scale", "int8 tables", "int8 tables scale",
                                                                 "fp16 tensors"} | {f"{lq.label} {p}" for p in
                                                                                    ("lqA", *lq.parts)}
    want = sum(entropy_bytes(t.numpy().reshape(-1).tolist()) for t in packed.values() if t.dtype == tg.torch.int8)
    codes = next(ln for ln in lines if ln.startswith("codes order0:"))
    assert abs(float(codes.split(":")[1].split()[0]) - want) < 1.0
    q = sum(t.numel() for k, t in packed.items() if k.endswith(".q6") and ".attn.q." in k + ".")
    assert f"elements:{q:>10}" in groups["int6 attn.q"]
    lqa = sum(t.numel() for k, t in packed.items() if k.endswith(".lqA"))
    assert f"elements:{lqa:>10}" in groups[f"{lq.label} lqA"]
    assert f"whole payload as rans: {path.stat().st_size} bytes" in lines
    assert any(ln.startswith("whole payload as lzma: ") for ln in lines)
    assert sorted(ln.split()[1] for ln in lines if ln.startswith("tensor ")) == sorted(packed)
    assert ar.main([str(tmp_path / "missing.ptz")]) == 1
