"""data/make_timing_set.py: a val set of a given shape cut from train text, with its byte sidecar (issue 40 item 4)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import make_timing_set as mts  # noqa: E402
from shards import read_shard, write_shard  # noqa: E402


def source(tmp_path: Path, val_lengths: list[int], train_tokens: int) -> Path:
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    write_shard(src / "fineweb_val_000000.bin", [t for n in val_lengths for t in [1] + [7] * (n - 1)])
    train = rng.integers(4, 500, train_tokens)
    train[np.sort(rng.choice(train_tokens, train_tokens // 25, replace=False))] = 1  # documents of 1 to ~150 tokens
    train[0] = 1
    write_shard(src / "fineweb_train_000000.bin", train[: train_tokens // 2])
    write_shard(src / "fineweb_train_000001.bin", train[train_tokens // 2:])
    return src


def test_lengths_are_scaled_to_the_exact_total():
    """One source length of 10, 7 documents, 75 tokens: 75/7 = 10.7 rounds to 11 (77 in all), so the first two
    documents give one back."""
    assert mts.lengths(7, 75, np.array([10]), 0).tolist() == [10, 10, 11, 11, 11, 11, 11]
    got = mts.lengths(1000, 123_457, np.array([3, 50, 900, 1]), 5)
    assert got.sum() == 123_457 and got.min() >= 1
    with pytest.raises(SystemExit, match="--tokens"):
        mts.lengths(10, 9, np.array([3]), 0)


def test_each_document_is_the_first_words_of_the_train_document_of_its_rank(tmp_path, tokenizer_path):
    """The k-th longest drawn length gets the k-th longest train document, cut at the last word start (a piece with
    U+2581) within the length, or whole when it is shorter; the sidecar is the challenge's byte rule."""
    import sentencepiece as spm
    src = source(tmp_path, [5, 9, 20, 3, 44], 6000)
    stats = mts.main(["--src", str(src), "--tokenizer", str(tokenizer_path), "--out", str(tmp_path / "out"),
                      "--docs", "40", "--tokens", "900", "--take", "25", "--seed", "3"])
    toks = read_shard(tmp_path / "out" / "fineweb_val_000000.bin").astype(np.int64)
    sidecar = read_shard(tmp_path / "out" / "fineweb_val_bytes_000000.bin").astype(np.int64)
    want = mts.lengths(40, 900, np.array([5, 9, 20, 3, 44]), 3)[:25]
    starts = np.flatnonzero(toks == 1)
    docs = [toks[a + 1: b].tolist() for a, b in zip(starts, np.append(starts[1:], toks.size))]
    train = np.concatenate([read_shard(src / f"fineweb_train_00000{i}.bin") for i in (0, 1)]).astype(np.int64)
    tb = np.flatnonzero(train == 1)
    tdocs = [train[a + 1: b].tolist() for a, b in zip(tb, np.append(tb[1:], train.size))]
    by_length = sorted(range(len(tdocs)), key=lambda i: -len(tdocs[i]))  # stable, as the tool's
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    for rank, i in enumerate(sorted(range(25), key=lambda i: -want[i])):
        src_doc, n = tdocs[by_length[rank]], int(want[i]) - 1
        assert docs[i] == src_doc[: len(docs[i])] and len(docs[i]) <= n
        if len(src_doc) <= n:
            assert docs[i] == src_doc
        elif any(sp.id_to_piece(t).startswith("\u2581") for t in src_doc[1: n + 1]):
            cut = max(j for j in range(1, n + 1) if sp.id_to_piece(src_doc[j]).startswith("\u2581"))
            assert len(docs[i]) == cut, (i, cut)
    assert stats["docs"] == 25 and stats["tokens"] == toks.size == sidecar.size and stats["drawn_tokens"] == want.sum()

    def boundary(t):
        return sp.is_control(t) or sp.is_unknown(t) or sp.is_unused(t)
    for i in range(1, toks.size):  # the challenge's rule, token by token
        t, piece = int(toks[i]), sp.id_to_piece(int(toks[i]))
        n = 0 if boundary(t) else 1 if sp.is_byte(t) else len(piece.removeprefix("\u2581").encode())
        n += int(not boundary(t) and not sp.is_byte(t) and piece.startswith("\u2581") and not boundary(int(toks[i - 1])))
        assert sidecar[i] == n, i
    assert sidecar[0] == 0 and stats["bytes"] == sidecar.sum()


def test_too_little_train_text_is_refused(tmp_path, tokenizer_path):
    src = source(tmp_path, [5, 9], 200)
    with pytest.raises(SystemExit, match="--take needs"):
        mts.main(["--src", str(src), "--tokenizer", str(tokenizer_path), "--out", str(tmp_path / "out"),
                  "--docs", "10", "--tokens", "500", "--take", "10"])
