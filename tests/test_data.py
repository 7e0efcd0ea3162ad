"""Data: the shard reader's refusals, and the training stream against a slicing of the concatenated shards
(every rank/accumulation split sees the same global batch; restorable position; the coprime order)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_VOCAB, make_cfg, run_script, tiny_env, write_shard

import train_gpt as tg

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


# =============================================================================================
# 3. Data reader errors
# =============================================================================================

def _raw_shard(path: Path, header: tuple[int, int, int], tokens, header_bytes: int = 1024) -> Path:
    h = np.zeros(256, dtype="<i4")
    h[:3] = header
    path.write_bytes(h.tobytes()[:header_bytes] + np.asarray(tokens, dtype="<u2").tobytes())
    return path


@pytest.mark.parametrize("case, message", [
    ("bad_magic", "magic"), ("bad_version", "version"), ("truncated", "truncated"), ("too_long", "size"),
    ("short_header", "truncated"), ("empty", "no tokens"), ("token_too_big", "token id 100 >= VOCAB_SIZE 100")])
def test_open_shard_rejects_corrupt_files(tmp_path, case, message):
    p = tmp_path / "fineweb_train_000000.bin"
    toks = [1, 5, 99, 7]
    {
        "bad_magic": lambda: _raw_shard(p, (20240521, 1, 4), toks),
        "bad_version": lambda: _raw_shard(p, (20240520, 2, 4), toks),
        "truncated": lambda: _raw_shard(p, (20240520, 1, 6), toks),
        "too_long": lambda: _raw_shard(p, (20240520, 1, 3), toks),
        "short_header": lambda: _raw_shard(p, (20240520, 1, 0), [], header_bytes=100),
        "empty": lambda: _raw_shard(p, (20240520, 1, 0), []),
        "token_too_big": lambda: _raw_shard(p, (20240520, 1, 5), toks + [100]),
    }[case]()
    with pytest.raises(ValueError) as e:
        tg.open_shard(p, 100)
    assert str(p) in str(e.value) and message in str(e.value), str(e.value)


def test_open_shard_reads_valid_file_and_missing_file_is_named(tmp_path):
    p = tmp_path / "fineweb_train_000000.bin"
    write_shard(p, [1, 5, 99, 0])
    assert tg.open_shard(p, 100).tolist() == [1, 5, 99, 0]  # id vocab-1 is fine
    with pytest.raises(FileNotFoundError, match="fineweb_train_000009"):
        tg.open_shard(tmp_path / "fineweb_train_000009.bin", 100)


def test_shard_files_errors_and_order(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        tg.shard_files(str(tmp_path / "nope"), "train")
    write_shard(tmp_path / "fineweb_val_000000.bin", [1, 2])
    with pytest.raises(FileNotFoundError, match="fineweb_train_"):
        tg.shard_files(str(tmp_path), "train")
    for i in (2, 0, 1):
        write_shard(tmp_path / f"fineweb_train_00000{i}.bin", [1, 2])
    assert [Path(f).name for f in tg.shard_files(str(tmp_path), "train")] == [
        "fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]


def test_tokenizer_vocab_must_equal_vocab_size(dataset, tokenizer_path, tmp_path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    with pytest.raises(ValueError, match=f"{TINY_VOCAB} != VOCAB_SIZE 1024"):
        tg.build_byte_luts(sp, 1024, CPU)
    r = run_script(tiny_env(dataset, tokenizer_path, VOCAB_SIZE="1024"), tmp_path)
    assert r.returncode != 0 and f"tokenizer vocabulary {TINY_VOCAB} != VOCAB_SIZE 1024" in r.stderr, r.stderr[-2000:]


# =============================================================================================
# 4. Training stream
# =============================================================================================

SHARD_LENGTHS = (50, 5, 1, 70, 37)  # small and odd so batches straddle (and skip over) shard boundaries


@pytest.fixture
def small_shards(tmp_path):
    """Shards whose tokens are their global positions 0..N-1, so every sequence names where it came from."""
    files, start = [], 0
    for i, n in enumerate(SHARD_LENGTHS):
        f = tmp_path / f"fineweb_train_{i:06d}.bin"
        write_shard(f, np.arange(start, start + n))
        files.append(str(f))
        start += n
    return files, np.arange(start)


def _expected_step(all_tokens: np.ndarray, step: int, batch: int, T: int) -> list[tuple]:
    """Independent slicing of the cyclic concatenation: step k covers positions k*B .. k*B + B (one token of
    overlap with the next step, for the last target)."""
    N = len(all_tokens)
    chunk = all_tokens[(step * batch + np.arange(batch + 1)) % N].tolist()
    return sorted((tuple(chunk[i * T:(i + 1) * T]), tuple(chunk[i * T + 1:(i + 1) * T + 1])) for i in range(batch // T))


def _gathered_step(loaders) -> list[tuple]:
    seqs = []
    for ld in loaders:
        micro = ld.next_batch()
        assert len(micro) == ld.rt.grad_accum_steps
        for x, y in micro:
            assert x.shape == y.shape == (ld.seqs_per_micro, ld.seq_len) and x.dtype == torch.int64
            seqs += [(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(x, y)]
    return sorted(seqs)


@pytest.mark.parametrize("batch", [32, 256])  # 256 > the 163 tokens of all shards: wraps inside one batch
@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1), (1, 1), (2, 1)])
def test_train_loader_global_batch_is_split_independent(small_shards, batch, world, accum):
    files, all_tokens = small_shards
    T = 4
    cfg = make_cfg(TRAIN_SEQ_LEN=T, TRAIN_BATCH_TOKENS=batch)
    assert tg.resolve_grad_accum_steps(dataclasses.replace(cfg, grad_accum_steps=accum), world) == accum
    loaders = [tg.TrainLoader(files, cfg, tg.Runtime(r, world, r, grad_accum_steps=accum)) for r in range(world)]
    for step in range(12):  # 12 * 32 = 384 tokens: wraps the 163-token stream twice
        if step % 3 == 1:  # prefetching (on some steps, any number of times) changes no batch
            for ld in loaders:
                ld.prefetch(), ld.prefetch()
        assert _gathered_step(loaders) == _expected_step(all_tokens, step, batch, T), f"step {step}"


def test_train_loader_state_dict_restores_position(small_shards):
    files, all_tokens = small_shards
    cfg = make_cfg(TRAIN_SEQ_LEN=4, TRAIN_BATCH_TOKENS=32)
    rt = tg.Runtime(grad_accum_steps=2)
    a = tg.TrainLoader(files, cfg, rt)
    for _ in range(3):
        a.next_batch()
        a.prefetch()  # as the trainer does: the next batch is queued when the state is taken
    state = a.state_dict()
    assert state["file_idx"] != 0  # 96 tokens in: inside the 4th shard, so restoring must reopen a shard
    after = [[(x.clone(), y.clone()) for x, y in a.next_batch()] for _ in range(5)]

    def same(loader):
        for want in after:
            got = loader.next_batch()
            assert all(torch.equal(x, wx) and torch.equal(y, wy) for (x, y), (wx, wy) in zip(got, want))
    a.load_state_dict(dict(state))
    same(a)
    b = tg.TrainLoader(files, cfg, rt)  # a fresh loader, as after a restart
    b.load_state_dict(dict(state))
    same(b)
    step3 = sorted((tuple(x.tolist()), tuple(y.tolist())) for xs, ys in after[0] for x, y in zip(xs, ys))
    assert step3 == _expected_step(all_tokens, 3, 32, 4)


def test_a_bad_shard_is_raised_at_the_step_that_needs_it_and_the_position_stays_before_it(small_shards):
    """The trainer prefetches the next step's batch while a step runs: a bad shard found then must not break the
    step under way (its error comes with the next batch), and the loader's position stays where a checkpoint
    resumes once the shard is fixed."""
    files, all_tokens = small_shards
    good = np.asarray(tg.open_shard(files[3], 1024)).copy()
    bad = good.copy()
    bad[5] = 2000  # >= VOCAB_SIZE
    write_shard(Path(files[3]), bad)
    cfg = make_cfg(TRAIN_SEQ_LEN=4, TRAIN_BATCH_TOKENS=32)  # step 1 reads tokens 32..64: shard 3 starts at 56
    loader = tg.TrainLoader(files, cfg, tg.Runtime())
    loader.next_batch()
    loader.prefetch()  # step 1's batch: fails here, raised by next_batch
    with pytest.raises(ValueError, match="fineweb_train_000003.bin: token id 2000 >= VOCAB_SIZE 1024"):
        loader.next_batch()
    state = loader.state_dict()
    write_shard(Path(files[3]), good)
    fresh = tg.TrainLoader(files, cfg, tg.Runtime())
    fresh.load_state_dict(state)
    got = sorted((tuple(x.tolist()), tuple(y.tolist())) for xs, ys in fresh.next_batch() for x, y in zip(xs, ys))
    assert got == _expected_step(all_tokens, 1, 32, 4)


def test_sample_shards_are_recognised_by_their_header_mark(tmp_path):
    f = tmp_path / "fineweb_val_000000.bin"
    write_shard(f, np.arange(10))
    assert not tg.is_sample_shard(f)
    raw = bytearray(f.read_bytes())
    raw[12:16] = tg.SAMPLE_MARK.to_bytes(4, "little")
    f.write_bytes(bytes(raw))
    assert tg.is_sample_shard(f) and tg.shard_token_count(f) == 10  # otherwise an ordinary shard


def _coprime_expected(all_tokens: np.ndarray, step: int, batch: int, T: int) -> list[tuple]:
    """The coprime-stride rule written independently: n = (N-1)//T slots, stride = the first integer >= the
    golden-ratio point round(0.618 n) coprime with n, the k-th sequence is slot (k * stride) mod n."""
    n = (len(all_tokens) - 1) // T
    stride = max(1, round(n * 0.6180339887))
    while np.gcd(stride, n) != 1:
        stride += 1
    S = batch // T
    out = []
    for k in range(step * S, step * S + S):
        j = (k * stride) % n
        w = all_tokens[j * T: j * T + T + 1].tolist()
        out.append((tuple(w[:-1]), tuple(w[1:])))
    return sorted(out)


def test_coprime_sampler_visits_every_slot_once_per_cycle(small_shards):
    files, all_tokens = small_shards
    T = 4
    sampler = tg.CoprimeSampler(files, tg.Hyperparameters().vocab_size, T)
    n = (len(all_tokens) - 1) // T
    assert sampler.n == n and np.gcd(sampler.stride, n) == 1
    for cycle in range(2):
        seqs = sampler.take_sequences(n)
        starts = sorted(int(s[0]) for s in seqs)  # tokens are global positions
        assert starts == [j * T for j in range(n)], f"cycle {cycle}"
        for s in seqs:  # content = the concatenated stream, across shard boundaries
            assert s.tolist() == all_tokens[s[0]: s[0] + T + 1].tolist()


@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1), (1, 1)])
def test_coprime_loader_is_split_independent_and_restorable(small_shards, world, accum):
    files, all_tokens = small_shards
    T, batch = 4, 32
    cfg = make_cfg(TRAIN_SEQ_LEN=T, TRAIN_BATCH_TOKENS=batch, TRAIN_SAMPLING="coprime")
    loaders = [tg.TrainLoader(files, cfg, tg.Runtime(r, world, r, grad_accum_steps=accum)) for r in range(world)]
    for step in range(7):  # 7 * 8 = 56 sequences > 40 slots: crosses a cycle
        assert _gathered_step(loaders) == _coprime_expected(all_tokens, step, batch, T), f"step {step}"
    loaders[0].prefetch()
    state = loaders[0].state_dict()  # taken with the next batch already prefetched
    want = _gathered_step(loaders[:1]) if world == 1 else None
    fresh = tg.TrainLoader(files, cfg, tg.Runtime(0, world, 0, grad_accum_steps=accum))
    fresh.load_state_dict(state)
    if want is not None:
        assert _gathered_step([fresh]) == want
    assert state == {"k": 7 * batch // T, "data": f"TRAIN_SAMPLING=coprime over {len(files)} shards of "
                                                 f"{sum(map(tg.shard_token_count, files))} tokens, sha256 of 16 "
                                                 f"tokens each {tg.shards_fingerprint(files)}, TRAIN_SEQ_LEN={T}"}
    other = tg.TrainLoader(files, make_cfg(TRAIN_SEQ_LEN=2 * T, TRAIN_BATCH_TOKENS=batch, TRAIN_SAMPLING="coprime"),
                           tg.Runtime())
    with pytest.raises(ValueError, match=f"TRAIN_SEQ_LEN={T}; this run reads .*TRAIN_SEQ_LEN={2 * T}"):
        other.load_state_dict(state)  # its position counts sequences of T: at 2T it re-read and skipped tokens
