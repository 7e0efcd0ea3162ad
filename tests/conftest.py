"""Shared fixtures: a tiny SentencePiece tokenizer trained with the challenge settings, tiny shards,
a tiny-config environment, and helpers to run train_gpt.py (1..N processes, gloo) or a function in
N gloo processes. Everything is built in temporary folders: no test reads ../shared or the network."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

# Triton kernels run on the CPU through Triton's interpreter; the flag must be set before triton is
# imported (train_gpt imports it). A machine with a GPU runs them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCRIPT = ROOT / "train_gpt.py"
TINY_VOCAB = 512


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): they gain nothing from
    intra-op threads, and on a busy 2-core machine OpenMP threads waiting for each other made many small ops 50x
    slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_shard(path: Path, tokens) -> None:
    tokens = np.asarray(tokens, dtype="<u2")
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, len(tokens))
    path.write_bytes(header.tobytes() + tokens.tobytes())


def sample_text(n_docs: int, seed: int = 0) -> list[str]:
    """Synthetic documents with words, digits, punctuation and non-ASCII characters."""
    rng = np.random.default_rng(seed)
    words = ("the of and to in is was for on that with as by at from his her an were are which "
             "this be or had it not but what all when we there can one so out if about who "
             "café naïve Zürich 東京 données Ελλάδα — “quoted” 2024 3.14 100% #tag").split()
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(20, 120))
        docs.append(" ".join(words[int(i)] for i in rng.integers(0, len(words), n)) + ".")
    return docs


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(sample_text(400)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "tiny"), model_type="bpe", vocab_size=TINY_VOCAB,
        byte_fallback=True, split_digits=True, normalization_rule_name="nmt_nfkc", add_dummy_prefix=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=1.0, num_threads=1,
        minloglevel=2)
    return d / "tiny.model"


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, tokenizer_path) -> Path:
    """Two train shards and one val shard of BOS-prefixed synthetic documents."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    d = tmp_path_factory.mktemp("data")

    def encode(docs):
        return [t for doc in docs for t in [1] + sp.encode(doc)]
    write_shard(d / "fineweb_val_000000.bin", encode(sample_text(40, seed=1)))
    write_shard(d / "fineweb_train_000000.bin", encode(sample_text(300, seed=2)))
    write_shard(d / "fineweb_train_000001.bin", encode(sample_text(300, seed=3)))
    return d


def tiny_env(dataset: Path, tokenizer_path: Path, **overrides) -> dict[str, str]:
    """A complete environment for a tiny CPU run (d=32, L=2, T=32, V=512)."""
    env = dict(
        DATA_PATH=str(dataset), TOKENIZER_PATH=str(tokenizer_path), VOCAB_SIZE=str(TINY_VOCAB),
        NUM_LAYERS="2", MODEL_DIM="32", NUM_HEADS="2", NUM_KV_HEADS="1", ROPE_DIMS="8",
        BIGRAM_VOCAB_SIZE="64", BIGRAM_DIM="16", VE_DIM="16", VE_LAYERS="1", XSA_LAST_N="1",
        TRAIN_SEQ_LEN="32", TRAIN_BATCH_TOKENS="512", ITERATIONS="20", WARMUP_STEPS="2",
        WARMDOWN_ITERS="5", MAX_WALLCLOCK_SECONDS="0", TRAIN_LOG_EVERY="1", VAL_LOSS_EVERY="0",
        EVAL_SEQ_LEN="32", EVAL_STRIDE="8", VAL_BATCH_SIZE="2048", MUON_MOMENTUM_WARMUP_STEPS="5",
        DEVICE="cpu", RUN_ID="tiny")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(env: dict[str, str], cwd: Path, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run train_gpt.py as a user would (torchrun for nproc > 1) in `cwd`; logs land in cwd/logs."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    full.update(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT)]
    return subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _spawn_entry(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = fn(rank, world_size, *args)
    finally:
        dist.barrier()  # tearing gloo down while a peer is still talking can abort the process
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; returns the per-rank results.
    fn must be a module-level function (it is pickled by name) returning picklable values."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args, results), nprocs=world_size, join=True)
        return [results[r] for r in range(world_size)]


def make_scorer(cfg, tokens, luts, batch_seqs: int = 4, rank: int = 0, world_size: int = 1):
    """A Scorer of `batch_seqs` windows per forward on `rank` of `world_size` (VAL_BATCH_SIZE set to match)."""
    import dataclasses
    import train_gpt as tg
    cfg = dataclasses.replace(cfg, val_batch_size=batch_seqs * world_size * cfg.eval_seq_len)
    scorer = tg.Scorer(cfg, tg.Runtime(rank, world_size, rank), tokens, luts)
    assert scorer.batch_seqs == batch_seqs
    return scorer
