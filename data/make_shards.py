"""Turn your own text into challenge-format shards (and optionally train a tokenizer for it).

    python3 data/make_shards.py --input FILE [--input FILE ...] --out DIR
        (--tokenizer MODEL | --train-tokenizer --vocab-size V [--tokenizer-out PATH])
        [--val-docs 50000] [--allow-partial-val] [--drop-leaked] [--shard-tokens M] [--text-field text]

Inputs, by extension:
  .txt    one document per paragraph; paragraphs are separated by one or more blank (or
          whitespace-only) lines; the lines of a paragraph are joined with "\\n".
  .jsonl  one JSON object per line; the document is the string field --text-field (default "text").
Empty or whitespace-only documents are skipped. Files must be UTF-8 (a leading BOM is allowed).

Output, as the published data: each document is [BOS=1] + encode(doc), no EOS. The first N documents
(--val-docs, default 50,000: the challenge's val set, the first 50,000 documents of its dump) form the token
stream of DIR/fineweb_val_000000.bin, ...; the rest form DIR/fineweb_train_000000.bin, ...; each stream is cut
into shards of exactly M tokens (--shard-tokens, default 100,000,000 like the published shards) plus a shorter
last one, so a document may straddle two shards. Fewer than N documents stop the tool unless --allow-partial-val
(then every document is val, and there is no train). The leak guard of data/make_caseops.py (shards.ValSplit): a
train document whose text is a val document's stops the tool before anything is written, unless --drop-leaked
(then it is left out of train, and of the tokenizer's training text). The shards are written beside DIR and moved
in only when all went well; stale fineweb_*.bin shards of a previous run in DIR are then removed.

Tokenizer training (--train-tokenizer) uses the challenge's sp1024 settings, read back from
fineweb_1024_bpe.model's trainer spec: BPE, byte_fallback, split_digits, nmt_nfkc normalization
(which also collapses runs of whitespace, newlines included, to one space), no dummy prefix,
pad/bos/eos/unk = 0/1/2/3, character_coverage=0.999 (rarer characters go through byte fallback),
hard_vocab_limit off (then we check the size ourselves). It is trained on every line of the train
documents (never on val; SentencePiece holds them in memory, fine up to a few hundred MB of text),
single-threaded with a fixed seed, and serialized without a path, so the same input gives a
byte-identical model and shards. Default output: DIR/tokenizer_sp<V>.model.

Every tokenizer must have a standalone "\u2581" piece (val_bpb byte counting relies on it: a piece's leading
U+2581 counts as the space byte, and a tokenizer without the standalone piece made fake records by miscounting
spaces). We check and fail instead of forcing it with user_defined_symbols, which would split every space off as
its own token and stop merges like "\u2581the".
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import sentencepiece as spm

try:
    from caseops import doc_hash
    from shards import CHALLENGE_VAL_DOCS, ValSplit, val_docs_warning, write_shard
except ImportError:  # imported as data.make_shards from the repo root
    from data.caseops import doc_hash
    from data.shards import CHALLENGE_VAL_DOCS, ValSplit, val_docs_warning, write_shard

BOS_ID = 1
MAX_VOCAB = 65536  # ids are stored as uint16
DEFAULT_SHARD_TOKENS = 100_000_000
SPACE_PIECE = "\u2581"
TRAIN_SEED = 1337
ENCODE_BATCH_DOCS = 512
# The challenge tokenizer's trainer settings (sp1024 trainer spec), minus vocab_size.
CHALLENGE_SPM_SETTINGS = dict(
    model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="nmt_nfkc",
    add_dummy_prefix=False, pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=0.999,
    hard_vocab_limit=False,
)


# ---------------------------------------------------------------- reading documents

def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without newline); decoding errors name the file, line and byte offset."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid UTF-8 at byte offset {offset + e.start} "
                                 f"(byte 0x{raw[e.start]:02x}); convert the file to UTF-8") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            offset += len(raw)
            yield lineno, line.rstrip("\r\n")


def _txt_documents(path: Path) -> Iterator[str]:
    para: list[str] = []
    for _, line in _utf8_lines(path):
        if line.strip():
            para.append(line)
        elif para:
            yield "\n".join(para)
            para = []
    if para:
        yield "\n".join(para)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    for lineno, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field {text_field!r}")
        yield obj[text_field]


def iter_documents(paths: Iterable[str | os.PathLike], text_field: str = "text") -> Iterator[str]:
    """All non-empty documents of the input files, in order."""
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"{path}: input file not found")
        if path.suffix == ".txt":
            docs = _txt_documents(path)
        elif path.suffix == ".jsonl":
            docs = _jsonl_documents(path, text_field)
        else:
            raise ValueError(f"{path}: unsupported input type {path.suffix!r}; expected .txt or .jsonl")
        yield from (d for d in docs if d.strip())


# ---------------------------------------------------------------- tokenizer

def check_tokenizer(sp: spm.SentencePieceProcessor, where: str) -> spm.SentencePieceProcessor:
    if sp.vocab_size() > MAX_VOCAB:
        raise ValueError(f"{where}: vocab size {sp.vocab_size()} > {MAX_VOCAB} does not fit uint16 shards")
    if sp.bos_id() != BOS_ID:
        raise ValueError(f"{where}: bos_id is {sp.bos_id()}, the challenge format needs bos_id={BOS_ID}")
    space_id = sp.piece_to_id(SPACE_PIECE)
    if sp.id_to_piece(space_id) != SPACE_PIECE or sp.is_unknown(space_id):
        raise ValueError(f"{where}: no standalone U+2581 piece; val_bpb byte counting needs one "
                         "(train on text with spaces, or a larger vocab)")
    return sp


def load_tokenizer(model_path: str | os.PathLike) -> spm.SentencePieceProcessor:
    try:
        sp = spm.SentencePieceProcessor(model_file=str(model_path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{model_path}: cannot load SentencePiece model ({e})") from None
    return check_tokenizer(sp, str(model_path))


def _training_lines(docs: Iterable[str]) -> Iterator[str]:
    # One sentence per line: SentencePiece silently drops sentences longer than max_sentence_length,
    # and nmt_nfkc turns newlines into spaces anyway, so lines lose nothing.
    for doc in docs:
        yield from (line for line in doc.split("\n") if line.strip())


def train_tokenizer(docs: Iterable[str], vocab_size: int, model_path: str | os.PathLike) -> spm.SentencePieceProcessor:
    """Train a challenge-style BPE tokenizer on docs and write it to model_path (deterministically)."""
    if not 0 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size}: must be in [1, {MAX_VOCAB}] to fit uint16 shards")
    # SentencePiece turns exceptions of the input iterator into RuntimeError; keep ours (file:line).
    seen = {"lines": 0, "error": None}

    def lines() -> Iterator[str]:
        try:
            for line in _training_lines(docs):
                seen["lines"] += 1
                yield line
        except ValueError as e:
            seen["error"] = e
            raise

    model = io.BytesIO()  # model_writer: no model_prefix path is stored, so the bytes do not depend on it
    spm.set_random_generator_seed(TRAIN_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size,
            num_threads=1, max_sentence_length=1 << 16, minloglevel=2, **CHALLENGE_SPM_SETTINGS)
    except RuntimeError as e:
        if seen["error"] is not None:
            raise seen["error"] from None
        if seen["lines"] == 0:
            raise ValueError("no documents to train the tokenizer on (empty input, or all documents are val)") from None
        raise ValueError(f"{model_path}: SentencePiece training failed: {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    if sp.vocab_size() != vocab_size:
        raise ValueError(f"{model_path}: training text too small for vocab {vocab_size}: "
                         f"only {sp.vocab_size()} pieces could be learned")
    check_tokenizer(sp, str(model_path))
    Path(model_path).parent.mkdir(parents=True, exist_ok=True)
    Path(model_path).write_bytes(model.getvalue())
    return sp


# ---------------------------------------------------------------- shards

class ShardStream:
    """Accumulates one split's token stream and writes it as fixed-size shards."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, mark: int = 0):
        self.out_dir, self.split, self.shard_tokens, self.mark = out_dir, split, shard_tokens, mark
        self.pending: list[np.ndarray] = []
        self.pending_tokens = self.total_tokens = self.docs = 0
        self.files: list[Path] = []

    def add(self, ids_T: np.ndarray) -> None:
        self.pending.append(ids_T)
        self.pending_tokens += len(ids_T)
        self.total_tokens += len(ids_T)
        self.docs += 1
        while self.pending_tokens >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            self._write(stream[: self.shard_tokens])
            self.pending, self.pending_tokens = [stream[self.shard_tokens:]], len(stream) - self.shard_tokens

    def close(self) -> None:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_tokens = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        path = self.out_dir / f"fineweb_{self.split}_{len(self.files):06d}.bin"
        write_shard(path, tokens, self.mark)
        self.files.append(path)


def split_documents(docs: Iterable[str], split: ValSplit) -> Iterator[tuple[str, str]]:
    """("val" or "train", document) in order: the first split.val_docs val, the rest train through the leak guard."""
    n_val = 0
    for doc in docs:
        if n_val < split.val_docs:
            split.add_val([doc_hash(doc)])
            n_val += 1
            yield "val", doc
        elif split.keep_train([doc_hash(doc)])[0]:
            yield "train", doc
    if n_val:  # none: the caller says the input is empty
        split.check_val(n_val)


def _check_split_args(val_docs: int, shard_tokens: int) -> None:
    if val_docs < 1:
        raise ValueError(f"--val-docs {val_docs}: need at least 1 validation document")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: must be positive")


def write_shards(docs: Iterable[str], sp: spm.SentencePieceProcessor, out_dir: str | os.PathLike,
                 val_docs: int, shard_tokens: int = DEFAULT_SHARD_TOKENS, mark: int = 0,
                 allow_partial_val: bool = False, drop_leaked: bool = False) -> dict:
    """Encode docs as [BOS] + ids; the first val_docs go to val shards, the rest to train shards (ValSplit: fewer
    stop it unless allow_partial_val, a leaked one unless drop_leaked; header word 3 = mark: shards.SAMPLE_MARK for
    the offline sample). Written to a staging folder beside out_dir, moved in only when all went well."""
    _check_split_args(val_docs, shard_tokens)
    check_tokenizer(sp, "tokenizer")
    out_dir = Path(out_dir)
    split = ValSplit(val_docs, allow_partial_val, drop_leaked)
    staging = out_dir.resolve().parent / f".{out_dir.resolve().name}.shards-staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        streams = {s: ShardStream(staging, s, shard_tokens, mark) for s in ("val", "train")}
        labelled = split_documents(docs, split)
        while batch := list(itertools.islice(labelled, ENCODE_BATCH_DOCS)):
            for (name, _), ids in zip(batch, sp.encode([doc for _, doc in batch])):
                streams[name].add(np.array([BOS_ID, *ids], dtype=np.uint16))
        if streams["val"].docs == 0:
            raise ValueError("no documents in the input (empty files or only blank lines?)")
        if streams["train"].docs == 0 and not allow_partial_val:
            raise ValueError(f"no train documents left: --drop-leaked dropped all {split.dropped}, each a val "
                             "document's text" if split.dropped else f"only {streams['val'].docs} documents: need "
                             f"more than --val-docs {val_docs} to leave train data")
        for stream in streams.values():
            stream.close()
        # Only now does out_dir change: a previous run's shards out (a glob would pick up extra ones), ours in.
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in out_dir.glob("fineweb_*_*.bin"):
            if re.fullmatch(r"fineweb_(train|val)_\d{6}\.bin", path.name):
                path.unlink()
        for stream in streams.values():
            for f in stream.files:
                os.replace(f, out_dir / f.name)
            stream.files = [out_dir / f.name for f in stream.files]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {s: dict(docs=st.docs, tokens=st.total_tokens, files=st.files) | (
        dict(dropped_leaked_docs=split.dropped) if s == "train" else {}) for s, st in streams.items()}


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", action="append", required=True, help=".txt or .jsonl file (repeatable)")
    p.add_argument("--out", required=True, help="output directory for the shards")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="existing SentencePiece model (bos_id must be 1)")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a tokenizer on the train documents")
    p.add_argument("--vocab-size", type=int, help="vocab size for --train-tokenizer")
    p.add_argument("--tokenizer-out", help="where to write the trained model (default DIR/tokenizer_sp<V>.model)")
    p.add_argument("--val-docs", type=int, default=CHALLENGE_VAL_DOCS,
                   help=f"the first N documents are val (default {CHALLENGE_VAL_DOCS}, the challenge's split)")
    p.add_argument("--allow-partial-val", action="store_true",
                   help="with fewer documents than --val-docs, make them all val instead of stopping")
    p.add_argument("--drop-leaked", action="store_true",
                   help="leave train documents whose text is a val document's out of train instead of stopping")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="max tokens per shard")
    p.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl inputs")
    args = p.parse_args(argv)
    if args.train_tokenizer and args.vocab_size is None:
        p.error("--train-tokenizer needs --vocab-size")
    if args.tokenizer and (args.vocab_size is not None or args.tokenizer_out):
        p.error("--vocab-size/--tokenizer-out only apply with --train-tokenizer")

    docs: Callable[[], Iterator[str]] = lambda: iter_documents(args.input, args.text_field)
    if warning := val_docs_warning(args.val_docs):  # the #2127 leak, if the input is the challenge's dump
        print(f"shards_warning {warning}")
    try:
        _check_split_args(args.val_docs, args.shard_tokens)  # fail before reading any input
        if args.train_tokenizer:
            model_path = Path(args.tokenizer_out or Path(args.out) / f"tokenizer_sp{args.vocab_size}.model")
            if not 0 < args.vocab_size <= MAX_VOCAB:
                raise ValueError(f"--vocab-size {args.vocab_size}: must be in [1, {MAX_VOCAB}] to fit uint16 shards")
            # the train documents as the shards will hold them: the guard's refusals come before any training
            split = ValSplit(args.val_docs, args.allow_partial_val, args.drop_leaked)
            train_docs = (doc for name, doc in split_documents(docs(), split) if name == "train")
            sp = train_tokenizer(train_docs, args.vocab_size, model_path)
            print(f"tokenizer path:{model_path} vocab_size:{sp.vocab_size()}")
        else:
            sp = load_tokenizer(args.tokenizer)
        out = write_shards(docs(), sp, args.out, args.val_docs, args.shard_tokens,
                           allow_partial_val=args.allow_partial_val, drop_leaked=args.drop_leaked)
    except ValueError as e:  # shards.LeakError, the val set's size, bad input: one line, exit status 1
        raise SystemExit(f"error: {e}") from None
    for name, st in out.items():
        print(f"shards split:{name} docs:{st['docs']} tokens:{st['tokens']} files:{len(st['files'])} dir:{args.out}"
              + (f" dropped_leaked:{st['dropped_leaked_docs']}" if name == "train" else ""))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
