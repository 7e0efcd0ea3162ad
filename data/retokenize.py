"""Re-encode challenge shards with another SentencePiece tokenizer (e.g. the sp1024 shards into SP8192 ones).

    python3 data/retokenize.py --src DIR --src-tokenizer MODEL --dst DIR --tokenizer MODEL [--workers N] [--overwrite]

Every fineweb_{val,train}_NNNNNN.bin of --src is read as a stream of documents, each [BOS=1] + ids. Each
document is decoded with --src-tokenizer and encoded whole with --tokenizer, in order, and written as
[BOS] + ids, no EOS (as data/make_shards.py writes). Shards are cut at a fixed token count, so a document
may continue in the next shard (or the ones after it): it is joined first, then re-encoded once. Output
shard k keeps input shard k's name and holds the documents that start in input shard k (none, when a
document covers the whole input shard: then it is empty); val and train are separate streams. Header
word 3 is kept, so a retokenized offline sample stays marked as one (shards.SAMPLE_MARK).

Checks: both tokenizers load, fit uint16 and have bos_id 1 (make_shards.load_tokenizer); the source ids are
in the source vocabulary; the source tokenizer re-encodes its own decoded text into the same ids for at
least ROUNDTRIP_MIN_FRACTION of the first ROUNDTRIP_DOCS documents of each split (else it is probably the
wrong tokenizer); in every shard the decoded text's UTF-8 bytes equal the bytes the challenge's val_bpb rule
counts (train_gpt.build_byte_luts, summed over the targets as its Scorer does) on the source ids with the
source tokenizer and on the output ids with the target tokenizer (a shard that fails it is not written, and
the run stops). --dst may not be --src and may not hold fineweb_*.bin shards unless --overwrite (which also
removes those this run does not write).

Shards are independent jobs spread over --workers processes (default: all CPUs), largest first; with fewer
shards than workers, each process encodes with several SentencePiece threads. Measured on this project's 2-core
machine, sp1024 -> SP8192: the 1,040,298-token proxy val shard (902 FineWeb documents) becomes 679,461 tokens,
2,504,867 bytes on both sides, in 0.52 s with 1 worker; a 10M-token proxy train shard takes 4.6 s with 1 worker,
2.6 s with 2; two of them 8.8 s and 4.8 s (plus about 3 s to import torch for the byte tables). Measured before
the shard format moved to train_gpt.py: now each worker process also imports it, and torch, as it starts (3.5-5 s
on that machine, 225 MB of memory each).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

try:
    from make_shards import BOS_ID, ENCODE_BATCH_DOCS, load_tokenizer
    from shards import HEADER_BYTES, read_shard, shard_token_count, write_shard
except ImportError:  # imported as data.retokenize from the repo root
    from data.make_shards import BOS_ID, ENCODE_BATCH_DOCS, load_tokenizer
    from data.shards import HEADER_BYTES, read_shard, shard_token_count, write_shard
import train_gpt  # noqa: E402  (the shard format's home, on sys.path through shards; imports torch)

SHARD_NAME = re.compile(r"fineweb_(train|val)_(\d{6})\.bin")
SPLITS = ("val", "train")
SCAN_TOKENS = 1 << 20  # a document's continuation is read in chunks of this many tokens until the next BOS
# Decode -> encode with the right tokenizer gave the same ids for 902/902 proxy val documents and 11,315/11,315
# documents of a proxy train shard (sp1024); with the SP8192 model passed as the source of those sp1024 shards,
# 0/902 and 1/11,315. The threshold leaves room for rare text that SentencePiece does not round-trip.
ROUNDTRIP_DOCS = 50
ROUNDTRIP_MIN_FRACTION = 0.9


# ---------------------------------------------------------------- documents

def find_splits(src: Path) -> dict[str, list[Path]]:
    """Each split's shards in stream order; numbered 0..N-1 without gaps, since a document may continue
    in the next shard."""
    if not src.is_dir():
        raise ValueError(f"--src {src}: directory not found")
    found: dict[str, list[Path]] = {}
    for path in sorted(src.glob("fineweb_*.bin")):
        if m := SHARD_NAME.fullmatch(path.name):
            found.setdefault(m[1], []).append(path)
    if not found:
        raise ValueError(f"--src {src}: no fineweb_{{val,train}}_NNNNNN.bin shards there")
    for split, paths in found.items():
        for i, path in enumerate(paths):
            if path.name != f"fineweb_{split}_{i:06d}.bin":
                raise ValueError(f"--src {src}: fineweb_{split}_{i:06d}.bin is missing (next is {path.name}); "
                                 "a split's shards must be numbered from 0 without gaps")
    return {s: found[s] for s in SPLITS if s in found}


def _continuation(path: Path) -> tuple[np.ndarray, bool]:
    """The tokens of `path` before its first BOS, and whether it has one (reads only as far as needed)."""
    shard_token_count(path)
    parts = [np.zeros(0, np.uint16)]
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while (chunk := np.fromfile(f, dtype="<u2", count=SCAN_TOKENS)).size:
            hits = np.flatnonzero(chunk == BOS_ID)
            if hits.size:
                return np.concatenate(parts + [chunk[: hits[0]]]), True
            parts.append(chunk)
    return np.concatenate(parts), False


def shard_documents(paths: list[Path], k: int) -> list[np.ndarray]:
    """The documents ([BOS] + ids each) that start in shard k of a split, the last one joined with its
    continuation in the shards after k."""
    tokens = read_shard(paths[k])
    if k == 0 and (tokens.size == 0 or tokens[0] != BOS_ID):
        raise ValueError(f"{paths[0]}: the first shard of a split must start with BOS={BOS_ID}; not a challenge shard")
    docs = np.split(tokens, np.flatnonzero(tokens == BOS_ID))[1:]  # [0] is the end of shard k-1's last document
    if docs:
        tail = [docs[-1]]
        for path in paths[k + 1:]:
            head, ends = _continuation(path)
            tail.append(head)
            if ends:
                break
        docs[-1] = np.concatenate(tail)
    return docs


def _check_ids(ids: np.ndarray, sp: spm.SentencePieceProcessor, where: Path) -> None:
    if ids.size and int(ids.max()) >= sp.vocab_size():
        raise ValueError(f"{where}: token id {int(ids.max())} >= the source tokenizer's vocab size {sp.vocab_size()}; "
                         "wrong --src-tokenizer?")


def check_source_tokenizer(paths: list[Path], sp: spm.SentencePieceProcessor) -> tuple[int, int]:
    """(exact, sampled): how many of the split's first ROUNDTRIP_DOCS documents the source tokenizer encodes
    back into the same ids after decoding them; refuses a tokenizer under ROUNDTRIP_MIN_FRACTION."""
    docs: list[np.ndarray] = []
    for k in range(len(paths)):
        docs += shard_documents(paths, k)
        if len(docs) >= ROUNDTRIP_DOCS:
            break
    docs = docs[:ROUNDTRIP_DOCS]
    _check_ids(np.concatenate(docs), sp, paths[0])
    ids = [d[1:].tolist() for d in docs]
    exact = sum(a == b for a, b in zip(ids, sp.encode(sp.decode(ids))))
    if exact < ROUNDTRIP_MIN_FRACTION * len(docs):
        raise ValueError(f"{paths[0].parent}: the source tokenizer re-encodes only {exact} of the first {len(docs)} "
                         f"decoded documents of {paths[0].name} into their ids (need {ROUNDTRIP_MIN_FRACTION:.0%}): "
                         "--src-tokenizer is probably not the tokenizer these shards were made with")
    return exact, len(docs)


# ---------------------------------------------------------------- byte rule

def byte_luts(sp: spm.SentencePieceProcessor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base bytes, has leading space, is boundary) per id: train_gpt.py's own tables, so val_bpb and this check
    share one definition."""
    return tuple(t.numpy() for t in train_gpt.build_byte_luts(sp, sp.vocab_size(), "cpu"))


def target_bytes(ids: np.ndarray, luts: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """The bytes the challenge counts for each target ids[1:] given its previous id (train_gpt's Scorer)."""
    base, space, boundary = luts
    x, y = ids[:-1].astype(np.int64), ids[1:].astype(np.int64)
    return base[y] + (space[y] & ~boundary[x])


def rule_bytes(ids: np.ndarray, luts: tuple[np.ndarray, np.ndarray, np.ndarray]) -> int:
    """Their sum; ids start with BOS, which as a target counts 0 bytes, so streams of documents add up."""
    return int(target_bytes(ids, luts).sum(dtype=np.int64))


# ---------------------------------------------------------------- one shard

@dataclass(frozen=True)
class ShardJob:
    paths: tuple[Path, ...]  # the split's shards, in order
    index: int  # the shard to re-encode
    dst: Path
    src_model: str
    dst_model: str
    src_luts: tuple
    dst_luts: tuple
    threads: int  # SentencePiece threads of this job's process


@functools.lru_cache(maxsize=None)
def _processor(model: str) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=model)  # validated by the main process already


def retokenize_shard(job: ShardJob) -> dict:
    """Re-encode the documents starting in shard job.index, check its byte totals, write it; returns its counts."""
    src_sp, dst_sp = _processor(job.src_model), _processor(job.dst_model)
    path = job.paths[job.index]
    docs = shard_documents(list(job.paths), job.index)
    counts = dict(docs=len(docs), src_tokens=0, dst_tokens=0, text_bytes=0, src_bytes=0, dst_bytes=0)
    out = [np.zeros(0, np.uint16)]
    for lo in range(0, len(docs), ENCODE_BATCH_DOCS):  # batches bound the memory of Python id lists
        batch = docs[lo: lo + ENCODE_BATCH_DOCS]
        src_ids = np.concatenate(batch)
        _check_ids(src_ids, src_sp, path)
        texts = src_sp.decode([d[1:].tolist() for d in batch], num_threads=job.threads)
        encoded = dst_sp.encode(texts, num_threads=job.threads)
        dst_ids = np.fromiter(itertools.chain.from_iterable([BOS_ID, *ids] for ids in encoded), dtype=np.uint16)
        out.append(dst_ids)
        counts["src_tokens"] += src_ids.size
        counts["dst_tokens"] += dst_ids.size
        counts["text_bytes"] += sum(len(t.encode("utf-8")) for t in texts)
        counts["src_bytes"] += rule_bytes(src_ids, job.src_luts)
        counts["dst_bytes"] += rule_bytes(dst_ids, job.dst_luts)
    if not counts["text_bytes"] == counts["src_bytes"] == counts["dst_bytes"]:
        raise ValueError(f"{path}: byte totals differ: decoded text {counts['text_bytes']:,} UTF-8 bytes, byte rule "
                         f"{counts['src_bytes']:,} on the source ids and {counts['dst_bytes']:,} on the output ids")
    mark = int(np.fromfile(path, dtype="<i4", count=4)[3])
    write_shard(job.dst / path.name, np.concatenate(out), mark)
    return counts


# ---------------------------------------------------------------- all shards

def _check_dst(src: Path, dst: Path, overwrite: bool) -> list[Path]:
    """The shards already in dst (refused without overwrite)."""
    if dst.resolve() == src.resolve():
        raise ValueError(f"--dst {dst} is --src: write the re-encoded shards to another directory")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"--dst {dst}: exists and is not a directory")
    existing = sorted(dst.glob("fineweb_*.bin"))
    if existing and not overwrite:
        raise ValueError(f"--dst {dst} already holds {len(existing)} shards ({existing[0].name}, ...); "
                         "pass --overwrite to replace them")
    return existing


def _load(model: str, flag: str) -> spm.SentencePieceProcessor:
    if not Path(model).is_file():
        raise ValueError(f"{flag} {model}: file not found")
    return load_tokenizer(model)  # vocab fits uint16, bos_id 1 (so both tokenizers agree), a standalone U+2581


def retokenize(src: Path, src_model: str, dst: Path, dst_model: str, workers: int, overwrite: bool = False) -> dict:
    """Re-encode every split of src into dst; returns per split its counts and round-trip sample, and the seconds
    taken after loading the tokenizers and their byte tables (importing torch for them takes seconds more)."""
    splits = find_splits(src)
    src_sp, dst_sp = _load(src_model, "--src-tokenizer"), _load(dst_model, "--tokenizer")
    existing = _check_dst(src, dst, overwrite)
    src_luts, dst_luts = byte_luts(src_sp), byte_luts(dst_sp)
    t0 = time.perf_counter()
    stats = {s: dict(roundtrip=check_source_tokenizer(paths, src_sp)) for s, paths in splits.items()}
    dst.mkdir(parents=True, exist_ok=True)  # only now: a refused run leaves no directory behind

    jobs = [(split, k) for split, paths in splits.items() for k in range(len(paths))]
    jobs.sort(key=lambda j: -splits[j[0]][j[1]].stat().st_size)  # largest first: the last to start are short
    processes = min(workers, len(jobs))
    threads = max(1, workers // processes)  # a lone val shard may still use all --workers cores
    todo = [ShardJob(tuple(splits[s]), k, dst, str(src_model), str(dst_model), src_luts, dst_luts, threads)
            for s, k in jobs]
    if processes == 1:
        results = list(map(retokenize_shard, todo))
    else:  # spawn: the parent holds torch's threads, which forked children should not inherit
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.map(retokenize_shard, todo, chunksize=1)
    for (split, _), counts in zip(jobs, results):
        for key, value in counts.items():
            stats[split][key] = stats[split].get(key, 0) + value
    written = {dst / p.name for paths in splits.values() for p in paths}
    for path in existing:  # with --overwrite: a glob over dst must not pick up shards of an earlier, larger run
        if path not in written:
            path.unlink()
    for split, paths in splits.items():
        stats[split]["shards"] = len(paths)
    return dict(splits=stats, seconds=time.perf_counter() - t0, processes=processes, threads=threads)


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True, help="directory of fineweb_{val,train}_NNNNNN.bin shards")
    p.add_argument("--src-tokenizer", required=True, help="the SentencePiece model the --src shards were made with")
    p.add_argument("--dst", required=True, help="output directory (created; must not hold shards unless --overwrite)")
    p.add_argument("--tokenizer", required=True, help="the SentencePiece model to re-encode with (bos_id must be 1)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace the fineweb_*.bin shards already in --dst")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers}: must be at least 1")
    try:
        out = retokenize(Path(args.src), args.src_tokenizer, Path(args.dst), args.tokenizer, args.workers,
                         args.overwrite)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for split, st in out["splits"].items():
        exact, sampled = st["roundtrip"]
        print(f"retokenize split:{split} shards:{st['shards']} docs:{st['docs']} src_tokens:{st['src_tokens']} "
              f"dst_tokens:{st['dst_tokens']} text_bytes:{st['text_bytes']} src_bytes:{st['src_bytes']} "
              f"dst_bytes:{st['dst_bytes']} roundtrip:{exact}/{sampled}")
    print(f"retokenize_done processes:{out['processes']} threads:{out['threads']} seconds:{out['seconds']:.2f} "
          f"dst:{args.dst}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
