"""Token shards in the challenge format for the data tools. The format is train_gpt.py's (its Data section:
a 1024-byte header of little-endian int32, then uint16 token ids): its constants and header check
(shard_token_count, errors ShardError, a ValueError) are imported from there, so the two cannot disagree.

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
