"""CaseOps (`lossless_caps_caseops_v1`): capitalisation as four operator characters, and the byte sidecar that
scores the text as it was before the transform.

    from caseops import encode, decode, token_bytes
    t = encode("The NASA iPhone")  # "\\ue001the \\ue002nasa i\\ue003phone"
    decode(t) == "The NASA iPhone"
    ids, nbytes = token_bytes(sp, t)  # sp: the CaseOps SentencePiece model; nbytes: original UTF-8 bytes per id

The transform (the one of the 2026-04-18..04-27 records, so our ids match theirs). Over every maximal run of
ASCII letters [A-Za-z] (a "word"; any other character, digits and non-ASCII letters included, ends it):
  all lowercase                     -> unchanged                       "the"      -> "the"
  all uppercase, 2 letters or more  -> ALLCAPS + lowercase             "NASA"     -> ALLCAPS "nasa"
  first upper, the rest lowercase   -> TITLE + lowercase               "The", "I" -> TITLE "the", TITLE "i"
  any other mix                     -> TITLE if the first is upper, then the lowercase letters with CAPNEXT
                                       before each later capital       "McDonald" -> TITLE "mc" CAPNEXT "donald"
                                                                       "iPhone"   -> "i" CAPNEXT "phone"
An operator character already in the text is written ESC + itself, so every string has exactly one encoding and
decode(encode(x)) == x for any str x. Nothing else changes: non-ASCII case stays as it is and ends a word
("ÉCOLE" -> "É" ALLCAPS "cole").
TITLE, ALLCAPS, CAPNEXT, ESC are U+E001..U+E004 (private use; the record's U+E000 sentinel is not used). The
tokenizer reserves them as user_defined_symbols, so each is always one token of its own.

The byte sidecar. val_bpb divides by the bytes of the ORIGINAL text, so each val token carries the number of
original UTF-8 bytes it stands for (uint16, written beside the val shards). The rule is the record tool's
(prepare_caseops_data.py: `surface_piece_original_byte_counts` over the pieces' `surface`s): a token's bytes
are the characters of the transformed text that SentencePiece aligns to it (its surface, an input span), each
counted at its UTF-8 length, except the operators TITLE/ALLCAPS/CAPNEXT and an ESC, which count 0 (an escaped
literal after ESC counts its own 3 bytes: it is text). So an operator token is 0, a word piece is its letters,
and BOS (added by the shard writer) is 0. It needs the alignment, not only the ids, because the tokenizer
normalizes (nmt_nfkc) before it cuts: a whitespace run is one "\u2581" in the piece but all of its bytes in the
surface, "ｆｕｌｌ" is the piece "full" (4 bytes) but 12 original bytes, and a character split into byte-fallback
pieces puts all its bytes on the last of them (the first ones have empty surfaces: [0, 0, 3], not [1, 1, 1]).
What the normalizer drops at the ends of a document (leading and trailing whitespace, and characters it deletes,
such as U+200B, beside them) is in no surface and counted nowhere (the challenge's byte rule does not count it
either). Everything else is counted exactly once, so a document's sidecar sums to its UTF-8 bytes less that.
On NFKC-stable text without capitals, operators, whitespace runs or byte-fallback characters this equals the
challenge's tokenizer rule (train_gpt.build_byte_luts: the piece's bytes without its leading U+2581, +1 for that
U+2581 unless the previous token is BOS).

Only numpy, the standard library and sentencepiece: data/make_caseops.py's worker processes import this module
and not torch.
"""

from __future__ import annotations

import hashlib
import itertools
import re

import numpy as np
import sentencepiece as spm

TRANSFORM = "lossless_caps_caseops_v1"  # the records' name for this transform (their encode_lossless_caps_v2)
TITLE, ALLCAPS, CAPNEXT, ESC = "\ue001", "\ue002", "\ue003", "\ue004"
OPERATORS = TITLE + ALLCAPS + CAPNEXT + ESC
MAX_TOKEN_BYTES = 65535  # sidecar values are uint16

# A literal operator, or a word that needs an operator (has a capital). The lookbehind makes a match start only
# where a word starts, so the whole word is taken and a long lowercase run is scanned once, not once per letter.
_ENCODE_RE = re.compile(r"[\ue001-\ue004]|(?<![A-Za-z])[a-z]*[A-Z][A-Za-z]*")
# An escaped literal, or a word: an optional TITLE/ALLCAPS, then lowercase letters with CAPNEXT before some.
_DECODE_RE = re.compile(r"\ue004([\s\S])|([\ue001\ue002]?)((?:\ue003?[a-z])+)")
# The operators that stand for no original byte: an ESC (with the literal it escapes, which is text), or a lone
# TITLE/ALLCAPS/CAPNEXT. Scanning left to right pairs ESC ESC as one escaped ESC, as decoding does.
_MARKER_RE = re.compile(r"\ue004[\ue001-\ue004]|[\ue001-\ue004]")


class CaseOpsError(ValueError):
    """A string that is not the CaseOps encoding of any text, or a tokenizer that cannot carry it."""


# ---------------------------------------------------------------- the transform

def _encode_word(m: re.Match) -> str:
    word = m.group()
    if word[0] in OPERATORS:  # a literal operator in the input (the regex's first branch)
        return ESC + word
    lower = word.lower()
    if len(word) >= 2 and word.isupper():
        return ALLCAPS + lower
    if word[0].isupper() and word[1:] == lower[1:]:  # "The", and "I" (the record's mixed rule gives the same)
        return TITLE + lower
    rest = "".join(CAPNEXT + c.lower() if c.isupper() else c for c in word[1:])
    return (TITLE if word[0].isupper() else "") + lower[0] + rest


def encode(text: str) -> str:
    """The CaseOps form of text (see the module docstring); lowercase words and other characters are kept."""
    return _ENCODE_RE.sub(_encode_word, text)


def _decode_word(m: re.Match) -> str:
    literal, op, word = m.groups()
    if literal is not None:
        return literal
    if op == ALLCAPS:
        return word.replace(CAPNEXT, "").upper()
    first, *capped = word.split(CAPNEXT)  # each later part starts with a letter that CAPNEXT makes upper
    out = first + "".join(p[0].upper() + p[1:] for p in capped)
    return out[0].upper() + out[1:] if op == TITLE else out


def decode(text: str) -> str:
    """The text whose encode() is `text`; CaseOpsError if there is none (a stray operator, an uppercase ASCII
    letter, an ALLCAPS word with CAPNEXT in it, ...). Checked by encoding the result again: a decoder that
    accepted other spellings would make two encodings decode to one text, and the transform would not be a
    bijection on what the tokenizer sees."""
    out = _DECODE_RE.sub(_decode_word, text)
    if encode(out) != text:
        bad = next(i for i, (a, b) in enumerate(itertools.zip_longest(encode(out), text)) if a != b)
        raise CaseOpsError(f"not a CaseOps encoding: {text[max(0, bad - 20): bad + 20]!r} (at character {bad})")
    return out


def doc_hash(text: str) -> bytes:
    """sha256 of a document's original UTF-8 text: the identity the leak guard compares val and train by."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


# ---------------------------------------------------------------- tokenizer and byte sidecar

def check_tokenizer(sp: spm.SentencePieceProcessor, where: str) -> spm.SentencePieceProcessor:
    """A CaseOps tokenizer has each operator as one piece of its own (user_defined_symbols): else operators
    would be spelled in byte-fallback pieces and the model could not treat them as the single events they are."""
    for op in OPERATORS:
        i = sp.piece_to_id(op)
        if sp.is_unknown(i) or sp.id_to_piece(i) != op:
            raise CaseOpsError(f"{where}: U+{ord(op):04X} is not a piece of this tokenizer; a CaseOps tokenizer "
                               "reserves U+E001..U+E004 as user_defined_symbols")
    return sp


def _spans(sp: spm.SentencePieceProcessor, texts: list[str], threads: int) -> list[tuple[list[int], list]]:
    """Per text: the ids of sp.encode and each piece's [begin, end) in characters of the text (its surface)."""
    if hasattr(sp, "EncodeAsOffsetMapping"):  # sentencepiece 0.2.3's form of the surface spans
        return [(r["ids"], r["offsets"]) for r in sp.encode(texts, out_type="offset_mapping", num_threads=threads)]
    # 0.2.0 and 0.2.1 (which lack it) give them in the immutable proto, the record tool's call; its begin/end are
    # character offsets in 0.2.0, checked against each surface, so a release that counted bytes stops here.
    out = []
    for text, proto in zip(texts, sp.encode(texts, out_type="immutable_proto", num_threads=threads)):
        spans = [(p.begin, p.end) for p in proto.pieces]
        if any(text[b:e] != p.surface for (b, e), p in zip(spans, proto.pieces)):
            raise CaseOpsError("this sentencepiece's piece offsets are not character offsets; use sentencepiece "
                               "0.2.3 (offset_mapping)")
        out.append(([p.id for p in proto.pieces], spans))
    return out


def original_char_bytes(transformed: str) -> np.ndarray:
    """Per character of an encode() output: the original UTF-8 bytes it stands for (its UTF-8 length; 0 for
    the operators that mark case or escape)."""
    cp = np.frombuffer(transformed.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    n = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    n[[m.start() for m in _MARKER_RE.finditer(transformed)]] = 0
    return n


def token_bytes_batch(sp: spm.SentencePieceProcessor, transformed: list[str],
                      threads: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """token_bytes for several encode() outputs at once (SentencePiece spreads them over `threads`)."""
    out = []
    for text, (ids, spans) in zip(transformed, _spans(sp, transformed, threads)):
        cum = np.concatenate(([0], np.cumsum(original_char_bytes(text))))
        se = np.fromiter(itertools.chain.from_iterable(spans), dtype=np.int64, count=2 * len(spans)).reshape(-1, 2)
        nbytes = cum[se[:, 1]] - cum[se[:, 0]]
        if nbytes.size and nbytes.max() > MAX_TOKEN_BYTES:  # a whitespace run of 64 KiB is one token's surface
            raise CaseOpsError(f"a token stands for {int(nbytes.max())} bytes, more than a uint16 sidecar holds")
        out.append((np.asarray(ids, dtype=np.int64), nbytes))
    return out


def token_bytes(sp: spm.SentencePieceProcessor, transformed: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, original UTF-8 bytes per id) of one document's encode() output, without BOS: ids are exactly
    sp.encode(transformed). The bytes need the text, not only the ids: see "The byte sidecar" above."""
    return token_bytes_batch(sp, [transformed])[0]
