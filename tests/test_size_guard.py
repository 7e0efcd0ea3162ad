"""The size guard (Export section): a rANS artifact over the limit is quantized again on coarser grids, the
matrices of least GPTQ error per code first (reverse water-filling); COMPRESSOR=fast's is not; a script run logs the
fit and, after its final scores, what it cost. References: GPTQ's objective as E H E^T's trace in float64, the
water-filling's optimality conditions, quantize_matrix called per matrix."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, perturbed_model, tiny_cfg, tiny_env, _script_command
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")


def bank_matrices(num_layers: int) -> dict[str, tuple[str, int]]:
    return {f"blocks.{i}.{n}": (n, i) for n in tg.MATRICES for i in range(num_layers)}


def spd(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(4 * n, n, generator=g)
    return x.T @ x


def fixture_export(lqer: bool = True):
    cfg = tiny_cfg(lqer_enabled=lqer, lqer_top_k=2, lqer_rank=2, matrix_clip_sigmas=12.85, mlp_clip_sigmas=12.0,
                   attn_clip_sigmas=0)  # the attention matrices at MATRIX_CLIP_SIGMAS
    model = perturbed_model(cfg, 5, bank_std=0.1, table_std=0.3)
    g = torch.Generator().manual_seed(0)
    banked = bank_matrices(cfg.num_layers)
    hessians = {banked[n]: spd(t.shape[1], g) for n, t in tg.unbank(model.state_dict(), cfg.num_layers).items()
                if n in banked}
    return cfg, model, hessians


def test_code_errors_are_gptqs_objective_per_code():
    """tr(E H E^T) / codes for each matrix with an H (the head has none here); without calibration ||E||^2 / codes
    for every SD-clipped coded matrix; a clip-searched one (SD clip 0) is left out."""
    cfg, model, hessians = fixture_export(lqer=False)
    state = model.state_dict()
    flat, banked = tg.unbank(state, cfg.num_layers), bank_matrices(cfg.num_layers)
    for h in (hessians, None):
        packed = tg.quantize_state(state, cfg, h)
        errors = tg.code_errors(packed, state, cfg, h)
        want = set(banked) if h is not None else {k.rsplit(".", 1)[0] for k in packed if k.endswith((".q6", ".q8"))}
        assert set(errors) == want
        for name, (err, n) in errors.items():
            kind = "q6" if name in banked else "q8"
            e = (packed[f"{name}.{kind}"].double() * packed[name + ".scale"].double()[:, None] - flat[name].double())
            ref = torch.trace(e @ h[banked[name]].double() @ e.T) if h is not None else (e * e).sum()
            assert n == e.numel() and err == pytest.approx(ref.item() / n, rel=1e-4)
    searched = tg.replace(cfg, attn_clip_sigmas=0, matrix_clip_sigmas=0)
    packed = tg.quantize_state(state, searched, hessians)
    assert all(".mlp." in n for n in tg.code_errors(packed, state, searched, hessians))


def test_coarser_grids_take_the_cheapest_bits_first():
    """Reverse water-filling, checked by its optimality conditions: the bits asked for are saved (sum n log2 f);
    every coarsened matrix ends at one marginal cost c f^2 (the level), every other one's c is at or above it; no grid
    is coarser than 2^MAX_GRID_LOG2."""
    errors = {"a": (1e-4, 1000), "b": (4e-4, 3000), "c": (2e-3, 500), "d": (1.0, 10_000)}
    for bits in (10.0, 700.0, 5000.0, 9000.0):
        grids = tg.coarser_grids(errors, bits)
        assert all(f > 1 for f in grids.values())
        assert sum(errors[k][1] * math.log2(f) for k, f in grids.items()) == pytest.approx(bits, rel=1e-6)
        level = {k: errors[k][0] * f * f for k, f in grids.items()}
        assert max(level.values()) == pytest.approx(min(level.values()), rel=1e-6)
        assert all(errors[k][0] >= min(level.values()) * (1 - 1e-6) for k in errors if k not in grids)
    assert [len(tg.coarser_grids(errors, b)) for b in (10.0, 5000.0, 9000.0)] == [1, 2, 3]
    assert tg.coarser_grids(errors, 1e9) == dict.fromkeys(errors, 2.0 ** tg.MAX_GRID_LOG2)  # the coarsest grid


@pytest.mark.parametrize("lqer", [True, False])
def test_an_over_budget_artifact_is_quantized_again_on_coarser_grids(lqer):
    """Within the budget; the matrices coarsened are those of least error per code, each GPTQ'd again on a grid its
    factor times coarser; every other tensor is as before the fit (LQER's factors aside: they follow the new errors),
    which the fit returns whole."""
    cfg, model, hessians = fixture_export(lqer)
    meta, state = {"tokenizer_sha256": ""}, model.state_dict()
    first, coder, fit = tg.serialize(model, cfg, meta, hessians)
    assert coder == "rans" and fit is None
    budget = len(first) - 300
    blob, _, fit = tg.serialize(model, cfg, meta, hessians, budget)
    assert len(blob) <= budget and fit["bytes"] == len(first)
    packed = tg.quantize_state(state, cfg, hessians)
    assert fit["unfitted"].keys() == packed.keys() and all(torch.equal(fit["unfitted"][k], packed[k]) for k in packed)
    errors, grids = tg.code_errors(packed, state, cfg, hessians), fit["grids"]
    assert grids and max(errors[n][0] for n in grids) <= min(errors[n][0] for n in errors if n not in grids)
    fitted, flat, banked = tg.unpack_tensors(tg.decompress(blob))[1], tg.unbank(state, 2), bank_matrices(2)
    for name, f in grids.items():
        codes, scale = tg.quantize_matrix(flat[name].float(), tg.clip_sigmas(cfg, banked[name][0]),
                                          cfg.int6_scale_floor, hessians[banked[name]], coarsen=f)
        assert f > 1 and torch.equal(scale, (packed[name + ".scale"].float() * f).half())
        assert torch.equal(fitted[name + ".q6"], codes) and torch.equal(fitted[name + ".scale"], scale)
        # GPTQ'd on the stored fp16 scale, as the reader applies it (not on the product before its rounding)
        assert torch.equal(codes, tg.gptq_codes(flat[name].float(), hessians[banked[name]], scale.float(), tg.INT6_MAX))
    coded = {n + s for n in grids for s in (".q6", ".scale")}
    lqer_keys = {k for k in packed if k.rsplit(".", 1)[1] in ("lqA", *tg.FORMATS["lqA"].parts)}
    assert all(torch.equal(fitted[k], packed[k]) for k in packed if k not in coded | lqer_keys)
    assert bool(lqer_keys) == lqer


def test_an_all_zero_matrix_is_left_out_of_the_fit():
    """A zero matrix (a zero-initialised projection never trained: ITERATIONS=0) codes exactly, so it has no bits to
    trade: the fit leaves it out (its log2 of a zero error crashed the water-filling) and still fits."""
    cfg, model, hessians = fixture_export(lqer=False)
    tg.unbank(model.state_dict(), cfg.num_layers)["blocks.0.attn.o"].zero_()
    first, _, _ = tg.serialize(model, cfg, {"tokenizer_sha256": ""}, hessians)
    blob, _, fit = tg.serialize(model, cfg, {"tokenizer_sha256": ""}, hessians, len(first) - 300)
    assert len(blob) <= len(first) - 300 and fit["grids"] and "blocks.0.attn.o" not in fit["grids"]


def test_the_fast_coder_is_never_fitted():
    cfg, model, hessians = fixture_export()
    cfg = tg.replace(cfg, compressor="fast")
    first, _, _ = tg.serialize(model, cfg, {"tokenizer_sha256": ""}, hessians)
    blob, coder, fit = tg.serialize(model, cfg, {"tokenizer_sha256": ""}, hessians, len(first) - 400)
    assert coder == "zstd" and fit is None and blob == first


def test_a_budget_no_grid_reaches_is_an_error():
    cfg, model, hessians = fixture_export()
    with pytest.raises(ValueError, match="after 4 coarser grids"):
        tg.serialize(model, cfg, {"tokenizer_sha256": ""}, hessians, 1000)


# A run whose limit is set, once its artifact is known, 300 bytes below it: the export must fit itself.
FIT_RUN = """
import math, sys
import train_gpt as tg
real = tg.serialize
def serialize(model, cfg, meta, hessians=None, budget=math.inf):
    code_bytes = tg.SIZE_LIMIT_BYTES - budget
    tg.SIZE_LIMIT_BYTES = int(len(real(model, cfg, meta, hessians)[0]) + code_bytes - 300)
    return real(model, cfg, meta, hessians, tg.SIZE_LIMIT_BYTES - code_bytes)
tg.serialize = serialize
sys.exit(tg.main())
"""


OVER_RUN = """
import train_gpt as tg
tg.SIZE_LIMIT_BYTES = 1000  # no grid fits: serialize raises, on rank 0 alone
tg.entry()
"""


def test_an_export_that_fails_on_rank_0_stops_every_rank_with_its_one_line(tmp_path, dataset, tokenizer_path):
    """The other ranks raise rank 0's error: waiting in its broadcast, they died of a broken connection (a second,
    misleading error line)."""
    cmd, env = _script_command(tiny_env(dataset, tokenizer_path, ITERATIONS="2", RUN_ID="over"), 2)
    (tmp_path / "over.py").write_text(OVER_RUN)
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(cmd[:-1] + ["over.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 1 and len(errors) == 1 and "left beside the code" in errors[0], r.stderr[-3000:]


def test_a_run_over_the_limit_fits_its_export_and_logs_what_it_cost(tmp_path, dataset, tokenizer_path):
    cmd, env = _script_command(tiny_env(dataset, tokenizer_path, ITERATIONS="6", RUN_ID="fit", TTT_ENABLED="0",
                                        MATRIX_CLIP_SIGMAS="12.85"), 1)
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", FIT_RUN], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "logs" / "fit.txt").read_text()
    before, after, moved = map(int, re.search(r"size_fit bytes:(\d+)->(\d+) coarser_grids:(\d+) ", log).groups())
    assert before > after and moved > 0
    assert after == (tmp_path / "logs" / "fit.int6.ptz").stat().st_size
    headroom = int(re.search(r"Total submission size int6\+rans: \d+ bytes limit:\d+ headroom:(-?\d+)", log)[1])
    assert 0 <= headroom < 300
    fitted = float(re.search(r"final_int6_roundtrip_exact val_loss:\S+ val_bpb:(\S+)", log)[1])
    cost, f, u = map(float, re.search(r"size_fit_cost roundtrip_val_bpb:(\S+) \(fitted (\S+), unfitted (\S+)\)",
                                      log).groups())
    assert f == fitted and cost == pytest.approx(f - u, abs=2e-8)
    keys = [line.split(" ")[0] for line in log.splitlines()]
    assert keys.index("size_fit_cost") > keys.index("final_int6_sliding_window_exact")  # after the final scores
