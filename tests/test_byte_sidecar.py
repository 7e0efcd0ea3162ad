"""The val byte sidecar (CaseOps data: each val token's bytes of the original text, fineweb_val_bytes_*.bin): every
scorer takes a target's bytes from it, checked against a brute-force per-target sum written here; a CaseOps
tokenizer without one is refused; the val set is checked against its manifest; the artifact and the log say which
byte rule scored."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

from conftest import make_scorer, perturbed_model, run_inline, sample_text, tiny_cfg, tiny_env, write_shard
import train_gpt as tg

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


def stream_and_sidecar(n_docs: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS-led documents of random ids and a random per-token byte count (0 for BOS, as the sidecar has it)."""
    rng = np.random.default_rng(seed)
    docs = [[1] + rng.integers(4, 512, int(rng.integers(5, 60))).tolist() for _ in range(n_docs)]
    tokens = torch.tensor([t for d in docs for t in d])
    nbytes = torch.from_numpy(np.where(tokens.numpy() == 1, 0, rng.integers(0, 7, tokens.numel())))
    return tokens, nbytes


def brute_force(model: tg.GPT, tokens: torch.Tensor, nbytes: torch.Tensor, window: int) -> tuple[float, int, int]:
    """(nll, targets, bytes): disjoint windows of `window` targets, each target's bytes read from the sidecar."""
    n, nll = tokens.numel() - 1, 0.0
    for s in range(0, n, window):
        e = min(s + window, n)
        logits = model.logits(tokens[s:e][None])[0]
        nll += F.cross_entropy(logits.float(), tokens[s + 1: e + 1], reduction="none").double().sum().item()
    return nll, n, int(nbytes[1:].sum())


@pytest.mark.parametrize("stride", [32, 8])
def test_every_scorer_counts_the_sidecars_bytes(stride):
    """Sliding (disjoint and strided), per document and lora TTT: bytes = the sidecar's over the scored targets; at
    stride = window the loss matches the brute force, and val_bpb is that loss over the sidecar's bytes."""
    cfg = tiny_cfg(vocab_size=512)
    tokens, nbytes = stream_and_sidecar()
    luts = tuple(torch.zeros(512, dtype=t) for t in (torch.int16, torch.bool, torch.bool))  # unused with a sidecar
    model = perturbed_model(cfg, 3, 0.05, 0.02).eval()
    scorer = make_scorer(cfg, tokens, luts, 3, val_bytes=nbytes)
    s = scorer(model, stride)
    nll, n, total = brute_force(model, tokens, nbytes, cfg.eval_seq_len)
    assert (s.tokens, s.bytes, scorer.byte_rule) == (n, total, "sidecar")
    if stride == cfg.eval_seq_len:  # batches of 3 windows against one at a time: fp32 NLLs (~6) a few ulps apart
        assert s.loss == pytest.approx(nll / n, rel=1e-6)
        assert s.bpb == pytest.approx(nll / n / math.log(2) * n / total, rel=1e-6)
    assert scorer(model, stride, per_doc=True).bytes == total
    lora = tg.lora_ttt(tiny_cfg(vocab_size=512, ttt_enabled=True, ttt_lora_rank=4, ttt_batch_size=4), tg.Runtime(),
                       perturbed_model(cfg, 3, 0.05, 0.02).eval(), scorer)
    assert (lora.tokens, lora.bytes) == (n, total)


def caseops_tokenizer(path) -> spm.SentencePieceProcessor:
    """A tiny tokenizer that reserves the four case operators, as CaseOps tokenizers do."""
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sample_text(200)), model_writer=f, vocab_size=512,
                                       model_type="bpe", byte_fallback=True, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                       user_defined_symbols=["\ue001", "\ue002", "\ue003", "\ue004"], minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(path))


def copy_dataset(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    return data


def val_scorer(data, tokenizer_path, **settings):
    """validation_scorer on `data` (EVAL_ONLY: the train shards are not read); returns (scorer, its log lines)."""
    lines = []
    cfg = tiny_cfg(data_path=str(data), tokenizer_path=str(tokenizer_path), eval_only="a.ptz", **settings)
    scorer, _ = tg.validation_scorer(cfg, tg.Runtime(), lambda msg, console=True: lines.append(msg), "sha")
    return scorer, lines


def test_a_caseops_tokenizer_needs_the_sidecar(dataset, tmp_path):
    data = copy_dataset(dataset, tmp_path)
    sp = caseops_tokenizer(tmp_path / "caseops.model")
    docs = [[1] + sp.encode(t) for t in sample_text(30, seed=4)]
    write_shard(data / "fineweb_val_000000.bin", [t for d in docs for t in d])
    with pytest.raises(ValueError, match="CaseOps tokenizer, and DATA_PATH has no byte sidecar"):
        val_scorer(data, tmp_path / "caseops.model")
    n = sum(map(len, docs))
    write_shard(data / "fineweb_val_bytes_000000.bin", [0] * (n - 1))  # one value short
    with pytest.raises(tg.ShardError, match=f"holds {n - 1} values for {n} val tokens"):
        val_scorer(data, tmp_path / "caseops.model")
    sidecar = [0 if t == 1 else len(sp.id_to_piece(t).encode()) for d in docs for t in d]
    write_shard(data / "fineweb_val_bytes_000000.bin", sidecar)
    scorer, lines = val_scorer(data, tmp_path / "caseops.model")
    assert scorer.byte_rule == "sidecar" and torch.equal(scorer.val_bytes, torch.tensor(sidecar))
    assert any(ln.startswith("val_tokens:") and "byte_rule:sidecar" in ln for ln in lines)
    assert tg.shard_files(str(data), "val") == [str(data / "fineweb_val_000000.bin")]  # not the sidecar


def test_the_val_set_must_be_the_manifests(dataset, tokenizer_path, tmp_path):
    """Our data tools' manifest (DATA_PATH/manifest.json) and the challenge export's (../manifest.json, this folder's
    entry): a val set with other document or token counts (a partial split, or one that leaked) is refused."""
    data = copy_dataset(dataset, tmp_path)
    tokens = np.fromfile(data / "fineweb_val_000000.bin", "<u2", offset=1024)
    docs, n = int((tokens == 1).sum()), tokens.size
    _, lines = val_scorer(data, tokenizer_path)
    assert any(ln.startswith(f"val_tokens:{n} val_docs:{docs} ") and "manifest:none" in ln for ln in lines)
    (data / "manifest.json").write_text(json.dumps({"val": {"docs": docs, "tokens": n}}))
    _, lines = val_scorer(data, tokenizer_path)
    assert any(f"byte_rule:tokenizer manifest:{data / 'manifest.json'}" in ln for ln in lines)
    (data / "manifest.json").write_text(json.dumps({"val": {"docs": 50000, "tokens": n}}))
    with pytest.raises(ValueError, match=f"the val shards hold {docs} docs, .*manifest.json says 50000"):
        val_scorer(data, tokenizer_path)
    (data / "manifest.json").unlink()
    export = {"datasets": [{"name": "x", "path": f"datasets/{data.name}", "stats": {"tokens_val": n + 1}}]}
    (tmp_path / "manifest.json").write_text(json.dumps(export))
    with pytest.raises(ValueError, match=f"the val shards hold {n} tokens, .*manifest.json says {n + 1}"):
        val_scorer(data, tokenizer_path)


def test_the_artifact_and_the_log_say_which_byte_rule_scored(dataset, tokenizer_path, tmp_path, monkeypatch):
    data = copy_dataset(dataset, tmp_path)
    tokens = np.fromfile(data / "fineweb_val_000000.bin", "<u2", offset=1024)
    write_shard(data / "fineweb_val_bytes_000000.bin", np.where(tokens == 1, 0, 2))
    r = run_inline(monkeypatch, tiny_env(data, tokenizer_path, ITERATIONS="4", RUN_ID="side"), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "byte_rule:sidecar" in next(ln for ln in r.stdout.splitlines() if ln.startswith("val_tokens:"))
    header, _ = tg.read_artifact(tmp_path / "logs" / "side.int6.ptz")
    assert header["byte_rule"] == "sidecar" and header["tokenizer_sha256"] == tg.tokenizer_sha256(str(tokenizer_path))
    final = next(ln for ln in r.stdout.splitlines() if ln.startswith("final_int6_roundtrip "))
    assert f"scored_bytes:{2 * int((tokens[1:] != 1).sum())}" in final
