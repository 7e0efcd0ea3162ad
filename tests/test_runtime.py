"""Runtime: the "auto" choices (gradient accumulation, inductor settings) resolved for this machine."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import make_cfg

import train_gpt as tg

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


# =============================================================================================
# 2. Gradient accumulation
# =============================================================================================

@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (3, 2), (4, 2), (5, 1), (6, 1), (8, 1), (16, 1)])
def test_auto_grad_accum_rule(world, accum):
    cfg = make_cfg(TRAIN_BATCH_TOKENS=786432 if world != 5 else 10 * 2048 * 5)
    assert tg.resolve_grad_accum_steps(cfg, world) == accum


def test_grad_accum_divisibility():
    default = make_cfg()
    # 786432 / (3 * 2 * 2048) = 64: fine; 786432 / (5 * 1 * 2048) = 76.8: error
    assert tg.resolve_grad_accum_steps(default, 3) == 2
    with pytest.raises(ValueError, match="TRAIN_BATCH_TOKENS"):
        tg.resolve_grad_accum_steps(default, 5)
    # 524288 / (3 * 2 * 2048) = 42.67: error; 524288 / (4 * 2 * 2048) = 32: fine
    cfg = make_cfg(TRAIN_BATCH_TOKENS=524288)
    with pytest.raises(ValueError, match="TRAIN_BATCH_TOKENS"):
        tg.resolve_grad_accum_steps(cfg, 3)
    assert tg.resolve_grad_accum_steps(cfg, 4) == 2
    # explicit accumulation: 786432 / (1 * 3 * 2048) = 128 fine, 786432 / (1 * 5 * 2048) = 76.8 error
    assert tg.resolve_grad_accum_steps(make_cfg(GRAD_ACCUM_STEPS=3), 1) == 3
    with pytest.raises(ValueError, match="GRAD_ACCUM_STEPS=5"):
        tg.resolve_grad_accum_steps(make_cfg(GRAD_ACCUM_STEPS=5), 1)


@pytest.mark.parametrize("gib", [0, 200, 31.5 * 0.85, 20, 9, 4, 0.5])
def test_memory_plan_takes_the_fewest_micro_batches_and_most_ttt_rows_that_fit(gib):
    """Issue 58 (one 32-GB card): with a memory budget, auto accumulation is the smallest of 8 // WORLD_SIZE times a
    power of two whose micro-batch's activations fit (the largest that divides the batch if none does), and auto TTT
    rows the most of 64, 56, ..., 8 that fit; a budget of 0 (no GPU) keeps 8 // WORLD_SIZE and 64; explicit settings
    stand. The reference: activations counted by hand from the layers a looped forward runs (17 at the defaults)."""
    (cfg, _), budget = tg.Hyperparameters.from_env({}), gib * 2 ** 30
    act = lambda tokens, per: per * tokens * 512 * 17
    for world in (1, 2, 8):
        seqs, accums = 384 // world, [8 // world * 2 ** k for k in range(12)]
        fits = [a for a in accums if seqs % a == 0 and (not budget or act(786432 // (world * a), 53) <= budget)]
        want = fits[0] if fits else max(a for a in accums if seqs % a == 0)
        assert tg.resolve_grad_accum_steps(cfg, world, budget) == want, world
    rows = [r for r in range(64, 0, -8) if not budget or act(r * 2048, 55) + 110 * 47851520 <= budget]  # + the tilt
    assert tg.resolve_ttt_rows(cfg, budget) == (rows[0] if rows else 8)
    assert tg.resolve_grad_accum_steps(dataclasses.replace(cfg, grad_accum_steps=2), 1, budget) == 2
    rt = tg.Runtime(ttt_rows=tg.resolve_ttt_rows(cfg, budget))  # the plan's rows; an explicit setting stands
    assert tg.ttt_rows(dataclasses.replace(cfg, ttt_batch_size=48), rt) == 48
    if gib == 31.5 * 0.85:  # the 32-GB card: the choice the README states
        assert (tg.resolve_grad_accum_steps(cfg, 1, budget), tg.resolve_ttt_rows(cfg, budget)) == (16, 16)
        assert tg.resolve_ttt_rows(dataclasses.replace(cfg, ngram_tilt_enabled=False), budget) == 24  # no counts


@pytest.mark.parametrize("gib, accum, rows, warned", [(20, 32, 16, []), (1, 128, 8, ["GRAD_ACCUM", "TTT_BATCH"]),
                                                     (16, 32, 8, ["GLOBAL_TTT_CHUNK_TOKENS"])])
def test_the_memory_plan_reaches_the_runtime_and_the_log(monkeypatch, gib, accum, rows, warned):
    """init_runtime takes memory_budget's figure (stubbed: no GPU here) into Runtime, and log_header says the plan:
    the budget, the micro-batch and rows with their estimates, and a warning naming the setting for an estimate over
    the budget (1 GiB: even 128 micro-batches and 8 rows are over). Phased TTT's SGD takes 16 rows on one rank
    (GLOBAL_TTT_CHUNK_TOKENS / EVAL_SEQ_LEN) whatever TTT_BATCH_SIZE: at 16 GiB, 8 lora rows fit and its 16 do not
    (the plan counted the lora rows only, and warned of nothing)."""
    cfg, _ = tg.Hyperparameters.from_env({})
    monkeypatch.setattr(tg, "memory_budget", lambda device: gib * 2 ** 30)
    rt = tg.init_runtime(cfg, {})
    assert (rt.budget, rt.grad_accum_steps, rt.ttt_rows) == (gib * 2 ** 30, accum, rows)
    lines = []
    log = lambda msg, console=True: lines.append(msg)
    log.path = "logs/x.txt"
    tg.log_header(log, cfg, rt, [], "", 0)
    micro = 786432 // accum
    est = micro * 512 * 17 * 53 / 2 ** 30, (16 * 2048 * 512 * 17 * 55 + 110 * 47851520) / 2 ** 30  # 16 SGD rows
    want = (f"memory_plan budget:{gib:.1f} micro_batch_tokens:{micro} est:{est[0]:.1f} ttt_rows:{rows} "
            f"global_sgd_rows:16 est:{est[1]:.1f}")
    assert want in lines
    warnings = [x for x in lines if x.startswith("warning memory_plan")]
    assert len(warnings) == len(warned) and all(w in x for w, x in zip(warned, warnings))
    lines.clear()  # EVAL_ONLY trains nothing: no micro-batch in the plan, no GRAD_ACCUM_STEPS warning (there was)
    tg.log_header(log, dataclasses.replace(cfg, eval_only="a.ptz"), rt, [], "", 0)
    assert f"memory_plan budget:{gib:.1f} ttt_rows:{rows} global_sgd_rows:16 est:{est[1]:.1f}" in lines
    assert [x for x in lines if x.startswith("warning memory_plan")] == [x for x in warnings if "GRAD_ACCUM" not in x]


def test_inductor_is_configured_only_where_the_run_compiles(monkeypatch):
    """init_runtime imports and configures inductor only with COMPILE_ENABLED on (a tiny CPU run 0.13 s faster)."""
    calls = []
    monkeypatch.setattr(tg, "configure_inductor", lambda: calls.append(1))
    for flag, want in (("0", []), ("auto", []), ("1", [1])):  # auto is off on the CPU
        calls.clear()
        tg.init_runtime(make_cfg(COMPILE_ENABLED=flag, DEVICE="cpu"), {})
        assert calls == want, flag


def test_configure_inductor_turns_mix_order_reductions_off_unless_the_env_sets_them(monkeypatch):
    import torch._inductor.config as ic
    if not hasattr(ic.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix-order reductions")
    for preset in (True, False):  # the user's explicit choice stands, whichever it is
        monkeypatch.setattr(ic.triton, "mix_order_reduction", preset)
        monkeypatch.setenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", str(int(preset)))
        tg.configure_inductor()
        assert ic.triton.mix_order_reduction is preset
    monkeypatch.delenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION")
    monkeypatch.setattr(ic.triton, "mix_order_reduction", True)
    tg.configure_inductor()
    assert ic.triton.mix_order_reduction is False


# =============================================================================================
# Outputs: one run, one log; folders checked at the start
# =============================================================================================

def test_a_taken_run_id_gets_the_first_free_suffix_and_the_artifact_follows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tg.claim_outputs(make_cfg(RUN_ID="exp"), tg.Runtime())
    assert (cfg.run_id, cfg.artifact_path) == ("exp", "logs/exp.int6.ptz") and (tmp_path / "logs").is_dir()
    for name in ("exp.txt", "exp_2.txt"):
        (tmp_path / "logs" / name).write_text("an earlier run\n")
    cfg = tg.claim_outputs(make_cfg(RUN_ID="exp"), tg.Runtime())
    assert (cfg.run_id, cfg.artifact_path) == ("exp_3", "logs/exp_3.int6.ptz")
    assert tg.claim_outputs(make_cfg(RUN_ID="exp", ARTIFACT_PATH="mine.ptz"), tg.Runtime()).artifact_path == "mine.ptz"


def test_a_missing_or_read_only_output_folder_is_an_error_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="ARTIFACT_PATH's folder out does not exist: create it"):
        tg.claim_outputs(make_cfg(ARTIFACT_PATH="out/model.ptz"), tg.Runtime())
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(tg.os, "access", lambda path, mode: Path(path) != Path("out"))  # root may write anywhere
    with pytest.raises(PermissionError, match="ARTIFACT_PATH's folder out is not writable"):
        tg.claim_outputs(make_cfg(ARTIFACT_PATH="out/model.ptz"), tg.Runtime())
