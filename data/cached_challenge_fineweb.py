"""Download the published challenge shards and tokenizer, driven by the export's manifest.json.

    python3 data/cached_challenge_fineweb.py --variant sp1024 --train-shards N [--dest data]
    python3 data/cached_challenge_fineweb.py --variant sp1024 --train-shards 1 --local-repo /mirror
    python3 data/cached_challenge_fineweb.py --variant sp8192_caseops --train-shards 80

Writes <dest>/datasets/fineweb10B_<variant>/fineweb_{train,val}_NNNNNN.bin (the first N train shards,
always every val shard), <dest>/tokenizers/<tokenizer files> and <dest>/datasets/manifest.json.

Source: the Hugging Face dataset repo that publishes the variant (VARIANT_REPOS: `willdepueoai/parameter-golf`
for sp1024, `kevclark/parameter-golf` for sp4096 and sp8192, `romeerp/parameter-golf-caseops-v1` for CaseOps;
env MATCHED_FINEWEB_REPO_ID overrides), export rooted at `datasets/` (env MATCHED_FINEWEB_REMOTE_ROOT_PREFIX).
The manifest lists `datasets[]` {name, tokenizer_name, path, vocab_size, bos_id, val_bytes_glob (CaseOps),
stats{files_train, files_val, tokens_val, ...}} and `tokenizers[]` {name, model_path, vocab_path}; paths are
relative to the export root. `--local-repo DIR` copies from a directory laid out like the remote repo (mirrors, tests).

CaseOps (`--variant sp8192_caseops`, alias of sp8192_lossless_caps_caseops_v1_reserved, the name the records'
commands use): SP8192 lossless-caps shards into <dest>/datasets/fineweb10B_sp8192_lossless_caps_caseops_v1_reserved/,
tokenizer fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model. Besides the val shards it fetches each one's
byte sidecar fineweb_val_bytes_NNNNNN.bin (shard format: uint16 original-text bytes per val token, which
train_gpt.py scores CaseOps val_bpb with): size-checked like a shard, and its count must equal its val shard's
(a sidecar that fails either is deleted and refused). Sidecars are fetched for any dataset whose manifest entry has
val_bytes_glob, and always for a CaseOps one. The layout (the 2026-04-18 CaseOps record of openai/parameter-golf and
its download commands) is untried here: these machines have no network; only a fake local repository is tested.
The alternative is building the data locally with data/make_caseops.py.

Resumable: each file lands in `<name>.part` and is renamed when complete; a shard already present
whose size matches its header is skipped, a present shard that fails the check is fetched again.
The manifest is always fetched again (it is small and decides everything else): a manifest cached for another
variant or repository, which made the records delete data/manifest.json before switching, is never read.
huggingface_hub is imported only when the default fetcher is used. Offline, or with the hub unreachable, the tool
ends in one line naming the file and the error, and what to do (exit status 1), as for any other failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

try:
    from shards import shard_token_count
except ImportError:  # imported as data.cached_challenge_fineweb from the repo root
    from data.shards import shard_token_count

DEFAULT_REPO_ID = "willdepueoai/parameter-golf"
CASEOPS_VARIANT = "sp8192_lossless_caps_caseops_v1_reserved"  # fineweb10B_<this> in the CaseOps export's manifest
VARIANT_ALIASES = {"sp8192_caseops": CASEOPS_VARIANT}
# The repository that publishes each tokenizer family (the records' download commands, in the READMEs of
# openai/parameter-golf records/track_10min_16mb/: sp4096 2026-04-01_Vocab4096_MLPMult4_WD085, sp8192
# 2026-04-05_SP8192_GPTQ-Embeddings_SDClip_Loop45x2, CaseOps 2026-04-18_PR1626_CaseOps_Taper); others default to
# DEFAULT_REPO_ID.
VARIANT_REPOS = {"sp4096": "kevclark/parameter-golf", "sp8192": "kevclark/parameter-golf",
                 CASEOPS_VARIANT: "romeerp/parameter-golf-caseops-v1"}
DEFAULT_ROOT_PREFIX = "datasets"

# fetch(remote_relpath, local_path): copy one file of the repo (path relative to the repo root) to local_path.
Fetch = Callable[[str, Path], None]


def hf_fetch(repo_id: str) -> Fetch:
    def fetch(remote_relpath: str, local_path: Path) -> None:
        try:  # lazy: tests and --local-repo need no network stack
            from huggingface_hub import hf_hub_download
        except ImportError:
            raise ValueError("huggingface_hub is not installed: pip install huggingface_hub (or use --local-repo)") from None

        try:
            cached = Path(hf_hub_download(repo_id=repo_id, filename=remote_relpath, repo_type="dataset"))
        except Exception as e:  # noqa: BLE001  (the hub raises its own, requests' or httpx's errors, by version)
            raise ValueError(f"downloading {remote_relpath} from the Hugging Face dataset {repo_id} failed "
                             f"({type(e).__name__}: {' '.join(str(e).split())}): check the network (or HF_ENDPOINT, "
                             "a proxy), or fetch the data where there is network and copy --dest over, or mirror "
                             "the repository and pass --local-repo DIR") from None
        _link_or_copy(cached.resolve(strict=True), local_path)  # HF cache entries are symlinks to blobs

    return fetch


def local_fetch(repo_dir: str | os.PathLike) -> Fetch:
    repo_dir = Path(repo_dir)

    def fetch(remote_relpath: str, local_path: Path) -> None:
        src = repo_dir / remote_relpath
        if not src.is_file():
            raise ValueError(f"{src}: not found in local repo {repo_dir}")
        shutil.copyfile(src, local_path)

    return fetch


def _link_or_copy(src: Path, dst: Path) -> None:
    # A hard link avoids holding every 200 MB shard twice (HF cache + data/); copy across filesystems.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _fetch_to(fetch: Fetch, remote: str, dest: Path) -> None:
    """Fetch into dest.part, then rename: a crash never leaves a half file under the final name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.unlink(missing_ok=True)
    fetch(remote, part)
    os.replace(part, dest)


def _shard_ok(path: Path) -> int | None:
    """num_tokens of a valid shard at path, or None if it is missing or fails the size/header check."""
    if not path.is_file():
        return None
    try:
        return shard_token_count(path)
    except ValueError:
        return None


def get_shard(fetch: Fetch, remote: str, dest: Path) -> int:
    """Make sure dest holds a valid shard (skip if already valid, else fetch once); return its num_tokens."""
    num_tokens = _shard_ok(dest)
    if num_tokens is not None:
        return num_tokens
    if dest.exists():
        print(f"refetch path:{dest} reason:size_or_header_mismatch")
    _fetch_to(fetch, remote, dest)
    try:
        return shard_token_count(dest)
    except ValueError as e:
        dest.unlink()
        raise ValueError(f"downloaded shard {remote} is corrupt: {e}") from None


def canonical_variant(variant: str) -> str:
    return VARIANT_ALIASES.get(variant, variant)


def dataset_name(variant: str) -> str:
    variant = canonical_variant(variant)
    if not re.fullmatch(r"[a-z]+[0-9]+(_[a-z0-9]+)*", variant):
        raise ValueError(f"--variant {variant!r}: expected a name like sp1024, byte260 or sp8192_caseops")
    return f"fineweb10B_{variant}"


def get_sidecar(fetch: Fetch, remote: str, dest: Path, val_tokens: int, val_remote: str) -> int:
    """Make sure dest holds the byte sidecar of a val shard of val_tokens tokens (a shard-format file of as many
    values); a present one of another count is fetched again, a fetched one of another count deleted and refused."""
    num = _shard_ok(dest)
    if num is not None and num != val_tokens:
        print(f"refetch path:{dest} reason:count_mismatch ({num} values, {val_tokens} val tokens)")
        dest.unlink()
    num = get_shard(fetch, remote, dest)
    if num != val_tokens:
        dest.unlink()
        raise ValueError(f"byte sidecar {remote} holds {num} values, its val shard {val_remote} {val_tokens} tokens")
    return num


def _find(entries: list, name: str, what: str, manifest_path: str) -> dict:
    for e in entries:
        if e.get("name") == name:
            return e
    names = sorted(str(e.get("name")) for e in entries)
    raise ValueError(f"{manifest_path}: no {what} named {name!r}; available: {names}")


def _stat(entry: dict, key: str, manifest_path: str) -> int:
    value = (entry.get("stats") or {}).get(key)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{manifest_path}: dataset {entry['name']!r} lacks a valid stats.{key} (got {value!r})")
    return value


def download(variant: str, train_shards: int, dest: str | os.PathLike, fetch: Fetch, root: str) -> dict:
    """Download manifest, the first train_shards train shards, all val shards and the tokenizer files.
    Returns a summary dict (paths and token counts)."""
    dest, root = Path(dest), root.strip("/")
    if train_shards < 0:
        raise ValueError(f"--train-shards must be >= 0, got {train_shards}")
    manifest_remote = f"{root}/manifest.json"
    manifest_local = dest / "datasets" / "manifest.json"
    _fetch_to(fetch, manifest_remote, manifest_local)
    try:
        manifest = json.loads(manifest_local.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest_remote}: not valid JSON ({e})") from None

    name = dataset_name(variant)
    entry = _find(manifest.get("datasets", []), name, "dataset", manifest_remote)
    files_train = _stat(entry, "files_train", manifest_remote)
    files_val = _stat(entry, "files_val", manifest_remote)
    if train_shards > files_train:
        raise ValueError(f"--train-shards {train_shards}: {name} has only {files_train} train shards")
    tok_entry = _find(manifest.get("tokenizers", []), entry.get("tokenizer_name"), "tokenizer", manifest_remote)

    remote_dir = f"{root}/{entry.get('path') or 'datasets/' + name}".rstrip("/")
    local_dir = dest / "datasets" / name
    val_counts = [get_shard(fetch, f"{remote_dir}/fineweb_val_{i:06d}.bin", local_dir / f"fineweb_val_{i:06d}.bin")
                  for i in range(files_val)]
    val_tokens = sum(val_counts)
    expected_val = (entry.get("stats") or {}).get("tokens_val")
    if expected_val is not None and val_tokens != expected_val:
        raise ValueError(f"{local_dir}: val shards hold {val_tokens} tokens, manifest stats.tokens_val={expected_val}")
    sidecars = []
    if entry.get("val_bytes_glob") or "caseops" in name:  # CaseOps val_bpb is scored on these: never without them
        for i, n in enumerate(val_counts):
            sidecar = local_dir / f"fineweb_val_bytes_{i:06d}.bin"
            get_sidecar(fetch, f"{remote_dir}/{sidecar.name}", sidecar, n, f"{remote_dir}/fineweb_val_{i:06d}.bin")
            sidecars.append(sidecar)
    train_tokens = sum(
        get_shard(fetch, f"{remote_dir}/fineweb_train_{i:06d}.bin", local_dir / f"fineweb_train_{i:06d}.bin")
        for i in range(train_shards)
    )
    expected_train = (entry.get("stats") or {}).get("tokens_train")
    if train_shards == files_train and expected_train is not None and train_tokens != expected_train:
        raise ValueError(f"{local_dir}: train shards hold {train_tokens} tokens, manifest stats.tokens_train={expected_train}")

    if not tok_entry.get("model_path"):
        raise ValueError(f"{manifest_remote}: tokenizer {tok_entry['name']!r} has no model_path")
    tokenizer_files = []
    for key in ("model_path", "vocab_path"):
        rel = tok_entry.get(key)
        if not rel:
            continue
        local = dest / "tokenizers" / Path(rel).name
        if not (local.is_file() and local.stat().st_size > 0):  # no size in the manifest: present = done
            _fetch_to(fetch, f"{root}/{rel}", local)
        tokenizer_files.append(local)
    return dict(dataset_dir=local_dir, train_shards=train_shards, train_tokens=train_tokens, val_shards=files_val,
                val_tokens=val_tokens, val_byte_sidecars=sidecars, tokenizer_files=tokenizer_files)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="sp1024", help="tokenizer family, e.g. sp1024 -> fineweb10B_sp1024; "
                   f"sp8192_caseops -> fineweb10B_{CASEOPS_VARIANT} (with the val byte sidecars)")
    p.add_argument("--train-shards", type=int, default=1, help="number of train shards (a prefix)")
    p.add_argument("--dest", default=str(Path(__file__).resolve().parent), help="local data dir (default: data/)")
    p.add_argument("--local-repo", help="copy from this directory (laid out like the remote repo) instead of HF")
    args = p.parse_args(argv)
    root = os.environ.get("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", DEFAULT_ROOT_PREFIX)
    repo_id = os.environ.get("MATCHED_FINEWEB_REPO_ID") or VARIANT_REPOS.get(canonical_variant(args.variant),
                                                                             DEFAULT_REPO_ID)
    fetch = local_fetch(args.local_repo) if args.local_repo else hf_fetch(repo_id)
    print(f"source:{args.local_repo or repo_id} root:{root} variant:{args.variant}")  # names what errors refer to
    try:
        out = download(args.variant, args.train_shards, args.dest, fetch, root)
    except (ValueError, OSError) as e:  # OSError: --dest unwritable, a full disk, ...: its message names the path
        raise SystemExit(f"error: {e}") from None
    print(f"downloaded dataset:{out['dataset_dir']} train_shards:{out['train_shards']} train_tokens:{out['train_tokens']} "
          f"val_shards:{out['val_shards']} val_tokens:{out['val_tokens']} "
          f"val_byte_sidecars:{len(out['val_byte_sidecars'])}")
    for f in out["tokenizer_files"]:
        print(f"downloaded tokenizer:{f}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
