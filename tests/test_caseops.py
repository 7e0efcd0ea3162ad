"""Tests of data/caseops.py (the CaseOps transform and its byte sidecar) and data/make_caseops.py (the shard tool).

CPU, offline, tokenizers trained here: a tiny CaseOps model (the challenge settings plus the four operators as
user_defined_symbols) and, for re-encoding shards, conftest's tiny plain one. Expected values come from
independent code: a character-loop encoder written from the rule table, per-piece byte counting over the pieces
(not SentencePiece's offsets), UTF-8 lengths of the documents, train_gpt.build_byte_luts, per-document sp.encode.
"""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import train_gpt as tg
from conftest import sample_text

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(DATA_DIR))

import caseops  # noqa: E402
import make_caseops  # noqa: E402
import make_shards  # noqa: E402
import retokenize  # noqa: E402
import shards  # noqa: E402

T, A, C, E = caseops.TITLE, caseops.ALLCAPS, caseops.CAPNEXT, caseops.ESC


# ---------------------------------------------------------------- independent references

def is_letter(ch: str) -> bool:
    return "a" <= ch <= "z" or "A" <= ch <= "Z"


def reference_encode(text: str) -> str:
    """The rule table of caseops.py's docstring, one character at a time."""
    out, i = [], 0
    while i < len(text):
        if text[i] in caseops.OPERATORS:
            out += [E, text[i]]
            i += 1
        elif not is_letter(text[i]):
            out.append(text[i])
            i += 1
        else:
            j = i
            while j < len(text) and is_letter(text[j]):
                j += 1
            word, up = text[i:j], [ch <= "Z" for ch in text[i:j]]
            if not any(up):
                out.append(word)
            elif all(up) and len(word) > 1:
                out += [A, word.lower()]
            elif up[0] and not any(up[1:]):
                out += [T, word.lower()]
            else:
                out += [T] * up[0] + [word[0].lower()] + [C * u + ch.lower() for ch, u in zip(word[1:], up[1:])]
            i = j
    return "".join(out)


def reference_sidecar(sp: spm.SentencePieceProcessor, ids) -> list[int]:
    """Original bytes per token read from the pieces (valid where the normalizer changes nothing): U+2581 is one
    space, the operators 0 unless escaped, a byte-fallback character all its bytes on its last byte piece."""
    out, escaped, need = [], False, 0
    for i in map(int, ids):
        if sp.is_byte(i):
            b = int(sp.id_to_piece(i)[1:-1], 16)
            if need == 0:  # a lead byte: how many bytes this character has
                need = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
                size = need
            need -= 1
            out.append(size if need == 0 else 0)
            continue
        n = 0
        for ch in sp.id_to_piece(i).replace("\u2581", " "):
            if escaped:
                n, escaped = n + len(ch.encode()), False
            elif ch == E:
                escaped = True
            elif ch not in caseops.OPERATORS:
                n += len(ch.encode())
        out.append(n)
    return out


def rule_per_token(luts, ids) -> np.ndarray:
    """The challenge's byte rule per target (train_gpt.Scorer's), the document's first token after BOS."""
    base, space, boundary = (t.numpy() for t in luts)
    y = np.asarray(ids, dtype=np.int64)
    x = np.concatenate(([make_caseops.BOS_ID], y[:-1]))
    return base[y] + (space[y] & ~boundary[x])


# ---------------------------------------------------------------- fuzzed text

SCRIPTS = ["é", "É", "ß", "ñ", "Ελλάδα", "Москва", "東京", "한국", "😀", "x\u0301", "Σσς", "İ"]
NFKC_CHANGED = ["ｆｕｌｌ", "ﬁ", "①", "\u00a0", "\u3000", "ℌ", "\u212a", "ǅ"]  # the last two become "K", "Dž"
PUNCT = [".", ",", "'", "\"", "-", "—", "(", ")", "%", "#", "3.14", "2024", "0"]
OPS_AND_NEIGHBOURS = list(caseops.OPERATORS) + ["\ue000", "\ue005", E + E, T + "a", C + "x"]


def random_word(rng: random.Random) -> str:
    w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
    style = rng.randrange(5)
    if style == 1:
        return w.upper()
    if style == 2:
        return w.capitalize()
    if style == 3:
        return "".join(ch.upper() if rng.random() < 0.4 else ch for ch in w)
    return w


def fuzz_text(rng: random.Random, n: int, ops: bool = True, nfkc: bool = True, edges: bool = True) -> str:
    """Words of every case style, digits, punctuation, non-Latin scripts, whitespace runs, operators."""
    kinds = [random_word] * 6 + [lambda r: r.choice(SCRIPTS), lambda r: r.choice(PUNCT)]
    kinds += [lambda r: r.choice(OPS_AND_NEIGHBOURS)] * ops + [lambda r: r.choice(NFKC_CHANGED)] * nfkc
    seps = ["", " ", " ", " ", "\n", "  ", "\t", " \n\n "]
    parts = [rng.choice(kinds)(rng) + rng.choice(seps) for _ in range(n)]
    text = "".join(parts)
    return (rng.choice(["", " ", "\n "]) + text + rng.choice(["", "\n", "  "])) if edges else text


def random_unicode(rng: random.Random, n: int) -> str:
    """Any code point but surrogates, with the operators and ASCII letters frequent."""
    pool = "aZqQ" + caseops.OPERATORS + "\ue000 "
    return "".join(rng.choice(pool) if rng.random() < 0.5 else chr(rng.choice(
        [rng.randrange(0x80), rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(n))


def plain_doc(rng: random.Random, words: int) -> str:
    """What the challenge byte rule and the sidecar agree on: lowercase ASCII words, digits and punctuation
    between single spaces (no capitals, operators, whitespace runs, or characters outside the tokenizer)."""
    return " ".join(rng.choice([random_word(rng).lower()] * 4 + [rng.choice(PUNCT[:-3]), str(rng.randrange(999))])
                    for _ in range(words))


@pytest.fixture(scope="module")
def caseops_model(tmp_path_factory) -> Path:
    """A tiny CaseOps tokenizer: challenge settings, the operators reserved, characters outside its training
    text (such as 한국 or 😀) left to byte fallback."""
    rng = random.Random(5)
    docs = [caseops.encode(fuzz_text(rng, 60, ops=False, nfkc=False)) for _ in range(150)]
    docs += [caseops.encode(d) for d in sample_text(150, seed=9)]
    lines = [line for d in docs for line in d.split("\n") if line.strip() and "한" not in line and "😀" not in line]
    path = tmp_path_factory.mktemp("caseops_tok") / "caseops.model"
    settings = dict(make_shards.CHALLENGE_SPM_SETTINGS, character_coverage=1.0)
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=f, vocab_size=480,
                                       user_defined_symbols=list(caseops.OPERATORS), num_threads=1, minloglevel=2,
                                       **settings)
    return path


@pytest.fixture(scope="module")
def sp(caseops_model) -> spm.SentencePieceProcessor:
    return caseops.check_tokenizer(make_shards.load_tokenizer(caseops_model), str(caseops_model))


# ---------------------------------------------------------------- the transform

@pytest.mark.parametrize("text, want", [
    ("The NASA Launch", f"{T}the {A}nasa {T}launch"),
    ("iPhone McDonald", f"i{C}phone {T}mc{C}donald"),
    ("I a A ABc aBC", f"{T}i a {T}a {T}a{C}bc a{C}b{C}c"),
    ("USA's x2Y", f"{A}usa's x2{T}y"),  # digits and the apostrophe end words
    ("ÉCOLE Zürich", f"É{A}cole {T}zürich"),  # non-ASCII letters keep their case and end ASCII words
    (f"a{T}b{E}{E}", f"a{E}{T}b{E}{E}{E}{E}"),  # literal operators are escaped
    ("\ue000\ue005", "\ue000\ue005"),  # only U+E001..U+E004 are operators
    ("", ""),
])
def test_examples(text, want):
    assert caseops.encode(text) == want == reference_encode(text)
    assert caseops.decode(want) == text


def test_fuzzed_round_trip_is_exact():
    rng = random.Random(1234)
    texts = [fuzz_text(rng, rng.randint(0, 40)) for _ in range(1500)] + [random_unicode(rng, 60) for _ in range(1500)]
    for text in texts:
        encoded = caseops.encode(text)
        assert encoded == reference_encode(text)
        assert caseops.decode(encoded) == text
        assert not any("A" <= ch <= "Z" for ch in encoded)  # the case lives in the operators only


@pytest.mark.parametrize("bad", [T, f"{T} a", f"a{C}", f"{C}a", "Abc", f"{A}a{C}b", f"{T}{A}ab", E, f"ab{T}c",
                                 f"{A}a", f"{T}a{C}b{C}c{A}"])
def test_decode_refuses_what_encode_never_writes(bad):
    with pytest.raises(caseops.CaseOpsError):
        caseops.decode(bad)


# ---------------------------------------------------------------- the byte sidecar

def test_sidecar_matches_pieces_and_sums_to_the_text(sp):
    rng = random.Random(7)
    for _ in range(300):
        doc = fuzz_text(rng, rng.randint(1, 30))
        ids, nbytes = caseops.token_bytes(sp, caseops.encode(doc))
        assert ids.tolist() == sp.encode(caseops.encode(doc))
        # Every byte once, except the leading/trailing whitespace that no token carries (here ASCII whitespace,
        # NBSP and U+3000, which NFKC makes spaces: what str.strip removes).
        assert int(nbytes.sum()) == len(doc.strip().encode()), repr(doc)
    for _ in range(300):  # where the normalizer changes nothing, the pieces themselves give each token's bytes
        doc = " ".join(fuzz_text(rng, rng.randint(1, 30), nfkc=False, edges=False).split())
        ids, nbytes = caseops.token_bytes(sp, caseops.encode(doc))
        assert nbytes.tolist() == reference_sidecar(sp, ids), repr(doc)


def test_sidecar_is_the_challenge_rule_on_plain_text(sp):
    luts = tg.build_byte_luts(sp, sp.vocab_size(), "cpu")
    rng = random.Random(8)
    for _ in range(200):
        doc = plain_doc(rng, rng.randint(1, 40))
        ids, nbytes = caseops.token_bytes(sp, caseops.encode(doc))
        assert nbytes.tolist() == rule_per_token(luts, ids).tolist(), repr(doc)


def test_sidecar_where_the_challenge_rule_differs(sp):
    luts = tg.build_byte_luts(sp, sp.vocab_size(), "cpu")
    cases = {  # text: what the piece-length rule gets wrong about it
        "the NASA": "an operator piece counts its 3 UTF-8 bytes",
        "the 한국 x": "a byte-fallback character is 1 byte per piece, the sidecar puts them all on the last",
        "the   x": "a whitespace run is one U+2581",
        "the ｆｕｌｌ x": "NFKC: the piece is 'full', the text 12 bytes",
    }
    for doc, why in cases.items():
        ids, nbytes = caseops.token_bytes(sp, caseops.encode(doc))
        rule = rule_per_token(luts, ids)
        assert nbytes.tolist() != rule.tolist(), why
        assert int(nbytes.sum()) == len(doc.encode())
    ids, nbytes = caseops.token_bytes(sp, caseops.encode("the 한 x"))
    fallback = [i for i in ids if sp.is_byte(i)]
    assert len(fallback) == 3 and [int(n) for i, n in zip(ids, nbytes) if sp.is_byte(i)] == [0, 0, 3]


def test_tokenizer_without_operators_is_refused(tokenizer_path):
    with pytest.raises(caseops.CaseOpsError, match="U\\+E001"):
        caseops.check_tokenizer(spm.SentencePieceProcessor(model_file=str(tokenizer_path)), "plain")


# ---------------------------------------------------------------- the tool

def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def read_split(out: Path, names: list[str]) -> list[np.ndarray]:
    return [shards.read_shard(out / n) for n in names]


def docs_of(stream: np.ndarray) -> list[list[int]]:
    return [d[1:].tolist() for d in np.split(stream, np.flatnonzero(stream == 1))[1:]]


def tool(*args) -> dict:
    return make_caseops.main([str(a) for a in args])


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "caseops-staging" in p.name]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    rng = random.Random(3)
    docs = list(dict.fromkeys(fuzz_text(rng, rng.randint(1, 50)) for _ in range(40)))  # distinct: no leak
    return docs + [""]  # an empty document is a lone BOS


def test_tool_end_to_end(tmp_path, sp, caseops_model, docs):
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    man = tool("--docs", src, "--tokenizer", caseops_model, "--out", out, "--val-docs", 15, "--shard-tokens", 200,
               "--workers", 2)
    sizes = {}
    expected = {s: [[*sp.encode(caseops.encode(d))] for d in part] for s, part in (("val", docs[:15]),
                                                                                  ("train", docs[15:]))}
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(man["val"]["files"] + man["val"]["byte_files"] + man["train"]["files"] + ["manifest.json"])
    assert json.loads((out / "manifest.json").read_text()) == {k: v for k, v in man.items() if k != "seconds"}
    for split in ("val", "train"):
        parts = read_split(out, man[split]["files"])
        assert [f"fineweb_{split}_{k:06d}.bin" for k in range(len(parts))] == man[split]["files"]
        for p in parts:  # documents whole: each shard starts one, and only a lone document passes the size
            assert p[0] == 1 and (p.size <= 200 or (p == 1).sum() == 1)
        sizes[split] = [(p.size, int((p == 1).sum())) for p in parts]
        stream = np.concatenate(parts)
        assert docs_of(stream) == expected[split]
        assert (man[split]["docs"], man[split]["tokens"]) == (int((stream == 1).sum()), stream.size)
    all_sizes = sizes["val"] + sizes["train"]
    assert any(n > 1 for _, n in all_sizes) and any(size > 200 for size, _ in all_sizes), all_sizes  # both cases
    val, sidecar = (np.concatenate(read_split(out, man["val"][k])) for k in ("files", "byte_files"))
    assert [s.size for s in read_split(out, man["val"]["byte_files"])] == [
        s.size for s in read_split(out, man["val"]["files"])]
    assert (sidecar[val == 1] == 0).all()
    per_doc = [int(s.sum()) for s in np.split(sidecar, np.flatnonzero(val == 1))[1:]]
    assert per_doc == [len(d.strip().encode()) for d in docs[:15]]
    v = man["val"]
    assert (v["bytes"], v["text_bytes"]) == (sum(per_doc), sum(len(d.encode()) for d in docs[:15]))
    assert (v["requested_docs"], v["partial"], man["byte_rule"]) == (15, False, "sidecar")
    assert v["docs_sha256"] == hashlib.sha256(b"".join(hashlib.sha256(d.encode()).digest()
                                                       for d in docs[:15])).hexdigest()
    assert man["tokenizer_sha256"] == hashlib.sha256(caseops_model.read_bytes()).hexdigest()
    assert man["tokenizer"] == caseops_model.name and man["train"]["dropped_leaked_docs"] == 0
    # One worker writes the same bytes; a second run into the folder is refused, then replaces it with --overwrite.
    one = tmp_path / "one"
    tool("--docs", src, "--tokenizer", caseops_model, "--out", one, "--val-docs", 15, "--shard-tokens", 200,
         "--workers", 1)
    assert all((one / n).read_bytes() == (out / n).read_bytes() for n in names)
    with pytest.raises(SystemExit, match="--overwrite"):
        tool("--docs", src, "--tokenizer", caseops_model, "--out", one, "--val-docs", 15, "--workers", 1)
    man = tool("--docs", src, "--tokenizer", caseops_model, "--out", one, "--val-docs", 15, "--workers", 1,
               "--overwrite")
    assert sorted(p.name for p in one.iterdir()) == [
        "fineweb_train_000000.bin", "fineweb_val_000000.bin", "fineweb_val_bytes_000000.bin", "manifest.json"]
    assert leftovers(tmp_path) == []


def test_leak_guard(tmp_path, caseops_model, docs):
    leaky = docs[:20] + [docs[4]] + docs[20:]  # train document 0 is val document 4
    src = write_jsonl(tmp_path / "leaky.jsonl", leaky)
    out = tmp_path / "out"
    cmd = [sys.executable, str(DATA_DIR / "make_caseops.py"), "--docs", str(src), "--tokenizer", str(caseops_model),
           "--out", str(out), "--val-docs", "20", "--workers", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "train document 0 (from 0) has the sha256 of a val document" in run.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    man = tool(*cmd[2:], "--drop-leaked")
    train = np.concatenate(read_split(out, man["train"]["files"]))
    assert (man["train"]["docs"], man["train"]["dropped_leaked_docs"]) == (len(docs) - 20, 1)
    assert docs_of(train) == [caseops_sp_ids(caseops_model, d) for d in docs[20:]]


def caseops_sp_ids(model: Path, doc: str) -> list[int]:
    return spm.SentencePieceProcessor(model_file=str(model)).encode(caseops.encode(doc))


def test_partial_val_is_refused_unless_allowed(tmp_path, caseops_model, docs):
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=f"only {len(docs)} documents.*first 50,000.*--allow-partial-val"):
        tool("--docs", src, "--tokenizer", caseops_model, "--out", out, "--workers", 1)  # default --val-docs 50000
    assert not out.exists() and leftovers(tmp_path) == []
    man = tool("--docs", src, "--tokenizer", caseops_model, "--out", out, "--workers", 1, "--allow-partial-val")
    assert (man["val"]["docs"], man["val"]["requested_docs"], man["val"]["partial"]) == (len(docs), 50000, True)
    assert (man["train"]["docs"], man["train"]["files"]) == (0, [])


def test_from_shards(tmp_path, dataset, tokenizer_path, caseops_model, sp):
    """conftest's shards (40 val, 600 train documents, vocab 512) re-encoded: the val set is the first 30 val
    documents, whose sidecar adds up to the bytes the challenge rule counts on the source ids."""
    out = tmp_path / "out"
    man = tool("--src", dataset, "--src-tokenizer", tokenizer_path, "--tokenizer", caseops_model, "--out", out,
               "--val-docs", 30, "--workers", 1)
    src_sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    src = {split: docs_of(np.concatenate([shards.read_shard(p) for p in sorted(dataset.glob(f"fineweb_{split}_*"))]))
           for split in ("val", "train")}
    src["val"] = src["val"][:30]
    for split in ("val", "train"):
        assert docs_of(np.concatenate(read_split(out, man[split]["files"]))) == [
            sp.encode(caseops.encode(src_sp.decode(d))) for d in src[split]]
    val, sidecar = (np.concatenate(read_split(out, man["val"][k])) for k in ("files", "byte_files"))
    per_doc = [int(s.sum()) for s in np.split(sidecar, np.flatnonzero(val == 1))[1:]]
    src_luts = retokenize.byte_luts(src_sp)
    assert per_doc == [retokenize.rule_bytes(np.array([1, *d]), src_luts) for d in src["val"]]
    assert per_doc == [len(src_sp.decode(d).encode()) for d in src["val"]]
    assert (man["source"]["kind"], man["source"]["val_docs_unused"], man["train"]["docs"]) == ("shards", 10, 600)
    with pytest.raises(SystemExit, match="is a CaseOps tokenizer"):
        tool("--src", out, "--src-tokenizer", caseops_model, "--tokenizer", caseops_model, "--out",
             tmp_path / "again", "--val-docs", 30, "--workers", 1)
    assert not (tmp_path / "again").exists() and leftovers(tmp_path) == []


def test_help():
    run = subprocess.run([sys.executable, str(DATA_DIR / "make_caseops.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "--allow-partial-val" in run.stdout and "--drop-leaked" in run.stdout
