"""Token shards in the challenge format for the data tools. The format is train_gpt.py's (its Data section:
a 1024-byte header of little-endian int32, then uint16 token ids): its constants and header check
(shard_token_count, errors ShardError, a ValueError) are imported from there, so the two cannot disagree.
Also the val split of the tools that build shards from a document dump (make_shards.py, make_caseops.py), so
the two split alike: ValSplit.

    from shards import read_shard, write_shard
    write_shard("x.bin", [1, 5, 7]); tokens = read_shard("x.bin")  # np.ndarray[uint16]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # train_gpt.py, at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_gpt import (HEADER_BYTES, SAMPLE_MARK, SHARD_MAGIC, SHARD_VERSION, ShardError,  # noqa: E402,F401
                       shard_token_count)

MAX_TOKEN_ID = 65535  # ids are stored as uint16
# The challenge's validation set: the first 50,000 documents of its dump (NUM_VAL_DOCS of its exporter,
# data/download_hf_docs_and_tokenize.py of openai/parameter-golf; the canonical CaseOps export's docs_val)
CHALLENGE_VAL_DOCS = 50_000


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """The shard's tokens as a plain uint16 array, after train_gpt's header and size check."""
    return np.fromfile(path, dtype="<u2", count=shard_token_count(path), offset=HEADER_BYTES)


def write_shard(path: str | os.PathLike, tokens, mark: int = 0) -> None:
    """Write tokens (any int sequence/array) as one shard (`mark` in header word 3). Writes to a temporary
    name first so an interrupted run never leaves a shard that passes the size check with a wrong header."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError(f"{path}: token ids must be integers in [0, {MAX_TOKEN_ID}] to fit uint16")
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:4] = SHARD_MAGIC, SHARD_VERSION, arr.size, mark
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(arr.astype("<u2").tobytes())
    os.replace(tmp, path)


class LeakError(ValueError):
    """A train document whose text is a val document's: the model would train on what it is scored on."""


class ValSplit:
    """The first val_docs documents of a dump are val, the rest train. Fewer than val_docs stop the build unless
    allow_partial_val (then all of them are val); a train document with a val document's hash (caseops.doc_hash:
    sha256 of its text) stops it unless drop_leaked (then it is left out of train and counted). FineWeb deduplicates
    within each crawl only, so the dump may hold a text twice (and a split at fewer documents trains on the rest of
    the val set: the records' 10,000, openai/parameter-golf issue #2127)."""

    def __init__(self, val_docs: int, allow_partial_val: bool = False, drop_leaked: bool = False):
        self.val_docs, self.allow_partial_val, self.drop_leaked = val_docs, allow_partial_val, drop_leaked
        self.val_hashes: set[bytes] = set()
        self.train_seen = self.dropped = 0

    def add_val(self, hashes: list[bytes]) -> None:
        self.val_hashes.update(hashes)

    def keep_train(self, hashes: list[bytes]) -> list[bool]:
        """Which of the next train documents (by hash, in order) go to train."""
        keep = [h not in self.val_hashes for h in hashes]
        if not all(keep):
            i = keep.index(False)
            if not self.drop_leaked:
                raise LeakError(f"train document {self.train_seen + i} (from 0) has the sha256 of a val document "
                                f"({hashes[i].hex()[:16]}...): it would train on the val set; nothing was written "
                                "(--drop-leaked leaves such documents out of train)")
            self.dropped += keep.count(False)
        self.train_seen += len(keep)
        return keep

    def check_val(self, have: int) -> None:
        """have: the val documents there are, when no more will come."""
        if have < self.val_docs and not self.allow_partial_val:
            raise ValueError(f"only {have} documents for the val set, --val-docs is {self.val_docs} (the challenge's "
                             f"val set is the first {CHALLENGE_VAL_DOCS:,} documents); pass --allow-partial-val to "
                             f"build a val set of {have} documents, whose scores are not comparable to the "
                             "challenge's")


def val_docs_warning(val_docs: int) -> str | None:
    """What a build from the challenge's dump with fewer val documents than its val set does (None: nothing)."""
    if val_docs < CHALLENGE_VAL_DOCS:
        return (f"--val-docs {val_docs}: documents {val_docs:,}..{CHALLENGE_VAL_DOCS - 1:,} of the challenge's val "
                "set go to train here; never score this build's models on that val set")
    return None
