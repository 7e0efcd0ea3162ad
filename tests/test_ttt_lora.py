"""Tests of TTT_MODE=lora, per-document LoRA test-time training (issue 23 items 3-4; CPU, offline).

1. A fresh adapter (B = 0) leaves the logits unchanged; a non-zero head adapter adds ALPHA/r * B A h to the
   raw logits before the softcap (written out by hand here).
2. With TTT_GRAD_STEPS=0 the score equals the sliding-window score with DOC_ISOLATION (per document, whether
   the model was trained isolated or not), and every target is scored once.
3. Legality: changing token p changes no score of a target before p - 1 (the one that predicts it), with
   training on: nothing is scored after an update that saw it, and attention stays causal.
4. Documents are independent: each target's score in one batched run equals the score of its document run
   alone, whatever the batch size; 2 ranks equal 1.
5. End to end, with and without DOC_ISOLATION (then the per-document sliding score is logged beside it).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_scorer, perturbed_model, spawn, tiny_cfg
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")
V = 512
BOS_AT = [0, 5, 6, 47, 90, 130, 133, 181, 260]  # documents of 1 to 79 tokens; windows of 32 tokens


def lora_cfg(**kw) -> tg.Hyperparameters:
    return tiny_cfg(**(dict(doc_isolation=True, ttt_mode="lora", ttt_lora_rank=4, ttt_lora_alpha=8.0,
                            ttt_lora_lr=0.01, ttt_weight_decay=0.1, ttt_chunk_size=5, ttt_batch_size=3,
                            ttt_grad_steps=1, eval_stride=8) | kw))


def make_stream(n: int, seed: int = 0) -> torch.Tensor:
    """A noisy repeated pattern (training moves the loss), with BOS at BOS_AT and nowhere else."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(2, V, (23,), generator=g).repeat(n // 23 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.3
    toks[noise] = torch.randint(2, V, (int(noise.sum()),), generator=g)
    toks[[p for p in BOS_AT if p < n]] = tg.BOS_ID
    return toks


def make_luts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 5, (V,), generator=g).to(torch.int16), torch.rand(V, generator=g) < 0.4, torch.zeros(V, dtype=torch.bool)


def model_for(cfg: tg.Hyperparameters) -> tg.GPT:
    return perturbed_model(cfg, 3, bank_std=0.1, table_std=0.3).eval()


def lora_run(cfg, tokens, rank: int = 0, world_size: int = 1, lse: bool = False, double: bool = False):
    """(score, each target's NLL; NaN where this rank scored none), and each target's logsumexp if lse. double: the
    model in float64 (the adapters stay fp32, their deltas are computed in the model's dtype)."""
    scorer = make_scorer(cfg, tokens, make_luts(), rank=rank, world_size=world_size)
    probe = {k: torch.full((tokens.numel() - 1,), float("nan"), dtype=torch.float64) for k in ("nll", "lse")}
    model = model_for(cfg).double() if double else model_for(cfg)
    score = tg.lora_ttt(cfg, scorer.rt, model, scorer, probe=probe)
    return (score, probe["nll"], probe["lse"]) if lse else (score, probe["nll"])


def test_fresh_adapter_is_the_identity_and_the_head_adapter_adds_BAh():
    cfg = lora_cfg()  # float64: the by-hand sum is another order of the same products
    model, x = model_for(cfg).double(), make_stream(64).view(2, 32)
    lora = tg.DocLoRA(cfg, 2, torch.device("cpu")).double()
    with torch.no_grad():
        assert torch.equal(model.logits(x, lora), model.logits(x))
        j = lora.index["head", 0]
        lora.B[j].normal_()
        h = model.hidden(x)
        by_hand = [h[b] @ lora.A[j][b].T @ lora.B[j][b].T * (cfg.ttt_lora_alpha / cfg.ttt_lora_rank) for b in range(2)]
        want = tg.softcap(torch.nn.functional.linear(h, model.tok_emb.weight) + torch.stack(by_hand), cfg.logit_softcap)
        torch.testing.assert_close(model.logits(x, lora), want, rtol=1e-12, atol=1e-12)
        for name in ("attn.q", "attn.v", "attn.o", "mlp"):  # every other adapter reaches the logits too
            lora.reset()
            lora.B[lora.index[name, 1]].normal_()
            assert not torch.allclose(model.logits(x, lora), model.logits(x)), name


@pytest.mark.parametrize("name", ["attn.q", "attn.k", "attn.v"])
def test_a_q_k_or_v_adapter_is_its_weight_plus_scaled_BA(name):
    """For one row, the q, k or v adapter of layer 1 is the same model with that matrix + ALPHA/r * B A: an
    independent reference for the stacked down-projection (DocLoRA.deltas), whose outputs must go to the right
    projection. The other adapters keep B = 0."""
    import copy
    cfg = lora_cfg()  # float64: x (W + s B A) and x W + s (x A) B differ in rounding only
    model, x = model_for(cfg).double(), make_stream(32).view(1, 32)
    lora = tg.DocLoRA(cfg, 1, torch.device("cpu")).double()
    j = lora.index[name, 1]
    with torch.no_grad():
        lora.B[j].normal_()
        ref = copy.deepcopy(model)
        banks = {bank: getattr(ref, bank) for bank in tg.BANKS}
        tg.layer_matrix(banks, name, 1, cfg.num_layers).add_(lora.B[j][0] @ lora.A[j][0] * (cfg.ttt_lora_alpha / cfg.ttt_lora_rank))
        torch.testing.assert_close(model.logits(x, lora), ref.logits(x), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(model.logits(x, lora), model.logits(x))


@pytest.mark.parametrize("n, chunk, stride", [(270, 5, 8), (200, 48, 32), (151, 1, 3)])
def test_epochs_zero_equals_the_isolated_sliding_score(n, chunk, stride):
    cfg = lora_cfg(ttt_grad_steps=0, ttt_chunk_size=chunk, eval_stride=stride)
    tokens = make_stream(n)
    plain = make_scorer(cfg, tokens, make_luts())(model_for(cfg), stride)
    score, nll = lora_run(cfg, tokens)
    assert (score.tokens, score.bytes) == (plain.tokens, plain.bytes) and score.tokens == n - 1
    assert not nll.isnan().any()  # n - 1 targets scored, all covered: each exactly once
    # the sliding scorer batches other rows: fp32 NLLs (~6) a few ulps (~1e-7) apart at most; measured <= 0.004x
    assert score.loss == pytest.approx(plain.loss, rel=1e-6) and score.bpb == pytest.approx(plain.bpb, rel=1e-6)


@pytest.mark.parametrize("p, steps", [(20, 1), (61, 2), (100, 1), (131, 2), (200, 1)])
def test_changing_token_p_changes_no_score_before_it(p, steps):
    """Token p is the target of position p - 1: every target before that keeps its score exactly, although
    the adapters train on p's chunk (and later scores move); with one AdamW step per chunk or two."""
    cfg = lora_cfg(ttt_grad_steps=steps)
    a = make_stream(270)
    b = a.clone()
    b[p] = 2 + (a[p] - 1) % (V - 2)  # another non-BOS token
    (sa, na), (sb, nb) = lora_run(cfg, a), lora_run(cfg, b)
    assert torch.equal(na[: p - 1], nb[: p - 1])
    assert not torch.equal(na[p - 1:], nb[p - 1:])
    frozen = lora_run(lora_cfg(ttt_grad_steps=0), a)[1]
    assert not torch.allclose(na, frozen)  # training happened


def chunk_starts(cfg, tokens) -> list[int]:
    """The first target of each of lora TTT's chunks that is not its document's first (an update came before)."""
    scorer = make_scorer(cfg, tokens, make_luts())
    starts = set(scorer.doc_starts())
    return sorted(a for _, lo, hi in scorer.windows(cfg.eval_stride).tolist()
                  for a in range(lo, hi, cfg.ttt_chunk_size) if a not in starts)


@pytest.mark.parametrize("steps", [1, 2])
def test_the_target_after_a_chunk_is_not_trained_on_before_it_is_scored(steps):
    """Condition C3 at the chunk edge: the normaliser (logsumexp) of every target up to p - 1 does not depend on
    token p, p - 1 included, where p - 1 opens a chunk after an update. (The NLL of p - 1 depends on p anyway,
    so the NLL test above cannot see an update that reaches one target past its chunk; the normaliser can.)"""
    cfg, a = lora_cfg(ttt_grad_steps=steps), make_stream(270)
    (_, _, lse_a), picked = lora_run(cfg, a, lse=True, double=True), [t + 1 for t in chunk_starts(cfg, a)][1::7]
    assert len(picked) >= 4 and set(picked) & set(BOS_AT), picked
    for p in picked:
        b = a.clone()
        b[p] = 2 + (a[p] - 1) % (V - 2)
        lse_b = lora_run(cfg, b, lse=True, double=True)[2]
        if p in BOS_AT:  # documents merge: the lockstep batches' rows and lengths change, so float noise only: the
            # float64 model's (its fp32 adapters' Adam steps could turn fp32 noise in a near-zero gradient into a
            # whole step); the probe's logsumexp is fp32, so a logit may round to either side: 1 ulp (1.2e-7)
            torch.testing.assert_close(lse_a[:p], lse_b[:p], rtol=1e-6, atol=0)
        else:
            assert torch.equal(lse_a[:p], lse_b[:p]), p
        assert not torch.equal(lse_a[p:], lse_b[p:]), p  # later normalisers move: the update saw p


@pytest.mark.parametrize("batch", [1, 2, 9, 16])
def test_each_document_scores_as_if_alone(batch):
    """9 documents in lockstep batches: 9 and 16 cut steps to the first 8 rows; 16 also runs padding rows."""
    cfg = lora_cfg(ttt_batch_size=batch, ttt_grad_steps=2)
    tokens = make_stream(270)
    _, together = lora_run(cfg, tokens, double=True)  # float64: rows of other batches than alone, see above
    bounds = BOS_AT + [269]
    for s, e in zip(bounds, bounds[1:]):  # targets s..e-1: the stream up to token e
        _, alone = lora_run(cfg, tokens[s: e + 1], double=True)
        torch.testing.assert_close(together[s:e], alone, rtol=1e-6, atol=0)  # the fp32 cross entropy: 1 ulp


def test_automatic_rows_are_the_runtimes(monkeypatch):
    """TTT_BATCH_SIZE=0 takes the rows the memory plan chose (Runtime.ttt_rows): the same plan, adapters and scores
    as that many rows set by hand; a set TTT_BATCH_SIZE wins over the plan's."""
    tokens, rows = make_stream(270), []
    real = tg.DocLoRA.__init__

    def init(self, cfg, n, device):
        rows.append(n)
        real(self, cfg, n, device)
    monkeypatch.setattr(tg.DocLoRA, "__init__", init)
    scores = []
    for batch, planned in ((0, 3), (3, 64), (3, 7)):
        cfg = lora_cfg(ttt_batch_size=batch)
        scorer = make_scorer(cfg, tokens, make_luts())
        scores.append(tg.lora_ttt(cfg, dataclasses.replace(scorer.rt, ttt_rows=planned), model_for(cfg), scorer).bpb)
    assert rows == [3, 3, 3] and scores[0] == scores[1] == scores[2]


def test_one_compiled_graph_serves_every_rows_and_length(monkeypatch):
    """Compiled (dynamo with its eager backend: the graphs and guards are dynamo's; aot_eager took 5 s more), lora
    TTT's steps of 8 or 16 rows and 8 to 32 tokens all run one graph, made before the loop, and score what the
    uncompiled run scores."""
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("eager")
    cfg, tokens = lora_cfg(ttt_batch_size=16), make_stream(270)
    plain = lora_run(cfg, tokens)[0]
    monkeypatch.setattr(tg, "compiled", lambda fn, rt: torch.compile(fn, backend=counter, dynamic=False, fullgraph=True))
    scorer = make_scorer(cfg, tokens, make_luts())
    rt = dataclasses.replace(scorer.rt, compile_enabled=True)
    torch._dynamo.reset()
    score = tg.lora_ttt(cfg, rt, model_for(cfg), scorer)
    assert counter.frame_count == 1
    assert score.loss == pytest.approx(plain.loss, rel=1e-5)


def _lora_on_rank(rank: int, world_size: int, tokens: list[int]):
    """lora_run in float64: a rank batches other documents together than one rank does (each rank's share)."""
    score, nll = lora_run(lora_cfg(ttt_batch_size=2), torch.tensor(tokens), rank, world_size, double=True)
    return (score.loss, score.bpb, score.tokens, score.bytes), nll.numpy()


def test_more_ranks_than_documents_equal_one_rank():
    """Two documents (BOS at 0 and 5, a stream of 40 tokens) on 3 ranks: the third rank has none and still joins
    the reduction; the score equals one process's."""
    tokens = make_stream(40)
    tokens[6] = 7  # make_stream's third BOS
    tokens = tokens.tolist()
    one, _ = _lora_on_rank(0, 1, tokens)
    results = spawn(_lora_on_rank, 3, tokens)
    assert all(r[0][2:] == one[2:] for r in results) and results[2][1].size == 39 and np.isnan(results[2][1]).all()
    assert results[0][0][0] == pytest.approx(one[0], rel=1e-6)


@pytest.mark.parametrize("chunk, stride", [(12, 8), (5, 8), (8, 5)])
def test_chunks_longer_or_shorter_than_the_stride_keep_every_earlier_score(chunk, stride):
    """With training on, a chunk that spans two windows' targets (chunk > stride) or part of one: changing token
    p still leaves every normaliser up to p - 1 and every NLL before p - 1 unchanged; every target is scored."""
    cfg, a = lora_cfg(ttt_chunk_size=chunk, eval_stride=stride), make_stream(200)
    score, nll_a, lse_a = lora_run(cfg, a, lse=True)
    assert score.tokens == 199 and not nll_a.isnan().any()
    for p in (23, 70, 141):
        b = a.clone()
        b[p] = 2 + (a[p] - 1) % (V - 2)
        _, nll_b, lse_b = lora_run(cfg, b, lse=True)
        assert torch.equal(lse_a[:p], lse_b[:p]) and torch.equal(nll_a[:p - 1], nll_b[:p - 1]), p


def test_two_ranks_equal_one_rank():
    """9 documents in batches of 2: 5 batches, 3 on rank 0 and 2 on rank 1."""
    tokens = make_stream(270).tolist()
    one, one_nll = _lora_on_rank(0, 1, tokens)
    (s0, n0), (s1, n1) = spawn(_lora_on_rank, 2, tokens)
    assert s0 == s1 and s0[2:] == one[2:]
    assert s0[0] == pytest.approx(one[0], rel=1e-6) and s0[1] == pytest.approx(one[1], rel=1e-6)
    both = np.where(np.isnan(n0), n1, n0)
    assert not np.isnan(both).any() and (np.isnan(n0) | np.isnan(n1)).all()  # each target on one rank
    np.testing.assert_allclose(both, one_nll, rtol=1e-5)


def test_without_isolation_lora_scores_per_document():
    """A model trained without DOC_ISOLATION: lora's windows are still each document's own, so with no updates
    it gives the per-document sliding score of the same weights, not the across-documents one."""
    cfg = lora_cfg(doc_isolation=False, ttt_grad_steps=0)
    tokens = make_stream(270)
    per_doc = make_scorer(cfg, tokens, make_luts())(model_for(cfg), cfg.eval_stride, per_doc=True)
    across = make_scorer(cfg, tokens, make_luts())(model_for(cfg), cfg.eval_stride)
    isolated_cfg = dataclasses.replace(cfg, doc_isolation=True)
    isolated = make_scorer(isolated_cfg, tokens, make_luts())(model_for(isolated_cfg), cfg.eval_stride)
    score = lora_run(cfg, tokens)[0]
    # lora batches other rows than the scorer (fp32 NLLs a few ulps apart at most: 1e-6, as above); per_doc and
    # isolated score the same windows in the same batches
    assert score.loss == pytest.approx(per_doc.loss, rel=1e-6) and per_doc.loss == pytest.approx(isolated.loss, rel=1e-9)
    assert abs(score.loss - across.loss) > 1e-4
    with pytest.raises(ValueError, match="TTT_MODE"):
        tg.Hyperparameters.from_env({"TTT_MODE": "adam"})


@pytest.mark.parametrize("iso", [0, 1])
def test_script_runs_lora_ttt_and_eval_only_reproduces_it(dataset, tokenizer_path, tmp_path, iso, monkeypatch):
    """End to end: a tiny run with TTT_MODE=lora (the default mode) logs legal_ttt over the same targets and
    bytes as the sliding-window score, with progress lines; EVAL_ONLY of its artifact gives the same line (without
    DOC_ISOLATION also with the sliding pass off). Without DOC_ISOLATION the per-document sliding score, lora's
    baseline, is logged too."""
    from conftest import run_inline, tiny_env
    import re
    ttt = dict(DOC_ISOLATION=iso, TTT_ENABLED=1, TTT_LORA_RANK=4, TTT_CHUNK_SIZE=16, TTT_BATCH_SIZE=8)
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, ITERATIONS=4, RUN_ID="lora", **ttt), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    exact = [ln for ln in lines if ln.startswith("legal_ttt_exact ")]
    sw = [ln for ln in lines if ln.startswith("final_int6_sliding_window ")]
    counts = re.compile(r" scored_tokens:(\d+) scored_bytes:(\d+)")
    ttt_line = next(ln for ln in lines if ln.startswith("legal_ttt "))
    assert len(exact) == 1 and counts.search(ttt_line).groups() == counts.search(sw[0]).groups()
    # the reference's format, "so people's greps work" (REFERENCE.md): these keys in this order, more may follow
    assert re.match(r"legal_ttt val_loss:[0-9.]+ val_bpb:[0-9.]+ eval_time:\d+ms( |$)", ttt_line), ttt_line
    assert lines.index(ttt_line) > lines.index(next(ln for ln in lines if ln.startswith("final_int6_roundtrip_exact")))
    per_doc = [ln for ln in lines if ln.startswith("final_int6_sliding_window_per_doc ")]
    assert len(per_doc) == 1 - iso and all(counts.search(ln).groups() == counts.search(sw[0]).groups() for ln in per_doc)
    assert any(re.fullmatch(r"ttt_lora_docs:\d+/\d+ rank0_bpb_so_far:\d+\.\d{4} time:\d+ms", ln) for ln in lines)
    assert "setting ttt_mode:lora" in (tmp_path / "logs" / "lora.txt").read_text(encoding="utf-8").splitlines()
    # without isolation SLIDING_EVAL_ENABLED=0 (the record runs' time saver): the training run, which had the sliding
    # pass, and this one give the same TTT score, so the pass leaves the model as it found it
    fast = {} if iso else dict(SLIDING_EVAL_ENABLED=0)
    r2 = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, EVAL_ONLY=str(tmp_path / "logs" / "lora.int6.ptz"),
                                          RUN_ID="lora_eval", **fast, **ttt), tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    lines2 = r2.stdout.splitlines()
    assert [ln for ln in lines2 if ln.startswith("legal_ttt_exact ")] == exact
    if not iso:  # no sliding pass, the roundtrip score still, and the TTT score is the run's
        assert not any(ln.startswith("final_int6_sliding_window") for ln in lines2)
        assert any(ln.startswith("final_int6_roundtrip_exact ") for ln in lines2)
        assert any(ln.startswith("summary score:legal_ttt ") for ln in lines2)


def test_scores_are_a_full_softmax_over_the_vocabulary(monkeypatch):
    """Every NLL that lora_ttt scores is -log softmax over all VOCAB_SIZE logits of the model with the adapters
    (no logit bias, no truncated vocabulary): checked on each cross_entropy call it makes."""
    cfg = lora_cfg()
    seen, ce = [], torch.nn.functional.cross_entropy

    def spy(logits, targets, reduction="mean"):
        out = ce(logits, targets, reduction=reduction)
        assert logits.size(-1) == cfg.vocab_size
        full = torch.logsumexp(logits.double(), -1) - logits.double().gather(-1, targets[:, None])[:, 0]
        # fp32 cross entropy against float64: NLLs ~6-10 a few ulps (~1e-6) apart; measured <= 0.03x
        torch.testing.assert_close(out.double(), full, rtol=1e-5, atol=1e-5)
        seen.append(out.numel())
        return out
    monkeypatch.setattr(tg, "cross_entropy", spy)
    score, _ = lora_run(cfg, make_stream(270))
    assert seen and score.tokens == 269


def test_lora_ttt_leaves_the_models_requires_grad_flags_as_it_found_them():
    cfg = lora_cfg()
    model, tokens = model_for(cfg), make_stream(100)
    model.tok_emb.weight.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    scorer = make_scorer(cfg, tokens, make_luts())
    tg.lora_ttt(cfg, scorer.rt, model, scorer)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before and not before["tok_emb.weight"]


def test_scoring_paths_never_build_the_document_mask(monkeypatch):
    """Under DOC_ISOLATION the sliding scorer and lora TTT run on rows of one document: no (B, T, T) mask, so any
    attention backend serves them (GPT.hidden's one_doc). Only rows that cross documents (training) build it."""
    cfg = lora_cfg(ttt_grad_steps=1)
    tokens, model = make_stream(270), model_for(cfg)
    monkeypatch.setattr(tg, "document_mask", lambda *a: (_ for _ in ()).throw(AssertionError("mask built")))
    make_scorer(cfg, tokens, make_luts())(model, cfg.eval_stride)
    lora_run(cfg, tokens)
    with pytest.raises(AssertionError, match="mask built"):  # the control: a row across documents builds it
        model.logits(tokens[:32].view(1, -1))  # documents at 0, 5 and 6


def test_sliding_eval_off_needs_ttt():
    """Without TTT the sliding score is the run's final score: switching it off alone is refused at the start."""
    with pytest.raises(ValueError, match="SLIDING_EVAL_ENABLED=0 needs TTT_ENABLED=1"):
        tg.Hyperparameters.from_env({"SLIDING_EVAL_ENABLED": "0", "TTT_ENABLED": "0"})
    assert not tg.Hyperparameters.from_env({"SLIDING_EVAL_ENABLED": "0", "TTT_ENABLED": "1"})[0].sliding_eval_enabled


def test_a_looped_layer_has_adapters_of_its_own_at_each_repeat():
    """With recurrence the adapters follow the positions of the layer order, one set per position as in the 04-27
    record (its slots): here layer 1 runs at positions 1 and 2, and the same B A put at either one changes the logits,
    differently (shared adapters would give the same logits both ways)."""
    cfg = lora_cfg(num_loops=1, loop_start=1, loop_end=1)
    assert tg.layer_order(cfg, True) == [0, 1, 1]
    model, x = model_for(cfg), make_stream(64).view(2, 32)
    lora = tg.DocLoRA(cfg, 2, torch.device("cpu"))
    assert set(lora.index) == {(n, s) for s in range(3) for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp")} | {
        ("head", 0)}
    g = torch.Generator().manual_seed(5)
    A, B = torch.rand(lora.A[0].shape, generator=g), torch.randn(lora.B[lora.index["attn.q", 1]].shape, generator=g)
    with torch.no_grad():
        base, got = model.logits(x), []
        for s in (1, 2):
            lora.reset()
            lora.A[lora.index["attn.q", s]].copy_(A), lora.B[lora.index["attn.q", s]].copy_(B)
            got.append(model.logits(x, lora))
    assert (got[0] - base).abs().max() > 1e-3 and (got[1] - base).abs().max() > 1e-3
    assert (got[0] - got[1]).abs().max() > 1e-3
