"""Export: un-bank / re-bank, the int6 clip search, int8 tables, fp16 small tensors, the container, the
compressors, corrupt / truncated / wrong-config / over-limit artifacts, EVAL_ONLY reproducibility. References are
independent of the code under test: numpy per-row loops, a reader of the documented container written here with
zstandard."""
from __future__ import annotations

import base64
import copy
import json
import lzma
import re
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from conftest import SCRIPT, make_cfg, perturbed_model, run_inline, run_script, tiny_cfg, tiny_env
import train_gpt as tg

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")
# REFERENCE.md "Details that decide parity" (export): the per-row clip candidates, the table threshold.
CLIP_CANDIDATES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)
KEEP_FLOAT_MAX = 65536


def random_model(cfg: tg.Hyperparameters, seed: int, bank_std: float = 0.05, table_std: float = 0.02) -> tg.GPT:
    """Realistic non-zero weights everywhere, in eval mode."""
    return perturbed_model(cfg, seed, bank_std, table_std).eval()


def bank_slices(L: int) -> dict[str, tuple[str, int]]:
    return {f"blocks.{i}.{n}": (bank, slot * L + i) for i in range(L) for n, (bank, slot) in tg.MATRICES.items()}


def test_bank_layout_is_the_references():
    # REFERENCE.md: qo (2L, D, D) holds Q then attention out, kv (2L, kv, D) K then V; one bank each for MLP up, down
    assert tg.MATRICES == {"attn.q": ("qo_bank", 0), "attn.o": ("qo_bank", 1), "attn.k": ("kv_bank", 0),
                           "attn.v": ("kv_bank", 1), "mlp.up": ("mlp_up_bank", 0), "mlp.down": ("mlp_down_bank", 0)}
    model = tg.build_model(tiny_cfg(), tg.Runtime())
    L, D = 2, 32
    assert model.qo_bank.shape == (2 * L, D, D) and model.kv_bank.shape == (2 * L, 16, D)
    assert model.mlp_up_bank.shape == (L, 3 * D, D) and model.mlp_down_bank.shape == (L, D, 3 * D)


def read_artifact(blob: bytes, settings: dict | None = None) -> dict[str, np.ndarray]:
    """Independent reader of the documented format: b"PGA1", compressor byte (0 zstd, 3 rans), compressed
    payload; payload = b"PGT2", u32 LE header length, JSON {"settings": {...}, "tensors": [[name, dtype, shape],
    ...]}, raw LE data. Checks the stored settings against `settings` when given. (rANS streams are decoded by
    train_gpt.py; its own tests check them against the payload, byte for byte.)"""
    assert blob[:4] == b"PGA1" and blob[4] in (0, 3)
    payload = zstandard.ZstdDecompressor().decompress(blob[5:]) if blob[4] == 0 else tg.decompress(blob)
    assert payload[:4] == b"PGT2"
    (hlen,) = struct.unpack("<I", payload[4:8])
    out, off = {}, 8 + hlen
    header = json.loads(payload[8: off])
    assert settings is None or header["settings"] == settings
    for name, dtype, shape in header["tensors"]:
        dt = np.dtype({"int8": "i1", "float16": "<f2", "float32": "<f4"}[dtype])
        n = int(np.prod(shape))
        out[name] = np.frombuffer(payload, dt, count=n, offset=off).reshape(shape)
        off += n * dt.itemsize
    assert off == len(payload)
    return out


def export(state: dict, cfg: tg.Hyperparameters, method: str) -> tuple[bytes, str]:
    return tg.compress(tg.pack_tensors(tg.quantize_state(state, cfg), cfg), method)


# =============================================================================================
# 1-3. Quantization, container, compressors, banks
# =============================================================================================

# Tables: tok_emb 4096x32 = 131,072 and bigram 4097x16 = 65,552 elements (int8); ve.embed 4096x16 is
# exactly 65,536 elements (stays fp16: "at most 65,536").
QCFG = dict(vocab_size=4096, bigram_vocab_size=4097)


def check_rows(w: np.ndarray, codes: np.ndarray, scale: np.ndarray, deq: np.ndarray, qmax: int, q_lo: float):
    """Per-row symmetric quantization bound: |err| <= scale/2 for every element not above the smallest clip
    candidate (q_lo quantile of |w| in its row); an element above it may be clipped: |err| <= |w| - clip + s/2.
    Tolerance: 1e-5 of the scale (float32 division and product)."""
    assert codes.dtype == np.int8 and scale.dtype == np.float16
    assert np.abs(codes.astype(np.int32)).max() <= qmax
    np.testing.assert_array_equal(deq, codes.astype(np.float32) * scale.astype(np.float32)[:, None])
    w64, s = w.astype(np.float64), scale.astype(np.float64)[:, None]
    err = np.abs(deq.astype(np.float64) - w64)
    lo = np.quantile(np.abs(w64), q_lo, axis=1)[:, None]
    bound = s / 2 * (1 + 1e-5) + np.maximum(np.abs(w64) - lo, 0.0)
    assert np.all(err <= bound), float((err - bound).max())
    return err


@pytest.mark.parametrize("method", ["fast", "rans"])
def test_export_roundtrip_error_bounds_and_reproducible(tmp_path, method):
    cfg = tiny_cfg(**QCFG)
    L = cfg.num_layers
    model = random_model(cfg, seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    blob, used = export(state, cfg, method)
    assert used == {"fast": "zstd", "rans": "rans"}[method]
    path = tmp_path / "a.ptz"
    path.write_bytes(blob)
    # Exactly reproducible: a second export of an equal state gives a byte-identical file.
    (tmp_path / "b.ptz").write_bytes(export(copy.deepcopy(state), cfg, method)[0])
    assert path.read_bytes() == (tmp_path / "b.ptz").read_bytes()

    template = tg.build_model(cfg, tg.Runtime()).state_dict()
    header, stored = tg.read_artifact(path)
    settings = header["settings"]
    loaded = tg.dequantize_state(stored, template, L)
    assert list(loaded) == list(template)
    assert all(loaded[k].dtype == template[k].dtype and loaded[k].shape == template[k].shape for k in template)
    # the model's settings travel with it, exactly the MODEL_SETTINGS list
    assert settings == {n: getattr(cfg, n) for n in tg.MODEL_SETTINGS} and "xsa_last_n" in settings
    packed = read_artifact(path.read_bytes(), settings)

    slices = bank_slices(L)
    for name, (bank, j) in slices.items():  # int6 bank matrices
        w, deq = state[bank][j].numpy(), loaded[bank][j].numpy()
        err = check_rows(w, packed[name + ".q6"], packed[name + ".scale"], deq, 31, min(CLIP_CANDIDATES))
        # Whole-matrix MSE no worse than the plain max-scaled candidate (float32 selection: 1e-6 rel.).
        w64 = w.astype(np.float64)
        s = np.maximum(np.abs(w64).max(1) / 31, cfg.int6_scale_floor).astype(np.float16).astype(np.float64)[:, None]
        plain = np.mean((w64 - np.clip(np.round(w64 / s), -31, 31) * s) ** 2)
        assert np.mean(err ** 2) <= plain * (1 + 1e-6)
    tables = [k for k, v in state.items() if not k.endswith("_bank") and v.numel() > KEEP_FLOAT_MAX]
    assert sorted(tables) == ["bigram.embed.weight", "tok_emb.weight"]
    for name in tables:  # int8 per-row tables
        check_rows(state[name].numpy(), packed[name + ".q8"], packed[name + ".scale"], loaded[name].numpy(),
                   127, tg.INT8_CLIP_QUANTILE)
    rest = [k for k in state if not k.endswith("_bank") and k not in tables]
    assert "ve.embed.weight" in rest and state["ve.embed.weight"].numel() == KEEP_FLOAT_MAX
    for name in rest:  # fp16: exactly numpy's round-to-nearest fp16, so |err| <= 2^-11 |w| (normal range)
        w = state[name].numpy()
        np.testing.assert_array_equal(loaded[name].numpy(), w.astype(np.float16).astype(np.float32), err_msg=name)
        assert np.all(np.abs(loaded[name].numpy() - w) <= np.abs(w) * 2.0 ** -11 + 2.0 ** -25)


def test_the_largest_vocabulary_exports_and_reads_back(tmp_path):
    """Issue 22: at VOCAB_SIZE=65,536 the tables quantise per row as at 4,096 (the int8 bound holds on the
    last rows too), the artifact reads back into the model, and the read-back model runs on id 65,535."""
    cfg = tiny_cfg(vocab_size=65536, bigram_vocab_size=4097)
    state = {k: v.detach().clone() for k, v in random_model(cfg, seed=2).state_dict().items()}
    path = tmp_path / "v.ptz"
    path.write_bytes(export(state, cfg, "fast")[0])
    header, stored = tg.read_artifact(path)
    settings = header["settings"]
    assert settings["vocab_size"] == 65536
    model = tg.build_model(cfg, tg.Runtime())
    model.load_state_dict(tg.dequantize_state(stored, model.state_dict(), cfg.num_layers))
    packed = read_artifact(path.read_bytes(), settings)
    for name in ("tok_emb.weight", "bigram.embed.weight"):
        assert packed[name + ".q8"].shape == state[name].shape
        check_rows(state[name].numpy(), packed[name + ".q8"], packed[name + ".scale"],
                   model.state_dict()[name].numpy(), 127, tg.INT8_CLIP_QUANTILE)
    ids = torch.tensor([[65535, 65534, 1, 65535] * 8])
    assert torch.isfinite(model.eval()(ids, ids.roll(-1, 1)))


def test_a_one_layer_model_reads_back_its_empty_skip_tensors(tmp_path):
    """NUM_LAYERS=1 without loops has U-Net skips of 0 rows: written, and read back with their shapes (the reader
    refused 0 bytes, after a whole training run), and the read-back model loads them."""
    cfg = tiny_cfg(num_layers=1, num_loops=0, xsa_last_n=1, ve_layers="0")
    state = {k: v.detach().clone() for k, v in random_model(cfg, seed=2).state_dict().items()}
    assert {k for k, v in state.items() if v.numel() == 0} == {"skip_weights", "skip_gates"}
    for coder in ("rans", "fast"):
        path = tmp_path / f"{coder}.ptz"
        path.write_bytes(export(state, cfg, coder)[0])
        stored = tg.read_artifact(path)[1]
        model = tg.build_model(cfg, tg.Runtime())
        model.load_state_dict(tg.dequantize_state(stored, model.state_dict(), cfg.num_layers))
        assert model.state_dict()["skip_weights"].shape == state["skip_weights"].shape == (0, cfg.model_dim)


@pytest.mark.filterwarnings(r"ignore:std\(\)")  # torch says the std of one value is undefined
def test_a_one_column_table_under_an_sd_clip_is_refused_not_written_as_nan():
    """BIGRAM_DIM=1: a row of one value has no std (NaN), so every scale was NaN and the artifact scored NaN (a
    review); the clip search codes it."""
    cfg = tiny_cfg(bigram_dim=1, bigram_vocab_size=70_000, embed_clip_sigmas=14.0)  # a coded table, SD clip
    state = {k: v.detach().clone() for k, v in random_model(cfg, seed=3).state_dict().items()}
    with pytest.raises(ValueError, match=r"export: bigram\.embed\.weight\.\w+ not finite .*CLIP_SIGMAS=0"):
        tg.quantize_state(state, cfg)
    out = tg.quantize_state(state, tg.replace(cfg, embed_clip_sigmas=0.0))
    assert all(torch.isfinite(v).all() for v in out.values() if v.is_floating_point())


def test_both_coders_read_back_and_older_coders_are_refused():
    """COMPRESSOR=rans and fast give the payload back byte for byte, each marked by its byte; an artifact of a coder
    this script no longer writes (1: xz, 2: the order-0 rANS) is refused with what to do."""
    cfg = tiny_cfg(**QCFG)
    payload = tg.pack_tensors(tg.quantize_state(random_model(cfg, seed=2).state_dict(), cfg), cfg)
    for method, coder, byte in (("rans", "rans", 3), ("fast", "zstd", 0)):
        blob, used = tg.compress(payload, method)
        assert used == coder and blob[:5] == b"PGA1" + bytes([byte]) and tg.decompress(blob) == payload
        unpacked, ref = tg.unpack_tensors(payload)[1], read_artifact(blob)
        assert list(unpacked) == list(ref) and all(np.array_equal(unpacked[k].numpy(), ref[k]) for k in ref)
    xz = b"PGA1\x01" + lzma.compress(payload, format=lzma.FORMAT_XZ)
    with pytest.raises(ValueError, match="coders of an older train_gpt.py: export it again"):
        tg.decompress(xz)


def test_fast_coder_is_zstd_level_3_and_reads_back():
    """COMPRESSOR=fast (sweeps): an ordinary zstd artifact, byte-identical to zstandard's own level-3 output."""
    cfg = tiny_cfg(**QCFG)
    payload = tg.pack_tensors(tg.quantize_state(random_model(cfg, seed=2).state_dict(), cfg), cfg)
    blob, coder = tg.compress(payload, "fast")
    assert coder == "zstd" and blob[:5] == b"PGA1\x00"
    assert blob[5:] == zstandard.ZstdCompressor(level=3, write_checksum=True).compress(payload)
    assert tg.decompress(blob) == payload


def brute_force_int6(w: np.ndarray, floor: float) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Per-row loop over the clip candidates in float64; returns (mse, codes, scales) per candidate."""
    w = w.astype(np.float64)
    out = []
    for qt in CLIP_CANDIDATES:
        codes, scales = np.empty(w.shape, np.int8), np.empty(w.shape[0], np.float16)
        for r in range(w.shape[0]):
            a = np.abs(w[r])
            c = a.max() if qt == 1.0 else np.quantile(a, qt)
            scales[r] = np.float16(max(c / 31, floor))
            codes[r] = np.clip(np.round(np.clip(w[r], -c, c) / float(scales[r])), -31, 31)
        mse = float(np.mean((w - codes * scales.astype(np.float64)[:, None]) ** 2))
        out.append((mse, codes, scales))
    return out


@pytest.mark.parametrize("dist, floor", [("normal0.05", 1 / 31), ("student_t", 1e-4), ("student_t", 1 / 31),
                                         ("row_scaled", 1e-4)])
def test_int6_clip_search_is_brute_force_argmin(dist, floor):
    g = np.random.default_rng(7)
    shape = (24, 1500)
    if dist == "normal0.05":
        w = g.normal(0, 0.05, shape)
    elif dist == "student_t":
        w = g.standard_t(2.0, shape)
    else:
        w = g.normal(0, 1, shape) * np.exp(g.normal(0, 2, (shape[0], 1)))
    w = w.astype(np.float32)
    codes, scales = tg.quantize_rows(torch.from_numpy(w), 31, tg.CLIP_QUANTILES, floor)
    assert tuple(tg.CLIP_QUANTILES) == CLIP_CANDIDATES
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    codes, scales = codes.numpy(), scales.numpy()
    assert np.abs(codes.astype(np.int32)).max() <= 31
    assert np.all(scales >= np.float16(floor))  # floor as stored: fp16(1/31) = 0.0322571 < 1/31
    cands = brute_force_int6(w, floor)
    best = min(c[0] for c in cands)
    # Near-ties (within 1e-6 relative, the float32 selection) may go either way.
    ok = [c for c in cands if c[0] <= best * (1 + 1e-6)]
    assert any(np.array_equal(codes, c[1]) and np.array_equal(scales, c[2]) for c in ok)
    if dist == "student_t" and floor < 1e-3:  # the data really exercises the search: clipping wins
        assert cands[-1][0] > best * (1 + 1e-3)


def test_quantize_state_kinds_dtypes_and_floor():
    cfg = tiny_cfg(**QCFG, int6_scale_floor=1 / 31)
    state = random_model(cfg, seed=3, bank_std=2.0).state_dict()
    packed = tg.quantize_state(state, cfg)
    L = cfg.num_layers
    bank_names = set(bank_slices(L))
    tables = {k for k, v in state.items() if not k.endswith("_bank") and v.numel() > KEEP_FLOAT_MAX}
    small = {k for k in state if not k.endswith("_bank")} - tables
    want = ({f"{n}.q6" for n in bank_names} | {f"{n}.scale" for n in bank_names | tables}
            | {f"{n}.q8" for n in tables} | {f"{n}.f16" for n in small})
    assert "ve.embed.weight.f16" in packed and "bigram.embed.weight.q8" in packed  # 65,536 vs 65,552
    for k, t in packed.items():
        kind = k.rsplit(".", 1)[1]
        if kind == "q6":
            assert t.dtype == torch.int8 and int(t.abs().max()) <= 31
            assert int(t.abs().max()) == 31  # std 2 weights: the floor does not bind everywhere
        elif kind == "q8":
            assert t.dtype == torch.int8 and int(t.abs().max()) <= 127
        elif kind == "f16":
            assert t.dtype == torch.float16
        else:
            assert t.dtype == torch.float16 and t.ndim == 1
    for n in bank_names:
        assert bool((packed[n + ".scale"] >= torch.tensor(cfg.int6_scale_floor).half()).all())
    # Only the 6L bank matrices are int6; small control tensors (e.g. blocks.{i}.resid_mix, 2 x D) stay fp16.
    assert set(packed) == want, f"int6: {sorted(k for k in set(packed) - want)}, missing: {sorted(want - set(packed))}"


def test_unbank_rebank_identity_names_shapes():
    cfg = tiny_cfg(num_layers=3, ve_layers="1,2", mlp_mult=2.0)
    L, D, kv, mlp = 3, 32, cfg.num_kv_heads * cfg.head_dim, 64
    state = random_model(cfg, seed=4).state_dict()
    flat = tg.unbank(state, L)
    shapes = {"attn.q": (D, D), "attn.o": (D, D), "attn.k": (kv, D), "attn.v": (kv, D),
              "mlp.up": (mlp, D), "mlp.down": (D, mlp)}
    per_layer = set(flat) - {k for k in state if not k.endswith("_bank")}
    assert len(per_layer) == 6 * L and per_layer == set(bank_slices(L))
    for name, (bank, j) in bank_slices(L).items():
        assert tuple(flat[name].shape) == shapes[name.split(".", 2)[2]]
        assert torch.equal(flat[name], state[bank][j])
    for k in state:
        if not k.endswith("_bank"):
            assert flat[k] is state[k] or torch.equal(flat[k], state[k])
    back = tg.rebank({k: v.clone() for k, v in flat.items()}, L)
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k


# =============================================================================================
# 7-9. Artifacts through the script
# =============================================================================================

def env_cfg(dataset, tokenizer_path, **kw) -> tg.Hyperparameters:
    return tg.Hyperparameters.from_env(tiny_env(dataset, tokenizer_path, **kw))[0]


def write_artifact(path: Path, cfg: tg.Hyperparameters, method: str, seed: int = 10) -> bytes:
    blob = export(random_model(cfg, seed).state_dict(), cfg, method)[0]
    path.write_bytes(blob)
    return blob


def damaged(blob: bytes, how: str) -> bytes:
    if how == "truncated":
        return blob[: len(blob) // 2]
    b = bytearray(blob)
    k = len(b) // 2
    b[k: k + 8] = bytes(v ^ 0x5A for v in b[k: k + 8])
    return bytes(b)


@pytest.mark.parametrize("method", ["fast", "rans"])
@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_corrupt_or_truncated_artifact_is_a_clear_error(tmp_path, dataset, tokenizer_path, method, how):
    cfg = env_cfg(dataset, tokenizer_path)
    blob = write_artifact(tmp_path / "good.ptz", cfg, method)
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(damaged(blob, how))
    template = tg.build_model(cfg, tg.Runtime()).state_dict()
    with pytest.raises(ValueError, match="corrupt|truncated"):
        tg.decompress(bad.read_bytes())
    with pytest.raises(ValueError, match="corrupt|truncated"):
        tg.read_artifact(bad)
    tg.dequantize_state(tg.read_artifact(tmp_path / "good.ptz")[1], template, cfg.num_layers)  # the undamaged file loads


def test_artifact_with_trailing_bytes_is_rejected(tmp_path):
    """Bytes appended after a complete compressed stream must not load silently (a botched copy or
    concatenation): zstd's one-shot API ignores trailing data unless checked; rANS's streams must end at the start."""
    cfg = tiny_cfg()
    for method in ("fast", "rans"):
        blob = export(random_model(cfg, seed=12).state_dict(), cfg, method)[0]
        with pytest.raises(ValueError):
            tg.decompress(blob + b"\x00garbage appended after the stream\x00" * 4)


@pytest.mark.parametrize("method, how", [("fast", "flipped"), ("rans", "truncated")])
def test_eval_only_corrupt_artifact_exits_nonzero(tmp_path, dataset, tokenizer_path, method, how, monkeypatch):
    cfg = env_cfg(dataset, tokenizer_path)
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(damaged(write_artifact(tmp_path / "good.ptz", cfg, method), how))
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, EVAL_ONLY=str(bad), RUN_ID="corrupt"), tmp_path)
    assert r.returncode != 0
    assert re.search(r"ValueError: artifact is corrupt or truncated", r.stderr), r.stderr[-2000:]
    assert "final_int6_roundtrip" not in r.stdout


@pytest.mark.parametrize("key, value", [("NUM_LAYERS", "3"), ("XSA_LAST_N", "0"), ("MLP_NEGATIVE_SLOPE", "0")])
def test_eval_only_refuses_model_settings_that_differ_from_the_artifacts(tmp_path, dataset, tokenizer_path, key,
                                                                           value, monkeypatch):
    """Before artifacts stored their settings, XSA_LAST_N=0 scored the quickstart artifact 2.3397 instead of 1.8146
    (exit 0), MLP_NEGATIVE_SLOPE=0 1.8900: settings that keep the tensor shapes went unchecked."""
    good = tmp_path / "good.ptz"
    write_artifact(good, env_cfg(dataset, tokenizer_path), "fast")
    env = tiny_env(dataset, tokenizer_path, EVAL_ONLY=str(good), RUN_ID="wrong", **{key: value})
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and f"{key}=" in errors[0] and f"leave {key} unset" in errors[0], r.stderr[-2000:]
    assert str(good) in errors[0]


def test_tensors_of_another_model_are_refused():
    cfg = tiny_cfg()
    _, stored = tg.unpack_tensors(tg.decompress(export(random_model(cfg, seed=3).state_dict(), cfg, "fast")[0]))
    template = tg.build_model(tiny_cfg(num_layers=3), tg.Runtime()).state_dict()
    with pytest.raises(ValueError, match="does not match the model settings"):
        tg.dequantize_state(stored, template, 3)


def test_over_limit_artifact_scores_then_fails(tmp_path, dataset, tokenizer_path, monkeypatch):
    """An honest artifact over 16,000,000 bytes: a model with 1,050,000 BigramHash buckets whose int8 table
    codes are random (incompressible). EVAL_ONLY scores it, then reports the limit and exits non-zero."""
    buckets = 1_050_000
    cfg = env_cfg(dataset, tokenizer_path, BIGRAM_VOCAB_SIZE=buckets)
    state = random_model(env_cfg(dataset, tokenizer_path), seed=13).state_dict()  # same shapes but the table
    state.pop("bigram.embed.weight")
    packed = tg.quantize_state(state, cfg)
    g = torch.Generator().manual_seed(0)
    packed["bigram.embed.weight.q8"] = torch.randint(-127, 128, (buckets, cfg.bigram_dim), generator=g,
                                                     dtype=torch.int8)
    packed["bigram.embed.weight.scale"] = torch.full((buckets,), 1e-3, dtype=torch.float16)
    big = tmp_path / "big.ptz"
    big.write_bytes(tg.compress(tg.pack_tensors(packed, cfg), "fast")[0])
    code_bytes = len(tg.shipped_code(SCRIPT.read_text(encoding="utf-8")))  # the code as a record ships it
    total = big.stat().st_size + code_bytes
    assert total > 16_000_000 == tg.SIZE_LIMIT_BYTES
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, EVAL_ONLY=str(big), BIGRAM_VOCAB_SIZE=str(buckets),
                                         RUN_ID="over"), tmp_path)
    assert r.returncode != 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert f"Total submission size int6+zstd: {total} bytes limit:16000000 headroom:{16_000_000 - total}" in lines
    keys = [ln.split()[0] for ln in lines]
    i_rt, i_sw = keys.index("final_int6_roundtrip_exact"), keys.index("final_int6_sliding_window_exact")
    assert i_rt < i_sw < len(lines) - 1
    assert lines[-1] == f"ERROR submission_over_limit total:{total} limit:16000000 over_by:{total - 16_000_000}"
    log = (tmp_path / "logs" / "over.txt").read_text(encoding="utf-8").strip().splitlines()
    assert log[-1] == lines[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset, tokenizer_path):
    cwd = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as mp:
        r = run_inline(mp, tiny_env(dataset, tokenizer_path, ITERATIONS="8", RUN_ID="train"), cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return cwd, r.stdout.splitlines()


def test_eval_only_reproduces_training_run_scores(tmp_path, dataset, tokenizer_path, trained, monkeypatch):
    cwd, train_lines = trained
    artifact = cwd / "logs" / "train.int6.ptz"  # the default ARTIFACT_PATH: logs/<RUN_ID>.int6.ptz
    assert artifact.is_file()
    # EVAL_ONLY builds the model from the artifact's settings: the tiny model's are all left unset here
    env = {k: v for k, v in tiny_env(dataset, tokenizer_path, EVAL_ONLY=str(artifact), RUN_ID="eval").items()
           if k.lower() not in tg.MODEL_SETTINGS}
    assert "NUM_LAYERS" not in env and "VOCAB_SIZE" not in env
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    eval_lines = r.stdout.splitlines()
    assert not list((tmp_path / "logs").glob("*.ptz"))  # EVAL_ONLY writes no artifact

    def pick(lines, key):
        found = [ln for ln in lines if ln.split(" ", 1)[0] == key]
        assert len(found) == 1, (key, found)
        return found[0]
    for key in ("final_int6_sliding_window_exact", "final_int6_roundtrip_exact"):
        assert pick(eval_lines, key) == pick(train_lines, key)
    for key in ("final_int6_sliding_window", "final_int6_roundtrip"):  # scored_tokens / scored_bytes too
        a, b = pick(eval_lines, key), pick(train_lines, key)
        assert re.search(r"scored_tokens:\d+ scored_bytes:\d+", a).group() == \
            re.search(r"scored_tokens:\d+ scored_bytes:\d+", b).group()
    total = artifact.stat().st_size + len(tg.shipped_code(SCRIPT.read_text(encoding="utf-8")))
    line = pick(eval_lines, "Total")
    assert line.startswith("Total submission size") and f" {total} bytes " in line
    assert pick(train_lines, "Total") == pick(eval_lines, "Total")


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """A full disk used to leave a half-written artifact: write_atomic writes beside the file, then renames."""
    path = tmp_path / "model.ptz"
    tg.write_atomic(path, b"old artifact")
    def disk_full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tg.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        tg.write_atomic(path, b"new artifact")
    assert path.read_bytes() == b"old artifact" and [p.name for p in tmp_path.iterdir()] == ["model.ptz"]


# =============================================================================================
# GPTQ
# =============================================================================================

def gptq_reference(w: np.ndarray, x: np.ndarray, scale: np.ndarray, qmax: int, damp: float) -> np.ndarray:
    """GPTQ's greedy rule by brute force, in float64, with no Cholesky factor or lazy block: columns in order of
    decreasing H_jj (H = X^T X + damp mean(diag) I); each is rounded on the row's grid, then every column not yet
    rounded is re-fitted from the original weights by least squares, min ||X_aug (w - w')||^2 with the rounded
    columns fixed (X_aug = X over sqrt(lambda) I, so X_aug^T X_aug = H)."""
    c = w.shape[1]
    h = x.T @ x
    lam = damp * np.mean(np.diag(h))
    x_aug = np.vstack([x, np.sqrt(lam) * np.eye(c)])
    order = np.argsort(-np.diag(h), kind="stable")
    codes = np.zeros_like(w)
    for r in range(w.shape[0]):
        cur, fixed = w[r].copy(), []
        for j in order:
            codes[r, j] = np.clip(np.round(cur[j] / scale[r]), -qmax, qmax)
            fixed.append(j)
            free = [k for k in range(c) if k not in fixed]
            if free:
                d_fixed = w[r, fixed] - codes[r, fixed] * scale[r]
                d_free = np.linalg.lstsq(x_aug[:, free], -x_aug[:, fixed] @ d_fixed, rcond=None)[0]
                cur[free] = w[r, free] - d_free
    return codes


def test_gptq_matches_a_brute_force_least_squares_reference(monkeypatch):
    monkeypatch.setattr(tg, "GPTQ_BLOCK", 8)  # 3 lazy blocks, the last one partial
    rng = np.random.default_rng(0)
    r, c, n = 5, 21, 64
    mix = rng.normal(size=(c, c)) * 0.3 + np.eye(c)  # correlated inputs: the updates matter
    x = rng.normal(size=(n, c)) @ mix * rng.uniform(0.2, 3.0, size=c)
    w = rng.normal(size=(r, c)) * 0.05
    scale = (np.abs(w).max(1) / 7).astype(np.float16).astype(np.float64)
    want = gptq_reference(w, x, scale, 7, tg.GPTQ_DAMP)
    got = tg.gptq_codes(torch.tensor(w), torch.tensor(x.T @ x), torch.tensor(scale), 7)
    assert got.dtype == torch.int8
    np.testing.assert_array_equal(got.numpy(), want)
    rtn = np.clip(np.round(w / scale[:, None]), -7, 7)
    assert (rtn != want).any()  # GPTQ chose other codes than rounding, and they fit the layer's output better:
    out_err = lambda q: np.linalg.norm(x @ (w - q * scale[:, None]).T)
    assert out_err(want) < 0.9 * out_err(rtn)


def test_calibration_sums_x_transpose_x_in_fp32_under_autocast():
    """On CUDA the forward runs under bf16 autocast, which also casts a matmul of fp32 inputs to bf16: H summed
    that way was indefinite (GPTQ's Cholesky failed on an H200). observe keeps X^T X in fp32."""
    model = tg.build_model(tiny_cfg(), tg.Runtime())
    x = torch.randn(4, 64, 32).bfloat16()
    hessians = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tg.observe(hessians, ("attn.o",), 0, x)
    h, want = hessians["attn.o", 0], x.double().reshape(-1, 32).T @ x.double().reshape(-1, 32)
    assert h.dtype == torch.float32
    # fp32 sums of 256 products of bf16 values (|x| <= ~4): entries up to ~256 (the diagonal), ~16 off it, ~1e-5
    # apart; a bf16 sum would be ~1 apart. Measured <= 0.04x this tolerance.
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-4)


def test_gptq_zeroes_columns_no_input_reaches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6))
    x[:, 2] = 0.0
    w = rng.normal(size=(3, 6))
    codes = tg.gptq_codes(torch.tensor(w), torch.tensor(x.T @ x), torch.full((3,), 0.1, dtype=torch.float64), 31)
    assert (codes[:, 2] == 0).all() and (codes[:, [0, 1, 3, 4, 5]] != 0).any()


def test_calibrate_sums_each_matrix_input_over_batches_and_gptq_lowers_the_layer_error(dataset, tokenizer_path):
    """calibrate's H for layer 0's q/k/v is X^T X of that layer's normed input, computed here without the hook;
    each matrix kind has one H per layer; GPTQ lowers the layers' output error below rounding's."""
    cfg = env_cfg(dataset, tokenizer_path, TRAIN_BATCH_TOKENS=256, GRAD_ACCUM_STEPS=2)
    model = random_model(cfg, seed=5)
    loader = tg.TrainLoader(tg.shard_files(str(dataset), "train"), cfg, tg.Runtime(grad_accum_steps=2))
    pairs = tg.TrainLoader(tg.shard_files(str(dataset), "train"), cfg, tg.Runtime(grad_accum_steps=2)).next_batch()
    h = tg.calibrate(model, loader, 2)
    banks = {(n, i) for n in tg.MATRICES for i in range(cfg.num_layers)}
    assert set(h) == banks | {("head", 0)}
    want, head = 0.0, 0.0
    with torch.no_grad():
        for ids, _ in pairs:
            final = model.hidden(ids).reshape(-1, cfg.model_dim).double()
            head = head + final.T @ final
            x0 = model.embed(ids)
            mix = model.blocks[0].resid_mix
            inp = tg.rms_norm(mix[0] * x0 + mix[1] * x0).reshape(-1, cfg.model_dim).double()
            want = want + inp.T @ inp
    for n in ("attn.q", "attn.k", "attn.v"):  # fp32 sums of 256 products of unit-RMS inputs: measured <= 0.1x
        torch.testing.assert_close(h[n, 0].double(), want, rtol=1e-5, atol=1e-4)
        assert torch.linalg.eigvalsh(h[n, 0].double()).min() > -1e-6 * want.diagonal().mean()  # PSD, as X^T X
    torch.testing.assert_close(h["head", 0].double(), head, rtol=1e-5, atol=1e-4)  # the output head's input
    assert h["mlp.down", 1].shape == (3 * cfg.model_dim,) * 2
    # the layer-output error GPTQ minimises, sum over matrices of tr((W - W_q) H (W - W_q)^T): below rounding's
    state, errors = tg.unbank(model.state_dict(), cfg.num_layers), {}
    for name, hess in (("rtn", None), ("gptq", h)):
        packed = tg.quantize_state(model.state_dict(), cfg, hess)
        errors[name] = 0.0
        for n, i in banks:
            key, hm = f"blocks.{i}.{n}", h[n, i]
            d = state[key].detach() - packed[key + ".q6"].float() * packed[key + ".scale"].float()[:, None]
            errors[name] += float(torch.einsum("rc,cd,rd->", d, hm, d))
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


@pytest.mark.parametrize("tied", [True, False])
def test_embed_bits_and_the_head_gptqd_on_the_final_hidden_states(tied):
    """EMBED_BITS=7: every big table's codes within +-63; the output head (tok_emb when tied, else lm_head) gets
    GPTQ's codes for H of the final hidden states, with a lower output error than rounding; the other tables
    are rounded."""
    cfg = tiny_cfg(**QCFG, tie_embeddings=tied, embed_bits=7)
    state = random_model(cfg, seed=8).state_dict()
    x = torch.randn(512, cfg.model_dim, dtype=torch.float64) * torch.linspace(0.1, 2.0, cfg.model_dim)
    hessians = {k: torch.eye(cfg.model_dim * (3 if k[0] == "mlp.down" else 1)) for k in
                ((n, i) for n in tg.MATRICES for i in range(cfg.num_layers))} | {("head", 0): (x.T @ x).float()}
    packed, rounded = tg.quantize_state(state, cfg, hessians), tg.quantize_state(state, cfg)
    head = "tok_emb.weight" if tied else "lm_head.weight"
    tables = [k for k in packed if k.endswith(".q8")]
    assert f"{head}.q8" in tables and "bigram.embed.weight.q8" in tables
    assert all(packed[k].abs().max() <= 63 for k in tables)
    w, scale = state[head].double(), packed[f"{head}.scale"].double()
    want = tg.gptq_codes(w, hessians["head", 0], scale, 63)
    assert torch.equal(packed[f"{head}.q8"], want) and not torch.equal(want, rounded[f"{head}.q8"])
    out_err = lambda q: float((x @ (w - q.double() * scale[:, None]).T).norm())
    assert out_err(packed[f"{head}.q8"]) < out_err(rounded[f"{head}.q8"])
    assert torch.equal(packed["bigram.embed.weight.q8"], rounded["bigram.embed.weight.q8"])


def test_sd_clip_sets_each_row_scale_from_its_std():
    cfg = tiny_cfg(matrix_clip_sigmas=12.85)
    w = torch.randn(8, 32) * torch.linspace(0.01, 0.1, 8)[:, None]
    codes, scale = tg.quantize_matrix(w, tg.clip_sigmas(cfg, "attn.q"), cfg.int6_scale_floor, None)
    want = np.maximum(12.85 * w.std(dim=1).numpy() / 31, cfg.int6_scale_floor).astype(np.float16)
    np.testing.assert_array_equal(scale.numpy(), want)
    np.testing.assert_array_equal(codes.numpy(), np.clip(np.round(w.numpy() / want.astype(np.float32)[:, None]), -31, 31))


def test_mlp_and_attention_clip_sigmas_override_the_matrix_one_per_kind():
    cfg = tiny_cfg(**QCFG, matrix_clip_sigmas=12.85, mlp_clip_sigmas=5.0)
    assert [tg.clip_sigmas(cfg, m) for m in ("mlp.up", "mlp.down", "attn.q", "attn.o")] == [5.0, 5.0, 12.85, 12.85]
    state = random_model(cfg, seed=9).state_dict()
    packed, flat = tg.quantize_state(state, cfg), tg.unbank(state, cfg.num_layers)
    for name, k in (("blocks.0.mlp.down", 5.0), ("blocks.1.attn.k", 12.85)):
        want = np.maximum(k * flat[name].detach().std(dim=1).numpy() / 31, cfg.int6_scale_floor).astype(np.float16)
        np.testing.assert_array_equal(packed[name + ".scale"].numpy(), want)
    both = [tg.predict_artifact_bytes(replace(cfg, matrix_clip_sigmas=k, mlp_clip_sigmas=0.0)) for k in (12.85, 5.0)]
    assert both[0] < tg.predict_artifact_bytes(cfg) < both[1]  # each kind predicted at its own k


def test_gptq_damps_more_only_when_h_is_singular(monkeypatch):
    """An H that is indefinite beyond the 1% damping (as the bf16-summed one was) gets 10x, then 100x the damping
    instead of failing the export after a finished training run; the codes stay on the grid."""
    w = torch.randn(4, 8, dtype=torch.float64)
    h = torch.eye(8, dtype=torch.float64)
    h[0, 0] = -0.05  # mean diag 0.86875: 1% damping leaves it negative, 10% does not
    codes = tg.gptq_codes(w, h, torch.full((4,), 0.05, dtype=torch.float64), 31)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 31
    h[0, 0] = -10.0  # beyond 100%: an error, not silent garbage
    with pytest.raises(torch.linalg.LinAlgError):
        tg.gptq_codes(w, h, torch.full((4,), 0.05, dtype=torch.float64), 31)


# =============================================================================================
# The code a record ships
# =============================================================================================

def test_the_shipped_stub_runs_alone_and_scores_as_the_readable_file(dataset, tokenizer_path, tmp_path):
    """A record ships train_gpt.py as shipped_code's stub: the source without its prose and with one-space indents,
    xz + base85, run from linecache so that @triton.jit can read its kernels' source. At most 55,000 bytes for this
    file. Alone in an empty folder on the tiny config it trains and scores exactly as the readable file does (every
    loss and score, the artifact's bytes); its log embeds the source it ran (without shipped_code, the packaging)
    and counts code_bytes as its own size, as the readable file counts it too."""
    source = SCRIPT.read_text(encoding="utf-8")
    stub = tmp_path / "train_gpt.py"
    stub.write_bytes(tg.shipped_code(source))
    assert stub.read_bytes() == tg.shipped_code(source) and stub.stat().st_size <= 55_000  # deterministic
    env = tiny_env(dataset, tokenizer_path, ITERATIONS="2", COMPRESSOR="rans")
    logs, artifacts = {}, {}
    for name, script in (("stub", stub), ("readable", SCRIPT)):
        r = run_script(dict(env, RUN_ID=name), tmp_path / name, script=script)
        assert r.returncode == 0, r.stderr[-3000:]
        logs[name] = (tmp_path / name / "logs" / f"{name}.txt").read_text(encoding="utf-8")
        artifacts[name] = (tmp_path / name / "logs" / f"{name}.int6.ptz").read_bytes()
    shipped = logs["stub"].split("==== source: train_gpt.py ====\n", 1)[1].split("\n==== end source ====", 1)[0]
    assert "#" not in "".join(line.split('"')[0] for line in shipped.splitlines()) and '"""' not in shipped
    packed = re.search(r'b85decode\("([^"]*)"\)', stub.read_text(encoding="utf-8"))[1]
    assert lzma.decompress(base64.b85decode(packed)).decode("utf-8") == shipped  # the log embeds what ran
    assert "def shipped_code" not in shipped and "def shipped_bytes" in shipped  # packaging is not shipped
    for log in logs.values():
        assert f"\ncode_bytes:{stub.stat().st_size}\n" in log
    scores = {n: re.findall(r"^(\S+(?:_exact)? val_loss:\S+ val_bpb:\S+|step:\S+ train_loss:\S+)", log, re.M)
              for n, log in logs.items()}
    assert scores["stub"] == scores["readable"] and len(scores["stub"]) > 6
    assert artifacts["stub"] == artifacts["readable"]
    run = tmp_path / "stub"
    if tg.triton is not None:  # the kernels were defined from the unpacked source: Triton read it back
        probe = run_script({"PYTHONPATH": "", "KERNELS": "triton"}, run, script=_probe(tmp_path, stub))  # interpreter
        assert probe.returncode == 0 and probe.stdout.strip() == "kernel source found", probe.stderr[-2000:]


def _probe(tmp_path: Path, stub: Path) -> Path:
    """A script that loads the stub as a module (not as __main__) and prints whether Triton kept a kernel's source."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"import inspect, runpy\nns = runpy.run_path({str(stub)!r}, run_name='stub')\n"
                     "src = inspect.getsource(ns['_xsa_fwd'].fn)  # what @triton.jit reads\n"
                     "print('kernel source found' if src.lstrip().startswith('@triton.jit') else 'missing')\n")
    return probe


# =============================================================================================
# Predicted artifact size and AUTO_SIZE
# =============================================================================================

@pytest.mark.parametrize("fields", [{}, dict(tie_embeddings=False, bigram_vocab_size=0), dict(ve_enabled=False)])
def test_prediction_counts_what_quantize_state_stores(monkeypatch, fields):
    """At 8 bits a code, 2 bytes a scale or fp16 value and no coder gain, the prediction is exactly the payload's
    tensor bytes: it classifies and counts every tensor as the export does."""
    cfg = tiny_cfg(**(QCFG | fields))
    for kind in ("q6", "q8"):
        monkeypatch.setitem(tg.FORMATS, kind, replace(tg.FORMATS[kind], bits=lambda cfg, name: 8.0))
    monkeypatch.setitem(tg.FORMATS, "f16", replace(tg.FORMATS["f16"], bits=lambda cfg, name: 16.0))
    monkeypatch.setattr(tg, "PREDICT_SIDE_BYTES", 2.0)
    packed = tg.quantize_state(random_model(cfg, seed=1).state_dict(), cfg)
    assert any(k.endswith(".q8") for k in packed) and any(k.endswith(".f16") for k in packed)
    assert tg.predict_artifact_bytes(replace(cfg, compressor="rans")) == sum(t.numel() * t.element_size()
                                                                             for t in packed.values())


def test_prediction_follows_the_coder_and_sd_clip():
    cfg = replace(tg.Hyperparameters(), matrix_clip_sigmas=0, mlp_clip_sigmas=0, attn_clip_sigmas=0)  # clip search
    base = tg.predict_artifact_bytes(cfg)
    assert tg.predict_artifact_bytes(replace(cfg, compressor="fast")) > base  # zstd-3 codes the same payload larger
    sd = [tg.predict_artifact_bytes(replace(cfg, matrix_clip_sigmas=k)) for k in (2.5, 5, 9, 12.85, 20, 32)]
    assert sd == sorted(sd, reverse=True) and len(set(sd)) == 6  # a coarser grid costs fewer bits, also off the table
    assert sd[2] < base  # k = 9 codes fewer bits than the clip search; k = 5 (4.68 bits) more
    assert tg.sd_clip_bits(2.5) == pytest.approx(tg.sd_clip_bits(5) + 1) and tg.sd_clip_bits(0) == 0


def test_auto_size_fills_the_limit_with_the_widest_mlp_else_the_bigram_table():
    cfg, code_bytes = replace(make_cfg(), auto_size=0.95), 50_000  # the sp1024 stack: a bigram table to size
    budget = 0.95 * tg.SIZE_LIMIT_BYTES - code_bytes
    fitted = tg.fit_to_limit(cfg, set(), code_bytes)
    step = 64 / cfg.model_dim
    assert fitted.mlp_mult * cfg.model_dim % 64 == 0 and fitted.bigram_vocab_size == cfg.bigram_vocab_size
    wider = replace(fitted, mlp_mult=fitted.mlp_mult + step)
    assert tg.predict_artifact_bytes(fitted) <= budget < tg.predict_artifact_bytes(wider)
    kept = tg.fit_to_limit(cfg, {"mlp_mult"}, code_bytes)  # MLP_MULT set: the bigram table is sized instead
    assert kept.mlp_mult == cfg.mlp_mult and kept.bigram_vocab_size % 64 == 0
    bigger = replace(kept, bigram_vocab_size=kept.bigram_vocab_size + 64)
    assert tg.predict_artifact_bytes(kept) <= budget < tg.predict_artifact_bytes(bigger)
    odd = replace(cfg, model_dim=448, num_heads=7, num_kv_heads=7, mlp_mult=61 * 64 / 448)  # a width it can pick
    with torch.device("meta"):  # 61 * 64 / 448 * 448 is 3903.99... in floats: the width must still be 3904
        assert tg.GPT(odd).mlp_up_bank.shape[1] == 61 * 64
    with pytest.raises(ValueError, match="leave one of them unset"):
        tg.fit_to_limit(cfg, {"mlp_mult", "bigram_vocab_size"}, code_bytes)
    with pytest.raises(ValueError, match="over the limit"):
        tg.fit_to_limit(replace(cfg, auto_size=0.01), set(), code_bytes)


# =============================================================================================
# Entropy coding (COMPRESSOR=rans)
# =============================================================================================

def order0_bytes(sym: np.ndarray, tid: np.ndarray) -> float:
    total = 0.0
    for t in np.unique(tid):
        counts = np.bincount(sym[tid == t])
        p = counts[counts > 0] / counts.sum()
        total -= (p * np.log2(p)).sum() * counts.sum() / 8
    return total


@pytest.mark.parametrize("n", [1, 5, tg.RANS_LANES, tg.RANS_LANES + 1, 300_001])
def test_rans_roundtrips_bit_exactly(n):
    rng = np.random.default_rng(n)
    tid = np.sort(rng.integers(0, 3, n))
    sym = np.where(tid == 0, rng.integers(0, 256, n),  # uniform bytes; int6-like codes; one symbol only
                   np.where(tid == 1, np.clip(np.round(rng.standard_t(4, n) * 5), -31, 31) + 128, 7)).astype(np.int64)
    freq = tg.rans_tables(sym, tid, 3, 256)
    assert (freq.sum(1) == 1 << tg.RANS_BITS).all() and ((np.bincount(tid * 256 + sym, minlength=768) > 0)
                                                          <= (freq.reshape(-1) > 0)).all()
    states, counts, words = tg.rans_encode(sym, tid, freq)
    np.testing.assert_array_equal(tg.rans_decode(states, counts, words, tid, freq), sym)
    if n > 100_000:  # at most 1% over the order-0 entropy, plus the lanes' fixed cost (a 32-bit state each)
        assert words.nbytes + states.nbytes < 1.01 * order0_bytes(sym, tid) + 4 * tg.RANS_LANES
        bad = words.copy()
        bad[len(bad) // 2] ^= 0x5A5A
        with pytest.raises(ValueError, match="does not decode to its start"):
            tg.rans_decode(states, counts, bad, tid, freq)


def test_rans_artifact_gives_back_the_payload_byte_for_byte(tmp_path):
    cfg = tiny_cfg(**QCFG)
    payload = tg.pack_tensors(tg.quantize_state(random_model(cfg, seed=4).state_dict(), cfg), cfg)
    blob, coder = tg.compress(payload, "rans")
    assert coder == "rans" and blob[:5] == b"PGA1\x03"
    assert tg.decompress(blob) == payload
    for how in ("flipped", "truncated"):
        with pytest.raises(ValueError, match="corrupt|truncated"):
            tg.decompress(damaged(blob, how))


def test_rans_keeps_empty_and_0d_int8_tensors_in_the_side_data_and_refuses_the_old_format():
    rng = np.random.default_rng(4)
    tensors = {"a.q6": torch.zeros(0, 8, dtype=torch.int8), "b.q8": torch.tensor(5, dtype=torch.int8),
               "c.q6": torch.from_numpy(rng.integers(-31, 32, (16, 40)).astype(np.int8)), "d.f16": torch.ones(3).half()}
    payload = tg.pack_tensors(tensors, tiny_cfg())
    blob, _ = tg.compress(payload, "rans")
    assert tg.decompress(blob) == payload
    with pytest.raises(ValueError, match="bytes 1 and 2 are coders of an older train_gpt.py"):
        tg.decompress(blob[:4] + b"\x02" + blob[5:])


def test_rans_codes_scaled_rows_and_columns_below_their_order0_entropy():
    """Codes whose spread is (row scale) x (column scale), as in trained banks: the spread contexts code them well
    under one order-0 table, and give them back exactly."""
    rng = np.random.default_rng(3)
    spread = np.exp2(rng.uniform(-1, 3, (512, 1))) * np.exp2(rng.uniform(-1, 3, (1, 2048)))
    codes = torch.from_numpy(np.clip(np.round(rng.standard_normal((512, 2048)) * spread), -31, 31).astype(np.int8))
    payload = tg.pack_tensors({"w.q6": codes, "w.scale": torch.ones(512, dtype=torch.float16)}, tiny_cfg())
    blob, _ = tg.compress(payload, "rans")
    assert tg.decompress(blob) == payload
    sym = codes.numpy().astype(np.int64).reshape(-1) + 128
    assert len(blob) < 0.92 * order0_bytes(sym, np.zeros_like(sym))  # 520,473 vs 598,387 B (xz: 601,393)


def test_rans_artifact_with_trailing_bytes_is_refused():
    cfg = tiny_cfg()
    blob = tg.compress(tg.pack_tensors(tg.quantize_state(random_model(cfg, seed=6).state_dict(), cfg), cfg), "rans")[0]
    with pytest.raises(ValueError, match="corrupt"):
        tg.decompress(blob + b"\x00\x00\x12\x34")
