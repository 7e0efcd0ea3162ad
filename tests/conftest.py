"""Shared fixtures: a tiny SentencePiece tokenizer trained with the challenge settings, tiny shards,
a tiny-config environment, and helpers to run train_gpt.py (1..N processes, gloo) or a function in
N gloo processes. Everything is built in temporary folders: no test reads ../shared or the network."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import signal
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
import train_gpt as tg  # noqa: E402  (after TRITON_INTERPRET is set)

SCRIPT = ROOT / "train_gpt.py"
_spec = importlib.util.spec_from_file_location("sweep_presets", ROOT / "tools" / "sweep.py")
_sweep = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _sweep
_spec.loader.exec_module(_sweep)
# The settings the tests run on unless they name others: the sp1024 stack (tools/sweep.py's preset, our defaults
# until 2026-11-26), which the tests were written for; test_record_stack.py runs the record-stack defaults.
STACK = dict(word.split("=", 1) for word in _sweep.SP1024_STACK.split())
TINY_VOCAB = 512
# The tiny config of the unit tests (d=32, L=2, V=512, T=32): banks qo (4,32,32), kv (4,16,32), mlp_up (2,96,32),
# mlp_down (2,32,96); tok_emb 512x32 and bigram 64x16 tables, VE on layer 1, XSA on the last layer.
TINY_FIELDS = dict(num_layers=2, model_dim=32, num_heads=2, num_kv_heads=1, rope_dims=8, vocab_size=TINY_VOCAB,
                   bigram_vocab_size=64, bigram_dim=16, ve_dim=16, ve_layers="1", xsa_last_n=1, train_seq_len=32,
                   eval_seq_len=32, eval_stride=8, phased_ttt_prefix_docs=0, ttt_short_score_first_steps="",
                   ttt_lora_lr=3e-4)


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


def bos2_tokenizer(path: Path, docs: list[str], vocab_size: int) -> Path:
    """A tokenizer whose BOS id is 2 (EOS 1), for the checks that find documents by BOS id 1."""
    import sentencepiece as spm
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=f, vocab_size=vocab_size,
                                       model_type="bpe", byte_fallback=True, pad_id=0, bos_id=2, eos_id=1, unk_id=3,
                                       minloglevel=2)
    return path


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
    env = dict(STACK,
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


OUTER_ONLY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "DEBUG")  # the test process's, not a run's to inherit


def _script_command(env: dict[str, str], nproc: int, script: Path = SCRIPT) -> tuple[list[str], dict[str, str]]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(OUTER_ONLY)}
    full.update(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if full.get("KERNELS") != "triton":  # the kernels are registered only where they run: 0.7 s a process less
        full.pop("TRITON_INTERPRET", None)
    if nproc == 1:
        return [sys.executable, str(script)], full
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)], full


def run_script(env: dict[str, str], cwd: Path, nproc: int = 1, timeout: int = 300,
               script: Path = SCRIPT, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run train_gpt.py (or another script, with `args`) as a user would (torchrun for nproc > 1) in `cwd`; logs in
    cwd/logs."""
    cmd, full = _script_command(env, nproc, script)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd + list(args), env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_script_interrupted(env: dict[str, str], cwd: Path, after: str, sig: int, timeout: int = 300) -> tuple:
    """Run train_gpt.py (1 process) and send it `sig` once it has printed a line starting with `after`: stopped
    first (SIGSTOP), so it cannot run on while the signal is on its way; returns (returncode, stdout, stderr)."""
    import signal
    cmd, full = _script_command(env, 1)
    p = subprocess.Popen(cmd, env=full, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith(after):
            for s in (signal.SIGSTOP, sig, signal.SIGCONT):
                os.kill(p.pid, s)
            break
    out, err = p.communicate(timeout=timeout)
    return p.returncode, "".join(seen) + out, err


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


def make_scorer(cfg, tokens, luts, batch_seqs: int = 4, rank: int = 0, world_size: int = 1, val_bytes=None):
    """A Scorer of `batch_seqs` windows per forward on `rank` of `world_size` (VAL_BATCH_SIZE set to match)."""
    cfg = dataclasses.replace(cfg, val_batch_size=batch_seqs * world_size * cfg.eval_seq_len)
    scorer = tg.Scorer(cfg, tg.Runtime(rank, world_size, rank), tokens, luts, val_bytes=val_bytes)
    assert scorer.batch_seqs == batch_seqs
    return scorer


def make_cfg(**env) -> "tg.Hyperparameters":
    """Hyperparameters from environment-style settings (values as strings), strictly parsed."""
    cfg, _ = tg.Hyperparameters.from_env(STACK | {k: str(v) for k, v in env.items()})
    return cfg


def tiny_cfg(**fields) -> "tg.Hyperparameters":
    """TINY_FIELDS with `fields` on top, validated."""
    cfg = dataclasses.replace(make_cfg(), **({"run_id": ""} | TINY_FIELDS | fields))
    cfg.validate()
    return cfg


def perturbed_model(cfg, seed: int, bank_std: float | None = None, table_std: float | None = None,
                    noise: float = 0.1) -> "tg.GPT":
    """The script's model with non-zero values everywhere (its init zeroes the attention-out and MLP-down banks
    and the bigram table, which would hide bugs): banks redrawn with bank_std and the embedding tables with
    table_std when given, every other parameter (or all, when not given) plus noise * N(0, 1)."""
    torch.manual_seed(seed)
    model = tg.build_model(cfg, tg.Runtime())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if bank_std is not None and name in tg.BANKS:
                p.normal_(0, bank_std)
            elif table_std is not None and name in tg.EMBED_TABLES:
                p.normal_(0, table_std)
            else:
                p.add_(noise * torch.randn_like(p))
    return model


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def rope_reference(x_BTHD: torch.Tensor, dims: int, base: float) -> torch.Tensor:
    """Pairs (j, j + dims/2) as complex numbers z_j, rotated by e^{-i t base^(-2j/dims)} (the baseline's sign)."""
    if dims == 0:
        return x_BTHD
    T, half = x_BTHD.shape[1], dims // 2
    inv_freq = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / dims)
    theta = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
    z = torch.complex(x_BTHD[..., :half].double(), x_BTHD[..., half:dims].double()) * torch.polar(
        torch.ones_like(theta), -theta)[None, :, None, :]
    return torch.cat((z.real.to(x_BTHD.dtype), z.imag.to(x_BTHD.dtype), x_BTHD[..., dims:]), dim=-1)


MODEL_CONFIGS = {
    # everything on, 4 layers (two U-Net skips popped in LIFO order), GQA 4/2, XSA on 2, VE on 2 layers
    "full": dict(NUM_LAYERS=4, MODEL_DIM=32, NUM_HEADS=4, NUM_KV_HEADS=2, ROPE_DIMS=4, VOCAB_SIZE=64,
                 BIGRAM_VOCAB_SIZE=64, BIGRAM_DIM=16, VE_DIM=16, VE_LAYERS="2,3", XSA_LAST_N=2, LOGIT_SOFTCAP=10),
    # odd depth, untied head, relu^2, no smear/bigram/VE/LN scale/softcap, XSA everywhere, other RoPE base
    "plain": dict(NUM_LAYERS=3, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1, ROPE_DIMS=8, VOCAB_SIZE=96,
                  TIE_EMBEDDINGS=0, MLP_NEGATIVE_SLOPE=0, SMEAR_ENABLED=0, BIGRAM_VOCAB_SIZE=0, VE_ENABLED=0,
                  LN_SCALE=0, LOGIT_SOFTCAP=0, XSA_LAST_N=3, ROPE_BASE=500, MLP_MULT=2),
    # no GQA, full-width RoPE, no XSA, VE on layer 0
    "mha": dict(NUM_LAYERS=2, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=2, ROPE_DIMS=16, VOCAB_SIZE=64,
                BIGRAM_VOCAB_SIZE=32, BIGRAM_DIM=8, VE_DIM=8, VE_LAYERS="0", XSA_LAST_N=0),
    # depth recurrence (layers 1-2 twice: order 0 1 2 1 2 3 4, decoder 1 2 3 4) and two lanes from layer 3, VE on a
    # looped layer, XSA on the last 3 (a looped one among them), the MLP lane out
    "loop": dict(NUM_LAYERS=5, MODEL_DIM=32, NUM_HEADS=4, NUM_KV_HEADS=2, ROPE_DIMS=4, VOCAB_SIZE=64,
                 BIGRAM_VOCAB_SIZE=64, BIGRAM_DIM=16, VE_DIM=16, VE_LAYERS="2,4", XSA_LAST_N=3, LOGIT_SOFTCAP=10,
                 NUM_LOOPS=1, LOOP_START=1, LOOP_END=2, PARALLEL_START_LAYER=3, PARALLEL_FINAL_LANE="mlp",
                 SKIP_GATES_ENABLED=1, SPARSE_ATTN_GATE_ENABLED=1, SPARSE_ATTN_GATE_SCALE=0.5, GATE_WINDOW=12,
                 SMEAR_BOS_FIX=1, SMEAR_ENABLED=0, SMEAR_GATE_ENABLED=1),
    # part (b), no loop: XSA on every layer, the sparse output gate on 8 channels, gated skips, the record's SmearGate
    # (8 channels) with its BOS fix;
    # PARALLEL_START_LAYER=1 reaches into the encoder (0 1 | 2 3), where layers stay serial: lanes in 2 and 3
    "gates": dict(NUM_LAYERS=4, MODEL_DIM=32, NUM_HEADS=2, NUM_KV_HEADS=1, ROPE_DIMS=8, VOCAB_SIZE=64,
                  BIGRAM_VOCAB_SIZE=32, BIGRAM_DIM=8, VE_DIM=8, VE_LAYERS="1", XSA_LAST_N=4, SPARSE_ATTN_GATE_ENABLED=1,
                  SPARSE_ATTN_GATE_SCALE=0.5, GATE_WINDOW=8, SKIP_GATES_ENABLED=1, SMEAR_BOS_FIX=1, PARALLEL_START_LAYER=1,
                  SMEAR_ENABLED=0, SMEAR_GATE_ENABLED=1),
}


def feature_model(name: str, seed: int = 0, backend: str = "math") -> tg.GPT:
    """A tiny GPT with non-zero random values everywhere (zero-initialised banks and tables included)."""
    cfg = make_cfg(**MODEL_CONFIGS[name])
    torch.manual_seed(seed)
    model = tg.GPT(cfg, backend)  # looping, when NUM_LOOPS > 0: the function scored and exported
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2 and "emb" not in n and n != "skip_weights" and "resid_mix" not in n:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            elif p.ndim >= 2 and "emb" in n:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.4)
    return model


def run_inline(monkeypatch, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """run_script's one process in this one: entry() without its os._exit, and without the 2 s a new interpreter
    spends importing torch and dynamo (which torch.optim's first step imports). `env` over the outer environment
    less its settings and rank variables; `cwd` the working directory until the test ends; one thread (the
    subprocess's OMP_NUM_THREADS=1). main() installs its own signal handlers: the ones before come back. For runs
    whose logs and files a test reads; what a new process alone shows (exit codes, signals, another script, the
    same seed in two processes) stays with run_script."""
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    for k in list(os.environ):
        if k.lower() in tg.SETTINGS or k.startswith(OUTER_ONLY):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    handlers, threads, out, err = {s: signal.getsignal(s) for s in tg.STOP_SIGNALS}, torch.get_num_threads(), \
        io.StringIO(), io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = tg.main()
            except (ValueError, OSError, RuntimeError, FloatingPointError, KeyboardInterrupt) as e:  # as entry()
                if os.environ.get("DEBUG") == "1":
                    raise
                rc = tg.report_error(e)
    finally:
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess([str(SCRIPT)], rc, out.getvalue(), err.getvalue())


def run_main(monkeypatch, cwd, dataset, tokenizer_path, run_id: str, **overrides) -> str:
    """run_inline on tiny_env's settings (ITERATIONS=6 unless named), which must succeed: the run's log after its
    copy of the source."""
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, RUN_ID=run_id, **{"ITERATIONS": 6, **overrides}), cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return (cwd / "logs" / f"{run_id}.txt").read_text(encoding="utf-8").split("==== end source ====\n", 1)[1]
