"""Model: the banked GPT against a plain per-layer model written here from REFERENCE.md, causality, the init,
the int6 grid of late QAT, and the FlashAttention-3 adapter."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import MODEL_CONFIGS, ROOT, feature_model, make_cfg, rms, rope_reference

import train_gpt as tg

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")
# The model against the plain per-layer model, both in float64 (in fp32 they differed by up to 1e-5 depending on the
# CPU's kernels): what remains is the model's fp32 RoPE tables, their angles t * freq rounded by up to 2e-6 rad at
# t = 31 the same way on every IEEE machine; measured <= 6e-7 on logits up to 12.
ROPE_TOL = 2e-6


# =============================================================================================
# 5. Model: banked forward vs a plain per-layer model
# =============================================================================================

def causal_attention_reference(q_BTHD, k_BTKD, v_BTKD) -> torch.Tensor:
    """GQA by repeating each KV head for its H/K query heads, explicit masked softmax."""
    T, H, hd = q_BTHD.shape[1], q_BTHD.shape[2], q_BTHD.shape[3]
    rep = H // k_BTKD.shape[2]
    k, v = k_BTKD.repeat_interleave(rep, dim=2), v_BTKD.repeat_interleave(rep, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q_BTHD, k) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), v)


def xsa_reference(y_BTHD, v_BTKD) -> torch.Tensor:
    """Per head: remove the component along its own position's (normalised) value vector."""
    H, K = y_BTHD.shape[2], v_BTKD.shape[2]
    out = []
    for h in range(H):
        vh = v_BTKD[:, :, h // (H // K)]
        n = vh / vh.norm(dim=-1, keepdim=True)
        out.append(y_BTHD[:, :, h] - (y_BTHD[:, :, h] * n).sum(-1, keepdim=True) * n)
    return torch.stack(out, dim=2)


def unrolled_order(cfg, looping: bool) -> list[int]:
    """The layer of each position, spelled out: 0..L-1, or with the segment repeated NUM_LOOPS more times."""
    L = cfg.num_layers
    if not (looping and cfg.num_loops):
        return list(range(L))
    order = []
    for i in range(L):
        order.append(i)
        if i == cfg.loop_end:  # the segment again, NUM_LOOPS times
            for _ in range(cfg.num_loops):
                order.extend(range(cfg.loop_start, cfg.loop_end + 1))
    return order


class PlainGPT(nn.Module):
    """The seed model written per layer with nn.Linear modules, from REFERENCE.md's description; weights are
    copied from a banked tg.GPT (bank slices -> Linear weights), optionally transformed (e.g. int6 quantised).
    Depth recurrence is the explicitly unrolled layer list (shared modules); parallel residuals a two-lane loop
    written out from the 2026-03-31 record's description."""

    def __init__(self, model: tg.GPT, transform=lambda w, name: w, looping: bool = True):
        super().__init__()
        cfg = self.cfg = model.cfg
        L = cfg.num_layers

        def linear(w, name):
            m = nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.dtype)
            with torch.no_grad():
                m.weight.copy_(transform(w.detach().clone(), name))
            return m
        self.layers = nn.ModuleList()
        for i in range(L):
            layer = nn.Module()
            layer.q, layer.o = linear(model.qo_bank[i], "attn.q"), linear(model.qo_bank[L + i], "attn.o")
            layer.k, layer.v = linear(model.kv_bank[i], "attn.k"), linear(model.kv_bank[L + i], "attn.v")
            layer.up, layer.down = linear(model.mlp_up_bank[i], "mlp.up"), linear(model.mlp_down_bank[i], "mlp.down")
            self.layers.append(layer)
        self.p = {n: t.detach().clone() for n, t in model.named_parameters() if not n.endswith("_bank")}
        self.order = unrolled_order(cfg, looping)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, self.p
        B, T = ids.shape
        L, D, H, K, hd = c.num_layers, c.model_dim, c.num_heads, c.num_kv_heads, c.head_dim
        x = p["tok_emb.weight"][ids]
        if c.bigram_vocab_size > 0:
            m = c.bigram_vocab_size - 1
            h = torch.tensor([[m] + [((36313 * r[t]) ^ (27191 * r[t - 1])) % m for t in range(1, T)]
                              for r in ids.tolist()])
            x = x + p["bigram.scale"] * (p["bigram.embed.weight"][h] @ p["bigram.proj.weight"].T)
        if c.smear_gate_enabled:  # the record's: e_t += lam sig(w . e_t[:W]) e_(t-1), position by position
            rows = []
            for t in range(T):
                g = p["smear_lambda"] * torch.sigmoid(x[:, t, :c.gate_window] @ p["smear_gate_w"][0])
                if c.smear_bos_fix:
                    g = torch.where(ids[:, t] == 1, 0.0, g)
                rows.append(x[:, t] + g[:, None] * x[:, t - 1] if t else x[:, 0])
            x = torch.stack(rows, 1)
        x = rms(x)
        if c.smear_enabled:
            g = torch.sigmoid(p["smear_gate"])
            smeared = (1 - g) * x + g * torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
            x = torch.where((ids == 1)[..., None], x, smeared) if c.smear_bos_fix else smeared  # BOS: unsmeared
        x0, skips, n_enc = x, [], len(self.order) // 2
        ve_layers = c.ve_layer_list
        ve = p["ve.scale"] * (p["ve.embed.weight"][ids] @ p["ve.proj.weight"].T) if ve_layers else None
        slope = c.mlp_negative_slope

        def attention_out(i, x):  # layer i's scaled attention output for residual input x
            layer, s = self.layers[i], 1 / math.sqrt(i + 1) if c.ln_scale else 1.0
            a = rms(x) * s
            q, k, v = layer.q(a).view(B, T, H, hd), layer.k(a).view(B, T, K, hd), layer.v(a)
            if i in ve_layers:
                v = v + p["ve_layer_scales"][ve_layers.index(i)] * ve
            v = v.view(B, T, K, hd)
            q = rope_reference(rms(q), c.rope_dims, c.rope_base) * p[f"blocks.{i}.q_gain"][:, None]
            k = rope_reference(rms(k), c.rope_dims, c.rope_base)
            y = causal_attention_reference(q, k, v)
            if i >= L - c.xsa_last_n:
                y = xsa_reference(y, v)
            if c.sparse_attn_gate_enabled:  # head h scaled by its gate
                w = p[f"blocks.{i}.attn_gate_w"]
                gates = []
                for h in range(H):
                    z = (a[..., :c.gate_window] * w[h]).sum(-1)
                    gates.append(1 / (1 + torch.exp(-c.sparse_attn_gate_scale * z)))
                y = y * torch.stack(gates, dim=2)[..., None]
            return p[f"blocks.{i}.attn_scale"] * layer.o(y.reshape(B, T, D))

        def mlp_out(i, x):
            layer, s = self.layers[i], 1 / math.sqrt(i + 1) if c.ln_scale else 1.0
            u = layer.up(rms(x) * s)
            u = torch.where(u > 0, u, slope * u) if slope > 0 else torch.clamp(u, min=0)
            return p[f"blocks.{i}.mlp_scale"] * layer.down(u * u)

        P = c.parallel_start_layer if 0 < c.parallel_start_layer < L else L
        two_lanes = False
        for pos, i in enumerate(self.order):
            mix = p[f"blocks.{i}.resid_mix"]
            if pos >= n_enc and i >= P and not two_lanes:  # the decoder's first parallel layer: x in both lanes
                attn_lane, mlp_lane, two_lanes = x, x, True
            if pos >= n_enc and skips:
                skip, j = p["skip_weights"][pos - n_enc] * skips.pop(), pos - n_enc
                into = attn_lane if two_lanes else x
                if c.skip_gates_enabled:
                    sg = torch.sigmoid(p["skip_gates"][j])
                    into = sg * into + (1 - sg) * skip
                else:
                    into = into + skip
                if two_lanes:
                    attn_lane = into
                else:
                    x = into
            if two_lanes:
                a = attention_out(i, mix[0] * attn_lane + mix[1] * x0)
                m = mlp_out(i, mlp_lane)
                resid, post = p["parallel_resid"][i - P], p["parallel_post"][i - P]
                attn_lane, mlp_lane = (resid[0] * attn_lane + post[0, 0] * a + post[1, 0] * m,
                                       resid[1] * mlp_lane + post[0, 1] * a + post[1, 1] * m)
            else:
                x = mix[0] * x + mix[1] * x0
                x = x + attention_out(i, x)
                x = x + mlp_out(i, x)
            if pos < n_enc:
                skips.append(x)
        if two_lanes:
            x = {"mean": (attn_lane + mlp_lane) / 2, "attn": attn_lane, "mlp": mlp_lane}[c.parallel_final_lane]
        logits = rms(x) @ (p["tok_emb.weight"] if c.tie_embeddings else p["lm_head.weight"]).T
        return c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap > 0 else logits


@pytest.mark.parametrize("name, extra", [(n, {}) for n in MODEL_CONFIGS] + [("gates", dict(SMEAR_BOS_FIX=0))],
                         ids=list(MODEL_CONFIGS) + ["gates_no_bos_fix"])
def test_banked_model_equals_plain_per_layer_model(name, extra):
    model = perturbed_feature_model(name, **extra) if extra else feature_model(name).double()
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, V, (2, 32), generator=g), torch.randint(0, V, (2, 32), generator=g)
    ids[:, 5::9] = tg.BOS_ID  # documents start mid-sequence (the BOS smear fix)
    ref = PlainGPT(model)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids)
        loss = model(ids, targets)
    assert want.abs().max() > 1.0  # logits far from trivial
    torch.testing.assert_close(got, want, rtol=ROPE_TOL, atol=ROPE_TOL)
    # the model's loss is an fp32 cross entropy of its logits (~1e-7 relative; measured <= 8e-7 on losses of ~4)
    torch.testing.assert_close(loss.double(), F.cross_entropy(want.flatten(0, 1), targets.flatten()), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("fix", [True, False])
@pytest.mark.parametrize("kind", ["seed", "record"])
def test_smear_gate_passes_nothing_across_a_bos(fix, kind):
    """SMEAR_BOS_FIX, both SmearGates: the embedding at a document's first token does not depend on the tokens before
    it (without the bigram table, which hashes the previous token by design); without the fix it does."""
    which = dict(SMEAR_ENABLED=int(kind == "seed"), SMEAR_GATE_ENABLED=int(kind == "record"))
    cfg = make_cfg(**(MODEL_CONFIGS["gates"] | dict(BIGRAM_VOCAB_SIZE=0, SMEAR_BOS_FIX=int(fix)) | which))
    torch.manual_seed(0)
    model = tg.GPT(cfg)
    with torch.no_grad():
        if kind == "seed":
            model.smear_gate.normal_()
        else:  # zero-initialised: the identity
            model.smear_gate_w.normal_(), model.smear_lambda.fill_(1.0)
        ids = torch.randint(2, cfg.vocab_size, (2, 16))
        ids[:, 8] = tg.BOS_ID
        other = ids.clone()
        other[:, :8] = (ids[:, :8] + 1) % (cfg.vocab_size - 2) + 2  # another document before, no BOS in it
        a, b = model.embed(ids), model.embed(other)
    assert torch.equal(a[:, 8], b[:, 8]) == fix
    assert torch.equal(a[:, 9:], b[:, 9:])  # after the BOS, the smear reaches back only to the BOS itself
    assert (a[:, 1:8] - b[:, 1:8]).abs().max() > 1e-3  # the test can see a change


def perturbed_feature_model(name: str, **extra) -> tg.GPT:
    """feature_model's config with `extra` settings, the same non-zero weights, float64."""
    ref = feature_model(name)
    model = tg.GPT(make_cfg(**(MODEL_CONFIGS[name] | extra)))
    model.load_state_dict(ref.state_dict())
    return model.double().eval()


@pytest.mark.parametrize("name", ["full", "loop", "gates", "mha"])
def test_doc_isolation_equals_each_document_run_alone(name):
    """DOC_ISOLATION=1 (issue 23): the logits of documents packed into one row equal those of each document run
    alone, the leading piece (its BOS before the row) included; without isolation they do not. Independent of the
    mask: the reference never sees two documents in one row."""
    extra = dict(SMEAR_BOS_FIX=1) if name in ("full", "mha") else {}
    model = perturbed_feature_model(name, DOC_ISOLATION=1, **extra)
    plain = perturbed_feature_model(name, **extra)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, model.cfg.vocab_size, (2, 32), generator=g)
    starts = [[5, 6, 19, 30], [1, 12]]  # BOS positions per row: a one-token document, one at the row's end
    for row, ss in zip(ids, starts):
        row[ss] = tg.BOS_ID
    with torch.no_grad():
        got, mixed = model.logits(ids), plain.logits(ids)
        for b, ss in enumerate(starts):
            for lo, hi in zip([0] + ss, ss + [32]):
                if hi > lo:
                    alone = model.logits(ids[b:b + 1, lo:hi])[0]
                    # 1e-7 apart: RoPE's float32 tables rotate the same relative offsets from other positions
                    torch.testing.assert_close(got[b, lo:hi], alone, rtol=1e-5, atol=1e-6)
        assert (got - mixed).abs().max() > 1e-3  # isolation changes what crosses a BOS


def test_doc_isolation_refuses_the_smear_without_its_bos_fix_and_gpu_backends(monkeypatch):
    with pytest.raises(ValueError, match="SMEAR_BOS_FIX=1"):
        make_cfg(DOC_ISOLATION=1, SMEAR_BOS_FIX=0)
    make_cfg(DOC_ISOLATION=1, SMEAR_BOS_FIX=0, SMEAR_ENABLED=0)  # no smear, nothing to fix
    tiny = dict(NUM_LAYERS=2, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1, VOCAB_SIZE=64, VE_LAYERS="1", DOC_ISOLATION=1)
    assert tg.init_runtime(make_cfg(**tiny, DEVICE="cpu"), {}).attn_backend == "math"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check comes before any CUDA call
    with pytest.raises(ValueError, match="DOC_ISOLATION=1 trains on ATTN_BACKEND=math, varlen, fa3, cudnn_fe .* cudnn"):
        tg.init_runtime(make_cfg(**tiny, DEVICE="cuda", KERNELS="torch", ATTN_BACKEND="cudnn"), {})
    with pytest.raises(ValueError, match="ATTN_BACKEND=varlen is DOC_ISOLATION=1's backend"):
        tg.init_runtime(make_cfg(**(tiny | dict(DOC_ISOLATION=0)), DEVICE="cuda", KERNELS="torch", ATTN_BACKEND="varlen"), {})
    if importlib.util.find_spec("cudnn") is None:  # the frontend not installed: said at the start
        with pytest.raises(ValueError, match="ATTN_BACKEND=cudnn_fe needs nvidia-cudnn-frontend"):
            tg.init_runtime(make_cfg(**tiny, DEVICE="cuda", KERNELS="torch", ATTN_BACKEND="cudnn_fe"), {})
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)  # and keep this process's SDPA backends
    monkeypatch.setattr(tg, "memory_budget", lambda d: 0.0)  # no device to ask
    for kind in ("flash", "cudnn", "mem_efficient", "math"):
        monkeypatch.setattr(torch.backends.cuda, f"enable_{kind}_sdp", lambda on: None)
    # the TF32 flags by hand: pytest 9.2's monkeypatch deletes, on undo, what cuBLASModule's __getattr__ serves
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for ttt in (dict(TTT_ENABLED=0), dict(TTT_ENABLED=1, TTT_MODE="lora")):
            rt = tg.init_runtime(make_cfg(**tiny, DEVICE="cuda", KERNELS="torch", EVAL_ONLY="a.ptz", **ttt), {})
            assert rt.attn_backend == "cudnn"  # scoring rows hold one document: no mask
        assert tg.init_runtime(make_cfg(**tiny, DEVICE="cuda", KERNELS="torch"), {}).attn_backend == "varlen"
        real_find = importlib.util.find_spec  # FA3 importable: it trains (its varlen call) and scores
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: n == "flash_attn_interface" or real_find(n, *a))
        for extra in ({}, dict(EVAL_ONLY="a.ptz")):
            assert tg.init_runtime(make_cfg(**tiny, DEVICE="cuda", KERNELS="torch", **extra), {}).attn_backend == "fa3"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("name", ["full", "gates"])
def test_one_doc_rows_score_as_the_document_mask_does(name):
    """GPT.hidden's one_doc (the scorer's rows under DOC_ISOLATION): a row that is one document up to its last
    counted target needs no mask; the logits equal the masked ones there, and only after the next BOS differ."""
    model = perturbed_feature_model(name, DOC_ISOLATION=1)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, model.cfg.vocab_size, (3, 24), generator=g)
    cut = [24, 15, 9]  # row b is one document up to cut[b]; a BOS starts the next
    for b, c in enumerate(cut):
        ids[b, c:c + 1] = tg.BOS_ID
    ids[1, 0] = tg.BOS_ID  # a row may start at its document's BOS
    with torch.no_grad():
        masked, one_doc = model.logits(ids), model.logits(ids, one_doc=True)
    for b, c in enumerate(cut):
        torch.testing.assert_close(one_doc[b, :c], masked[b, :c], rtol=1e-5, atol=1e-6)
    assert (one_doc[1:, 16:] - masked[1:, 16:]).abs().max() > 1e-3  # past a BOS they part: the mask is off


def test_loop_config_before_its_repeats_start_equals_plain_model():
    """Training runs the looped model without its repeats until ENABLE_LOOPING_AT: the same weights, order 0..L-1
    (U-Net over 5 positions), two lanes from layer 3 still."""
    model = feature_model("loop").double()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=g)
    ref = PlainGPT(model, looping=False)
    assert ref.order == [0, 1, 2, 3, 4]
    with torch.no_grad():
        got, want, looped = model.logits(ids, mode=tg.Mode(looping=False)), ref(ids), PlainGPT(model)(ids)
    torch.testing.assert_close(got, want, rtol=ROPE_TOL, atol=ROPE_TOL)
    assert (looped - want).abs().max() > 1e-2  # the repeats change the function


def test_record_loop_order_and_parameter_shapes():
    """The 2026-04-27 record's settings (FRONTIER.md 2.4): encoder 0 1 2 3 4 5 3 4, decoder 5 3 4 5 6 7 8 9 10, 8 skip
    weights; lanes in layers 8-10. Features off: the parameters of the model before them."""
    cfg = make_cfg(NUM_LOOPS=2, LOOP_START=3, LOOP_END=5, PARALLEL_START_LAYER=8)
    order = tg.layer_order(cfg, True)
    assert order == unrolled_order(cfg, True) and len(order) == 17
    assert (order[:8], order[8:]) == ([0, 1, 2, 3, 4, 5, 3, 4], [5, 3, 4, 5, 6, 7, 8, 9, 10])
    assert tg.layer_order(cfg, False) == list(range(11))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in tg.GPT(cfg).named_parameters()}
        off = {n: tuple(p.shape) for n, p in tg.GPT(make_cfg(PARALLEL_START_LAYER=0)).named_parameters()}
    assert (shapes["skip_weights"], shapes["parallel_resid"], shapes["parallel_post"]) == ((8, 512), (3, 2), (3, 2, 2))
    assert off["skip_weights"] == (5, 512) and set(shapes) - set(off) == {"parallel_resid", "parallel_post"}


def test_bigram_hash_is_exact_for_every_uint16_id_and_unchanged_below_the_old_overflow():
    """Python's integers are the reference; below id 59,139 (36313 * id < 2^31) the int32 hash the model used
    before agrees, so artifacts trained at vocabularies up to 59,138 keep their meaning."""
    g = torch.Generator().manual_seed(3)
    ids = torch.cat((torch.randint(0, 65536, (3, 40), generator=g), torch.tensor([[65535, 65534, 59139, 0] * 10])))
    for buckets in (64, 4097, 10240):
        want = [[buckets - 1] + [((36313 * c) ^ (27191 * p)) % (buckets - 1) for p, c in zip(row, row[1:])]
                for row in ids.tolist()]
        h = tg.bigram_hash(ids, buckets)
        assert h.dtype == torch.int64 and h.tolist() == want
        low = ids % 59139
        t = low.to(torch.int32)
        old = torch.bitwise_xor(36313 * t[:, 1:], 27191 * t[:, :-1]) % (buckets - 1)
        assert torch.equal(tg.bigram_hash(low, buckets)[:, 1:], old.long())
    t = ids.to(torch.int32)  # the int32 form wraps for the large ids: the reason for int64
    assert (36313 * t).min() < 0


def test_rope_tables_cover_the_longest_sequence_and_refuse_longer():
    cfg = make_cfg(TRAIN_SEQ_LEN=16, EVAL_SEQ_LEN=24, EVAL_STRIDE=8)
    model = tg.GPT(cfg)
    assert model.rope_cos.shape == model.rope_sin.shape == (24, cfg.rope_dims // 2)
    assert "rope_cos" not in model.state_dict()  # rebuilt from the config, never exported
    with torch.no_grad():
        assert model.logits(torch.zeros(1, 24, dtype=torch.long)).shape == (1, 24, cfg.vocab_size)
        with pytest.raises(ValueError, match="sequence length 25 > max"):
            model.logits(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("name", ["full", "mha"])
def test_model_is_causal(name):
    model = feature_model(name)
    V, T = model.cfg.vocab_size, 32
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, T), generator=g)
    with torch.no_grad():
        base = model.logits(ids)
        for t in (0, 5, 17, 30):
            other = ids.clone()
            other[:, t + 1:] = (ids[:, t + 1:] + torch.randint(1, V, (2, T - t - 1), generator=g)) % V
            changed = model.logits(other)
            assert (changed[:, : t + 1] - base[:, : t + 1]).abs().max() <= 1e-6, f"future tokens leak into {t}"
            assert (changed[:, t + 1] - base[:, t + 1]).abs().max() > 1e-3  # the test can see a change
    # gradient form: d logits[:, t] / d (token embeddings at s) == 0 for every s > t
    captured = {}

    def keep(_, __, out):
        out.retain_grad()
        captured["emb"] = out
    handle = model.tok_emb.register_forward_hook(keep)
    try:
        for t in (3, 20):
            model.zero_grad()
            model.logits(ids)[:, t].square().sum().backward()
            grad = captured["emb"].grad
            assert grad[:, t + 1:].abs().max() == 0.0
            assert grad[:, : t + 1].abs().max() > 0.0
    finally:
        handle.remove()


def test_init_facts_of_the_issue_21_parameters():
    """Lanes: decay 1.1 and unit writes (the 2026-03-31 record); skip gates 0 (sig = 0.5); the sparse gate's W 0, or
    N(0, SPARSE_ATTN_GATE_INIT_STD); the record's SmearGate (w, lam) 0: the identity."""
    cfg = make_cfg(**MODEL_CONFIGS["gates"])
    m = tg.GPT(cfg)
    assert torch.equal(m.parallel_resid, torch.full((3, 2), 1.1)) and torch.equal(m.parallel_post, torch.ones(3, 2, 2))
    assert torch.equal(m.skip_gates, torch.zeros(2, 32)) and torch.equal(m.skip_weights, torch.ones(2, 32))
    assert all(torch.equal(b.attn_gate_w, torch.zeros(2, 8)) for b in m.blocks)
    assert torch.equal(m.smear_gate_w, torch.zeros(1, 8)) and torch.equal(m.smear_lambda, torch.zeros(1))  # identity
    sparse = make_cfg(**(MODEL_CONFIGS["gates"] | dict(SPARSE_ATTN_GATE_INIT_STD=0.5)))
    torch.manual_seed(0)
    w = torch.cat([b.attn_gate_w.flatten() for b in tg.GPT(sparse).blocks])
    assert 0.4 < w.std() < 0.6 and abs(w.mean()) < 0.15


def test_init_facts():
    cfg = make_cfg(NUM_LAYERS=2, MODEL_DIM=128, NUM_HEADS=4, NUM_KV_HEADS=2, VOCAB_SIZE=512, BIGRAM_VOCAB_SIZE=64,
                   BIGRAM_DIM=64, VE_DIM=64, VE_LAYERS="1", XSA_LAST_N=1)
    torch.manual_seed(0)
    m = tg.build_model(cfg, tg.Runtime())
    L, D, kv, mlp = 2, 128, 64, 384
    assert m.qo_bank.shape == (2 * L, D, D) and m.kv_bank.shape == (2 * L, kv, D)
    assert m.mlp_up_bank.shape == (L, mlp, D) and m.mlp_down_bank.shape == (L, D, mlp)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # CPU: everything fp32
    assert torch.count_nonzero(m.qo_bank[L:]) == 0 and torch.count_nonzero(m.mlp_down_bank) == 0  # out, down zero

    def orthonormal_rows(w):  # W W^T = I (wide or square); fp32 sums of D <= 128 products: ~1e-7 off, <= 0.05x here
        return torch.allclose(w @ w.T, torch.eye(w.shape[0]), atol=1e-5)

    def orthonormal_cols(w):  # W^T W = I (tall)
        return torch.allclose(w.T @ w, torch.eye(w.shape[1]), atol=1e-5)
    for i in range(L):
        assert orthonormal_rows(m.qo_bank[i]) and orthonormal_cols(m.qo_bank[i])  # Q square
        assert orthonormal_rows(m.kv_bank[i]) and orthonormal_rows(m.kv_bank[L + i])  # K, V (64 x 128)
        assert orthonormal_cols(m.mlp_up_bank[i])  # up (384 x 128)
    assert not torch.allclose(m.qo_bank[0], m.qo_bank[1])  # each slice its own matrix
    assert orthonormal_cols(m.bigram.proj.weight)  # 128 x 64: a linear >= 64x64
    assert orthonormal_rows(m.ve.proj.weight)  # 64 x 64
    w = m.tok_emb.weight  # 65,536 samples: std estimate within ~0.3%
    assert w.std().item() == pytest.approx(0.005, rel=0.03) and abs(w.mean().item()) < 2e-4
    assert m.ve.embed.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert torch.count_nonzero(m.bigram.embed.weight) == 0
    assert m.bigram.scale.item() == pytest.approx(0.05) and m.ve.scale.item() == pytest.approx(0.1)
    assert torch.equal(m.ve_layer_scales, torch.ones(1)) and torch.equal(m.skip_weights, torch.ones(1, D))
    assert torch.count_nonzero(m.smear_gate) == 0
    for b in m.blocks:
        assert torch.equal(b.resid_mix, torch.stack((torch.ones(D), torch.zeros(D))))
        assert torch.equal(b.attn_scale, torch.ones(D)) and torch.equal(b.mlp_scale, torch.ones(D))
        assert torch.equal(b.q_gain, torch.full((4,), 1.5))


def int6_reference(w: torch.Tensor, floor: float = 1 / 31, sigmas: float = 0.0) -> torch.Tensor:
    """Per row (last dim): clip c = max|w|, or with sigmas the records' SD clip sigmas x std(w) (unbiased); scale =
    max(c / 31, floor), codes round(clamp(w, -c, c) / scale) in [-31, 31]."""
    c = sigmas * w.std(-1, keepdim=True) if sigmas > 0 else w.abs().amax(-1, keepdim=True)
    s = torch.clamp(c / 31, min=floor).half().float()  # scales are stored fp16
    return torch.clamp(torch.round(torch.maximum(torch.minimum(w, c), -c) / s), -31, 31) * s


def test_fake_quant_on_the_int6_grid_and_straight_through():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 40, generator=g) * torch.tensor([0.01, 0.1, 0.5, 1.0, 3.0, 30.0])[:, None]
    w.requires_grad_(True)
    q = tg.fake_quant(w, 31, 1 / 31)
    s = torch.clamp(w.detach().abs().amax(-1, keepdim=True) / 31, min=1 / 31).half().float()
    codes = q.detach() / s
    assert (codes - codes.round()).abs().max() < 1e-4 and codes.abs().max() <= 31 + 1e-4  # on the int6 grid
    assert torch.allclose(q.detach(), int6_reference(w.detach()), atol=1e-6)
    assert ((q.detach() - w.detach()).abs() <= s / 2 + 1e-6).all()  # round to nearest, no clipping
    grad_out = torch.randn(6, 40, generator=g)
    (q * grad_out).sum().backward()
    assert torch.equal(w.grad, grad_out)  # straight-through estimator


@pytest.mark.parametrize("floor", [1 / 31, 1e-4])
def test_qat_trains_on_the_grid_the_export_writes(floor):
    """One int6 grid: late QAT's fake quantisation equals the export's quantise-dequantise of the same rows, when
    the export's clip search keeps the max (its 1.0 candidate) and with the SD clips the defaults export with (the
    codes rounded: GPTQ moves codes, not the grid)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 7, 50, generator=g) * torch.tensor([0.003, 0.05, 2.0])[:, None, None]
    qmax = tg.FORMATS["q6"].qmax(tg.Hyperparameters())
    codes, scales = tg.quantize_rows(w.reshape(-1, 50), 31, (1.0,), floor)
    exported = (codes.float() * scales.float()[:, None]).view_as(w)
    assert torch.equal(tg.fake_quant(w, qmax, floor), exported)
    for sigmas in (2.5, 12.85):  # 2.5: some entries clipped
        codes, scales = tg.quantize_matrix(w.reshape(-1, 50), sigmas, floor, None)
        exported = (codes.float() * scales.float()[:, None]).view_as(w)
        assert torch.equal(tg.fake_quant(w, qmax, floor, sigmas), exported)
        assert (codes.abs() == 31).any() == (sigmas == 2.5)


@pytest.mark.parametrize("attn,mlp", [(0.0, 0.0), (13.0, 11.5)])  # the sp1024 stack's clip search; the defaults'
def test_qat_forward_uses_int6_banks(attn, mlp):
    """Late QAT's forward: each bank on its export grid, the SD clip of its kind (or the row's max)."""
    model = feature_model("full").double()
    cfg = model.cfg = dataclasses.replace(model.cfg, attn_clip_sigmas=attn, mlp_clip_sigmas=mlp)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model.logits(ids)
        qat = model.logits(ids, mode=tg.Mode(qat=31))
        want = PlainGPT(model, transform=lambda w, name: int6_reference(
            w, cfg.int6_scale_floor, mlp if name.startswith("mlp.") else attn))(ids)
    assert (qat - plain).abs().max() > 1e-3
    torch.testing.assert_close(qat, want, rtol=ROPE_TOL, atol=ROPE_TOL)


# =============================================================================================
# 6. FlashAttention-3 adapter
# =============================================================================================

@pytest.fixture
def fake_fa3(monkeypatch):
    calls = []

    def make(return_tuple: bool):
        def flash_attn_func(q, k, v, causal=True):
            """Stand-in for FA3: (B,T,H,D) q, (B,T,Hkv,D) k/v, causal GQA with an explicit softmax."""
            calls.append(dict(q=q, k=k, v=v, causal=causal))
            B, T, H, D = q.shape
            rep = H // k.shape[2]
            out = torch.empty_like(q)
            for h in range(H):
                s = q[:, :, h] @ k[:, :, h // rep].transpose(1, 2) / math.sqrt(D)  # (B, T, T)
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                out[:, :, h] = torch.softmax(s, dim=-1) @ v[:, :, h // rep]
            return (out, torch.zeros(B, H, T)) if return_tuple else out
        mod = types.ModuleType("flash_attn_interface")
        mod.flash_attn_func = flash_attn_func
        monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
        return calls
    return make


@pytest.mark.parametrize("return_tuple", [True, False])
def test_fa3_adapter_matches_math_backend(fake_fa3, return_tuple):
    calls = fake_fa3(return_tuple)
    g = torch.Generator().manual_seed(5)  # float64: the three softmaxes agree to float64 rounding
    q = torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = tg.attention(q, k, v, "fa3")
    assert len(calls) == 1
    c = calls[0]
    assert c["q"].shape == (2, 16, 4, 8) and c["k"].shape == (2, 16, 2, 8) and c["v"].shape == (2, 16, 2, 8)
    assert torch.equal(c["q"], q) and torch.equal(c["k"], k) and torch.equal(c["v"], v) and c["causal"] is True
    assert isinstance(got, torch.Tensor) and got.shape == q.shape
    torch.testing.assert_close(got, tg.attention(q, k, v, "math"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, causal_attention_reference(q, k, v), rtol=1e-12, atol=1e-12)


def test_fa3_backend_in_the_model(fake_fa3):
    calls = fake_fa3(True)
    math_model = feature_model("full").double()  # float64: only the attention's summation order differs
    fa3_model = feature_model("full", backend="fa3").double()
    fa3_model.load_state_dict(math_model.state_dict())
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(fa3_model.logits(ids), math_model.logits(ids), rtol=1e-12, atol=1e-12)
    assert len(calls) == math_model.cfg.num_layers
    assert all(c["q"].shape == (2, 32, 4, 8) and c["k"].shape == (2, 32, 2, 8) for c in calls)
    with pytest.raises(ValueError, match="ATTN_BACKEND=fa3 needs CUDA"):  # never silently on a CPU
        tg.init_runtime(make_cfg(ATTN_BACKEND="fa3", DEVICE="cpu"), {})


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size):
    """torch.nn.attention.varlen.varlen_attn's meaning (its kernel runs on CUDA only): causal attention within
    each [cu[i], cu[i+1]) of the flattened tokens, empty sequences allowed."""
    assert torch.equal(cu_q, cu_k) and window_size == (-1, 0) and cu_q.dtype == torch.int32 and k.shape == q.shape
    out = torch.zeros_like(q)
    for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()):
        if b > a:
            t = [x[a:b].transpose(0, 1) for x in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*t, is_causal=True).transpose(0, 1)
    return out


def test_document_segments_list_row_starts_and_bos_padded_to_a_fixed_size(monkeypatch):
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 4)
    ids = torch.full((2, 8), 5)
    ids[0, 0] = ids[0, 5] = ids[1, 3] = tg.BOS_ID
    cu = tg.document_segments(ids)  # 2 rows + 16 / 4 = 6 boundaries at most, then the end
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 8, 11, 16, 16, 16]
    ids[:, 1:] = tg.BOS_ID  # 16 documents: more than 6, the rest merge into the last (TrainLoader refuses this)
    assert tg.document_segments(ids).tolist() == [0, 1, 2, 3, 4, 5, 16]


@pytest.mark.parametrize("name", ["full", "gates"])
def test_varlen_backend_equals_the_document_mask(monkeypatch, name):
    """ATTN_BACKEND=varlen's plumbing (cu_seqlens, flattening, K/V repeated for GQA, the result's layout) with the
    kernel replaced by its meaning: logits and gradients equal the math backend's masked SDPA. The kernel itself
    is compared on the GPU."""
    import torch.nn.attention.varlen as varlen_module
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_reference)
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 4)
    assert_backend_equals_the_document_mask(name, "varlen")


def test_varlen_with_span_cuts_equals_the_document_mask(monkeypatch):
    """TRAIN_SEQ_SCHEDULE's span on ATTN_BACKEND=varlen: cu_seqlens hold every cut beside the documents (without
    their room the last segments merged), so the logits equal the math backend's mask."""
    import torch.nn.attention.varlen as varlen_module
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_reference)
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 4)
    masked, model = (perturbed_feature_model("full", DOC_ISOLATION=1, TRAIN_SEQ_LEN=24,
                                             TRAIN_SEQ_SCHEDULE="3@0.5,24@1.0") for _ in range(2))
    model.attn_backend = "varlen"
    ids = torch.randint(2, masked.cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(6))
    ids[0, [4, 9]] = ids[1, 0] = ids[2, [1, 2, 20]] = tg.BOS_ID
    for m in (masked, model):
        m.span.fill_(3)
    assert tg.segment_starts(ids, model.span).sum() > tg.segment_room(3, 24)  # more than the documents' room
    torch.testing.assert_close(model.logits(ids), masked.logits(ids), rtol=1e-9, atol=1e-9)


def assert_backend_equals_the_document_mask(name: str, backend: str) -> tuple[tg.GPT, torch.Tensor]:
    """A DOC_ISOLATION model on `backend`: its logits and gradients equal the math backend's masked SDPA (float64) on
    rows of several documents. Returns the model and the ids."""
    masked, model = (perturbed_feature_model(name, DOC_ISOLATION=1) for _ in range(2))
    model.attn_backend = backend
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, masked.cfg.vocab_size, (3, 24), generator=g)
    ids[0, [4, 9]] = ids[1, 0] = ids[2, [1, 2, 20]] = tg.BOS_ID
    outs = []
    for m in (masked, model):
        logits = m.logits(ids)
        logits.square().sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-9, atol=1e-9)
    for n, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], grad, rtol=1e-8, atol=1e-10, msg=n)
    return model, ids


@pytest.fixture
def fa3_standin(monkeypatch):
    """tools/standin/flash_attn_interface.py as the flash_attn_interface module: FA3's calls, checked as its kernels
    check them, computed by SDPA per sequence."""
    spec = importlib.util.spec_from_file_location("flash_attn_interface",
                                                  ROOT / "tools" / "standin" / "flash_attn_interface.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
    return mod


@pytest.mark.parametrize("name", ["full", "gates"])
def test_fa3_varlen_equals_the_document_mask(monkeypatch, fa3_standin, name):
    """ATTN_BACKEND=fa3 under DOC_ISOLATION: FA3's varlen call with our padded cu_seqlens (the records' call), K/V not
    repeated, (out, lse) unpacked; logits and gradients equal the math backend's masked SDPA."""
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 4)
    fa3, ids = assert_backend_equals_the_document_mask(name, "fa3")
    cfg, calls = fa3.cfg, fa3_standin.CALLS
    assert len(calls) == len(tg.layer_order(cfg, True))  # one a position; the scorer's one_doc rows take the dense call
    for c in calls:
        assert c["q"].shape == (3 * 24, cfg.num_heads, cfg.head_dim) and c["causal"] is True
        assert c["k"].shape == c["v"].shape == (3 * 24, cfg.num_kv_heads, cfg.head_dim)  # GQA: not repeated
        assert torch.equal(c["cu_q"], tg.document_segments(ids)) and torch.equal(c["cu_k"], c["cu_q"])
        assert c["max_q"] == c["max_k"] == 24


@pytest.mark.parametrize("name", ["full", "gates"])
def test_cudnn_frontend_equals_the_document_mask(monkeypatch, name):
    """ATTN_BACKEND=cudnn_fe: the cuDNN frontend's varlen op with our padded cu_seqlens and unrepeated K/V, its
    differentiable form (return_lse) unpacked; logits and gradients equal the math backend's masked SDPA."""
    spec = importlib.util.spec_from_file_location("cudnn", ROOT / "tools" / "standin" / "cudnn.py")
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    monkeypatch.setitem(sys.modules, "cudnn", standin)
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 4)
    model, ids = assert_backend_equals_the_document_mask(name, "cudnn_fe")
    cfg = model.cfg
    assert len(standin.CALLS) == len(tg.layer_order(cfg, True))
    for c in standin.CALLS:
        assert c["q"].shape == (3 * 24, cfg.num_heads, cfg.head_dim) and c["causal"] and c["return_lse"]
        assert c["k"].shape == c["v"].shape == (3 * 24, cfg.num_kv_heads, cfg.head_dim)
        assert torch.equal(c["cu_q"], tg.document_segments(ids)) and torch.equal(c["cu_k"], c["cu_q"])
        assert c["max_q"] == c["max_k"] == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel needs a GPU")
def test_fa3_varlen_matches_the_varlen_kernel_on_the_gpu(fa3_standin):
    """The same call on the GPU, in bf16 under autocast: its logits' error against the float64 masked math backend
    is within twice torch's varlen kernel's (bf16 noise through the layers; a leak across documents is order 1).
    On the H200 (session 38): max 0.1134 both, mean 0.01331 against 0.01325; FA3's causal=False fails it."""
    cuda = torch.device("cuda")
    ref = perturbed_feature_model("full", DOC_ISOLATION=1).to(cuda)
    varlen, fa3 = (perturbed_feature_model("full", DOC_ISOLATION=1).float().to(cuda) for _ in range(2))
    varlen.attn_backend, fa3.attn_backend = "varlen", "fa3"  # float32 weights: autocast leaves float64 alone
    ids = torch.randint(2, fa3.cfg.vocab_size, (4, 256), generator=torch.Generator().manual_seed(7)).to(cuda)
    ids[:, ::200] = tg.BOS_ID  # 2 documents a row: 8 segments, all document_segments holds (B + B*T/256; TrainLoader)
    with torch.no_grad():
        want = ref.logits(ids)
        with tg.autocast(cuda):
            err = {m.attn_backend: (m.logits(ids).double() - want).abs() for m in (fa3, varlen)}
    assert ref.attn_backend == "math" and err["fa3"].max() <= 2 * err["varlen"].max()
    assert err["fa3"].mean() <= 2 * err["varlen"].mean()


def test_varlen_room_holds_the_schedules_span_cuts_besides_the_documents(tmp_path, monkeypatch):
    """TRAIN_SEQ_SCHEDULE's cuts have room of their own in cu_seqlens and in the loader's count: a batch at the
    documents' limit under the shortest span is taken, its segments all listed (a review: the cuts took the
    documents' room, so spans of 256 refused nearly every FineWeb batch at 2,048)."""
    from conftest import write_shard
    monkeypatch.setattr(tg, "DOC_BOUNDARY_TOKENS", 8)
    tokens = [tg.BOS_ID if i % 8 == 3 else 7 for i in range(80)]  # a document start every 8 tokens
    write_shard(tmp_path / "fineweb_train_000000.bin", tokens)
    cfg = make_cfg(TRAIN_SEQ_LEN=32, TRAIN_BATCH_TOKENS=64, DOC_ISOLATION=1, VOCAB_SIZE=64,
                   TRAIN_SEQ_SCHEDULE="4@0.5,32@1.0")
    loader = tg.TrainLoader([str(tmp_path / "fineweb_train_000000.bin")], cfg, tg.Runtime(attn_backend="varlen"))
    assert (loader.cuts, loader.max_docs) == (7, 2 * (1 + 7) + 2 * 32 // 8)
    ((x, _),) = loader.next_batch()  # 4 documents a row (8 in the batch: the limit), cut every 4 tokens
    cu = tg.document_segments(x, torch.tensor(4), tg.span_cuts(cfg, 32))
    starts = (tg.segment_starts(x, torch.tensor(4)).flatten().nonzero()[:, 0]).tolist()  # the loop's: test_training
    assert len(starts) > tg.segment_room(2, 32)  # more than the room without the cuts'
    assert cu.tolist()[:len(starts)] == starts and set(cu.tolist()[len(starts):]) == {64}  # nothing merged


def test_varlen_loader_refuses_a_batch_with_more_documents_than_cu_seqlens_holds(tmp_path):
    from conftest import write_shard
    tokens = [tg.BOS_ID if i % 3 == 0 else 7 for i in range(600)]  # a document every 3 tokens
    write_shard(tmp_path / "fineweb_train_000000.bin", tokens)
    cfg = make_cfg(TRAIN_SEQ_LEN=512, TRAIN_BATCH_TOKENS=512, DOC_ISOLATION=1, VOCAB_SIZE=64)
    files = [str(tmp_path / "fineweb_train_000000.bin")]
    tg.TrainLoader(files, cfg, tg.Runtime()).next_batch()  # the math backend's mask has no limit
    loader = tg.TrainLoader(files, cfg, tg.Runtime(attn_backend="varlen"))
    before = loader.sampler.state_dict()
    with pytest.raises(tg.ShardError, match="holds 171 documents, more than varlen's cu_seqlens holds \\(3"):
        loader.next_batch()  # a ShardError: mid-run, the timed loop writes a checkpoint before this batch
    assert loader.sampler.state_dict() == before
    # two ranks: only rank 0's micro-batch is too full, and both stop (one alone would leave the other in a collective)
    cfg = make_cfg(TRAIN_SEQ_LEN=512, TRAIN_BATCH_TOKENS=1024, DOC_ISOLATION=1, VOCAB_SIZE=64)
    write_shard(tmp_path / "fineweb_train_000000.bin", tokens[:513] + [7] * 600)
    for rank in (0, 1):
        with pytest.raises(tg.ShardError, match="holds 171 documents"):
            tg.TrainLoader(files, cfg, tg.Runtime(rank=rank, world_size=2, attn_backend="varlen")).next_batch()


def test_asym_logit_caps_act_in_their_own_precision_under_autocast():
    """Eager autocast (bf16 logits): caps of 30.06 and 29.94 are not 30 (bf16 rounded both to 30.0, a review), and
    their gradient is the fp32 computation's."""
    z = (torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 40).bfloat16()
    caps = [torch.tensor([30.06, 29.94], requires_grad=True), torch.tensor([30.0, 30.0])]
    out = [tg.softcap(z, c) for c in caps]
    assert out[0].dtype == torch.bfloat16 and not torch.equal(out[0], out[1])
    out[0].float().sum().backward()
    ref = caps[0].detach().clone().requires_grad_()
    torch.where(z.float() >= 0, ref[0], ref[1]).mul(torch.tanh(z.float() / torch.where(z.float() >= 0, ref[0], ref[1]))).sum().backward()
    torch.testing.assert_close(caps[0].grad, ref.grad)
