"""The three extension points of train_gpt.py (issue 56) take a new entry without any other change: for each, a toy
entry made here alone (a weight format in FORMATS, a TTT mode in TTT_MODES, an Adapter class) runs end to end
through train_gpt's own main(), in this process (a subprocess would not see the patched table), on the tiny CPU
config.

1. FORMATS: a toy "q4" row (the MLP bank matrices as int4 codes -7..7 with a per-row absmax fp16 scale, no GPTQ),
   ahead of "q6". The run writes .q4 tensors, its scores are those of the toy's dequantization, the size
   prediction and tools/artifact_report.py follow the row; without the row the artifact is refused.
2. TTT_MODES: a toy "score_only" mode (per-document sliding windows, no training): TTT_MODE accepts it only while
   the row is there, score_artifact dispatches to it and logs the per-document baseline it asks for.
3. Adapter: a toy per-document bias on the head's logits, run by lora_ttt (adapter_cls) under a mode of its own:
   trained, it moves the score; with no steps it scores what the per-document sliding windows score.
"""
from __future__ import annotations

import functools
import re
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT, run_main, tiny_env

import train_gpt as tg

sys.path.insert(0, str(ROOT / "tools"))
import artifact_report as ar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ITERATIONS = 6


def one_line(log: str, prefix: str) -> str:
    lines = [x for x in log.splitlines() if x.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return lines[0]


def exact(log: str, key: str) -> tuple[float, float]:
    """(val_loss, val_bpb) of the score line `key`_exact."""
    m = re.fullmatch(r"val_loss:(\S+) val_bpb:(\S+)", one_line(log, f"{key}_exact ").split(" ", 1)[1])
    assert m, key
    return float(m.group(1)), float(m.group(2))


# =============================================================================================
# 1. FORMATS: a toy int4 format for the MLP matrices
# =============================================================================================

Q4_MAX = 7


def q4_quantize(cfg, name, w, h, coarsen):
    """Per-row absmax: scale = max |w| / 7 (fp16, floored at its smallest normal), codes round(w / scale)."""
    scale = (w.abs().amax(1) / Q4_MAX * coarsen).clamp(min=tg.FP16_MIN_NORMAL).half()
    return {"q4": torch.round(w / scale.float()[:, None]).clamp(-Q4_MAX, Q4_MAX).to(torch.int8), "scale": scale}


def q4_dequantize(p):
    return p["q4"].float() * p["scale"].float()[:, None]


def mlp_matrix(cfg, name, t):
    return (m := tg.bank_matrix(name)) is not None and m[0].startswith("mlp.")


Q4 = tg.Format("q4", "int4 toy", mlp_matrix, q4_quantize, q4_dequantize, lambda cfg, name: 3.0, ("scale",),
               lambda cfg: Q4_MAX)


def test_a_toy_format_runs_end_to_end(monkeypatch, tmp_path, dataset, tokenizer_path):
    original = dict(tg.FORMATS)
    monkeypatch.setattr(tg, "FORMATS", {"q4": Q4, **original})  # ahead of q6: the first row that holds wins
    log = run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "q4")
    exact(log, "final_int6_roundtrip")  # scored on the read-back artifact
    cfg = tg.Hyperparameters.from_env(tiny_env(dataset, tokenizer_path, RUN_ID="q4", ITERATIONS=ITERATIONS))[0]
    L, path = cfg.num_layers, tmp_path / "logs" / "q4.int6.ptz"
    _, tensors = tg.read_artifact(path)
    mlp = {f"blocks.{i}.{m}" for i in range(L) for m in tg.MATRICES if m.startswith("mlp.")}
    assert {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".q4")} == mlp
    assert all(f"{n}.q6" in tensors for n in tg.unbank(tg.build_model(cfg, tg.Runtime()).state_dict(), L)
               if tg.bank_matrix(n) and n not in mlp)  # the attention matrices stay int6
    codes = torch.cat([tensors[f"{n}.q4"].flatten() for n in mlp])
    assert codes.dtype == torch.int8 and codes.abs().max() == Q4_MAX  # absmax: every row reaches +-7
    # what was scored: the toy's dequantization of its tensors
    template = tg.build_model(cfg, tg.Runtime()).state_dict()
    flat = tg.unbank(tg.dequantize_state(tensors, template, L), L)
    for n in mlp:
        assert torch.equal(flat[n], q4_dequantize({"q4": tensors[f"{n}.q4"], "scale": tensors[f"{n}.scale"]}))
    # the size prediction reads the row: the log's is the toy's, not the one without it
    with_toy = tg.predict_artifact_bytes(cfg)
    with monkeypatch.context() as m:
        m.setattr(tg, "FORMATS", original)
        without = tg.predict_artifact_bytes(cfg)
        with pytest.raises(ValueError, match="unknown tensor kind"):  # an artifact of a format this file lacks
            tg.dequantize_state(tensors, template, L)
    assert with_toy != without
    code_bytes = int(one_line(log, "code_bytes:").split(":")[1])
    assert int(re.search(r"total:(\d+)", one_line(log, "predicted_size ")).group(1)) == with_toy + code_bytes
    # tools/artifact_report.py groups the tensors by the toy's label
    groups = {ln[len("group "):ln.index(" elements:")].strip() for ln in ar.report(path) if ln.startswith("group ")}
    assert {"int4 toy mlp.up", "int4 toy mlp.down", "int4 toy scale"} <= groups


# =============================================================================================
# 2. TTT_MODES: a toy mode that scores each document's sliding windows and trains nothing
# =============================================================================================

def test_a_toy_ttt_mode_runs_end_to_end(monkeypatch, tmp_path, dataset, tokenizer_path):
    env = tiny_env(dataset, tokenizer_path, TTT_ENABLED=1, TTT_MODE="score_only", DOC_ISOLATION=0)
    with pytest.raises(ValueError, match="is not one of"):  # not a mode before its row exists
        tg.Hyperparameters.from_env(env)
    calls = []

    def score_only(cfg, rt, model, scorer):
        calls.append(cfg.ttt_mode)
        return scorer(model, cfg.eval_stride, per_doc=True)
    monkeypatch.setitem(tg.TTT_MODES, "score_only", tg.TTTMode(score_only, True))
    log = run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "mode", TTT_ENABLED=1, TTT_MODE="score_only",
                   DOC_ISOLATION=0)
    assert calls == ["score_only"]
    assert exact(log, "legal_ttt") == exact(log, "final_int6_sliding_window_per_doc")  # per_doc_baseline: logged
    assert exact(log, "legal_ttt") != exact(log, "final_int6_sliding_window")  # windows within documents
    assert "\nttt_lora documents:" not in log  # lora's scheduler did not run


# =============================================================================================
# 3. Adapter: a toy per-document bias on the head's logits, trained by lora_ttt
# =============================================================================================

class HeadBias(tg.Adapter):
    """Row b's logits + bias[b]: one vector per document, zero at each reset."""
    built: list["HeadBias"] = []

    def __init__(self, cfg, rows, device):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(rows, cfg.vocab_size, device=device))
        self.moved = 0.0  # the largest |bias| a forward used
        HeadBias.built.append(self)

    @torch.no_grad()
    def reset(self):
        self.bias.zero_()

    def deltas(self, names, s, x_BTI):
        self.moved = max(self.moved, float(self.bias.detach().abs().max()))
        return [self.bias[:x_BTI.size(0), None, :].to(x_BTI.dtype) if n == "head" else 0 for n in names]


def test_a_toy_adapter_runs_end_to_end(monkeypatch, tmp_path, dataset, tokenizer_path):
    monkeypatch.setattr(HeadBias, "built", [])
    monkeypatch.setitem(tg.TTT_MODES, "bias", tg.TTTMode(functools.partial(tg.lora_ttt, adapter_cls=HeadBias),
                                                         True, settings="lora"))
    scores = {}
    for steps in (1, 0):
        log = run_main(monkeypatch, tmp_path, dataset, tokenizer_path, f"bias{steps}", TTT_ENABLED=1,
                       TTT_MODE="bias", DOC_ISOLATION=0, TTT_GRAD_STEPS=steps, TTT_LORA_LR=0.05)
        scores[steps] = exact(log, "legal_ttt"), exact(log, "final_int6_sliding_window_per_doc")
        assert "\nttt_lora documents:" in log  # lora's scheduler ran the toy
        assert "TTT_MODE=lora's" not in log  # the lora settings it reads are not reported as ignored
    trained, frozen = HeadBias.built
    assert trained.moved > 0 and frozen.moved == 0  # the toy's deltas reached the logits, and trained
    (ttt, per_doc), (ttt0, per_doc0) = scores[1], scores[0]
    assert per_doc == per_doc0  # the same artifact (same seed, same settings up to TTT)
    assert abs(ttt[0] - per_doc[0]) > 1e-4  # the adapter trained
    # no steps: the per-document windows' score (equal to the 8 logged decimals here; lora batches other rows
    # than the sliding scorer, fp32 NLLs a few ulps apart at most, as tests/test_ttt_lora.py measures)
    assert ttt0 == pytest.approx(per_doc0, rel=1e-6)
