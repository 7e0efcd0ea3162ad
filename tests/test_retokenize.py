"""Tests of data/retokenize.py: CPU, offline, a few seconds.

Source shards are written by the test itself (conftest.write_shard), cut every SHARD_TOKENS tokens so documents
span two or three shards and some shards hold no document start, with the tiny vocab-512 tokenizer (conftest);
they are re-encoded with a vocab-384 tokenizer trained here with the challenge settings. Expected texts, byte
totals and placements come from independent code (NFKC text, UTF-8 lengths, the offsets at which the test cut
the documents), not from the tool.
"""

import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from conftest import sample_text, write_shard

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA_DIR))

import make_shards  # noqa: E402
import retokenize  # noqa: E402
import shards  # noqa: E402

SHARD_TOKENS = 40  # sample_text documents are 27-163 tokens here with vocab 512
DOCS = {"val": sample_text(12, seed=11), "train": sample_text(30, seed=12)}
MARKS = {"val": 0, "train": shards.SAMPLE_MARK}  # header word 3 must carry over


def normalized(text: str) -> str:
    # What the challenge tokenizers preserve: NFKC, and whitespace runs collapsed to one space.
    return " ".join(unicodedata.normalize("NFKC", text).split())


def build_source(out: Path, model: Path, docs_by_split: dict[str, list[str]]) -> dict[str, list[int]]:
    """Writes each split as [BOS] + ids per document, cut every SHARD_TOKENS tokens; returns per split the shard
    in which each document starts."""
    sp = spm.SentencePieceProcessor(model_file=str(model))
    out.mkdir(parents=True)
    starts = {}
    for split, docs in docs_by_split.items():
        stream: list[int] = []
        starts[split] = []
        for doc in docs:
            starts[split].append(len(stream) // SHARD_TOKENS)
            stream += [1, *sp.encode(doc)]
        for k, lo in enumerate(range(0, len(stream), SHARD_TOKENS)):
            path = out / f"fineweb_{split}_{k:06d}.bin"
            write_shard(path, stream[lo: lo + SHARD_TOKENS])
            if MARKS[split]:
                with open(path, "r+b") as f:
                    f.seek(12)
                    f.write(np.array([MARKS[split]], "<i4").tobytes())
    return starts


def read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(header words 0-3, tokens), read without the code under test."""
    return np.fromfile(path, "<i4", count=4), np.fromfile(path, "<u2", offset=1024)


def run(src: Path, src_model: Path, dst: Path, dst_model: Path, *extra: str) -> dict:
    return retokenize.main(["--src", str(src), "--src-tokenizer", str(src_model), "--dst", str(dst),
                            "--tokenizer", str(dst_model), *extra])


@pytest.fixture(scope="module")
def tokenizer_384(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok384") / "tiny384.model"
    make_shards.train_tokenizer(sample_text(400, seed=5), 384, path)
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer_path) -> tuple[Path, dict[str, list[int]]]:
    src = tmp_path_factory.mktemp("src") / "sp512"
    return src, build_source(src, tokenizer_path, DOCS)


@pytest.fixture(scope="module")
def retokenized(tmp_path_factory, source, tokenizer_path, tokenizer_384) -> tuple[Path, dict]:
    dst = tmp_path_factory.mktemp("dst") / "sp384"  # does not exist yet: the tool creates it
    return dst, run(source[0], tokenizer_path, dst, tokenizer_384, "--workers", "1")


def test_documents_bytes_names_and_placement(source, retokenized, tokenizer_384):
    (src, starts), (dst, out) = source, retokenized
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_384))
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    for split, docs in DOCS.items():
        n_shards = len(list(src.glob(f"fineweb_{split}_*.bin")))
        # the cases that matter were exercised: documents continuing over 2+ shards, shards where none starts
        assert max(np.diff(starts[split] + [n_shards])) >= 3 and len(set(starts[split])) < n_shards
        dst_tokens = 0
        for k in range(n_shards):
            header, tokens = read(dst / f"fineweb_{split}_{k:06d}.bin")
            assert header.tolist() == [20240520, 1, tokens.size, MARKS[split]]
            assert tokens.size == 0 or tokens[0] == 1
            got = [sp.decode(ids.tolist()) for ids in np.split(tokens, np.flatnonzero(tokens == 1))[1:]]
            assert got == [normalized(d) for d, s in zip(docs, starts[split]) if s == k], (split, k)
            dst_tokens += tokens.size
        text_bytes = sum(len(normalized(d).encode("utf-8")) for d in docs)
        st = out["splits"][split]
        assert st["text_bytes"] == st["src_bytes"] == st["dst_bytes"] == text_bytes
        assert (st["docs"], st["shards"], st["dst_tokens"]) == (len(docs), n_shards, dst_tokens)
        assert st["roundtrip"] == (min(len(docs), retokenize.ROUNDTRIP_DOCS),) * 2


def test_refuses_wrong_source_tokenizer(tmp_path, source, tokenizer_path, tokenizer_384):
    # ids beyond the given tokenizer's vocabulary
    assert max(read(p)[1].max() for p in source[0].iterdir()) >= 384
    with pytest.raises(SystemExit, match=r"token id \d+ >= the source tokenizer's vocab size 384; wrong --src-tok"):
        run(source[0], tokenizer_384, tmp_path / "a", tokenizer_384)
    # ids that fit but are another tokenizer's: the decoded text does not encode back
    src384 = tmp_path / "sp384"
    build_source(src384, tokenizer_384, DOCS)
    with pytest.raises(SystemExit, match=r"re-encodes only \d+ of the first 12 .* probably not the tokenizer"):
        run(src384, tokenizer_path, tmp_path / "b", tokenizer_384)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_existing_shards_need_overwrite(tmp_path, source, retokenized, tokenizer_path, tokenizer_384):
    dst = tmp_path / "dst"
    dst.mkdir()
    write_shard(dst / "fineweb_val_000000.bin", [1, 5, 6])
    write_shard(dst / "fineweb_train_000099.bin", [1, 7])  # of an earlier, larger run
    (dst / "notes.txt").write_text("kept")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(SystemExit, match=r"--dst .*dst already holds 2 shards .* pass --overwrite"):
        run(source[0], tokenizer_path, dst, tokenizer_384)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    run(source[0], tokenizer_path, dst, tokenizer_384, "--overwrite", "--workers", "1")
    expected = {p.name: p.read_bytes() for p in retokenized[0].iterdir()}
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == expected | {"notes.txt": b"kept"}


def test_two_workers_give_identical_shards(tmp_path, source, retokenized, tokenizer_path, tokenizer_384, capsys):
    out = run(source[0], tokenizer_path, tmp_path / "w2", tokenizer_384, "--workers", "2")
    assert out["processes"] == 2 and "retokenize_done processes:2 threads:1 " in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (tmp_path / "w2").iterdir()} == \
           {p.name: p.read_bytes() for p in retokenized[0].iterdir()}


def _truncate(src: Path) -> None:
    p = src / "fineweb_train_000001.bin"
    p.write_bytes(p.read_bytes()[:-2])


def _invalid_utf8(src: Path) -> None:
    # a last train document of one byte-fallback piece, 0xE9 alone: the rule counts 1 byte, its text is U+FFFD (3)
    last = sorted(src.glob("fineweb_train_*.bin"))[-1]
    write_shard(last, [*read(last)[1], 1, 4 + 0xE9])


@pytest.mark.parametrize("change, args, message", [
    (None, ["--src", "{tmp}/nowhere"], r"--src .*nowhere: directory not found"),
    (lambda s: [p.unlink() for p in s.iterdir()], [], r"no fineweb_\{val,train\}_NNNNNN.bin shards there"),
    (lambda s: (s / "fineweb_train_000001.bin").unlink(), [], r"fineweb_train_000001.bin is missing \(next is"),
    (_truncate, [], r"fineweb_train_000001.bin: size \d+ != \d+ for \d+ tokens \(truncated\?\)"),
    (lambda s: write_shard(s / "fineweb_val_000000.bin", [5, 1, 6]), [], r"must start with BOS=1"),
    (_invalid_utf8, [], r"fineweb_train_\d+.bin: byte totals differ: decoded text \d+ UTF-8 bytes, byte rule \d+ on"),
    (None, ["--tokenizer", "{tmp}/none.model"], r"--tokenizer .*none.model: file not found"),
    (None, ["--dst", "{src}"], r"--dst .* is --src"),
])
def test_errors(tmp_path, tokenizer_path, tokenizer_384, change, args, message):
    src = tmp_path / "src"
    build_source(src, tokenizer_path, DOCS)
    if change:
        change(src)
    argv = dict(zip(["--src", "--src-tokenizer", "--dst", "--tokenizer"],
                    [str(src), str(tokenizer_path), str(tmp_path / "dst"), str(tokenizer_384)]))
    argv.update(zip(args[::2], (a.format(tmp=tmp_path, src=src) for a in args[1::2])))
    with pytest.raises(SystemExit, match=message):
        retokenize.main([x for kv in argv.items() for x in kv])


def test_command_line_error_has_no_traceback(tmp_path, tokenizer_path):
    proc = subprocess.run([sys.executable, str(DATA_DIR / "retokenize.py"), "--src", str(tmp_path / "x"),
                           "--src-tokenizer", str(tokenizer_path), "--dst", str(tmp_path / "y"),
                           "--tokenizer", str(tokenizer_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("error: --src ") and "Traceback" not in proc.stderr


def syllable_text(n_docs: int, seed: int) -> list[str]:
    """Documents of pseudo-words (2-4 syllables of a 15 x 6 table): enough distinct strings for a 2,048-piece
    BPE, which sample_text's fixed word list cannot fill (538 pieces at most), plus its non-ASCII words."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghjklmnprst" for v in "aeiouy"]
    extra = "café naïve Zürich 東京 données — 2024 3.14".split()
    docs = []
    for _ in range(n_docs):
        words = ["".join(rng.choice(syllables, int(rng.integers(2, 5)))) for _ in range(int(rng.integers(20, 80)))]
        words[int(rng.integers(len(words)))] = str(rng.choice(extra))
        docs.append(" ".join(words) + ".")
    return docs


def test_a_larger_vocabulary_trains_exports_and_scores_the_same_bytes(tmp_path, monkeypatch):
    """Issue 22: the same text as sp-512 shards and, retokenized, as sp-2048 shards: train_gpt.py trains,
    exports, reads back and scores both, over the same val_bpb byte count."""
    from conftest import run_inline, tiny_env
    corpus = syllable_text(600, seed=21)
    small, large = tmp_path / "tok512.model", tmp_path / "tok2048.model"
    make_shards.train_tokenizer(corpus, 512, small)
    make_shards.train_tokenizer(corpus, 2048, large)
    sp = spm.SentencePieceProcessor(model_file=str(small))
    src = tmp_path / "sp512"
    src.mkdir()
    for name, docs in (("val", syllable_text(30, seed=22)), ("train", syllable_text(300, seed=23))):
        write_shard(src / f"fineweb_{name}_000000.bin", [t for d in docs for t in [1, *sp.encode(d)]])
    run(src, small, tmp_path / "sp2048", large, "--workers", "1")
    scored = {}
    for vocab, data, tok in ((512, src, small), (2048, tmp_path / "sp2048", large)):
        env = tiny_env(data, tok, VOCAB_SIZE=vocab, RUN_ID=f"v{vocab}", ITERATIONS=6)
        r = run_inline(monkeypatch, env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        log = (tmp_path / "logs" / f"v{vocab}.txt").read_text()
        line = next(x for x in log.splitlines() if x.startswith("final_int6_sliding_window "))
        scored[vocab] = int(line.split("scored_bytes:")[1].split()[0])
        assert "setting vocab_size:%d" % vocab in log
    assert scored[512] == scored[2048] > 10_000
