"""Tests of the records' evaluation options on lora TTT (issue 40; CPU, offline): phased global SGD, warm-started A,
LoRA on a subset of q/k/v/o/MLP, smaller chunks for short documents, and an evaluation context longer than training.

Legality, in the issue's terms: no target is trained on before it is scored (every span global_sgd receives is
already scored when it is called), a change of token p changes no score made before p's own (the order of scoring is
observed: the events are batch starts and SGD phases), every target is scored once, and 2 ranks give what 1 gives.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_scorer, spawn
from test_ttt_lora import BOS_AT, V, lora_cfg, make_luts, make_stream, model_for
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")
PHASED = dict(phased_ttt_prefix_docs=6, phased_ttt_num_phases=2, global_ttt_lr=0.05, global_ttt_chunk_tokens=64,
              ttt_batch_size=2)
DOCS = list(zip(BOS_AT, BOS_AT[1:] + [269]))  # (first target, end) of the 9 documents of make_stream(270)


def observed_run(cfg, tokens, monkeypatch, rank: int = 0, world_size: int = 1):
    """lora_ttt with each target's NLL, the spans of each global_sgd call, and each target's event: how many batch
    starts and SGD phases came before it was scored. A global_sgd call on a target not yet scored fails here."""
    probe = {k: torch.full((tokens.numel() - 1,), float("nan"), dtype=torch.float64) for k in ("nll", "lse")}
    events, calls = [], []
    real_sgd, real_reset = tg.global_sgd, tg.DocLoRA.reset

    def sgd(cfg_, rt, model, scorer, fn, spans):
        scored = ~probe["nll"].isnan()
        assert all(scored[s:e].all() for s, e in spans), "global_sgd trains on a target not yet scored"
        events.append(scored.clone())
        calls.append(list(spans))
        return real_sgd(cfg_, rt, model, scorer, fn, spans)

    def reset(self):
        events.append(~probe["nll"].isnan())
        return real_reset(self)
    monkeypatch.setattr(tg, "global_sgd", sgd)
    monkeypatch.setattr(tg.DocLoRA, "reset", reset)
    scorer = make_scorer(cfg, tokens, make_luts(), rank=rank, world_size=world_size)
    score = tg.lora_ttt(cfg, scorer.rt, model_for(cfg), scorer, probe=probe)
    event = sum((~e).long() for e in events)  # per target: the events before its score
    return score, probe["nll"], event, calls


def changed_only_after(cfg, p, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token p changed: every target scored at an earlier event, every other document's target at p's event, and
    p's document's targets before p - 1 keep their scores exactly. Returns (nll a, nll b, events)."""
    a = make_stream(270)
    b = a.clone()
    b[p] = 2 + (a[p] - 1) % (V - 2)  # another non-BOS token
    score, na, event, _ = observed_run(cfg, a, monkeypatch)
    nb = observed_run(cfg, b, monkeypatch)[1]
    assert score.tokens == 269 and not na.isnan().any()
    s, e = next((s, e) for s, e in DOCS if s < p <= e)
    t = torch.arange(269)
    same = (event < event[p - 1]) | ((event == event[p - 1]) & ((t < s) | (t >= e))) | ((t >= s) & (t < p - 1))
    assert torch.equal(na[same], nb[same]), p
    return na, nb, event


@pytest.mark.parametrize("p", [20, 61, 100, 150, 200, 265])
def test_phases_change_no_score_made_before_the_changed_token(p, monkeypatch):
    na, nb, event = changed_only_after(lora_cfg(**PHASED), p, monkeypatch)
    assert not torch.equal(na, nb)


def test_phases_train_on_every_scored_prefix_document_and_move_later_scores(monkeypatch):
    """Two phases of 3 documents (the 6 longest): the second SGD call trains on the first call's documents
    and its own; a token of the first phase moves the scores of both later phases (the SGD reached them)."""
    cfg = lora_cfg(**PHASED)
    _, nll, _, calls = observed_run(cfg, make_stream(270), monkeypatch)
    assert [len(c) for c in calls] == [3, 6] and calls[1][:3] == calls[0]
    phase = torch.full((269,), 2)
    for k in (1, 0):
        for s, e in calls[k]:
            phase[s:e] = k
    na, nb, _ = changed_only_after(cfg, calls[0][0][0] + 3, monkeypatch)
    assert not torch.equal(na[phase == 1], nb[phase == 1]) and not torch.equal(na[phase == 2], nb[phase == 2])
    plain = observed_run(lora_cfg(ttt_batch_size=2), make_stream(270), monkeypatch)[1]
    assert torch.equal(nll[phase == 0], plain[phase == 0]) and not torch.allclose(nll[phase == 2], plain[phase == 2])


def _phased_on_rank(rank: int, world_size: int, tokens: list[int], settings: dict | None = None):
    """In float64: each rank batches other documents together than one rank does, and the adapters' Adam could turn
    fp32 rounding of a near-zero gradient into a whole step. `settings`: lora_cfg's (PHASED's by default)."""
    cfg = lora_cfg(**(PHASED if settings is None else settings))
    scorer = make_scorer(cfg, torch.tensor(tokens), make_luts(), rank=rank, world_size=world_size)
    probe = {k: torch.full((len(tokens) - 1,), float("nan"), dtype=torch.float64) for k in ("nll", "lse")}
    score = tg.lora_ttt(cfg, scorer.rt, model_for(cfg).double(), scorer, probe=probe)
    return (score.loss, score.bpb, score.tokens, score.bytes), probe["nll"].numpy()


def test_two_ranks_equal_one_rank_with_phases():
    """The phases' documents are the same on any number of ranks; the SGD averages all ranks' rows: 2 ranks score
    every target once and as 1 rank does (up to the order of float sums: the fp32 adapters' rounding, measured
    <= 1.3e-7 of a target's NLL, 5e-10 of the loss)."""
    tokens = make_stream(270).tolist()
    one, one_nll = _phased_on_rank(0, 1, tokens)
    (s0, n0), (s1, n1) = spawn(_phased_on_rank, 2, tokens)
    assert s0 == s1 and s0[2:] == one[2:] == (269, s0[3])
    assert s0[0] == pytest.approx(one[0], rel=1e-7)
    both = np.where(np.isnan(n0), n1, n0)
    assert not np.isnan(both).any() and (np.isnan(n0) | np.isnan(n1)).all()
    np.testing.assert_allclose(both, one_nll, rtol=1e-5)


def test_one_layer_two_ranks_equal_one_rank():
    """NUM_LAYERS=1: the U-Net skips have no rows, so their weights get no gradient (None); global_sgd's all-reduce
    of 2 ranks skips them (it crashed on None) and scores as 1 rank does."""
    tokens, one_layer = make_stream(270).tolist(), PHASED | dict(num_layers=1, ve_layers="0", xsa_last_n=1)
    one, _ = _phased_on_rank(0, 1, tokens, one_layer)
    (s0, _), (s1, _) = spawn(_phased_on_rank, 2, tokens, one_layer)
    assert s0 == s1 and s0[0] == pytest.approx(one[0], rel=1e-7)


def test_the_ttt_plan_is_inside_eval_time(monkeypatch):
    """lora_plan (every document's chunks, the order, the phases: 1.4 s on FineWeb's val set) ran before the timer
    started: eval_time left it out, where the records' timer holds it. A plan that takes 0.3 s shows in time_ms."""
    plan = tg.lora_plan
    monkeypatch.setattr(tg, "lora_plan", lambda *a: (time.sleep(0.3), plan(*a))[1])
    cfg = lora_cfg(**PHASED)
    scorer = make_scorer(cfg, make_stream(270), make_luts())
    assert tg.lora_ttt(cfg, scorer.rt, model_for(cfg), scorer).time_ms >= 300


def test_global_sgd_equals_a_row_by_row_reference():
    """global_sgd on 3 documents against a loop written here: each document cut into rows of EVAL_SEQ_LEN from its
    start, 2 rows (64 tokens) per step, the last chunk skipped, lr 0.05 x cosine over the trained chunks, the mean
    NLL of the step's targets (each row run alone, at its own length), grad-norm clip 0.5, SGD momentum 0.9."""
    cfg = lora_cfg(**(PHASED | dict(global_ttt_grad_clip=0.5)))
    tokens, spans = make_stream(270), [DOCS[7], DOCS[6], DOCS[2]]
    model, ref = model_for(cfg), model_for(cfg)
    scorer = make_scorer(cfg, tokens, make_luts())
    before = copy.deepcopy(dict(model.named_parameters()))
    model.requires_grad_(False)
    tg.global_sgd(cfg, scorer.rt, model, scorer, scorer.logits_fn(model), spans)
    rows = [(a, min(e - a, 32)) for s, e in spans for a in range(s, e, 32)]
    chunks = [rows[i: i + 2] for i in range(0, len(rows), 2)][:-1]
    assert len(rows) == 7 and len(chunks) == 3
    params, bufs = list(ref.parameters()), None
    for c, chunk in enumerate(chunks):
        loss = sum(F.cross_entropy(ref.logits(tokens[a: a + n][None], one_doc=True)[0].float(), tokens[a + 1: a + n + 1],
                                   reduction="sum") for a, n in chunk) / sum(n for _, n in chunk)
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        grads = [g * min(1.0, 0.5 / (float(norm) + 1e-6)) for g in grads]
        bufs = grads if bufs is None else [0.9 * b + g for b, g in zip(bufs, grads)]
        with torch.no_grad():
            for p_, b in zip(params, bufs):
                p_ -= 0.05 * 0.5 * (1 + math.cos(math.pi * c / 3)) * b
    for name, p_ in ref.named_parameters():
        got = dict(model.named_parameters())[name]
        torch.testing.assert_close(got, p_, rtol=1e-4, atol=1e-6)
        assert not got.requires_grad
    assert any(not torch.equal(before[n], p_) for n, p_ in model.named_parameters())


@pytest.mark.parametrize("off", [("ttt_q_lora", "ttt_v_lora"), ("ttt_k_lora",), ("ttt_q_lora", "ttt_k_lora",
                                 "ttt_v_lora", "ttt_o_lora", "ttt_mlp_lora")])
def test_adapters_on_a_subset(off):
    """Switched-off adapters do not exist (no parameters, no compute); those left are the same as with all on."""
    full, cfg = lora_cfg(), lora_cfg(**{k: False for k in off})
    # in float64: in float32 the B = 0 deltas change the summation order by up to 5.4e-6 on some CPUs (logits ~13)
    model, x = model_for(cfg).double(), make_stream(64).view(2, 32)
    some, every = (tg.DocLoRA(c, 2, torch.device("cpu")).double() for c in (cfg, full))
    names = {"ttt_q_lora": "attn.q", "ttt_k_lora": "attn.k", "ttt_v_lora": "attn.v", "ttt_o_lora": "attn.o",
             "ttt_mlp_lora": "mlp"}
    assert {n for n, _ in some.index} == {"head"} | set(names.values()) - {names[k] for k in off}
    with torch.no_grad():
        for key, j in every.index.items():
            every.B[j].normal_()
            if key in some.index:
                some.B[some.index[key]].copy_(every.B[j])
                some.A[some.index[key]].copy_(every.A[j])  # (A's draw depends on which adapters exist)
        for key, j in every.index.items():  # every's adapters that `some` lacks switched off by B = 0
            if key not in some.index:
                every.B[j].zero_()
        torch.testing.assert_close(model.logits(x, some), model.logits(x, every), rtol=1e-12, atol=1e-12)
    score, = [tg.lora_ttt(cfg, s.rt, model.float(), s) for s in [make_scorer(cfg, make_stream(270), make_luts())]]
    assert score.tokens == 269


def test_short_documents_get_their_own_chunk():
    """TTT_SHORT_SCORE_FIRST_STEPS=10:2,45:3: documents of at most 10 targets train in chunks of 2, at most 45 in 3,
    longer ones in TTT_CHUNK_SIZE. A document's score depends on its own chunk only: the long documents score as
    before, the short ones differ; with no training the chunks change nothing."""
    base, short = lora_cfg(), lora_cfg(ttt_short_score_first_steps="10:2,45:3")
    assert [short.ttt_chunk_for(n) for n in (1, 10, 11, 45, 46)] == [2, 2, 3, 3, 5]
    tokens = make_stream(270)
    scorer = make_scorer(base, tokens, make_luts())
    a = tg.lora_ttt(base, scorer.rt, model_for(base), scorer, probe=(pa := {k: torch.full((269,), float("nan"),
                    dtype=torch.float64) for k in ("nll", "lse")}))
    b = tg.lora_ttt(short, scorer.rt, model_for(short), scorer, probe=(pb := {k: torch.full((269,), float("nan"),
                    dtype=torch.float64) for k in ("nll", "lse")}))
    assert a.tokens == b.tokens == 269
    for s, e in DOCS:
        if e - s > 45:
            assert torch.equal(pa["nll"][s:e], pb["nll"][s:e])
        elif e - s > 2:  # a document of 1-2 targets has one chunk either way
            assert not torch.equal(pa["nll"][s:e], pb["nll"][s:e]), (s, e)
    frozen = [lora_cfg(ttt_grad_steps=0), lora_cfg(ttt_grad_steps=0, ttt_short_score_first_steps="10:2,45:3")]
    # float64 logits: in float32 the short documents' rows of other lengths round their targets' logits otherwise
    # (the loss 1.1e-9 apart on some CPUs); the fp32 cross entropy can still round a float64 logit to the other side,
    # so 1e-9, not 0
    x, y = (tg.lora_ttt(c, scorer.rt, model_for(c).double(), scorer) for c in frozen)
    assert x.loss == pytest.approx(y.loss, rel=1e-9)


@pytest.mark.parametrize("value", ["256", "256:0", "a:8", "256:8,", "8;16"])
def test_malformed_short_steps_are_refused(value):
    with pytest.raises(ValueError, match="TTT_SHORT_SCORE_FIRST_STEPS"):
        tg.Hyperparameters.from_env({"TTT_SHORT_SCORE_FIRST_STEPS": value})


def test_phase_settings_without_phases_are_reported_ignored():
    cfg, _ = tg.Hyperparameters.from_env({"GLOBAL_TTT_LR": "0.002", "PHASED_TTT_PREFIX_DOCS": "0"})
    assert "PHASED_TTT_PREFIX_DOCS=0" in cfg.ignored("global_ttt_lr")
    cfg, _ = tg.Hyperparameters.from_env({"GLOBAL_TTT_LR": "0.002", "PHASED_TTT_PREFIX_DOCS": "45"})
    assert cfg.ignored("global_ttt_lr") == ""
    cfg, _ = tg.Hyperparameters.from_env({"TTT_ENABLED": "0", "PHASED_TTT_PREFIX_DOCS": "45"})
    assert "TTT_ENABLED=False" in cfg.ignored("phased_ttt_prefix_docs")


def test_an_evaluation_context_longer_than_training_scores_with_the_same_rope():
    """EVAL_SEQ_LEN past TRAIN_SEQ_LEN: the rotary tables are one formula of the position (the records' plain
    frequencies), so the training positions keep their angles and longer windows score every target."""
    short, long = lora_cfg(), lora_cfg(eval_seq_len=64)
    a, b = model_for(short), model_for(long)
    assert b.rope_cos.size(0) == 64 and torch.equal(b.rope_cos[:32], a.rope_cos) and torch.equal(b.rope_sin[:32], a.rope_sin)
    tokens = make_stream(270)
    for cfg in (long, dataclasses.replace(long, **PHASED)):
        scorer = make_scorer(cfg, tokens, make_luts())
        assert tg.lora_ttt(cfg, scorer.rt, model_for(cfg), scorer).tokens == 269


def test_compiled_phases_make_two_graphs_and_never_recompile():
    """Compiled (dynamo with its eager backend: the graphs and guards are dynamo's; aot_eager took 5 s more), lora
    TTT with two phases makes its two graphs in the warmup, the adapters' (any rows x length) and the phases' SGD rows
    (one shape on every step), recompiles neither, scores what the uncompiled run scores, and leaves no gradient on
    the model."""
    from torch._dynamo.testing import CompileCounterWithBackend
    cfg, tokens = lora_cfg(**(PHASED | dict(ttt_batch_size=16))), make_stream(270)
    plain = tg.lora_ttt(cfg, (s := make_scorer(cfg, tokens, make_luts())).rt, model_for(cfg), s)
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    scorer = make_scorer(cfg, tokens, make_luts())
    rt, model = dataclasses.replace(scorer.rt, compile_enabled=True), model_for(cfg)
    import unittest.mock
    with unittest.mock.patch.object(tg, "compiled", lambda fn, rt: torch.compile(fn, backend=counter, dynamic=False)):
        score = tg.lora_ttt(cfg, rt, model, scorer)
    assert counter.frame_count == 2
    assert score.loss == pytest.approx(plain.loss, rel=1e-5)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
