"""Optimizer tests for train_gpt.py: batched Newton-Schulz, the Muon update formula, Parallel Muon over
1/2/3 gloo ranks (3 ranks pads the bank dimension), global-norm clipping, the AdamW groups, the parameter
table, and optimizer state round trips. Every test compares with an independent reference (a per-matrix
loop, torch.optim.AdamW, torch's clip_grad_norm_, a 1-process run) with the tolerance stated where used."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import perturbed_model, spawn, tiny_cfg

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")
V, T, GLOBAL_SEQS = 64, 16, 6  # 6 sequences: splits evenly over 1, 2 and 3 ranks
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315  # REFERENCE.md: the seed system's quintic coefficients
BANKS = ("qo_bank", "kv_bank", "mlp_up_bank", "mlp_down_bank")  # REFERENCE.md's four banks: Muon's
TOKEN_TABLES = ("tok_emb.weight", "bigram.embed.weight", "ve.embed.weight")  # the token AdamW group


def opt_cfg(**overrides) -> tg.Hyperparameters:
    """V=64, T=16, fp32 Muon, no clipping unless asked."""
    return tiny_cfg(**(dict(vocab_size=V, train_seq_len=T, muon_reduce_dtype="fp32", grad_clip_norm=0.0, seed=1234)
                       | overrides))


def make_model(cfg: tg.Hyperparameters, seed: int = 0) -> tg.GPT:
    """Every parameter perturbed so that all gradients are non-zero from the first step."""
    return perturbed_model(cfg, seed, noise=0.02)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, V, (GLOBAL_SEQS, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = GLOBAL_SEQS // world_size
    return t[rank * n:(rank + 1) * n]


def schedule(step: int) -> tuple[float, float]:
    """A changing (lr scale, Muon momentum) so the schedule plumbing is exercised too."""
    return 1.0 - 0.12 * step, 0.85 + 0.02 * step


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# 1. Newton-Schulz
# ---------------------------------------------------------------------------------------------

# Polar Express (Amsel et al. 2025), as FRONTIER.md 2.5 lists the 2026-04-23 record's tuples
POLAR = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
         (4.042929935166739, -2.808917465908714, 0.5000178451051316),
         (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
         (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
         (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def ns_one_matrix(G: torch.Tensor, steps: int, dtype: torch.dtype, polar: bool = False) -> torch.Tensor:
    """The seed system's NS, written for one 2-D matrix: wide orientation, Frobenius-normalised; with `polar`,
    Polar Express's tuple k at step k (the last one from then on)."""
    X = G.to(dtype)
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.t()
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)
    for k in range(steps):
        a, b, c = POLAR[min(k, 4)] if polar else (NS_A, NS_B, NS_C)
        A = X @ X.t()
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.t() if transposed else X


@pytest.mark.parametrize("polar", [False, True], ids=["quintic", "polar"])
@pytest.mark.parametrize("shape", [(5, 16, 16), (4, 48, 12), (3, 12, 40)], ids=["square", "tall", "wide"])
def test_batched_newton_schulz_equals_per_matrix_loop(shape, polar):
    # float64 (the same code as fp32, the CPU's dtype): max abs difference 1e-12 against the per-matrix loop, outputs
    # O(1); measured <= 1e-14. (In fp32 the two differ by up to 1.5e-6, depending on the CPU's matmul kernels.)
    # bf16: the script fuses the polynomial into baddbmm (one rounding instead of three), so bit equality with
    # the unfused loop is not expected; both are compared with a float64 run of the loop, and the batched
    # result must be at least as accurate (relative Frobenius error <= 1.25x the unfused loop's, and < 5%).
    G = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    steps = 6 if polar else 5  # polar: one step past the table, which repeats its last tuple
    assert tg.newton_schulz(G, steps, dtype=torch.float32, polar=polar).dtype == torch.float32
    out = tg.newton_schulz(G, steps, dtype=torch.float64, polar=polar)
    truth = torch.stack([ns_one_matrix(g, steps, torch.float64, polar) for g in G])
    assert out.shape == G.shape and (out - truth).abs().max().item() <= 1e-12
    out16 = tg.newton_schulz(G, steps, dtype=torch.bfloat16, polar=polar)
    ref16 = torch.stack([ns_one_matrix(g, steps, torch.bfloat16, polar) for g in G])
    assert out16.dtype == torch.bfloat16
    err_batched, err_loop = rel_err(out16, truth), rel_err(ref16, truth)
    assert err_batched <= 1.25 * err_loop and err_batched < 0.05


def test_stacked_newton_schulz_equals_the_per_matrix_loop_for_each_bank():
    """MLP up (tall) and down (wide) banks in one batch: every matrix still normalised alone (batch
    members differ in scale by 1e3), results back in each bank's orientation; a lone bank as is."""
    g = torch.Generator().manual_seed(11)
    up = torch.randn(3, 24, 8, generator=g) * torch.tensor([1e-2, 1.0, 10.0])[:, None, None]
    down = torch.randn(3, 8, 24, generator=g)
    got = tg.newton_schulz_stacked([up, down], 5, torch.float64)
    for G, out in zip((up, down), got):
        ref = torch.stack([ns_one_matrix(m, 5, torch.float64) for m in G])
        assert out.shape == G.shape
        assert (out - ref).abs().max().item() <= 1e-12  # float64, outputs O(1): summation order only (<= 1e-14)
    lone = tg.newton_schulz_stacked([down], 5, torch.float32)[0]
    assert torch.equal(lone, tg.newton_schulz(down, 5, dtype=torch.float32))


def test_newton_schulz_singular_values_land_in_a_narrow_band():
    # Inputs: Gaussian matrices with aspect ratio >= 2.5 (tall and wide), columns scaled over 3.2x, the
    # batch scaled over 1e4. Measured over 40 seeds: 5 bf16 steps put every output singular value in
    # [0.66, 1.17] with per-matrix max/min <= 1.72, from inputs with per-matrix max/min >= 2.46.
    # Asserted: outputs in [0.6, 1.25] with max/min <= 1.9; inputs max/min >= 2.4 (and >= 1e3 over the
    # batch). (Square Gaussian matrices have singular values near 0 that 5 steps cannot lift: the
    # quintic's slope at 0 is 3.44, so only inputs above ~1/250 of the Frobenius norm reach the band.)
    g = torch.Generator().manual_seed(3)
    for shape in [(8, 64, 16), (8, 16, 64), (8, 96, 32), (8, 32, 80)]:
        G = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None, None]
        G = G * torch.logspace(0, 0.5, shape[2])
        s_in = torch.linalg.svdvals(G)
        s_out = torch.linalg.svdvals(tg.newton_schulz(G, 5).float())
        assert (s_in.amax(-1) / s_in.amin(-1)).min() >= 2.4 and s_in.max() / s_in.min() >= 1e3
        assert s_out.min() >= 0.6 and s_out.max() <= 1.25, (shape, s_out.min(), s_out.max())
        assert (s_out.amax(-1) / s_out.amin(-1)).max() <= 1.9


def test_polar_express_lands_in_a_narrower_band_than_the_quintic():
    # The inputs of the test above. Measured over 20 seeds, 5 bf16 steps: Polar Express puts every singular value
    # in [0.856, 1.146], per-matrix max/min <= 1.34; the quintic [0.676, 1.143], max/min <= 1.68. Asserted:
    # [0.8, 1.2] and max/min <= 1.45, and each matrix's band narrower than the quintic's on the same input.
    g = torch.Generator().manual_seed(3)
    for shape in [(8, 64, 16), (8, 16, 64), (8, 96, 32), (8, 32, 80)]:
        G = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None, None]
        G = G * torch.logspace(0, 0.5, shape[2])
        s_polar = torch.linalg.svdvals(tg.newton_schulz(G, 5, polar=True).float())
        s_quintic = torch.linalg.svdvals(tg.newton_schulz(G, 5).float())
        assert s_polar.min() >= 0.8 and s_polar.max() <= 1.2, (shape, s_polar.min(), s_polar.max())
        ratio = s_polar.amax(-1) / s_polar.amin(-1)
        assert ratio.max() <= 1.45 and (ratio < s_quintic.amax(-1) / s_quintic.amin(-1)).all()


# ---------------------------------------------------------------------------------------------
# 6. The Muon update formula on one bank, one rank
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("polar, row_normalize", [(False, False), (True, True)], ids=["seed", "polar+rownorm"])
@pytest.mark.parametrize("shape", [(3, 8, 24), (2, 24, 8)], ids=["wide", "tall"])
def test_muon_update_formula(shape, polar, row_normalize):
    # Independent reference: buf = mu*buf + g; u = g + mu*buf (MUON_ROW_NORMALIZE: each row of u over its norm);
    # O = NS(u) (fp32, per matrix); p *= 1 - lr*wd; p -= lr*sqrt(max(1, rows/cols))*O. Relative 1e-5 over 4 steps.
    lr, wd, mus = 0.05, 0.1, [0.8, 0.9, 0.95, 0.95]
    gen = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    ref = p.detach().clone()
    opt = tg.ParallelMuon([p], lr=lr, momentum=mus[0], weight_decay=wd, ns_steps=5,
                          comm_dtype=torch.float32, world_size=1, polar=polar, row_normalize=row_normalize)
    buf = torch.zeros(shape)
    scale = max(1.0, shape[1] / shape[2]) ** 0.5
    for mu in mus:
        grad = torch.randn(shape, generator=gen)
        p.grad = grad.clone()
        opt.param_groups[0]["momentum"] = mu
        opt.launch_reduce_scatter()
        sq = opt.finish_reduce_scatter()
        assert abs(sq.item() - grad.square().sum().item()) <= 1e-5 * grad.square().sum().item()
        opt.step()
        buf = mu * buf + grad
        u = grad + mu * buf
        if row_normalize:
            u = torch.stack([torch.stack([row / row.norm() for row in m]) for m in u])
        O = torch.stack([ns_one_matrix(m, 5, torch.float32, polar) for m in u])
        ref = ref * (1 - lr * wd) - lr * scale * O
        assert rel_err(p.detach(), ref) <= 1e-5
    assert rel_err(opt.state[p]["momentum"], buf) <= 1e-6


# ---------------------------------------------------------------------------------------------
# 2. Parallel Muon over 1/2/3 ranks; global-norm clipping
# ---------------------------------------------------------------------------------------------

def _as_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def train_worker(rank: int, world_size: int, overrides: dict, steps: int) -> dict:
    """Each rank: the same model (same seed), its slice of the same global batch (its local mean loss:
    the optimizer averages over ranks, so the result is the global mean's gradient). Returns final
    params, per-step returned norms, and on the first step: local pre-clip grads, the clipped grads the
    optimizer used (replicated grads; this rank's bank shards), and this rank's bank shard size."""
    cfg = opt_cfg(**overrides)
    model = make_model(cfg).double()  # the AdamW groups in float64; Muon's banks in fp32 (MUON_REDUCE_DTYPE)
    opt = tg.Optimizers(model, cfg, tg.Runtime(rank, world_size, rank))
    names = {id(p): n for n, p in model.named_parameters()}
    captured: dict[str, np.ndarray] = {}
    muon_step = opt.muon.step

    def capturing_step():
        for p, shard, _ in opt.muon.pending:
            captured[names[id(p)]] = _as_np(shard)
        muon_step()

    out = dict(norms=[], local_grads={}, clipped={}, shards={}, shard_rows={})
    for step in range(steps):
        opt.set_schedule(*schedule(step))
        x, y = global_batch(step)
        model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
        if step == 0:
            out["local_grads"] = {n: _as_np(p.grad) for n, p in model.named_parameters()}
            opt.muon.step = capturing_step
        out["norms"].append(float(opt.step()))
        if step == 0:
            opt.muon.step = muon_step
            out["clipped"] = {n: _as_np(p.grad) for n, p in model.named_parameters() if n not in BANKS}
            out["shards"] = dict(captured)
            out["shard_rows"] = {n: opt.muon.shard_rows(p) for n, p in model.named_parameters() if n in BANKS}
        opt.zero_grad()
    out["params"] = {n: _as_np(p) for n, p in model.named_parameters()}
    return out


STEPS = 6
CLIP = 0.05  # binds: the tiny model's grad norm is ~0.85-0.95 on these batches
CLIPS = (0.0, CLIP)


ROUNDTRIP = "roundtrip"  # runs' key of the 2-rank fp32 optimizer state round trip (section 5)


def train_worker_clips(rank: int, world_size: int, steps: int) -> dict:
    """One process group, both clip settings (spawning costs more than the training); the clipped run also has
    Polar Express and row-normalised updates on. On 2 ranks the same group also runs the fp32 state round trip."""
    out = {clip: train_worker(rank, world_size, dict(grad_clip_norm=clip, muon_polar_express=bool(clip),
                                                     muon_row_normalize=bool(clip)), steps) for clip in CLIPS}
    if world_size == 2:
        out[ROUNDTRIP] = roundtrip_worker(rank, world_size, dict(muon_reduce_dtype="fp32", grad_clip_norm=CLIP))
    return out


@pytest.fixture(scope="module")
def runs():
    """Lazily computed per-rank results of 1 (in-process: no process group, the degenerate case of
    the same code), 2 and 3 gloo ranks; shared by the tests below."""
    cache: dict = {}

    def get(world_size: int, clip: float | str) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = ([train_worker_clips(0, 1, STEPS)] if world_size == 1
                                 else spawn(train_worker_clips, world_size, STEPS))
        return [res[clip] for res in cache[world_size]]
    return get


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["noclip", "clip"])
def test_parallel_muon_matches_one_process(runs, world_size, clip):
    # Tolerance: every parameter tensor P after 6 steps, fp32 reduce dtype, satisfies
    # |P - P_1proc| <= 1e-5 * max(|P_1proc|, |P_1proc - P_init|) (Frobenius norms): relative to the
    # parameter or to its total movement, whichever is larger (a scalar that Adam moves through ~0,
    # e.g. bigram.scale, would otherwise inflate a plain relative error). Differences come only from
    # summation order: the model is float64, so only Muon's fp32 reduce-scatter and Newton-Schulz round
    # (measured <= 6e-7 on three CPU dispatch paths). An fp32 model measured up to 4.6e-6: Adam's
    # m / sqrt(v) amplifies the rounding of embedding rows that few tokens reach.
    one = runs(1, clip)[0]  # clip: with Polar Express and MuonEq-R too
    init = {n: _as_np(p) for n, p in make_model(opt_cfg()).named_parameters()}
    many = runs(world_size, clip)
    if clip:
        assert all(n > 2 * CLIP for n in one["norms"]), "clipping must bind for this test to mean anything"
    for r in range(world_size):  # replicated and gathered parameters are identical on every rank
        for n in one["params"]:
            np.testing.assert_array_equal(many[r]["params"][n], many[0]["params"][n])
    for n, ref in one["params"].items():
        ref64, init64 = torch.tensor(ref).double(), torch.tensor(init[n]).double()
        scale = max(ref64.norm(), (ref64 - init64).norm())
        err = (torch.tensor(many[0]["params"][n]).double() - ref64).norm()
        assert err <= 1e-5 * scale, (n, float(err / scale))
    for r in range(world_size):
        np.testing.assert_allclose(many[r]["norms"], one["norms"], rtol=1e-5)
    # The runs actually moved the parameters (a no-op optimizer would pass the equality above).
    for n in BANKS:
        assert rel_err(one["params"][n], init[n]) > 1e-2, n


def torch_reference_clip(grads: dict[str, np.ndarray], max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """torch's total norm of `grads` and the grads after torch's clip_grad_norm_ (on copies)."""
    ts = {n: torch.tensor(g) for n, g in grads.items()}
    total = float(torch.nn.utils.get_total_norm(list(ts.values())))
    returned = float(torch.nn.utils.clip_grad_norm_(_with_grads(ts), max_norm))
    assert abs(total - returned) <= 1e-6 * total
    return total, ts


def _with_grads(ts: dict[str, torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are the tensors in ts (clip_grad_norm_ then scales ts in place)."""
    params = []
    for t in ts.values():
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t
        params.append(p)
    return params


def assemble_banks(results: list[dict]) -> dict[str, np.ndarray]:
    """Concatenate the ranks' clipped bank shards and drop the padding rows."""
    out = {}
    for n in BANKS:
        full = np.concatenate([res["shards"][n] for res in results], axis=0)
        rows = results[0]["params"][n].shape[0]
        assert full.shape[0] == results[0]["shard_rows"][n] * len(results) >= rows
        np.testing.assert_array_equal(full[rows:], 0.0)  # padding rows carry no gradient
        out[n] = full[:rows]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_norm_and_clipping_match_torch(runs, world_size):
    # Reference: torch.nn.utils.get_total_norm / clip_grad_norm_ over the 1-process (global-batch) grads.
    # Tolerance: norm relative 1e-5, clipped grads relative (per tensor) 1e-5.
    one = runs(1, CLIP)[0]
    res = runs(world_size, CLIP)
    total, clipped_ref = torch_reference_clip(one["local_grads"], CLIP)
    assert total > 2 * CLIP
    for r in range(world_size):
        assert abs(res[r]["norms"][0] - total) <= 1e-5 * total
    got = dict(res[0]["clipped"], **assemble_banks(res))
    assert set(got) == set(clipped_ref)
    for n, ref in clipped_ref.items():
        assert rel_err(got[n], ref) <= 1e-5, n
    if world_size > 1:
        # Clipping each rank's local grads by its local norm, then averaging, is not the same thing:
        # the local norms are larger than the norm of the mean, so the step would be smaller.
        per_rank = {n: torch.zeros_like(t) for n, t in clipped_ref.items()}
        for r in range(world_size):
            ts = {n: torch.tensor(g) for n, g in res[r]["local_grads"].items()}
            torch.nn.utils.clip_grad_norm_(_with_grads(ts), CLIP)
            for n in ts:
                per_rank[n] += ts[n] / world_size
        flat_ref = torch.cat([t.flatten() for t in clipped_ref.values()])
        flat_local = torch.cat([per_rank[n].flatten() for n in clipped_ref])
        assert rel_err(flat_local, flat_ref) > 5e-2


def test_flat_tensors_of_mixed_dtypes_scale_and_write_back_exactly():
    """The replicated grads on CUDA mix bf16 tables and fp32 control tensors: the fp32 concatenation
    keeps each tensor's values and order, and writing back (one dtype at a time) casts each tensor once.
    Halving is exact in both dtypes, so the check is exact."""
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(5, 3, generator=g).bfloat16(), torch.randn(7, generator=g), torch.randn(2, 2, generator=g).bfloat16(),
          torch.randn(1, generator=g).double()]
    want = [t.clone() * 0.5 for t in ts]
    flat = tg.FlatTensors(ts).mean()  # one process: no all-reduce, the plain concatenation
    assert flat.dtype == torch.float32 and flat.numel() == sum(t.numel() for t in ts)
    assert torch.equal(flat, torch.cat([t.float().flatten() for t in ts]))
    flat_sq = float(flat.double().square().sum())
    assert abs(float(flat.dot(flat)) - flat_sq) <= 1e-6 * flat_sq
    buf = tg.FlatTensors(ts)
    buf.mean().mul_(0.5)
    buf.write_back()
    for t, w in zip(ts, want):
        assert t.dtype == w.dtype and torch.equal(t, w)


def test_returned_norm_is_pre_clip_and_clip_off_leaves_grads():
    # Single process, direct: Optimizers.step returns torch's total norm of the grads (tolerance 1e-6
    # relative) whether or not clipping binds, and with GRAD_CLIP_NORM=0 the grads are untouched (exact).
    for clip in (0.0, CLIP):
        cfg = opt_cfg(grad_clip_norm=clip)
        model = make_model(cfg)
        opt = tg.Optimizers(model, cfg, tg.Runtime())
        x, y = global_batch(0)
        model(x, y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        total = float(torch.nn.utils.get_total_norm(list(grads.values())))
        norm = float(opt.step())
        assert abs(norm - total) <= 1e-6 * total
        if clip == 0.0:
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, grads[n]), n


# ---------------------------------------------------------------------------------------------
# 3. The AdamW path
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_adamw_groups_match_torch_adamw(tie):
    # Reference: torch.optim.AdamW (foreach=False) on copies of the non-bank parameters, with the lrs
    # and weight decays REFERENCE.md gives: tables TIED_EMBED_LR (tied) or EMBED_LR (untied) with EMBED_WD,
    # everything else SCALAR_LR with ADAM_WD, lm_head HEAD_LR with no weight decay (the reference's plain
    # Adam). Clipping off, 5 steps with a changing lr scale. Tolerance: relative 1e-6 per tensor.
    cfg = opt_cfg(tie_embeddings=tie, adam_wd=0.1, embed_wd=0.2, beta1=0.8, beta2=0.9, adam_eps=1e-6)
    model = make_model(cfg)
    opt = tg.Optimizers(model, cfg, tg.Runtime())
    table_lr = cfg.tied_embed_lr if tie else cfg.embed_lr

    def expected(name: str) -> tuple[float, float]:
        if name in TOKEN_TABLES:
            return table_lr, cfg.embed_wd
        if name == "lm_head.weight":
            return cfg.head_lr, 0.0
        return cfg.scalar_lr, cfg.adam_wd

    named = [(n, p) for n, p in model.named_parameters() if n not in BANKS]
    assert any(n == "lm_head.weight" for n, _ in named) == (not tie)
    copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    ref = torch.optim.AdamW([dict(params=[copies[n]], lr=expected(n)[0], weight_decay=expected(n)[1],
                                  base_lr=expected(n)[0]) for n, _ in named],
                            betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, foreach=False)
    for step in range(5):
        scale, mom = schedule(step)
        x, y = global_batch(step)
        model(x, y).backward()
        for n, p in named:
            copies[n].grad = p.grad.detach().clone()
        for g in ref.param_groups:
            g["lr"] = g["base_lr"] * scale
        opt.set_schedule(scale, mom)
        opt.step()
        ref.step()
        opt.zero_grad()
        for n, p in named:
            assert rel_err(p.detach(), copies[n].detach()) <= 1e-6, (step, n)


# ---------------------------------------------------------------------------------------------
# 4. The parameter table
# ---------------------------------------------------------------------------------------------

def expected_group(name: str) -> str:
    """REFERENCE.md: banks -> Muon; token/bigram/value-embedding tables -> token; lm_head -> head."""
    if name in BANKS:
        return "muon"
    if name in TOKEN_TABLES:
        return "token"
    if name == "lm_head.weight":
        return "head"
    if name == "softcap_pm":  # AsymLogit's caps: no weight decay
        return "cap"
    return "scalar"


CONFIGS = {
    "default": {},
    "untied": dict(tie_embeddings=False),
    "no_bigram": dict(bigram_vocab_size=0),
    "no_ve": dict(ve_enabled=False),
    "no_smear": dict(smear_enabled=False),
    "record_smear": dict(smear_enabled=False, smear_gate_enabled=True),
    "all_off_untied": dict(tie_embeddings=False, bigram_vocab_size=0, ve_enabled=False, smear_enabled=False),
    "three_layers": dict(num_layers=3, ve_layers="1,2", xsa_last_n=2),
    "asym": dict(asym_logit_rescale=True),
}


@pytest.mark.parametrize("overrides", list(CONFIGS.values()), ids=list(CONFIGS))
def test_parameter_table_covers_every_parameter_once(overrides):
    cfg = opt_cfg(**overrides)
    model = tg.build_model(cfg, tg.Runtime())
    groups = tg.group_parameters(model)
    assert set(groups) == {g for g, _ in tg.PARAM_TABLE} == {"muon", "token", "head", "cap", "scalar"}
    seen = [id(p) for members in groups.values() for _, p in members]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    assert set(seen) == {id(p) for p in model.parameters()}
    for g, members in groups.items():
        for n, _ in members:
            assert expected_group(n) == g, (n, g)
    names = {n for n, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)
    assert ("bigram.embed.weight" in names) == (cfg.bigram_vocab_size > 0)
    assert ("ve.embed.weight" in names) == cfg.ve_enabled
    assert ("smear_gate" in names) == cfg.smear_enabled
    assert ("smear_gate_w" in names) == ("smear_lambda" in names) == cfg.smear_gate_enabled
    assert {n for n, _ in groups["muon"]} == set(BANKS)

    # The optimizers are built from those groups with the documented settings.
    opt = tg.Optimizers(model, cfg, tg.Runtime())
    assert {id(p) for p in opt.muon.param_groups[0]["params"]} == {id(p) for _, p in groups["muon"]}
    mg = opt.muon.param_groups[0]
    assert (mg["lr"], mg["weight_decay"], mg["momentum"], mg["ns_steps"]) == (
        cfg.matrix_lr, cfg.muon_wd, cfg.muon_momentum, cfg.muon_backend_steps)
    table_lr = cfg.tied_embed_lr if cfg.tie_embeddings else cfg.embed_lr
    want = {"token": (table_lr, cfg.embed_wd), "scalar": (cfg.scalar_lr, cfg.adam_wd), "head": (cfg.head_lr, 0.0),
            "cap": (cfg.scalar_lr, 0.0)}  # AsymLogit's caps: no weight decay
    adam_ids = set()
    for g in opt.adam.param_groups:
        ids = {id(p) for p in g["params"]}
        adam_ids |= ids
        (name,) = [k for k in want if ids == {id(p) for _, p in groups[k]}]
        assert (g["lr"], g["weight_decay"]) == want[name], name
    assert adam_ids == {id(p) for k in ("token", "scalar", "head", "cap") for _, p in groups[k]}
    assert opt.adam.defaults["betas"] == (cfg.beta1, cfg.beta2) and opt.adam.defaults["eps"] == cfg.adam_eps


# ---------------------------------------------------------------------------------------------
# 5. Optimizer state round trip (1 and 2 ranks; Muon state is sharded over ranks)
# ---------------------------------------------------------------------------------------------

def roundtrip_worker(rank: int, world_size: int, overrides: dict) -> dict:
    """Step 3, save (model + optimizers), step 3 more -> A. Fresh model (other seed) and fresh
    Optimizers, load both, step the same 3 -> B. Also C: load the model but not the optimizer state."""
    cfg = opt_cfg(**overrides)
    d = tg.Runtime(rank, world_size, rank)

    def run(model, opt, steps):
        for step in steps:
            opt.set_schedule(*schedule(step))
            x, y = global_batch(step)
            model(rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()

    model = make_model(cfg)
    opt = tg.Optimizers(model, cfg, d)
    run(model, opt, range(3))
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    # Muon's momentum shards as whole banks, on the CPU: a checkpoint fits any world size
    assert [tuple(m.shape) for m in saved[1]["momentum"]] == [tuple(p.shape) for p in opt.muon.banks]
    assert all(m.device.type == "cpu" for m in saved[1]["momentum"])
    momentum_dtypes = sorted(str(s["momentum"].dtype) for s in opt.muon.state.values())
    run(model, opt, range(3, 6))
    a = {n: _as_np(p) for n, p in model.named_parameters()}
    results = {}
    for load_opt in (True, False):
        fresh = make_model(cfg, seed=99)
        fresh.load_state_dict(saved[0])
        fopt = tg.Optimizers(fresh, cfg, d)
        if load_opt:
            fopt.load_state_dict(copy.deepcopy(saved[1]))
            loaded_dtypes = sorted(str(s["momentum"].dtype) for s in fopt.muon.state.values())
        run(fresh, fopt, range(3, 6))
        results[load_opt] = {n: _as_np(p) for n, p in fresh.named_parameters()}
    return dict(a=a, b=results[True], c=results[False], saved_dtypes=momentum_dtypes, loaded_dtypes=loaded_dtypes)


@pytest.mark.parametrize("world_size,reduce_dtype", [(1, "fp32"), (2, "fp32"), (1, "bf16")])
def test_optimizer_state_roundtrip(runs, world_size, reduce_dtype):
    # Exact equality: loading the saved state and stepping must reproduce the uninterrupted run bit for
    # bit on every rank (same ops, same order); the momentum buffers keep their dtype (bf16 on CUDA).
    overrides = dict(muon_reduce_dtype=reduce_dtype, grad_clip_norm=CLIP)
    if world_size == 1:
        results = [roundtrip_worker(0, 1, overrides)]
    else:  # the 2-rank group of runs (the same settings)
        assert reduce_dtype == "fp32"
        results = runs(world_size, ROUNDTRIP)
    want = "torch.bfloat16" if reduce_dtype == "bf16" else "torch.float32"
    for res in results:
        assert res["saved_dtypes"] == [want] * 4
        assert res["loaded_dtypes"] == res["saved_dtypes"], "load_state_dict changed the momentum dtype"
        for n in res["a"]:
            np.testing.assert_array_equal(res["b"][n], res["a"][n], err_msg=n)
        # The optimizer state matters: without it (fresh momentum/Adam moments) the result differs.
        assert max(rel_err(res["c"][n], res["a"][n]) for n in BANKS) > 1e-3


def test_whole_momentum_is_cut_into_the_shards_of_any_world_size():
    """A checkpoint stores each bank's momentum whole; a rank of any world size keeps its padded shard of it."""
    bank = torch.nn.Parameter(torch.zeros(5, 2, 3))
    m = torch.randn(5, 2, 3)
    for world_size in (1, 2, 3, 8):
        shards = []
        for rank in range(world_size):
            muon = tg.ParallelMuon([bank], 0.1, 0.9, 0.0, 1, torch.float32, world_size)
            muon.load_whole_momentum(bank, m, rank)
            shards.append(muon.state[bank]["momentum"])
        assert all(s.shape == (-(-5 // world_size), 2, 3) for s in shards)
        assert torch.equal(torch.cat(shards)[:5], m) and not torch.cat(shards)[5:].any()
        if world_size == 1:
            assert torch.equal(muon.whole_momentum(bank), m)
