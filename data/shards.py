"""Read and write token shards in the challenge format (byte-compatible with the published shards).

Layout of `fineweb_{train,val}_NNNNNN.bin`:
    header: 256 little-endian int32 (1024 bytes): [0]=20240520 (magic), [1]=1 (version), [2]=num_tokens, rest 0
            (except [3]=SAMPLE_MARK in the offline sample's shards, which train_gpt.py flags as not FineWeb)
    body:   num_tokens little-endian uint16 token ids

    from shards import read_shard, write_shard
    write_shard("x.bin", [1, 5, 7]); tokens = read_shard("x.bin")  # np.ndarray[uint16]
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = 65535  # ids are stored as uint16
SAMPLE_MARK = 0x504D4153  # header word 3 of data/make_sample.py's shards (b"SAMP"); train_gpt.py's copy must match


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header against its file size and return num_tokens (reads only 1 KiB,
    so the downloader can check 200 MB shards cheaply)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ValueError(f"{path}: bad magic {int(header[0])}, expected {SHARD_MAGIC} (not a challenge shard)")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: unsupported shard version {int(header[1])}, expected {SHARD_VERSION}")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise ValueError(
            f"{path}: size {size} bytes != {expected} (1024 + 2*num_tokens, num_tokens={num_tokens}); "
            "truncated or corrupt shard"
        )
    return num_tokens


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Return the shard's tokens as a uint16 array after validating the header."""
    num_tokens = read_header(path)
    return np.fromfile(path, dtype="<u2", count=num_tokens, offset=HEADER_BYTES).astype(np.uint16, copy=False)


def write_shard(path: str | os.PathLike, tokens, mark: int = 0) -> None:
    """Write tokens (any int sequence/array) as one shard (`mark` in header word 3). Writes to a temporary
    name first so an interrupted run never leaves a shard that passes the size check with a wrong header."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError(f"{path}: token ids must be integers in [0, {MAX_TOKEN_ID}] to fit uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[3] = SHARD_MAGIC, SHARD_VERSION, arr.size, mark
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(arr.astype("<u2").tobytes())
    os.replace(tmp, path)
