"""The record stack's export parts against brute-force references (LQER's factors, the SD-clipped int7 table), and
the record-stack defaults end to end at a tiny shape (no loop, lane, value-embedding or TTT setting named)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import perturbed_model, run_inline, tiny_cfg, tiny_env
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")


def f16(x) -> float:
    return float(np.float16(np.float32(x)))


def ref_codes(values: list[float], scale: float, lo: int, hi: int) -> list[int]:
    """Round half to even (torch.round's rule) of value / scale in float32, clamped."""
    return [int(min(max(np.round(np.float32(v) / np.float32(scale)), lo), hi)) for v in values]


def ref_lqer(err: torch.Tensor, rank: int, group: int) -> tuple[list, list, np.ndarray]:
    """LQER by the spec, element by element: A = U S and B = V^T of the error's top-`rank` SVD (torch's, so both
    sides share its sign convention); A -> int2 with one scale max|A| / 1.5, B -> int4 in flattened groups of `group`
    with scales max|group| / 7.5; or both int4 per row (max|row| / 7). Returns the A and B codes as rows of ints and
    A B from the codes, summed in float64."""
    u, s, vh = torch.linalg.svd(err.float(), full_matrices=False)
    r = min(rank, s.numel())
    a, b = (u[:, :r] * s[:r]).tolist(), vh[:r].tolist()
    rows, cols = len(a), len(b[0])
    if r * cols % group == 0:
        sa = f16(np.float32(max(abs(x) for row in a for x in row)) / np.float32(1.5))
        qa = [ref_codes(row, sa, -2, 1) for row in a]
        deq_a = [[q * sa for q in row] for row in qa]
        flat = [x for row in b for x in row]
        qb_flat, deq_b_flat = [], []
        for g0 in range(0, len(flat), group):
            chunk = flat[g0: g0 + group]
            sb = f16(np.float32(max(abs(x) for x in chunk)) / np.float32(7.5))
            codes = ref_codes(chunk, sb, -8, 7)
            qb_flat += codes
            deq_b_flat += [q * sb for q in codes]
        qb = [qb_flat[k * cols: (k + 1) * cols] for k in range(r)]
        deq_b = [deq_b_flat[k * cols: (k + 1) * cols] for k in range(r)]
    else:
        def per_row(m):
            scales = [f16(np.float32(max(abs(x) for x in row)) / np.float32(7)) for row in m]
            q = [ref_codes(row, sc, -7, 7) for row, sc in zip(m, scales)]
            return q, [[c * sc for c in row] for row, sc in zip(q, scales)]
        (qa, deq_a), (qb, deq_b) = per_row(a), per_row(b)
    delta = np.zeros((rows, cols))
    for i in range(rows):
        for j in range(cols):
            delta[i, j] = sum(deq_a[i][k] * deq_b[k][j] for k in range(r))
    return qa, qb, delta


@pytest.mark.parametrize("rows, cols, rank, group", [(48, 32, 4, 64), (40, 24, 3, 8), (24, 20, 4, 64), (6, 5, 8, 64)])
def test_lqer_factors_match_the_element_by_element_reference(rows, cols, rank, group):
    """(48, 32): asymmetric, 2 groups of B; (40, 24, r 3, g 8): 9 groups; (24, 20): 80 entries of B, not a multiple
    of 64, so int4 per row; (6, 5) rank 8 > 5 singular values: rank 5, per row."""
    torch.manual_seed(rows * cols)
    err = torch.randn(rows, cols) * 0.01
    f = tg.lqer_factors(err, rank, group)
    qa, qb, delta = ref_lqer(err, rank, group)
    assert f["lqA"].dtype == f["lqB"].dtype == torch.int8 and f["lqAs"].dtype == f["lqBs"].dtype == torch.float16
    assert f["lqA"].tolist() == qa and f["lqB"].tolist() == qb
    r = min(rank, rows, cols)
    asym = r * cols % group == 0
    assert f["lqAs"].numel() == (1 if asym else rows) and f["lqBs"].numel() == (r * cols // group if asym else r)
    # A B in fp32 against float64: entries up to 0.03 from r <= 8 products, a few fp32 ulps apart; measured <= 0.08x
    assert np.allclose(tg.lqer_delta(f).double().numpy(), delta, rtol=1e-5, atol=1e-9)


def test_lqer_removes_most_of_a_low_rank_error():
    """A rank-3 error plus a little noise: the rank-4 correction removes a good part of it (0.71 left here: A's one
    int2 scale keeps mostly the top direction), the same factors unquantized almost all."""
    torch.manual_seed(0)
    err = torch.randn(64, 3) @ torch.randn(3, 128) * 0.01 + 0.0005 * torch.randn(64, 128)
    left = (err - tg.lqer_delta(tg.lqer_factors(err, 4, 64))).norm() / err.norm()
    u, s, vh = torch.linalg.svd(err)
    exact = (err - (u[:, :4] * s[:4]) @ vh[:4]).norm() / err.norm()
    assert exact < 0.1 < left < 0.8


LQ = dict(vocab_size=4096, lqer_enabled=True, lqer_rank=2, lqer_top_k=3, lqer_asym_group=16, embed_bits=7, embed_clip_sigmas=14.0,
          matrix_clip_sigmas=12.85, mlp_clip_sigmas=11.5, attn_clip_sigmas=13.0, int6_scale_floor=2.0 ** -14)


def test_lqer_corrects_the_matrices_of_largest_error_and_the_artifact_carries_it():
    cfg = tiny_cfg(**LQ)
    model = perturbed_model(cfg, seed=3, bank_std=0.05, table_std=0.05)
    packed = tg.quantize_state(model.state_dict(), cfg)
    flat = tg.unbank({k: v.detach().float() for k, v in model.state_dict().items()}, cfg.num_layers)
    norms = {}
    for key, codes in packed.items():
        name, kind = key.rsplit(".", 1)
        if kind in ("q6", "q8"):  # brute force: every coded matrix's error norm
            norms[name] = (flat[name] - codes.float() * packed[name + ".scale"].float()[:, None]).norm().item()
    chosen = sorted(k.removesuffix(".lqA") for k in packed if k.endswith(".lqA"))
    assert chosen == sorted(sorted(norms, key=lambda n: -norms[n])[:3]) and len(norms) > 3
    state = tg.dequantize_state(packed, model.state_dict(), cfg.num_layers)
    back = tg.unbank(state, cfg.num_layers)
    for name in norms:
        plain = packed[name + "." + ("q6" if name + ".q6" in packed else "q8")].float() * packed[
            name + ".scale"].float()[:, None]
        fix = tg.lqer_delta({k: packed[f"{name}.{k}"] for k in ("lqA", "lqAs", "lqB", "lqBs")}) if name in chosen \
            else 0.0
        assert torch.allclose(back[name].float(), (plain + fix).to(back[name].dtype).float(), atol=0, rtol=0), name
        if name in chosen:
            assert (flat[name] - back[name].float()).norm() < (flat[name] - plain).norm()
    blob, _, _ = tg.serialize(model, cfg, {"tokenizer_sha256": ""})
    _, tensors = tg.deserialize(blob)
    assert set(tensors) == set(packed) and all(torch.equal(tensors[k], packed[k]) for k in packed)
    off = tg.quantize_state(model.state_dict(), dataclasses.replace(cfg, lqer_enabled=False))
    assert set(off) == {k for k in packed if not k.rsplit(".", 1)[1].startswith("lq")}


def test_embed_sd_clip_is_the_records_row_rule():
    """EMBED_CLIP_SIGMAS=k, EMBED_BITS=b: row scale fp16(k std(row) / (2^(b-1) - 1)), codes round(w / scale) clamped
    to that range; k = 0 keeps the quantile clip."""
    cfg = tiny_cfg(**(LQ | dict(lqer_top_k=1)))
    model = perturbed_model(cfg, seed=5, table_std=0.05)
    packed = tg.quantize_state(model.state_dict(), dataclasses.replace(cfg, lqer_enabled=False))
    w = model.state_dict()["tok_emb.weight"].double().numpy()
    codes, scales = packed["tok_emb.weight.q8"].numpy(), packed["tok_emb.weight.scale"].float().numpy()
    qmax = 63
    for i, row in enumerate(w):
        std = np.sqrt(((row - row.mean()) ** 2).sum() / (len(row) - 1))
        want = np.float16(14.0 * std / qmax)
        assert abs(float(want) - scales[i]) <= float(np.spacing(want)), i  # the float32 std may round the other way
        assert codes[i].tolist() == [int(min(max(np.round(np.float32(x) / np.float32(scales[i])), -qmax), qmax))
                                     for x in row], i
    assert 0 < np.abs(codes).max() < qmax // 2  # 14 sigmas: Gaussian rows reach about 4.5 of them
    search = tg.quantize_state(model.state_dict(), dataclasses.replace(cfg, lqer_enabled=False, embed_clip_sigmas=0))
    assert not torch.equal(search["tok_emb.weight.scale"], packed["tok_emb.weight.scale"])


def test_the_defaults_run_at_a_tiny_shape(dataset, tokenizer_path, tmp_path, monkeypatch):
    """The record stack (recurrence, lanes, XSA, gates, document isolation, GPTQ, LQER, int7 table, lora TTT) with
    only the shape, data and length named: no loop, lane or value-embedding setting, no warning."""
    env = dict(DATA_PATH=str(dataset), TOKENIZER_PATH=str(tokenizer_path), VOCAB_SIZE="512", NUM_LAYERS="2",
               MODEL_DIM="160", NUM_HEADS="2", NUM_KV_HEADS="1", TRAIN_SEQ_LEN="64", TRAIN_BATCH_TOKENS="1024",
               ITERATIONS="6", WARMUP_STEPS="2", MAX_WALLCLOCK_SECONDS="0", EVAL_SEQ_LEN="64",
               VAL_BATCH_SIZE="4096", DEVICE="cpu", RUN_ID="d")
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "logs" / "d.txt").read_text()
    assert not re.search(r"^warning", log, re.M), log[:3000]
    assert "layer_loop:enabled step:3 progress:0.500 layers:[0, 1, 1, 1]" in log  # 3..5 clamped to 1..1
    assert "gptq_calibration batches:16" in log and re.search(r"^legal_ttt_exact ", log, re.M)
    header, tensors = tg.read_artifact(tmp_path / "logs" / "d.int6.ptz")
    assert len([k for k in tensors if k.endswith(".lqA")]) == 3
    assert tensors["tok_emb.weight.q8"].abs().max() <= 63 and header["settings"]["doc_isolation"] is True
    assert "smear_gate_w.f16" in tensors and "smear_lambda.f16" in tensors  # the record's SmearGate, exported


# =============================================================================================
# AsymLogit (ASYM_LOGIT_RESCALE): two softcaps that learn
# =============================================================================================

def test_asym_logit_is_the_symmetric_cap_at_init_and_its_two_caps_get_the_analytic_gradient():
    """At s+ = s- = LOGIT_SOFTCAP the loss is the symmetric cap's; dL/ds+- equals the hand-derived sum, in float64,
    of dL/dz_hat (softmax - onehot, / N) x d(s tanh(z / s))/ds = tanh(z / s) - (z / s) sech^2(z / s) over the logits
    on each side of 0 (the records' scalars got none: FRONTIER_AFTER_0427 section 1)."""
    cfg = tiny_cfg(asym_logit_rescale=True, logit_softcap=2.0)  # a small cap: both sides' caps matter
    model = perturbed_model(cfg, 0, bank_std=0.3, table_std=1.0)
    with torch.no_grad():
        model.softcap_pm.fill_(2.0)  # perturbed_model moved it too: back to its init
    sym = tg.GPT(dataclasses.replace(cfg, asym_logit_rescale=False))
    sym.load_state_dict({k: v for k, v in model.state_dict().items() if k != "softcap_pm"})
    ids, targets = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(ids, targets)
    assert torch.equal(loss, sym(ids, targets))
    loss.backward()
    z = model.raw_logits(ids).detach().double().flatten(0, 1)
    s = 2.0
    zh = s * torch.tanh(z / s)
    g = (torch.softmax(zh, -1) - F.one_hot(targets.flatten(), cfg.vocab_size).double()) / z.size(0)
    dzh_ds = torch.tanh(z / s) - (z / s) / torch.cosh(z / s) ** 2
    want = torch.stack([(g * dzh_ds)[z >= 0].sum(), (g * dzh_ds)[z < 0].sum()])
    assert model.softcap_pm.grad.abs().min() > 1e-4
    torch.testing.assert_close(model.softcap_pm.grad.double(), want, rtol=1e-4, atol=1e-7)
    with torch.no_grad():  # apart, each side of 0 takes its own: the scorers' logits
        model.softcap_pm.copy_(torch.tensor([2.5, 1.5]))
        hand = torch.where(z >= 0, 2.5 * torch.tanh(z / 2.5), 1.5 * torch.tanh(z / 1.5))
        torch.testing.assert_close(model.logits(ids).double().flatten(0, 1), hand, rtol=1e-5, atol=1e-6)


def test_asym_logit_caps_train_and_are_stored(monkeypatch, tmp_path, dataset, tokenizer_path):
    """A tiny run: the two caps leave LOGIT_SOFTCAP in training, apart, and the artifact stores them (fp16)."""
    from conftest import run_main
    run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "asym", ASYM_LOGIT_RESCALE=1, LOGIT_SOFTCAP=5,
             SCALAR_LR=0.05, ITERATIONS=8)
    stored, tensors = tg.read_artifact(tmp_path / "logs" / "asym.int6.ptz")
    caps = [v for k, v in tensors.items() if k.startswith("softcap_pm")]
    assert len(caps) == 1 and caps[0].dtype == torch.float16 and caps[0].shape == (2,), tensors.keys()
    assert (caps[0] != 5.0).all() and caps[0][0] != caps[0][1], caps
    logged = re.search(r"^asym_logit_caps pos:(\S+) neg:(\S+)$", (tmp_path / "logs" / "asym.txt").read_text(), re.M)
    logged = torch.tensor([float(logged[1]), float(logged[2])]).half()  # the exported model's, as stored
    torch.testing.assert_close(logged, caps[0], rtol=0, atol=4e-3)  # an fp16 step at 4-8
