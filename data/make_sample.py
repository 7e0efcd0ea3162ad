"""Build the default offline sample dataset from text every Python installation has.

    python3 data/make_sample.py [--out data/sample] [--vocab-size 1024] [--val-fraction 0.05] [--max-docs N]

Writes <out>/datasets/sample_sp<V>/fineweb_{val,train}_000000.bin and <out>/tokenizers/sample_<V>_bpe.model.

Text: the docstrings (inspect.getdoc) of the standard library's public modules, their public classes
and functions and those classes' public methods, plus the help() topics of pydoc_data (the language
reference text behind `help("if")`). Modules come from the fixed, sorted sys.stdlib_module_names and
their sorted submodules; a module that fails to import (platform-specific ones) is skipped, and a few
with import side effects or non-stdlib content are never imported (SKIP_MODULES). Each docstring is a
document; documents are deduplicated, sorted, then shuffled with a fixed seed so the val split (the
first --val-fraction of documents) is not just the alphabetically first ones. The tokenizer is trained
with the challenge's settings (make_shards.CHALLENGE_SPM_SETTINGS) on the train documents.
Deterministic for a given Python installation; CPython 3.11 gives about 6,000 documents and
650k tokens with vocab 1024, built in about 1 s (plus 3-4 s to import torch, for train_gpt.py's shard
format). This is a smoke-test corpus (English prose mixed with code), not a stand-in for FineWeb: bpb
numbers on it are not comparable to the challenge's.

Licence: Python's docstrings and pydoc topics are part of CPython, under the PSF License Agreement.
The sample is generated on the user's machine from their own Python installation and is not
shipped in this repository (data/sample/ is git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import pkgutil
import random
import sys
import time
import warnings
from pathlib import Path

SHUFFLE_SEED = 1337
# Never imported: side effects on import (antigravity opens a browser, this prints), GUI/test suites
# (idlelib, tkinter, turtle, turtledemo, test), lib2to3 may write grammar caches next to its source,
# distutils is replaced by setuptools' copy when setuptools is installed (not stdlib text).
SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                          "lib2to3", "distutils"})


def _import_quietly(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # DeprecationWarnings of old modules are noise here
        return importlib.import_module(name)


def stdlib_modules() -> list:
    """Imported stdlib modules in a fixed order: sorted top-level names, each followed by its sorted
    public submodules (depth first). Private names (leading underscore, __main__) are never imported."""
    queue = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)
    modules = []
    while queue:
        name = queue.pop(0)
        try:
            module = _import_quietly(name)
        except BaseException:  # ImportError on other platforms; some modules raise other errors or exit
            continue
        modules.append(module)
        if hasattr(module, "__path__"):
            subs = sorted(m.name for m in pkgutil.iter_modules(module.__path__) if not m.name.startswith("_"))
            queue[0:0] = [f"{name}.{s}" for s in subs]
    return modules


def _public_docs(module) -> list[str]:
    docs = [inspect.getdoc(module)]
    for attr in sorted(a for a in dir(module) if not a.startswith("_")):
        try:  # a few modules have lazy attributes that raise on access
            obj = getattr(module, attr)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            docs.append(inspect.getdoc(obj))
            if inspect.isclass(obj):
                for name, member in sorted(vars(obj).items()):
                    if not name.startswith("_") and (inspect.isroutine(member) or isinstance(member, property)):
                        docs.append(inspect.getdoc(member))
        except Exception:
            continue
    return [d for d in docs if isinstance(d, str)]


def collect_documents() -> list[str]:
    """Deduplicated stdlib docstrings and pydoc topics in a fixed order (sorted, then seeded shuffle)."""
    docs = {d.strip() for module in stdlib_modules() for d in _public_docs(module)}
    try:
        from pydoc_data.topics import topics  # some distributions strip it
        docs.update(text.strip() for text in topics.values())
    except ImportError:
        pass
    docs.discard("")
    if not docs:
        raise SystemExit("error: no docstrings found (is Python running with -OO, which strips them?)")
    ordered = sorted(docs)
    random.Random(SHUFFLE_SEED).shuffle(ordered)
    return ordered


def _shard_tools():
    """make_shards' writers and train_gpt.py's SAMPLE_MARK, imported only after the documents are collected: the
    shard format is train_gpt.py's, which imports torch, whose torch.package replaces inspect.getfile (without a
    docstring), and a sample built after that lacks a document: another shuffle, tokenizer and shards."""
    try:
        from make_shards import train_tokenizer, write_shards
        from shards import SAMPLE_MARK
    except ImportError:  # imported as data.make_sample from the repo root
        from data.make_shards import train_tokenizer, write_shards
        from data.shards import SAMPLE_MARK
    return train_tokenizer, write_shards, SAMPLE_MARK


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "sample"), help="output root")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--val-fraction", type=float, default=0.05, help="first fraction of documents is val")
    p.add_argument("--max-docs", type=int, help="use only the first N documents (quick tests)")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        raise SystemExit(f"error: --val-fraction {args.val_fraction}: must be in (0, 1)")
    t0 = time.perf_counter()
    docs = collect_documents()[: args.max_docs]
    train_tokenizer, write_shards, SAMPLE_MARK = _shard_tools()
    val_docs = max(1, round(len(docs) * args.val_fraction))
    out = Path(args.out)
    model_path = out / "tokenizers" / f"sample_{args.vocab_size}_bpe.model"
    data_dir = out / "datasets" / f"sample_sp{args.vocab_size}"
    try:
        partial = model_path.with_name(model_path.name + ".partial")
        sp = train_tokenizer(docs[val_docs:], args.vocab_size, partial)
        stats = write_shards(docs, sp, data_dir, val_docs, mark=SAMPLE_MARK)  # train_gpt.py says: not FineWeb
        partial.replace(model_path)  # last: quickstart.sh takes the tokenizer for a whole sample
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"sample python:{sys.version.split()[0]} docs:{len(docs)} chars:{sum(map(len, docs))} "
          f"seconds:{time.perf_counter() - t0:.1f}")
    print(f"sample tokenizer:{model_path} vocab_size:{sp.vocab_size()}")
    for split, st in stats.items():
        print(f"sample split:{split} docs:{st['docs']} tokens:{st['tokens']} files:{' '.join(map(str, st['files']))}")
    return dict(stats, tokenizer=model_path, data_dir=data_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
