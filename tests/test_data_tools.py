"""Tests of the data tools (data/shards.py, cached_challenge_fineweb.py, make_shards.py, make_sample.py).

CPU only, offline, a few seconds in all: the downloader runs against a fake repository built in
tmp_path, tokenizers are tiny (vocab 384) and trained on synthetic text with non-ASCII and digits.
Expected values come from independent code (struct for headers, unicodedata for normalization,
per-document sp.encode for token streams), not from the code under test.
"""

import importlib.util
import json
import os
import random
import struct
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import train_gpt as tg
from conftest import bos2_tokenizer, sample_text

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA_DIR))

import cached_challenge_fineweb as ccf  # noqa: E402
import make_shards  # noqa: E402
import shards  # noqa: E402

TINY_VOCAB = 384  # 4 specials + 256 byte pieces + the synthetic text's characters + some merges
WORDS = ("the model reads every token of the shard and the loss goes down while training on data "
         "with values like 2024 and 3.14 in café Zürich naïve straße 日本 ﬁle größe x1 y22").split()


def synthetic_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 4))]
        docs.append(rng.choice(["\n", " ", "  "]).join(s.capitalize() + "." for s in sentences))
    return docs


def normalized(text: str) -> str:
    # What the challenge tokenizer preserves: NFKC, and whitespace runs collapsed to one space.
    return " ".join(unicodedata.normalize("NFKC", text).split())


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tiny.model"
    make_shards.train_tokenizer(synthetic_docs(400, seed=1), TINY_VOCAB, path)
    return path


def split_docs(tokens: np.ndarray) -> list[list[int]]:
    """Token stream -> documents (each starts with BOS=1; BOS never occurs inside encoded text)."""
    starts = list(np.flatnonzero(tokens == 1)) + [len(tokens)]
    assert starts[0] == 0, "stream must start with BOS"
    return [tokens[a + 1 : b].tolist() for a, b in zip(starts, starts[1:])]


# ---------------------------------------------------------------- shards

def test_shard_roundtrip_and_exact_layout(tmp_path):
    tokens = np.array([0, 1, 2, 65535, 1024, 7], dtype=np.int64)
    path = tmp_path / "s.bin"
    shards.write_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * len(tokens)
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240520, 1, len(tokens)) and not any(header[3:])
    assert struct.unpack(f"<{len(tokens)}H", raw[1024:]) == tuple(tokens)
    back = shards.read_shard(path)
    assert back.dtype == np.uint16 and back.tolist() == tokens.tolist()
    # data/retokenize.py writes one when a document covers a whole input shard; train_gpt.py refuses to read it
    shards.write_shard(tmp_path / "empty.bin", [])
    assert struct.unpack("<256i", (tmp_path / "empty.bin").read_bytes())[:3] == (20240520, 1, 0)
    with pytest.raises(tg.ShardError, match="empty.bin: shard holds no tokens"):
        shards.read_shard(tmp_path / "empty.bin")


def test_the_format_is_train_gpts():
    assert shards.shard_token_count is tg.shard_token_count and shards.ShardError is tg.ShardError
    assert (shards.SHARD_MAGIC, shards.SHARD_VERSION, shards.HEADER_BYTES, shards.SAMPLE_MARK) == \
           (tg.SHARD_MAGIC, tg.SHARD_VERSION, tg.HEADER_BYTES, tg.SAMPLE_MARK) == (20240520, 1, 1024, 0x504D4153)


@pytest.mark.parametrize("corrupt, message", [
    (lambda b: struct.pack("<i", 20240521) + b[4:], r"not a challenge shard \(magic 20240521, version 1\)"),
    (lambda b: b[:4] + struct.pack("<i", 2) + b[8:], r"not a challenge shard \(magic 20240520, version 2\)"),
    (lambda b: b[:-1], r"size 1043 != 1044 for 10 tokens \(truncated\?\)"),
    (lambda b: b + b"\0\0", r"size 1046 != 1044 for 10 tokens \(truncated\?\)"),
    (lambda b: b[:1000], r"truncated shard \(1000 bytes, header needs 1024\)"),
])
def test_read_shard_rejects_corrupt_files(tmp_path, corrupt, message):
    path = tmp_path / "bad.bin"
    shards.write_shard(path, np.arange(10))
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(tg.ShardError, match=message) as err:  # a ValueError, as the downloader catches
        shards.read_shard(path)
    assert "bad.bin" in str(err.value)


@pytest.mark.parametrize("bad", [[-1], [65536], [0.5]])
def test_write_shard_rejects_ids_outside_uint16(tmp_path, bad):
    with pytest.raises(ValueError, match="0, 65535"):
        shards.write_shard(tmp_path / "x.bin", bad)
    assert not (tmp_path / "x.bin").exists()


# ---------------------------------------------------------------- downloader

def build_fake_repo(repo: Path, root: str = "datasets", train=(100, 120, 90), val=(50, 30)) -> dict:
    """A directory laid out like the HF dataset repo: <root>/manifest.json, shards, tokenizer files."""
    rng = np.random.default_rng(0)
    ds = repo / root / "datasets" / "fineweb10B_sp1024"
    ds.mkdir(parents=True)
    for split, sizes in (("train", train), ("val", val)):
        for i, n in enumerate(sizes):
            shards.write_shard(ds / f"fineweb_{split}_{i:06d}.bin", rng.integers(0, 1024, n))
    tok = repo / root / "tokenizers"
    tok.mkdir()
    (tok / "fineweb_1024_bpe.model").write_bytes(b"fake model bytes")
    (tok / "fineweb_1024_bpe.vocab").write_bytes(b"fake vocab")
    manifest = {
        "datasets": [{"name": "fineweb10B_sp1024", "tokenizer_name": "sp_bpe_1024", "path": "datasets/fineweb10B_sp1024",
                      "train_glob": "datasets/fineweb10B_sp1024/fineweb_train_*.bin",
                      "val_glob": "datasets/fineweb10B_sp1024/fineweb_val_*.bin", "vocab_size": 1024, "bos_id": 1,
                      "stats": {"files_train": len(train), "files_val": len(val),
                                "tokens_train": sum(train), "tokens_val": sum(val)}}],
        "tokenizers": [{"name": "sp_bpe_1024", "kind": "sentencepiece_bpe", "vocab_size": 1024,
                        "model_path": "tokenizers/fineweb_1024_bpe.model",
                        "vocab_path": "tokenizers/fineweb_1024_bpe.vocab"}],
    }
    (repo / root / "manifest.json").write_text(json.dumps(manifest))
    return manifest


class CountingFetch:
    def __init__(self, repo: Path):
        self.inner, self.calls = ccf.local_fetch(repo), []

    def __call__(self, remote: str, local: Path) -> None:
        self.calls.append(remote)
        self.inner(remote, local)


@pytest.fixture
def fake_repo(tmp_path):
    repo = tmp_path / "repo"
    build_fake_repo(repo)
    return repo


def test_download_takes_train_prefix_all_val_and_tokenizer(tmp_path, fake_repo):
    dest, fetch = tmp_path / "data", CountingFetch(fake_repo)
    out = ccf.download("sp1024", 2, dest, fetch, "datasets")
    local = dest / "datasets" / "fineweb10B_sp1024"
    remote = fake_repo / "datasets" / "datasets" / "fineweb10B_sp1024"
    assert sorted(p.name for p in local.iterdir()) == [
        "fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin", "fineweb_val_000001.bin"]
    for p in local.iterdir():
        assert p.read_bytes() == (remote / p.name).read_bytes()
    assert (dest / "tokenizers" / "fineweb_1024_bpe.model").read_bytes() == b"fake model bytes"
    assert (dest / "tokenizers" / "fineweb_1024_bpe.vocab").read_bytes() == b"fake vocab"
    assert (out["train_tokens"], out["val_tokens"], out["val_shards"]) == (220, 80, 2)
    assert not list(dest.rglob("*.part"))
    assert "datasets/datasets/fineweb10B_sp1024/fineweb_train_000002.bin" not in fetch.calls


def test_rerun_skips_present_files_and_refetches_bad_one(tmp_path, fake_repo):
    dest = tmp_path / "data"
    ccf.download("sp1024", 2, dest, CountingFetch(fake_repo), "datasets")
    local = dest / "datasets" / "fineweb10B_sp1024"
    mtimes = {p: p.stat().st_mtime_ns for p in local.iterdir()}
    again = CountingFetch(fake_repo)
    ccf.download("sp1024", 2, dest, again, "datasets")
    assert again.calls == ["datasets/manifest.json"]  # only the manifest is fetched again
    assert {p: p.stat().st_mtime_ns for p in local.iterdir()} == mtimes

    bad = local / "fineweb_train_000001.bin"
    bad.write_bytes(bad.read_bytes()[:-2])  # a partial file left by some other tool
    third = CountingFetch(fake_repo)
    ccf.download("sp1024", 3, dest, third, "datasets")
    assert third.calls[1:] == ["datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin",
                               "datasets/datasets/fineweb10B_sp1024/fineweb_train_000002.bin"]
    assert shards.shard_token_count(bad) == 120


def test_corrupt_remote_shard_is_rejected(tmp_path, fake_repo):
    remote = fake_repo / "datasets" / "datasets" / "fineweb10B_sp1024" / "fineweb_val_000001.bin"
    remote.write_bytes(remote.read_bytes()[:-1])
    with pytest.raises(SystemExit, match="fineweb_val_000001.bin is corrupt"):
        ccf.main(["--variant", "sp1024", "--train-shards", "1", "--dest", str(tmp_path / "d"),
                  "--local-repo", str(fake_repo)])
    assert not (tmp_path / "d" / "datasets" / "fineweb10B_sp1024" / "fineweb_val_000001.bin").exists()


@pytest.mark.parametrize("change, args, message", [
    (None, ["--variant", "sp4096"], r"no dataset named 'fineweb10B_sp4096'; available: \['fineweb10B_sp1024'\]"),
    (None, ["--train-shards", "4"], "has only 3 train shards"),
    (lambda e: e["stats"].update(tokens_val=81), [], "stats.tokens_val=81"),
    (lambda e: e["stats"].pop("files_val"), [], "lacks a valid stats.files_val"),
])
def test_manifest_problems_are_clear_errors(tmp_path, fake_repo, change, args, message):
    if change:
        path = fake_repo / "datasets" / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest["datasets"][0])
        path.write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match=message):
        ccf.main(["--train-shards", "1", "--dest", str(tmp_path / "d"), "--local-repo", str(fake_repo), *args])


def test_env_overrides_repo_id_and_root_prefix(tmp_path, monkeypatch):
    repo = tmp_path / "mirror"
    build_fake_repo(repo, root="export_v2")
    seen = {}

    def fake_hf_fetch(repo_id):
        seen["repo_id"] = repo_id
        return seen.setdefault("fetch", CountingFetch(repo))

    monkeypatch.setattr(ccf, "hf_fetch", fake_hf_fetch)
    monkeypatch.setenv("MATCHED_FINEWEB_REPO_ID", "someone/mirror")
    monkeypatch.setenv("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", "export_v2")
    ccf.main(["--variant", "sp1024", "--train-shards", "1", "--dest", str(tmp_path / "d")])
    assert seen["repo_id"] == "someone/mirror"
    calls = seen["fetch"].calls
    assert calls[0] == "export_v2/manifest.json" and all(c.startswith("export_v2/") for c in calls)
    assert "export_v2/tokenizers/fineweb_1024_bpe.model" in calls
    assert len(calls) == 1 + 2 + 1 + 2  # manifest, val x2, train x1, tokenizer model + vocab


@pytest.mark.parametrize("variant, env, want", [
    ("sp1024", None, "willdepueoai/parameter-golf"),
    ("sp8192", None, "kevclark/parameter-golf"),  # published elsewhere: no env needed
    ("sp4096", None, "kevclark/parameter-golf"),
    ("sp8192", "someone/mirror", "someone/mirror"),  # the environment still wins
    ("sp8192_caseops", None, "romeerp/parameter-golf-caseops-v1"),
    ("sp8192_lossless_caps_caseops_v1_reserved", None, "romeerp/parameter-golf-caseops-v1"),  # the records' name
])
def test_each_variant_comes_from_the_repository_that_publishes_it(tmp_path, monkeypatch, capsys, variant, env, want):
    repo = tmp_path / "mirror"
    build_fake_repo(repo)  # holds sp1024 only: other variants stop at the manifest, after the repository is chosen
    seen = {}

    def fake_hf_fetch(repo_id):
        seen["repo_id"] = repo_id
        return CountingFetch(repo)

    monkeypatch.setattr(ccf, "hf_fetch", fake_hf_fetch)
    monkeypatch.delenv("MATCHED_FINEWEB_REPO_ID", raising=False)
    if env:
        monkeypatch.setenv("MATCHED_FINEWEB_REPO_ID", env)
    try:
        ccf.main(["--variant", variant, "--train-shards", "1", "--dest", str(tmp_path / "d")])
    except SystemExit as e:
        assert variant != "sp1024" and f"no dataset named '{ccf.dataset_name(variant)}'" in str(e)
    assert seen["repo_id"] == want
    assert f"source:{want} root:datasets variant:{variant}" in capsys.readouterr().out


HUB_STUB = """
class LocalEntryNotFoundError(FileNotFoundError):  # offline: what huggingface_hub raises (an OSError)
    pass


class ConnectError(Exception):  # httpx's, which huggingface_hub >= 1.0 lets through: not an OSError
    pass


class HfHubHTTPError(OSError):
    pass


FAILURES = {
    "offline": LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot "
                                       "find the requested files in the local cache. Please check your connection."),
    "unreachable": ConnectError("[Errno -3] Temporary failure in name resolution"),
    "http": HfHubHTTPError("503 Server Error: Service Unavailable for url: https://huggingface.co/x\\n\\nRetry later."),
}


def hf_hub_download(repo_id, filename, repo_type):
    import os
    raise FAILURES[os.environ["HUB_FAILURE"]]
"""


@pytest.fixture
def failing_hub(tmp_path, monkeypatch):
    """A stand-in huggingface_hub whose download fails as the real one does offline or with the hub unreachable
    (HUB_FAILURE picks how): no test touches the network."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "huggingface_hub.py").write_text(HUB_STUB)  # for a subprocess, on its PYTHONPATH
    spec = importlib.util.spec_from_file_location("huggingface_hub", stub / "huggingface_hub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)  # for this process, until the test ends
    monkeypatch.delenv("MATCHED_FINEWEB_REPO_ID", raising=False)
    return stub


@pytest.mark.parametrize("failure, what", [("offline", "LocalEntryNotFoundError: An error happened"),
                                           ("unreachable", "ConnectError: [Errno -3] Temporary failure"),
                                           ("http", "HfHubHTTPError: 503 Server Error: Service Unavailable for url: "
                                                    "https://huggingface.co/x Retry later.")])
def test_an_unreachable_hub_is_one_line_saying_what_failed_and_what_to_do(tmp_path, monkeypatch, failing_hub,
                                                                          failure, what):
    """Offline or with the hub unreachable, the downloader ended in a traceback."""
    monkeypatch.setenv("HUB_FAILURE", failure)
    with pytest.raises(SystemExit) as e:
        ccf.main(["--variant", "sp1024", "--train-shards", "1", "--dest", str(tmp_path / "d")])
    msg = str(e.value)
    assert msg.startswith(f"error: downloading datasets/manifest.json from the Hugging Face dataset "
                          f"willdepueoai/parameter-golf failed ({what}") and "\n" not in msg
    assert msg.endswith("or mirror the repository and pass --local-repo DIR")


def test_an_unreachable_hub_ends_the_script_without_a_traceback(tmp_path, failing_hub):
    env = {**{k: v for k, v in os.environ.items() if k != "MATCHED_FINEWEB_REPO_ID"}, "HUB_FAILURE": "unreachable",
           "PYTHONPATH": os.pathsep.join([str(failing_hub), *sys.path])}
    run = subprocess.run([sys.executable, str(DATA_DIR / "cached_challenge_fineweb.py"), "--dest", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: downloading datasets/manifest.json from the Hugging Face dataset ")


def test_an_unwritable_dest_is_one_line(tmp_path, fake_repo):
    (tmp_path / "d").write_text("a file, not a folder")
    with pytest.raises(SystemExit, match=r"^error: \[Errno 20\] Not a directory: .*d/datasets"):
        ccf.main(["--train-shards", "1", "--dest", str(tmp_path / "d"), "--local-repo", str(fake_repo)])


def test_a_manifest_left_by_another_variant_is_never_read(tmp_path, fake_repo):
    """The records deleted data/manifest.json before switching variants; here a stale one is replaced."""
    dest = tmp_path / "data"
    (dest / "datasets").mkdir(parents=True)
    (dest / "datasets" / "manifest.json").write_text(json.dumps({"datasets": [], "tokenizers": []}))
    out = ccf.download("sp1024", 1, dest, CountingFetch(fake_repo), "datasets")
    assert out["train_shards"] == 1
    assert json.loads((dest / "datasets" / "manifest.json").read_text())["datasets"][0]["name"] == "fineweb10B_sp1024"


CASEOPS = "fineweb10B_sp8192_lossless_caps_caseops_v1_reserved"
CASEOPS_TOK = "fineweb_8192_bpe_lossless_caps_caseops_v1_reserved"


def build_fake_caseops_repo(repo: Path, train=(100, 120), val=(50, 30)) -> Path:
    """Laid out like romeerp/parameter-golf-caseops-v1 as the CaseOps records describe it: datasets/manifest.json,
    datasets/datasets/<CASEOPS>/fineweb_{train,val,val_bytes}_NNNNNN.bin, datasets/tokenizers/<CASEOPS_TOK>.*.
    Returns the remote dataset folder."""
    rng = np.random.default_rng(1)
    ds = repo / "datasets" / "datasets" / CASEOPS
    ds.mkdir(parents=True)
    for split, sizes in (("train", train), ("val", val)):
        for i, n in enumerate(sizes):
            shards.write_shard(ds / f"fineweb_{split}_{i:06d}.bin", rng.integers(0, 8192, n))
    for i, n in enumerate(val):
        shards.write_shard(ds / f"fineweb_val_bytes_{i:06d}.bin", rng.integers(0, 12, n))
    tok = repo / "datasets" / "tokenizers"
    tok.mkdir()
    (tok / f"{CASEOPS_TOK}.model").write_bytes(b"fake caseops model")
    (tok / f"{CASEOPS_TOK}.vocab").write_bytes(b"fake caseops vocab")
    manifest = {
        "datasets": [{"name": CASEOPS, "tokenizer_name": "sp_bpe_8192_lossless_caps_caseops_v1_reserved",
                      "path": f"datasets/{CASEOPS}", "train_glob": f"datasets/{CASEOPS}/fineweb_train_*.bin",
                      "val_glob": f"datasets/{CASEOPS}/fineweb_val_*.bin",
                      "val_bytes_glob": f"datasets/{CASEOPS}/fineweb_val_bytes_*.bin", "vocab_size": 8192, "bos_id": 1,
                      "stats": {"files_train": len(train), "files_val": len(val), "docs_val": 7,
                                "tokens_train": sum(train), "tokens_val": sum(val)}}],
        "tokenizers": [{"name": "sp_bpe_8192_lossless_caps_caseops_v1_reserved", "kind": "sentencepiece_bpe",
                        "vocab_size": 8192, "text_transform": "lossless_caps_caseops_v1",
                        "model_path": f"tokenizers/{CASEOPS_TOK}.model",
                        "vocab_path": f"tokenizers/{CASEOPS_TOK}.vocab"}],
    }
    (repo / "datasets" / "manifest.json").write_text(json.dumps(manifest))
    return ds


@pytest.fixture
def caseops_repo(tmp_path):
    repo = tmp_path / "caseops_repo"
    build_fake_caseops_repo(repo)
    return repo


def caseops_main(tmp_path, repo, *args):
    return ccf.main(["--variant", "sp8192_caseops", "--train-shards", "1", "--dest", str(tmp_path / "d"),
                     "--local-repo", str(repo), *args])


def test_caseops_download_brings_the_byte_sidecars_where_train_gpt_reads_them(tmp_path, caseops_repo, capsys):
    out = caseops_main(tmp_path, caseops_repo)
    local, remote = tmp_path / "d" / "datasets" / CASEOPS, caseops_repo / "datasets" / "datasets" / CASEOPS
    assert sorted(p.name for p in local.iterdir()) == [
        "fineweb_train_000000.bin", "fineweb_val_000000.bin", "fineweb_val_000001.bin",
        "fineweb_val_bytes_000000.bin", "fineweb_val_bytes_000001.bin"]
    for p in local.iterdir():
        assert p.read_bytes() == (remote / p.name).read_bytes()
    assert [p.name for p in out["tokenizer_files"]] == [f"{CASEOPS_TOK}.model", f"{CASEOPS_TOK}.vocab"]
    assert (out["val_tokens"], [p.name for p in out["val_byte_sidecars"]]) == (
        80, ["fineweb_val_bytes_000000.bin", "fineweb_val_bytes_000001.bin"])
    assert "val_byte_sidecars:2" in capsys.readouterr().out
    assert not list((tmp_path / "d").rglob("*.part"))
    # What train_gpt.py reads at DATA_PATH=<dest>/datasets/<CASEOPS>: val shards without the sidecars, the sidecars
    # as one value per val token, and the val counts from the export's manifest one folder up.
    val_names = [Path(f).name for f in tg.shard_files(str(local), "val")]
    assert val_names == ["fineweb_val_000000.bin", "fineweb_val_000001.bin"]
    want = np.concatenate([np.fromfile(remote / f"fineweb_val_bytes_{i:06d}.bin", "<u2", offset=1024) for i in (0, 1)])
    assert tg.val_byte_sidecar(str(local), 80).tolist() == want.tolist()
    assert tg.val_manifest(str(local))[0] == {"docs": 7, "tokens": 80}


def test_caseops_rerun_skips_valid_sidecars_and_refetches_a_stale_one(tmp_path, caseops_repo):
    dest = tmp_path / "d"
    caseops_main(tmp_path, caseops_repo)
    again = CountingFetch(caseops_repo)
    ccf.download("sp8192_caseops", 1, dest, again, "datasets")
    assert again.calls == ["datasets/manifest.json"]
    stale = dest / "datasets" / CASEOPS / "fineweb_val_bytes_000001.bin"
    shards.write_shard(stale, [1, 2, 3])  # a valid shard, of another val set
    third = CountingFetch(caseops_repo)
    ccf.download("sp8192_caseops", 1, dest, third, "datasets")
    assert third.calls == ["datasets/manifest.json", f"datasets/datasets/{CASEOPS}/fineweb_val_bytes_000001.bin"]
    assert shards.shard_token_count(stale) == 30


def test_caseops_truncated_sidecar_is_refused(tmp_path, caseops_repo):
    remote = caseops_repo / "datasets" / "datasets" / CASEOPS / "fineweb_val_bytes_000001.bin"
    remote.write_bytes(remote.read_bytes()[:-2])
    with pytest.raises(SystemExit, match="fineweb_val_bytes_000001.bin is corrupt"):
        caseops_main(tmp_path, caseops_repo)
    assert not (tmp_path / "d" / "datasets" / CASEOPS / "fineweb_val_bytes_000001.bin").exists()


def test_caseops_sidecar_of_another_count_than_its_val_shard_is_refused(tmp_path, caseops_repo):
    remote = caseops_repo / "datasets" / "datasets" / CASEOPS
    shards.write_shard(remote / "fineweb_val_bytes_000000.bin", np.ones(30, dtype=int))  # well formed, val shard 0 has 50
    with pytest.raises(SystemExit, match=r"fineweb_val_bytes_000000.bin holds 30 values, its val shard "
                                         r".*fineweb_val_000000.bin 50 tokens"):
        caseops_main(tmp_path, caseops_repo)
    assert not (tmp_path / "d" / "datasets" / CASEOPS / "fineweb_val_bytes_000000.bin").exists()


def test_caseops_without_sidecars_is_refused(tmp_path, caseops_repo):
    """A CaseOps dataset is fetched with its sidecars even where the manifest names none (no val_bytes_glob):
    train_gpt.py cannot score CaseOps val without them."""
    path = caseops_repo / "datasets" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["datasets"][0]["val_bytes_glob"]
    path.write_text(json.dumps(manifest))
    (caseops_repo / "datasets" / "datasets" / CASEOPS / "fineweb_val_bytes_000000.bin").unlink()
    with pytest.raises(SystemExit, match="fineweb_val_bytes_000000.bin: not found"):
        caseops_main(tmp_path, caseops_repo)


def test_val_bytes_glob_brings_sidecars_for_any_dataset(tmp_path, fake_repo):
    path = fake_repo / "datasets" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["datasets"][0]["val_bytes_glob"] = "datasets/fineweb10B_sp1024/fineweb_val_bytes_*.bin"
    path.write_text(json.dumps(manifest))
    remote = fake_repo / "datasets" / "datasets" / "fineweb10B_sp1024"
    for i, n in enumerate((50, 30)):
        shards.write_shard(remote / f"fineweb_val_bytes_{i:06d}.bin", np.full(n, 3))
    out = ccf.download("sp1024", 0, tmp_path / "d", CountingFetch(fake_repo), "datasets")
    assert [shards.shard_token_count(p) for p in out["val_byte_sidecars"]] == [50, 30]


@pytest.mark.parametrize("variant, name", [
    ("sp1024", "fineweb10B_sp1024"), ("byte260", "fineweb10B_byte260"),
    ("sp8192_caseops", CASEOPS), ("sp8192_lossless_caps_caseops_v1_reserved", CASEOPS),
])
def test_dataset_names(variant, name):
    assert ccf.dataset_name(variant) == name


@pytest.mark.parametrize("variant", ["sp", "SP1024", "sp1024/../x", "sp8192_", "sp8192__caseops", "1024"])
def test_bad_variant_names_are_refused(variant):
    with pytest.raises(ValueError, match="expected a name like"):
        ccf.dataset_name(variant)


# ---------------------------------------------------------------- make_shards

def test_tokenizer_has_challenge_settings(tiny_tokenizer):
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    assert sp.vocab_size() == TINY_VOCAB
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert sp.id_to_piece(4) == "<0x00>" and sp.id_to_piece(259) == "<0xFF>"  # byte fallback
    assert sp.id_to_piece(sp.piece_to_id("\u2581")) == "\u2581"  # standalone space piece
    assert sp.encode("20243142", out_type=str) == list("20243142")  # split_digits (all seen in training)
    assert not sp.encode("the", out_type=str)[0].startswith("\u2581")  # no dummy prefix
    assert sp.decode(sp.encode("ﬁle")) == "file"  # nmt_nfkc
    assert sp.decode(sp.encode("Ω€")) == "Ω€"  # unseen characters survive through byte fallback


def test_documents_bos_split_and_roundtrip(tmp_path, tiny_tokenizer):
    docs = synthetic_docs(30, seed=2)
    out = tmp_path / "out"
    make_shards.main(["--input", str(write_jsonl(tmp_path / "in.jsonl", docs)), "--out", str(out),
                      "--tokenizer", str(tiny_tokenizer), "--val-docs", "5"])
    assert sorted(p.name for p in out.iterdir()) == ["fineweb_train_000000.bin", "fineweb_val_000000.bin"]
    val = split_docs(shards.read_shard(out / "fineweb_val_000000.bin"))
    train = split_docs(shards.read_shard(out / "fineweb_train_000000.bin"))
    assert (len(val), len(train)) == (5, 25)
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    for doc, ids in zip(docs, val + train):
        assert sp.decode(ids) == normalized(doc)
    assert any("file" in normalized(d) for d in docs)  # the ligature case was exercised


def test_shard_size_cap_and_stream_order(tmp_path, tiny_tokenizer):
    docs = synthetic_docs(40, seed=3)
    out = tmp_path / "out"
    stats = make_shards.main(["--input", str(write_jsonl(tmp_path / "in.jsonl", docs)), "--out", str(out),
                              "--tokenizer", str(tiny_tokenizer), "--val-docs", "4", "--shard-tokens", "64"])
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    for split, split_docs_ in (("val", docs[:4]), ("train", docs[4:])):
        files = sorted(out.glob(f"fineweb_{split}_*.bin"))
        sizes = [shards.shard_token_count(f) for f in files]
        assert len(files) > 1 and all(s == 64 for s in sizes[:-1]) and 0 < sizes[-1] <= 64
        expected = [t for d in split_docs_ for t in [1, *sp.encode(d)]]
        assert np.concatenate([shards.read_shard(f) for f in files]).tolist() == expected
        assert stats[split]["tokens"] == len(expected) and stats[split]["docs"] == len(split_docs_)


def test_txt_paragraphs_crlf_bom_and_stale_shards(tmp_path, tiny_tokenizer):
    text = "\ufeffFirst doc line one\r\nline two 2024\r\n\r\n \t \n\n\nSecond café doc\n\nThird\n"
    src = tmp_path / "in.txt"
    src.write_bytes(text.encode("utf-8"))
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "fineweb_train_000007.bin"
    shards.write_shard(stale, [1, 2, 3])
    make_shards.main(["--input", str(src), "--out", str(out), "--tokenizer", str(tiny_tokenizer), "--val-docs", "1"])
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    docs = [sp.decode(d) for d in split_docs(np.concatenate(
        [shards.read_shard(out / "fineweb_val_000000.bin"), shards.read_shard(out / "fineweb_train_000000.bin")]))]
    assert docs == ["First doc line one line two 2024", "Second café doc", "Third"]
    assert not stale.exists()


def test_training_is_deterministic(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", synthetic_docs(300, seed=4))
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        make_shards.main(["--input", str(src), "--out", str(out), "--train-tokenizer", "--vocab-size", str(TINY_VOCAB),
                          "--val-docs", "10", "--shard-tokens", "2000"])
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert "tokenizer_sp384.model" in outputs[0] and len(outputs[0]) >= 4


@pytest.mark.parametrize("content, extra, message", [
    ("\n\n  \n", [], "no documents in the input"),
    ("\n\n", ["--train-tokenizer", "--vocab-size", "384"], "no documents to train the tokenizer"),
    (b"ok line\n\xe9t\xe9\n", [], r"in\.txt:2: invalid UTF-8 at byte offset 8 \(byte 0xe9\)"),
    (b"ok line\n\xe9t\xe9\n", ["--train-tokenizer", "--vocab-size", "384"], r"in\.txt:2: invalid UTF-8 at byte offset 8"),
    ("One doc only.", [], "only 1 documents: need more than --val-docs 1"),
    ("a\n\nb", ["--train-tokenizer", "--vocab-size", "70000"], "--vocab-size 70000: must be in .1, 65536."),
    ("a\n\nb", ["--train-tokenizer", "--vocab-size", "384", "--val-docs", "0"], "--val-docs 0: need at least 1"),
])
def test_make_shards_errors_txt(tmp_path, tiny_tokenizer, content, extra, message):
    src = tmp_path / "in.txt"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = ["--input", str(src), "--out", str(tmp_path / "out"), "--val-docs", "1"]
    with pytest.raises(SystemExit, match=message):
        make_shards.main(args + (extra or ["--tokenizer", str(tiny_tokenizer)]))


def test_val_is_the_challenges_first_50000_documents_by_default(tmp_path, tiny_tokenizer):
    """--val-docs defaulted to 1000: the challenge's val documents 1,000-49,999 went to train without a word."""
    docs = [f"doc {i} {WORDS[i % len(WORDS)]}" for i in range(50_003)]
    src, out = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out"
    stats = make_shards.main(["--input", str(src), "--out", str(out), "--tokenizer", str(tiny_tokenizer)])
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    val = split_docs(np.concatenate([shards.read_shard(f) for f in stats["val"]["files"]]))
    train = split_docs(np.concatenate([shards.read_shard(f) for f in stats["train"]["files"]]))
    assert (len(val), val[-1]) == (50_000, sp.encode(docs[49_999]))
    assert train == sp.encode(docs[50_000:])


def test_fewer_documents_than_the_val_set_stop_unless_allowed(tmp_path, tiny_tokenizer, capsys):
    """As data/make_caseops.py: fewer documents than --val-docs stop the tool, naming the flag that builds a partial
    val set anyway (every document val, no train), and nothing is written."""
    docs = synthetic_docs(30, seed=5)
    src, out = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out"
    for tok in (["--tokenizer", str(tiny_tokenizer)], ["--train-tokenizer", "--vocab-size", str(TINY_VOCAB)]):
        with pytest.raises(SystemExit, match=r"^error: only 30 documents for the val set, --val-docs is 50000 \(the "
                           r"challenge's val set is the first 50,000 documents\); pass --allow-partial-val"):
            make_shards.main(["--input", str(src), "--out", str(out), *tok])
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert "shards_warning" not in capsys.readouterr().out  # the challenge's split: nothing to warn about
    stats = make_shards.main(["--input", str(src), "--out", str(out), "--tokenizer", str(tiny_tokenizer),
                              "--allow-partial-val"])
    assert (stats["val"]["docs"], stats["train"]["docs"]) == (30, 0)
    assert sorted(p.name for p in out.iterdir()) == ["fineweb_val_000000.bin"]
    make_shards.main(["--input", str(src), "--out", str(out), "--tokenizer", str(tiny_tokenizer), "--val-docs", "20"])
    assert "shards_warning --val-docs 20: documents 20..49,999 of the challenge's val set go to train" in \
        capsys.readouterr().out


def test_a_val_document_repeated_in_train_stops_the_tool_unless_dropped(tmp_path, tiny_tokenizer):
    """As data/make_caseops.py's leak guard: a train document whose text is a val document's stops the tool before
    anything is written (the tokenizer too); --drop-leaked leaves it out of train and of the tokenizer's text."""
    docs = synthetic_docs(40, seed=6)
    assert len(set(docs)) == len(docs)
    src = write_jsonl(tmp_path / "in.jsonl", docs[:20] + [docs[4]] + docs[20:])  # train document 0 is val document 4
    out = tmp_path / "out"
    for tok in (["--tokenizer", str(tiny_tokenizer)], ["--train-tokenizer", "--vocab-size", str(TINY_VOCAB)]):
        with pytest.raises(SystemExit, match=r"^error: train document 0 \(from 0\) has the sha256 of a val document "
                           r"\([0-9a-f]{16}\.\.\.\): it would train on the val set; nothing was written "
                           r"\(--drop-leaked leaves such documents out of train\)$"):
            make_shards.main(["--input", str(src), "--out", str(out), "--val-docs", "20", *tok])
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    stats = make_shards.main(["--input", str(src), "--out", str(out), "--val-docs", "20", "--drop-leaked",
                              "--train-tokenizer", "--vocab-size", str(TINY_VOCAB)])
    assert stats["train"]["dropped_leaked_docs"] == 1
    alone = make_shards.train_tokenizer(docs[20:], TINY_VOCAB, tmp_path / "alone.model")  # never saw the leak
    assert (out / f"tokenizer_sp{TINY_VOCAB}.model").read_bytes() == (tmp_path / "alone.model").read_bytes()
    train = split_docs(np.concatenate([shards.read_shard(f) for f in stats["train"]["files"]]))
    assert train == alone.encode(docs[20:])


@pytest.mark.parametrize("lines, message", [
    ('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n', r"in\.jsonl:3: malformed JSON"),
    ('{"text": "a"}\n\n{"body": "b"}\n', r"in\.jsonl:3: expected a JSON object with a string field 'text'"),
    ('["a"]\n', r"in\.jsonl:1: expected a JSON object"),
])
def test_make_shards_errors_jsonl(tmp_path, tiny_tokenizer, lines, message):
    src = tmp_path / "in.jsonl"
    src.write_text(lines)
    with pytest.raises(SystemExit, match=message):
        make_shards.main(["--input", str(src), "--out", str(tmp_path / "out"), "--tokenizer", str(tiny_tokenizer)])


def test_make_shards_rejects_bad_tokenizer_and_input_type(tmp_path, tiny_tokenizer):
    docs = write_jsonl(tmp_path / "in.jsonl", synthetic_docs(5))
    with pytest.raises(SystemExit, match=r"bos2\.model: bos_id is 2"):
        make_shards.main(["--input", str(docs), "--out", str(tmp_path / "o"), "--tokenizer", str(bos2_tokenizer(tmp_path / "bos2.model", synthetic_docs(200), TINY_VOCAB))])
    (tmp_path / "in.csv").write_text("a,b\n")
    with pytest.raises(SystemExit, match=r"in\.csv: unsupported input type '\.csv'"):
        make_shards.main(["--input", str(tmp_path / "in.csv"), "--out", str(tmp_path / "o"), "--tokenizer", str(tiny_tokenizer)])
    with pytest.raises(SystemExit, match="cannot load SentencePiece model"):
        make_shards.main(["--input", str(docs), "--out", str(tmp_path / "o"), "--tokenizer", str(docs)])


# ---------------------------------------------------------------- make_sample

def test_make_sample_collects_its_documents_before_torch_is_imported():
    """torch replaces inspect.getfile with a function without a docstring: a sample built after importing it (as
    shards does, for train_gpt.py's format) lacks that document, and its shuffle, tokenizer and shards differ."""
    code = ("import inspect, sys, make_sample; docs = make_sample.collect_documents(); "
            "assert 'torch' not in sys.modules; assert inspect.getdoc(inspect.getfile) in docs")
    proc = subprocess.run([sys.executable, "-c", code], cwd=DATA_DIR, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_an_interrupted_sample_build_leaves_no_tokenizer(tmp_path, monkeypatch):
    """data/quickstart.sh takes the tokenizer's presence for a whole sample: it is put in place last, so a build
    stopped in the shards leaves none, and the next quickstart builds the sample again (it trained on a half)."""
    import make_sample
    train_tokenizer, _, mark = make_sample._shard_tools()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(make_sample, "_shard_tools", lambda: (train_tokenizer, stopped, mark))
    monkeypatch.setattr(make_sample, "collect_documents", lambda: sample_text(400, seed=4))
    with pytest.raises(KeyboardInterrupt):
        make_sample.main(["--out", str(tmp_path), "--vocab-size", "512"])
    assert not list(tmp_path.rglob("*.model")) and list(tmp_path.rglob("*.model.partial"))


def test_make_sample_builds_readable_deterministic_shards(tmp_path):
    trees = []
    for run in ("a", "b"):  # fresh interpreters: the sample must not depend on what the caller imported
        out = tmp_path / run
        proc = subprocess.run([sys.executable, str(DATA_DIR / "make_sample.py"), "--out", str(out), "--vocab-size", "512"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        trees.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert trees[0] == trees[1]
    data, model = out / "datasets" / "sample_sp512", out / "tokenizers" / "sample_512_bpe.model"
    assert {p.name for p in data.iterdir()} == {"fineweb_train_000000.bin", "fineweb_val_000000.bin"}
    val, train = shards.read_shard(data / "fineweb_val_000000.bin"), shards.read_shard(data / "fineweb_train_000000.bin")
    assert val.size > 5_000 and train.size > 100_000 and val[0] == 1 and train[0] == 1
    sp = make_shards.load_tokenizer(model)
    assert sp.vocab_size() == 512 and int(train.max()) < 512
    n_val, n_train = int((val == 1).sum()), int((train == 1).sum())
    assert 0.03 < n_val / (n_val + n_train) < 0.07  # ~5% of documents are val
    assert f"split:val docs:{n_val} tokens:{val.size}" in proc.stdout
    text = sp.decode(train[:20_000].tolist())
    assert text.count(" the ") > 20 and "Return" in text  # real English docstrings, not byte soup
    # marked as the sample (header word 3), so train_gpt.py says its scores are not FineWeb scores
    for f in data.iterdir():
        assert np.fromfile(f, dtype="<i4", count=4)[3] == tg.SAMPLE_MARK
        assert tg.is_sample_shard(f)
    shards.write_shard(tmp_path / "plain.bin", [1, 2])  # any other shard: the rest of the header stays 0
    assert not tg.is_sample_shard(tmp_path / "plain.bin")
