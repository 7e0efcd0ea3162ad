"""Build CaseOps shards and the val byte sidecar, from documents or from existing challenge shards.

    python3 data/make_caseops.py --docs docs_selected.jsonl --tokenizer CASEOPS_MODEL --out DIR
    python3 data/make_caseops.py --src SHARD_DIR --src-tokenizer MODEL --tokenizer CASEOPS_MODEL --out DIR
        [--val-docs 50000] [--allow-partial-val] [--drop-leaked] [--shard-tokens N] [--workers N] [--overwrite]

Each document is transformed with data/caseops.py (capitals as the operators U+E001..U+E004), encoded whole with
the CaseOps tokenizer (it must reserve the operators, have bos_id 1 and fit uint16) and written as [BOS=1] + ids,
no EOS, as the challenge shards (data/make_shards.py). Val documents also get their sidecar values: BOS 0, then
each token's original UTF-8 bytes (caseops.py, "The byte sidecar"; the rule of the records' prepare_caseops_data.py).

Sources:
  --docs FILE.jsonl (repeatable, read in order): one JSON object per line, the document in --text-field ("text"),
      as the challenge's document dump docs_selected.jsonl. Every object is a document, an empty text too (it
      becomes a lone BOS): the split is by position in the dump, and skipping one would move it.
      Document i < --val-docs is val, every later one train.
  --src DIR --src-tokenizer MODEL: the documents of DIR's fineweb_{val,train}_NNNNNN.bin (found and joined
      across shards as data/retokenize.py does), decoded with MODEL. Val stays val (its first --val-docs
      documents; any after those are used nowhere), train stays train. The decoded text is what the source
      tokenizer kept (nmt_nfkc: NFKC, whitespace runs as one space), not the original: so the sidecar counts
      the bytes the source shards' byte rule counted, and the ids differ from a build from the dump.

The challenge's validation set is the first 50,000 documents of the dump: NUM_VAL_DOCS = 50_000 in the challenge's
exporter (data/download_hf_docs_and_tokenize.py of openai/parameter-golf), the published data's val shards (50,000
BOS tokens), and the canonical CaseOps export (manifest docs_val=50000). So --val-docs defaults to 50,000; with
fewer documents available the tool stops unless --allow-partial-val (then the val set is what there is: from
--docs, every document, and no train).
The records' prepare_caseops_data.py defaulted to 10,000: its train began at document 10,000, so run beside the
canonical 50,000-document val set 80% of the val documents were also trained on (issue #2127; two leaderboard
entries were removed for it).

The leak guard (shards.ValSplit, make_shards.py's too): every val document's sha256 (of its original text; of the
decoded text with --src) is kept, and a train document with one of those hashes stops the run before any train
shard holding it is written, unless --drop-leaked (then it is left out of train and counted in the manifest).
FineWeb deduplicates within each crawl only, so the dump may hold a text twice.

Output (--out; refused if it already holds fineweb_*.bin shards or a manifest.json, unless --overwrite, which
replaces them): fineweb_val_NNNNNN.bin, fineweb_val_bytes_NNNNNN.bin (one uint16 per val token in the same
shard layout, shard k beside val shard k), fineweb_train_NNNNNN.bin and manifest.json. A shard ends before the
document that would take it past --shard-tokens (default 100,000,000, the published shards' size): documents
never split (one longer than that is a shard of its own). Everything is written to a staging folder beside
--out and moved in only when the whole run succeeded: a refused or failed run leaves --out as it was.

manifest.json (train_gpt.py checks val.docs and val.tokens against the val shards at start):
  transform         "lossless_caps_caseops_v1"
  byte_rule         "sidecar": score val with fineweb_val_bytes_*.bin, not the tokenizer's piece lengths
  tokenizer         the CaseOps model's file name;  tokenizer_sha256  sha256 of its bytes
  vocab_size, bos_id, shard_tokens
  source            {"kind": "jsonl", "files": [names]} or {"kind": "shards", "dir", "tokenizer",
                    "tokenizer_sha256", "val_docs_unused"}
  val               {"docs": documents (= BOS tokens), "tokens": all tokens of the val shards, BOS included,
                     "bytes": sum of the sidecar (val_bpb's denominator), "text_bytes": UTF-8 bytes of the
                     documents (bytes - text_bytes: leading/trailing whitespace no token carries),
                     "files": [val shard names], "byte_files": [sidecar names], "requested_docs": --val-docs,
                     "partial": fewer than requested, "docs_sha256": sha256 of the documents' sha256s in order}
  train             {"docs", "tokens", "files", "dropped_leaked_docs"}

Workers: documents go in chunks of CHUNK_DOCS to --workers processes (default: all CPUs), which transform and
encode them (and count the sidecar and hash for val); the main process reads the source and writes the shards in
document order, so the output does not depend on --workers. Measured on this project's 2-core machine with the
SP8192 CaseOps tokenizer, per character of text and one core: transform 0.17 us, encode 0.75 us, encode with the
pieces' spans for the sidecar 1.22 us, sidecar arithmetic 0.08 us, decode check 0.71 us (val only). From the proxy
shards (--src, sp1024): the 902 val documents (808,827 CaseOps tokens, 2,504,867 bytes, the source byte rule's
count) and one 10M-token train shard (11,315 documents, 7,863,486 tokens) in 13.8 s with 2 workers, 17 s in all.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import sentencepiece as spm

try:
    import caseops
except ImportError:  # imported as data.make_caseops from the repo root
    from data import caseops

# The other data tools import train_gpt.py (the shard format's home), and with it torch: 3-5 s and 225 MB per
# process. The worker processes need only caseops and sentencepiece, and a spawned worker re-imports this
# module, so those imports happen inside the main process's functions (_tools).

BOS_ID = 1  # the challenge shards' (make_shards.BOS_ID; checked against the tokenizer by make_shards.load_tokenizer)
CHALLENGE_VAL_DOCS = 50_000  # shards.CHALLENGE_VAL_DOCS, which the workers cannot import (see above)
DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_DOCS = 512  # documents per worker job: ~1.5 MB of FineWeb text (3 KB a document), 1-2 s of work
SPLITS = ("val", "train")


def _tools():
    """make_shards, retokenize and shards (which import train_gpt and torch), for the main process only."""
    try:
        import make_shards, retokenize, shards
    except ImportError:
        from data import make_shards, retokenize, shards
    return make_shards, retokenize, shards


# ---------------------------------------------------------------- worker side

@dataclass(frozen=True)
class Chunk:
    split: str
    texts: list[str]  # original documents
    model: str  # the CaseOps tokenizer's path


@dataclass
class Encoded:
    split: str
    tokens: np.ndarray  # uint16, [BOS] + ids per document, concatenated
    lengths: np.ndarray  # tokens per document, BOS included
    nbytes: np.ndarray | None  # val: uint16 sidecar aligned with tokens (BOS 0); train: None
    hashes: list[bytes]  # caseops.doc_hash per document
    text_bytes: int  # UTF-8 bytes of the original documents


@functools.lru_cache(maxsize=None)
def _processor(model: str) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=model)  # checked by the main process already


def encode_chunk(chunk: Chunk) -> Encoded:
    """Transform and encode one chunk of documents (in a worker process)."""
    sp = _processor(chunk.model)
    transformed = [caseops.encode(t) for t in chunk.texts]
    hashes = [caseops.doc_hash(t) for t in chunk.texts]
    text_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in chunk.texts)
    if chunk.split == "val":
        for i, (text, t) in enumerate(zip(chunk.texts, transformed)):
            if caseops.decode(t) != text:  # the scored text must come back exactly; cheap next to encoding
                raise caseops.CaseOpsError(f"a val document does not round-trip through CaseOps: {text[:60]!r}")
        per_doc = caseops.token_bytes_batch(sp, transformed)
        ids = [d[0] for d in per_doc]
        nbytes = np.concatenate([np.concatenate(([0], d[1])) for d in per_doc]).astype(np.uint16)
    else:
        ids, nbytes = sp.encode(transformed), None
    lengths = np.fromiter((len(d) + 1 for d in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(itertools.chain((BOS_ID,), d) for d in ids),
                         dtype=np.uint16, count=int(lengths.sum()))
    return Encoded(chunk.split, tokens, lengths, nbytes, hashes, text_bytes)


def _ordered_map(fn: Callable, jobs: Iterable, workers: int) -> Iterator:
    """fn over jobs in order, in `workers` processes, with at most 2 jobs per worker read ahead (a source of
    millions of documents must not be read into memory by the pool)."""
    if workers == 1:
        yield from map(fn, jobs)
        return
    # spawn: the main process has imported torch, whose threads forked children should not inherit
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.apply_async(fn, (job,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------- sources

def _chunks(split: str, texts: Iterable[str], model: str) -> Iterator[Chunk]:
    it = iter(texts)
    while batch := list(itertools.islice(it, CHUNK_DOCS)):
        yield Chunk(split, batch, model)


def jsonl_chunks(paths: list[str], text_field: str, val_docs: int, model: str) -> Iterator[Chunk]:
    """The dump's documents in order: the first val_docs val, the rest train."""
    make_shards = _tools()[0]
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"--docs {path}: file not found")
    docs = itertools.chain.from_iterable(make_shards._jsonl_documents(Path(p), text_field) for p in paths)
    yield from _chunks("val", itertools.islice(docs, val_docs), model)
    yield from _chunks("train", docs, model)


@dataclass
class ShardSource:
    """The documents of challenge shards, decoded with their tokenizer."""
    src: Path
    src_model: str
    threads: int
    info: dict = field(default_factory=dict)  # the manifest's "source", given val_docs_unused here

    def chunks(self, val_docs: int, model: str) -> Iterator[Chunk]:
        _, retokenize, shards = _tools()
        splits = retokenize.find_splits(self.src)
        sp = retokenize._load(self.src_model, "--src-tokenizer")
        if sp.piece_to_id(caseops.TITLE) != sp.unk_id():
            raise ValueError(f"--src-tokenizer {self.src_model} is a CaseOps tokenizer: its shards' text is "
                             "transformed already; re-encode shards of a plain tokenizer")
        for split, paths in splits.items():
            retokenize.check_source_tokenizer(paths, sp)
        source_val = sum(int((shards.read_shard(p) == BOS_ID).sum()) for p in splits.get("val", []))
        self.info["val_docs_unused"] = max(0, source_val - val_docs)
        for split in SPLITS:
            left = val_docs if split == "val" else None
            paths = splits.get(split, [])
            for k in range(len(paths)):
                docs = retokenize.shard_documents(paths, k)[:left]
                retokenize._check_ids(np.concatenate(docs) if docs else np.zeros(0, np.uint16), sp, paths[k])
                for lo in range(0, len(docs), CHUNK_DOCS):
                    batch = [d[1:].tolist() for d in docs[lo: lo + CHUNK_DOCS]]
                    yield Chunk(split, sp.decode(batch, num_threads=self.threads), model)
                if left is not None:
                    left -= len(docs)
                    if left == 0:
                        break


# ---------------------------------------------------------------- writing

class SplitWriter:
    """One split's documents into shards of at most shard_tokens tokens, cut between documents (val: with the
    sidecar shard beside each)."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, write_shard: Callable):
        self.folder, self.split, self.shard_tokens, self.write_shard = folder, split, shard_tokens, write_shard
        self.pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.pending_tokens = self.docs = self.tokens = self.bytes = self.text_bytes = 0
        self.files: list[str] = []
        self.byte_files: list[str] = []

    def add(self, enc: Encoded, keep: np.ndarray) -> None:
        """The documents of enc with keep[i] True."""
        ends = np.cumsum(enc.lengths)
        for i in np.flatnonzero(keep):
            lo, hi = int(ends[i] - enc.lengths[i]), int(ends[i])
            if self.pending and self.pending_tokens + (hi - lo) > self.shard_tokens:
                self.flush()
            self.pending.append((enc.tokens[lo:hi], None if enc.nbytes is None else enc.nbytes[lo:hi]))
            self.pending_tokens += hi - lo
            self.docs += 1
            self.tokens += hi - lo
        if enc.nbytes is not None:  # val, where every document is kept
            self.bytes += int(enc.nbytes.sum(dtype=np.int64))
            self.text_bytes += enc.text_bytes

    def flush(self) -> None:
        if not self.pending:
            return
        k = len(self.files)
        self.files.append(f"fineweb_{self.split}_{k:06d}.bin")
        self.write_shard(self.folder / self.files[-1], np.concatenate([t for t, _ in self.pending]))
        if self.pending[0][1] is not None:
            self.byte_files.append(f"fineweb_{self.split}_bytes_{k:06d}.bin")
            self.write_shard(self.folder / self.byte_files[-1], np.concatenate([b for _, b in self.pending]))
        self.pending, self.pending_tokens = [], 0


def _existing_output(out: Path) -> list[Path]:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    return sorted(out.glob("fineweb_*.bin")) + ([out / "manifest.json"] if (out / "manifest.json").exists() else [])


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build(chunks: Iterator[Chunk], out: Path, model: str, val_docs: int, shard_tokens: int, workers: int,
          allow_partial_val: bool = False, drop_leaked: bool = False, overwrite: bool = False,
          source: dict | None = None, log: Callable = print) -> dict:
    """Encode the chunks (val first, then train), guard against leaks, write everything; returns the manifest."""
    make_shards, _, shards = _tools()
    sp = caseops.check_tokenizer(make_shards.load_tokenizer(model), model)  # bos 1, uint16, U+2581, operators
    existing = _existing_output(out)
    if existing and not overwrite:
        raise ValueError(f"--out {out} already holds {existing[0].name} and {len(existing) - 1} more shard/manifest "
                         "files; pass --overwrite to replace them (never mix splits of two builds)")
    staging = out.resolve().parent / f".{out.resolve().name}.caseops-staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writers = {s: SplitWriter(staging, s, shard_tokens, shards.write_shard) for s in SPLITS}
    split = shards.ValSplit(val_docs, allow_partial_val, drop_leaked)
    val_digest = hashlib.sha256()
    t0, done = time.perf_counter(), 0
    try:
        for enc in _ordered_map(encode_chunk, chunks, workers):
            if enc.split == "val":
                split.add_val(enc.hashes)
                for h in enc.hashes:
                    val_digest.update(h)
                keep = np.ones(len(enc.hashes), dtype=bool)
            else:
                split.check_val(writers["val"].docs)  # the val set is complete: refused before any train shard
                keep = np.array(split.keep_train(enc.hashes), dtype=bool)
            writers[enc.split].add(enc, keep)
            done += 1
            if done % 200 == 0:
                log(f"caseops_progress val_docs:{writers['val'].docs} train_docs:{writers['train'].docs} "
                    f"seconds:{time.perf_counter() - t0:.0f}")
        have = writers["val"].docs
        split.check_val(have)
        if have == 0:
            raise ValueError("no documents in the input")
        for w in writers.values():
            w.flush()
        manifest = dict(
            transform=caseops.TRANSFORM, byte_rule="sidecar", tokenizer=Path(model).name,
            tokenizer_sha256=_sha256(model), vocab_size=sp.vocab_size(), bos_id=BOS_ID, shard_tokens=shard_tokens,
            source=source or {},
            val=dict(docs=have, tokens=writers["val"].tokens, bytes=writers["val"].bytes,
                     text_bytes=writers["val"].text_bytes, files=writers["val"].files,
                     byte_files=writers["val"].byte_files, requested_docs=val_docs, partial=have < val_docs,
                     docs_sha256=val_digest.hexdigest()),
            train=dict(docs=writers["train"].docs, tokens=writers["train"].tokens, files=writers["train"].files,
                       dropped_leaked_docs=split.dropped))
        # Only now does --out change: old shards out, new ones in, the manifest last (its presence means done).
        out.mkdir(parents=True, exist_ok=True)
        for path in existing:
            path.unlink()
        for name in writers["val"].files + writers["val"].byte_files + writers["train"].files:
            os.replace(staging / name, out / name)
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(staging / "manifest.json", out / "manifest.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest["seconds"] = time.perf_counter() - t0
    return manifest


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring for the "
                                "output layout, the manifest keys and the leak guard.")
    p.add_argument("--docs", action="append", help="jsonl file of documents, in order (repeatable)")
    p.add_argument("--text-field", default="text", help="the JSON field holding a document's text (default text)")
    p.add_argument("--src", help="directory of challenge shards fineweb_{val,train}_NNNNNN.bin to re-encode")
    p.add_argument("--src-tokenizer", help="the SentencePiece model the --src shards were made with")
    p.add_argument("--tokenizer", required=True, help="the CaseOps SentencePiece model (reserves U+E001..U+E004)")
    p.add_argument("--out", required=True, help="output directory (must not hold shards unless --overwrite)")
    p.add_argument("--val-docs", type=int, default=CHALLENGE_VAL_DOCS,
                   help=f"the first N documents are val (default {CHALLENGE_VAL_DOCS}, the challenge's split)")
    p.add_argument("--allow-partial-val", action="store_true",
                   help="with fewer documents than --val-docs, make them all val instead of stopping")
    p.add_argument("--drop-leaked", action="store_true",
                   help="leave train documents whose text is a val document's out of train instead of stopping")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"most tokens per shard, cut between documents (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace the shards and manifest already in --out")
    args = p.parse_args(argv)
    if bool(args.docs) == bool(args.src):
        p.error("give either --docs (documents) or --src with --src-tokenizer (shards)")
    if args.src and not args.src_tokenizer:
        p.error("--src needs --src-tokenizer")
    if args.src and Path(args.src).resolve() == Path(args.out).resolve():
        p.error("--out is --src: write the CaseOps shards to another directory")
    for name in ("val_docs", "shard_tokens", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.docs and args.val_docs < CHALLENGE_VAL_DOCS:  # the #2127 leak, unless this is not the dump
        print(f"caseops_warning {_tools()[2].val_docs_warning(args.val_docs)}")
    elif args.val_docs != CHALLENGE_VAL_DOCS:
        print(f"caseops_note --val-docs {args.val_docs}: not the challenge's split (its first "
              f"{CHALLENGE_VAL_DOCS:,} documents)")
    try:
        if args.docs:
            chunks = jsonl_chunks(args.docs, args.text_field, args.val_docs, args.tokenizer)
            source = dict(kind="jsonl", files=[Path(d).name for d in args.docs])
        else:
            source = dict(kind="shards", dir=str(args.src), tokenizer=Path(args.src_tokenizer).name,
                          tokenizer_sha256=_sha256(args.src_tokenizer) if Path(args.src_tokenizer).is_file() else None)
            chunks = ShardSource(Path(args.src), args.src_tokenizer, args.workers, source).chunks(
                args.val_docs, args.tokenizer)
        man = build(chunks, Path(args.out), args.tokenizer, args.val_docs, args.shard_tokens, args.workers,
                    args.allow_partial_val, args.drop_leaked, args.overwrite, source)
    except ValueError as e:  # shards.LeakError, CaseOpsError, bad input: one line, exit status 1
        raise SystemExit(f"error: {e}") from None
    v, t = man["val"], man["train"]
    print(f"caseops split:val docs:{v['docs']} tokens:{v['tokens']} bytes:{v['bytes']} text_bytes:{v['text_bytes']} "
          f"files:{len(v['files'])} partial:{int(v['partial'])}")
    print(f"caseops split:train docs:{t['docs']} tokens:{t['tokens']} files:{len(t['files'])} "
          f"dropped_leaked:{t['dropped_leaked_docs']}")
    print(f"caseops_done seconds:{man['seconds']:.1f} workers:{args.workers} out:{args.out}")
    return man


if __name__ == "__main__":
    main(sys.argv[1:])
