#!/usr/bin/env python3
"""Where an artifact's bytes go: per group of tensors, the elements, the raw bytes, the order-0 entropy of the
codes (what an ideal per-tensor order-0 coder reaches), and what xz and COMPRESSOR=rans make of the whole.

    python3 tools/artifact_report.py logs/<RUN_ID>.int6.ptz [--tensors]

Groups: by train_gpt.py's FORMATS, each format's label: the bank matrix kinds' int6 codes, the tables' codes, each
format's row scales, the fp16 rest, LQER's factors. The entropy of a group is the sum of its tensors' own order-0
entropies (one table per tensor); COMPRESSOR=rans goes below it by
choosing each code's table from its row's and column's spread (670 KB below on the PQB artifact, 2026-11-23).
--tensors lists every tensor. The issue that asked for this (20) measured 14.97 MB of order-0 entropy for the
codes of a PQB artifact against 15.46 MB for xz over the whole payload.
"""
from __future__ import annotations

import argparse
import lzma
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402


def order0_bytes(values: np.ndarray) -> float:
    """Bytes an ideal order-0 coder needs for these symbols (their own table)."""
    counts = np.unique(values, return_counts=True)[1]
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() * counts.sum() / 8)


def group_of(name: str, fmt, part: str) -> str:
    """A tensor's group: its format's label (train_gpt.py's FORMATS), with the matrix kind for a bank matrix's codes
    and the part for the others (row scales, LQER's factors)."""
    matrix = tg.bank_matrix(name)
    if part == fmt.kind and fmt.holds is not None:
        return f"{fmt.label} {matrix[0]}" if matrix else fmt.label
    return f"{fmt.label} {part}"


def report(path: Path, per_tensor: bool = False) -> list[str]:
    blob = path.read_bytes()
    payload = tg.decompress(blob)
    _, tensors = tg.unpack_tensors(payload)
    groups: dict[str, list[float]] = {}  # group -> [elements, raw bytes, order-0 bytes of int8 codes]
    lines = []
    for name, stored in tg.stored_weights(tensors).items():
        for fmt, parts in stored:
            for part, t in parts.items():
                a = t.numpy()
                entropy = order0_bytes(a.reshape(-1)) if a.dtype == np.int8 else float("nan")
                g = groups.setdefault(group_of(name, fmt, part), [0, 0, 0.0])
                g[0], g[1], g[2] = g[0] + a.size, g[1] + a.nbytes, g[2] + (entropy if a.dtype == np.int8 else 0.0)
                if per_tensor:
                    lines.append(f"tensor {name}.{part} {a.dtype} {list(a.shape)} raw:{a.nbytes} order0:{entropy:.0f}")
    coder = {v: k for k, v in tg.COMPRESSOR_CODES.items()}[blob[4]]
    lines.append(f"artifact {path} bytes:{len(blob)} coder:{coder} payload:{len(payload)}")
    for name, (n, raw, ent) in sorted(groups.items()):
        lines.append(f"group {name:<24} elements:{n:>10} raw:{raw:>10}" + (f" order0:{ent:>12.0f} bits_per_code:"
                                                                            f"{8 * ent / n:.3f}" if ent else ""))
    codes = sum(g[2] for g in groups.values())
    lines.append(f"codes order0:{codes:.0f} (every int8 tensor: the codes, LQER's too; one table per tensor)")
    xz = lzma.compress(payload, format=lzma.FORMAT_XZ, preset=tg.LZMA_PRESET)  # a general-purpose coder, to compare
    lines.append(f"whole payload as lzma: {len(xz)} bytes")
    lines.append(f"whole payload as rans: {len(tg.compress(payload, 'rans')[0])} bytes")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--tensors", action="store_true", help="a line per tensor too")
    args = ap.parse_args(argv)
    try:
        print("\n".join(report(args.artifact, args.tensors)))
    except (OSError, ValueError) as e:
        print(f"artifact_report: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
