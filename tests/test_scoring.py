"""Scoring: sliding-window coverage, the scorer against a plain and a brute-force scorer written here, exact
val_bpb bytes against the UTF-8 length of decoded text (SentencePiece's own decoder), 2 ranks == 1 rank."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

from conftest import make_scorer, perturbed_model, sample_text, spawn, tiny_cfg
import train_gpt as tg

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")
# REFERENCE.md "Details that decide parity" (export): the per-row clip candidates, the table threshold.
CLIP_CANDIDATES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)
KEEP_FLOAT_MAX = 65536


def random_model(cfg: tg.Hyperparameters, seed: int, bank_std: float = 0.05, table_std: float = 0.02) -> tg.GPT:
    """Realistic non-zero weights everywhere, in eval mode."""
    return perturbed_model(cfg, seed, bank_std, table_std).eval()


# =============================================================================================
# 4. Sliding windows and the scorer
# =============================================================================================

@pytest.mark.parametrize("n, window, stride", [
    (1, 32, 8), (7, 32, 8), (31, 32, 8), (32, 32, 8), (33, 32, 8), (301, 32, 8), (301, 32, 1), (301, 32, 32),
    (300, 32, 32), (1000, 64, 7), (997, 13, 13), (997, 13, 5), (50, 2048, 64), (4027, 32, 31), (5, 1, 1)])
def test_sliding_windows_cover_every_target_once(n, window, stride):
    wins = tg.sliding_windows(n, window, stride)
    count = np.zeros(n, np.int64)
    for k, (start, lo, end) in enumerate(wins):
        assert start == k * stride and 0 <= start <= lo < end <= n and end - start <= window
        if k == 0:
            assert lo == 0 and end == min(window, n)  # the first window scores all its targets
        else:
            assert lo - start == window - stride and end - lo <= stride  # only its last `stride` targets
        count[lo:end] += 1
        t = np.arange(lo, end)
        assert np.all(t - start >= np.minimum(t, window - stride))  # context, except near the start
    assert np.all(count == 1)
    assert len(wins) == 1 + max(0, math.ceil((n - window) / stride))  # no wasted windows


def plain_scorer(model: tg.GPT, tokens: torch.Tensor, window: int) -> tuple[float, int]:
    """Non-overlapping windows of `window` targets, the last one shorter; logits called directly."""
    n = tokens.numel() - 1
    nll, count = 0.0, 0
    for s in range(0, n, window):
        e = min(s + window, n)
        logits = model.logits(tokens[s:e][None])[0]
        nll += F.cross_entropy(logits.float(), tokens[s + 1: e + 1], reduction="none").double().sum().item()
        count += e - s
    return nll, count


def brute_force_sliding(model: tg.GPT, tokens: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """Each target t is scored with context from the window start k*stride such that t is among that
    window's last `stride` targets (targets < window: the first window, from 0)."""
    n = tokens.numel() - 1
    by_start: dict[int, list[int]] = {}
    for t in range(n):
        start = 0 if t < window else ((t - window) // stride + 1) * stride
        assert start + window - stride <= t < start + window or start == 0
        by_start.setdefault(start, []).append(t)
    nll = 0.0
    for start, ts in by_start.items():
        e = min(start + window, n)
        logits = model.logits(tokens[start:e][None])[0]
        idx = torch.tensor(ts) - start
        targets = tokens[torch.tensor(ts) + 1]
        nll += F.cross_entropy(logits[idx].float(), targets, reduction="none").double().sum().item()
    return nll, n


def independent_luts(sp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes per token from SentencePiece's own decoder: a piece after the prefix 'a' adds exactly the
    bytes it decodes to (its leading space included); byte-fallback pieces are one byte each."""
    n = sp.vocab_size()
    a = sp.piece_to_id("a")
    base, space, boundary = np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n, bool)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            boundary[i] = True
        elif sp.is_byte(i):
            base[i] = 1
        else:
            text = sp.decode([a, i])
            assert text.startswith("a")
            space[i] = text[1:2] == " "
            base[i] = len(text.encode("utf-8")) - 1 - int(space[i])
    return base, space, boundary


def stream_tokens(sp, n_docs: int, seed: int) -> torch.Tensor:
    return torch.tensor([t for doc in sample_text(n_docs, seed) for t in [1] + sp.encode(doc)], dtype=torch.int64)


@pytest.fixture(scope="module")
def sp(tokenizer_path):
    return spm.SentencePieceProcessor(model_file=str(tokenizer_path))


@pytest.mark.parametrize("n, window, stride, batch", [
    (301, 32, 32, 4), (320, 32, 32, 3), (20, 32, 32, 2), (301, 32, 8, 4), (150, 32, 1, 16), (301, 32, 5, 3),
    (20, 32, 8, 2), (32, 32, 7, 1), (97, 16, 16, 5), (97, 16, 3, 64)])
def test_scorer_matches_independent_scorers(sp, n, window, stride, batch):
    # float64 model: the shorter last window's float32 logits would differ by shape-dependent rounding;
    # in float64 both sides round to the same float32 logits, so the float64 sums agree to ~1e-12.
    cfg = tiny_cfg(eval_seq_len=window)
    model = random_model(cfg, seed=5, bank_std=0.2, table_std=0.5).double()
    tokens = stream_tokens(sp, 40, seed=11)[: n + 1]
    luts = tg.build_byte_luts(sp, cfg.vocab_size, CPU)
    s = make_scorer(cfg, tokens, luts, batch)(model, stride)
    with torch.inference_mode():
        ref_nll, ref_n = plain_scorer(model, tokens, window) if stride == window else \
            brute_force_sliding(model, tokens, window, stride)
    base, space, boundary = independent_luts(sp)
    y, x = tokens[1:].numpy(), tokens[:-1].numpy()
    ref_bytes = int((base[y] + (space[y] & ~boundary[x])).sum())
    assert s.tokens == ref_n == n
    assert s.bytes == ref_bytes
    assert s.loss == pytest.approx(ref_nll / ref_n, rel=1e-9)
    assert s.bpb == pytest.approx(ref_nll / ref_n / math.log(2) * ref_n / ref_bytes, rel=1e-9)


@pytest.mark.parametrize("window, stride, lead", [(32, 8, 0), (32, 32, 0), (16, 5, 0), (32, 8, 7)])
def test_isolated_scoring_never_reaches_back_across_a_bos(sp, window, stride, lead):
    """DOC_ISOLATION=1 (issue 23 item 2): sliding windows over each document alone. The score equals a brute-force
    scorer that gives each target the context of the sliding-window rule applied from its document's BOS, one
    forward per target; every target scored once, the same bytes as without isolation. lead > 0: the stream
    starts inside a document (its first tokens, before any BOS, are scored as one)."""
    cfg = tiny_cfg(eval_seq_len=window, doc_isolation=True)
    model = random_model(cfg, seed=6, bank_std=0.2, table_std=0.5).double()
    tokens = stream_tokens(sp, 40, seed=12)[lead: lead + 401]
    n = tokens.numel() - 1
    bounds = sorted({0} | set((tokens[:n] == tg.BOS_ID).nonzero().flatten().tolist())) + [n]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert (tokens[0] == tg.BOS_ID) == (lead == 0) and len(lengths) >= 3 and max(lengths) > window, lengths
    luts = tg.build_byte_luts(sp, cfg.vocab_size, CPU)
    s = make_scorer(cfg, tokens, luts, 4)(model, stride)
    nll, bos = 0.0, 0
    with torch.inference_mode():
        for t in range(n):
            bos = t if tokens[t] == tg.BOS_ID else bos
            u = t - bos  # the target's index in its document
            start = bos + (0 if u < window else ((u - window) // stride + 1) * stride)
            logits = model.logits(tokens[start: t + 1][None])[0, -1]
            nll += F.cross_entropy(logits.float()[None], tokens[t + 1: t + 2]).double().item()
    plain_cfg = tiny_cfg(eval_seq_len=window)
    plain_model = random_model(plain_cfg, seed=6, bank_std=0.2, table_std=0.5).double()  # the same weights
    plain = make_scorer(plain_cfg, tokens, luts, 4)(plain_model, stride)
    assert s.tokens == n and s.bytes == plain.bytes
    assert s.loss == pytest.approx(nll / n, rel=1e-6)
    assert abs(s.loss - plain.loss) > 1e-4  # the same weights without isolation score otherwise


# =============================================================================================
# 5. Exact val_bpb bytes
# =============================================================================================

SENTENCES = [
    "The café in Zürich served crème brûlée to über-tired tourists.",
    "東京 is the capital of Japan; 日本語 text needs multi-byte pieces.",
    "Emoji need byte fallback: 😀 🚀 and 🧪 together.",
    "In 2024 there were 1,234,567 visitors and 3.14159 pies.",
    "Several   spaces    between words\tand a tab\nand a newline.",
    "naïve façade — “quoted” text with Ελλάδα and données.",
    "x",
]


def test_byte_luts_match_decoder_per_token(sp):
    base, space, boundary = (t.numpy() for t in tg.build_byte_luts(sp, sp.vocab_size(), CPU))
    ref_base, ref_space, ref_boundary = independent_luts(sp)
    np.testing.assert_array_equal(boundary, ref_boundary)
    np.testing.assert_array_equal(space, ref_space)
    np.testing.assert_array_equal(base.astype(np.int64), ref_base)
    assert boundary[[0, 1, 2, 3]].all() and base[[0, 1, 2, 3]].sum() == 0


def test_val_bpb_bytes_equal_utf8_bytes_of_decoded_text(sp):
    docs = [[1] + sp.encode(s) for s in SENTENCES + sample_text(30, seed=5)]
    stream = [t for doc in docs for t in doc]
    # The text really exercises byte fallback, multi-byte pieces and split digits.
    assert any(sp.is_byte(t) for t in stream)
    pieces = [sp.id_to_piece(t).lstrip("\u2581") for t in stream if not sp.is_byte(t)]
    assert any(len(p.encode()) > len(p) for p in pieces)  # multi-byte characters inside pieces
    assert all(sum(ch.isdigit() for ch in sp.id_to_piece(t)) <= 1 for t in stream if not sp.is_byte(t))
    base, space, boundary = tg.build_byte_luts(sp, sp.vocab_size(), CPU)
    x, y = torch.tensor(stream[:-1]), torch.tensor(stream[1:])
    counted = int((base[y].long() + (space[y] & ~boundary[x]).long()).sum())
    decoded_docs = [sp.decode(doc) for doc in docs]
    assert not any("\ufffd" in t for t in decoded_docs)
    expected = sum(len(t.encode("utf-8")) for t in decoded_docs)
    assert counted == expected
    assert counted == len(sp.decode(stream).encode("utf-8"))  # documents joined as the decoder sees them
    # Through the scorer (sliding, batched, padded): the same byte total.
    cfg = tiny_cfg()
    s = make_scorer(cfg, torch.tensor(stream), (base, space, boundary), 3)(
        random_model(cfg, seed=6), 8)
    assert s.tokens == len(stream) - 1 and s.bytes == expected


def test_first_token_after_bos_counts_no_leading_space(sp):
    ids = {p: sp.piece_to_id(p) for p in ("\u2581the", "\u2581of", "\u2581and", "\u2581")}
    assert all(i != sp.unk_id() for i in ids.values())
    docs = [[1, ids["\u2581the"], ids["\u2581of"]], [1, ids["\u2581and"], ids["\u2581the"]],
            [1, ids["\u2581of"], ids["\u2581"]]]
    stream = [t for d in docs for t in d]
    base, space, boundary = tg.build_byte_luts(sp, sp.vocab_size(), CPU)
    x, y = torch.tensor(stream[:-1]), torch.tensor(stream[1:])
    counted = int((base[y].long() + (space[y] & ~boundary[x]).long()).sum())
    decoded = [sp.decode(d) for d in docs]  # the decoder drops the space of a document's first piece
    assert decoded == ["the of", "and the", "of "]
    assert counted == sum(len(t.encode()) for t in decoded)
    # The scorer applies the same rule (x = previous token of each target).
    cfg = tiny_cfg()
    score = make_scorer(cfg, torch.tensor(stream * 5), (base, space, boundary), 2)
    assert score(random_model(cfg, seed=6), 4).bytes == 5 * counted


def test_tokenizer_without_standalone_space_piece_is_refused():
    rng = np.random.default_rng(0)
    lines = ["".join(rng.choice(list("abcdefghij東京é"), int(rng.integers(5, 40)))) for _ in range(300)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=300, byte_fallback=True,
        split_digits=True, normalization_rule_name="nmt_nfkc", add_dummy_prefix=False, pad_id=0, bos_id=1,
        eos_id=2, unk_id=3, character_coverage=1.0, num_threads=1, minloglevel=2)
    bad = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert not any(bad.id_to_piece(i) == "\u2581" for i in range(bad.vocab_size()))
    # Why it matters: a space becomes the 3 byte-fallback bytes of U+2581 (3 bytes counted for 1).
    assert [bad.id_to_piece(i) for i in bad.encode("ab cd") if bad.is_byte(i)] == ["<0xE2>", "<0x96>", "<0x81>"]
    with pytest.raises(ValueError, match="U\\+2581"):
        tg.build_byte_luts(bad, bad.vocab_size(), CPU)


# =============================================================================================
# 6. 2 ranks == 1 rank
# =============================================================================================

def _score_on_rank(rank: int, world_size: int, tokens: list[int], tok_path: str) -> list[tuple]:
    torch.set_num_threads(1)
    cfg = tiny_cfg()
    sp_ = spm.SentencePieceProcessor(model_file=tok_path)
    luts = tg.build_byte_luts(sp_, cfg.vocab_size, CPU)
    scorer = make_scorer(cfg, torch.tensor(tokens), luts, 4, rank, world_size)
    model = random_model(cfg, seed=8, bank_std=0.2, table_std=0.5).double()
    return [(s.loss, s.bpb, s.tokens, s.bytes) for s in (scorer(model, 8), scorer(model, 32), scorer(model, 1))]


def test_two_rank_scoring_equals_one_rank(sp, tokenizer_path):
    tokens = stream_tokens(sp, 12, seed=9)[:1001].tolist()  # 1000 targets: uneven window split
    threads = torch.get_num_threads()
    try:
        one = _score_on_rank(0, 1, tokens, str(tokenizer_path))
    finally:
        torch.set_num_threads(threads)
    two = spawn(_score_on_rank, 2, tokens, str(tokenizer_path))
    assert two[0] == two[1]
    # float64 model: a window sits in other batches on 2 ranks than on 1; in float32 its logits would rest on the
    # CPU's matmul rounding the same whatever the batch. The cross entropy is still fp32: a float64 logit that
    # rounds to the other side moves one target's NLL by ~1e-6, 2e-10 of the 1000 targets' sum, hence 1e-9.
    for a, b in zip(one, two[0]):
        assert a[2:] == b[2:] and a[2] == 1000
        assert a[0] == pytest.approx(b[0], rel=1e-9) and a[1] == pytest.approx(b[1], rel=1e-9)
