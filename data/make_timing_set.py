"""A validation set of the real one's shape, for timing the evaluation (issue 40): real lengths, not real text.

    python3 data/make_timing_set.py --src DIR --tokenizer MODEL --out DIR [--docs 50000] [--tokens 47851520]
        [--take 25000] [--seed 0]

Document lengths are drawn with replacement (numpy, --seed) from the lengths of --src's val documents (on the
proxy: the 902 real FineWeb documents), then scaled so that --docs documents hold --tokens tokens (the real CaseOps
val set: 50,000 documents, 47,851,520 tokens, BOS included); the rounding is spread one token at a time over the
first documents, so the sum is exact. The first --take documents are written (25,000: half the set, for 4 GPUs).
Each is the first words of a train document of --src (the k-th longest length takes the k-th longest document), cut
at the last word start within its length: the documents re-encode to their ids, as train_gpt.py's tokenizer check
asks, and are a few tokens shorter than drawn (the output says both totals). Timing needs the shape: a score on it
means nothing. The lengths come from few documents (902 on the proxy): the longest, which set the first batches and
a phased TTT's prefix, are a few scaled copies. Half the set (--take 25000) on 4 GPUs is the whole on 8 when per-rank
settings are halved too (PHASED_TTT_PREFIX_DOCS=1250 for the records' 2,500). On the sp1024 proxy (4 train shards,
45,000 documents): 25,000 documents, 23,875,383 tokens against 23,913,333 drawn, the first 50 all re-encode, 4.5 s on
this project's 2-core machine. Writes --out/fineweb_val_000000.bin and the byte sidecar fineweb_val_bytes_000000.bin
(each target's bytes by the challenge's tokenizer rule, train_gpt.build_byte_luts, which train_gpt.py reads in place
of a CaseOps sidecar), and prints the documents and tokens written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retokenize import byte_luts, target_bytes  # noqa: E402
from shards import read_shard, write_shard  # noqa: E402
import train_gpt  # noqa: E402  (the shard format's home, on sys.path through shards)
from train_gpt import BOS_ID as BOS  # noqa: E402


def lengths(docs: int, tokens: int, source: np.ndarray, seed: int) -> np.ndarray:
    """`docs` lengths drawn from `source`, scaled to sum to `tokens` (each at least 1)."""
    if tokens < docs:
        raise SystemExit(f"error: --tokens {tokens} < --docs {docs}: every document holds its BOS")
    drawn = source[np.random.default_rng(seed).integers(0, source.size, docs)].astype(np.float64)
    out = np.maximum(1, np.rint(drawn * tokens / drawn.sum())).astype(np.int64)
    while (gap := tokens - int(out.sum())) != 0:  # one token more (or less, never below 1) for the first documents
        fix = np.flatnonzero(out > 1)[: abs(gap)] if gap < 0 else np.arange(min(gap, docs))
        out[fix] += np.sign(gap)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="shards: val for the lengths, train for the text")
    ap.add_argument("--tokenizer", required=True, help="SentencePiece model of --src's ids (the sidecar's bytes)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--tokens", type=int, default=47_851_520)
    ap.add_argument("--take", type=int, default=25_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 < args.take <= args.docs:
        raise SystemExit(f"error: --take must be in 1..--docs ({args.docs})")
    val = np.concatenate([read_shard(p) for p in train_gpt.shard_files(args.src, "val")])
    starts = np.flatnonzero(val == BOS)
    if starts.size == 0 or starts[0] != 0:
        raise SystemExit(f"error: {args.src}'s val stream does not start with BOS={BOS}")
    want = lengths(args.docs, args.tokens, np.diff(np.append(starts, val.size)), args.seed)[: args.take]
    train = np.concatenate([read_shard(p) for p in train_gpt.shard_files(args.src, "train")])
    firsts = np.flatnonzero(train == BOS)
    have = np.diff(np.append(firsts, train.size)) - 1  # each train document's tokens after its BOS
    if have.size < want.size:
        raise SystemExit(f"error: {args.src}'s train shards hold {have.size} documents, --take needs {want.size}")
    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    # the k-th longest drawn length takes the k-th longest train document, cut to it at a word start (a piece with
    # U+2581) at or before it: a document's first words re-encode to its ids, as train_gpt.py's tokenizer check asks
    doc = np.empty(want.size, dtype=np.int64)
    doc[np.argsort(-want, kind="stable")] = np.argsort(-have, kind="stable")[: want.size]
    words = np.flatnonzero(np.array([sp.id_to_piece(i).startswith("\u2581") for i in range(sp.vocab_size())])[train])
    docs = []
    for n, d in zip(want - 1, doc):
        a, e = firsts[d] + 1, firsts[d] + 1 + min(n, have[d])
        k = np.searchsorted(words, e, side="right") - 1  # the last word start at or before e
        cut = words[k] if e < a + have[d] and k >= 0 and words[k] > a else e  # else whole, or mid-word
        docs.append(np.concatenate(([BOS], train[a:cut])))
    out = np.concatenate(docs).astype(np.uint16)
    sidecar = np.zeros(out.size, dtype=np.uint16)  # value i: the bytes of target i - 1 (token i), as the scorer reads
    sidecar[1:] = target_bytes(out, byte_luts(sp))
    args.out.mkdir(parents=True, exist_ok=True)
    write_shard(args.out / "fineweb_val_000000.bin", out)
    write_shard(args.out / "fineweb_val_bytes_000000.bin", sidecar)
    stats = {"docs": int(want.size), "tokens": int(out.size), "drawn_tokens": int(want.sum()), "bytes": int(sidecar.sum()),
             "out": str(args.out)}
    print(" ".join(f"{k}:{v}" for k, v in stats.items()))
    return stats


if __name__ == "__main__":
    main()
