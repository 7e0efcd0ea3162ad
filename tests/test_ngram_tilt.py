"""The token-only n-gram tilt of lora's score (issue 59 item 4; #2135's token expert), on the CPU.

Its proofs: the tilted distribution is one (its normaliser is the sum over the vocabulary); the counts equal a
dictionary count of the absorbed documents' pairs; no score made before a changed token moves (the counts absorb
only documents scored before a segment of lora's order starts: checked as tests/test_ttt_phased.py checks the
phases, and failing when the counts absorb the segment under way); 2 ranks score as 1 (the segments are edges of the
global order, the counts the same on every rank)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import spawn
from test_ttt_lora import lora_cfg, make_stream
from test_ttt_phased import _phased_on_rank, changed_only_after
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")
TILT = dict(ngram_tilt_enabled=True, token_order=3, token_threshold=0.5, token_boost=2.0, ngram_update_docs=2,
            ttt_batch_size=2)


def test_the_tilted_distribution_sums_to_one_and_scores_its_target():
    """NLL' of the tilt = -log of p(a) e^(beta [a = h]) normalised by its sum over the whole vocabulary, where a hint
    fires; the NLL itself elsewhere."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(3, 7, 50, generator=g) * 3, torch.randint(0, 50, (3, 7), generator=g)
    h = torch.where(torch.rand(3, 7, generator=g) < 0.6, torch.randint(0, 50, (3, 7), generator=g), -1)
    h[0, :3] = y[0, :3]  # some hints right
    scorer = SimpleNamespace(tokens=torch.zeros(10, dtype=torch.int64))  # the table reads the scorer's tokens
    table = tg.NGramTable(tg.Hyperparameters(token_boost=2.625), scorer)
    table.hint = lambda t, ok: h
    nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(3, 7)
    out = table.tilt(logits, nll, y, torch.zeros(3, 7, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                     torch.ones(3, 7, dtype=torch.bool))
    boost = 2.625 * F.one_hot(h.clamp(min=0), 50).double() * (h >= 0)[..., None]
    p = torch.softmax(logits.double(), -1) * torch.exp(boost)
    p = p / p.sum(-1, keepdim=True)
    want = -p.gather(-1, y[..., None])[..., 0].log()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[h < 0], nll[h < 0]) and (out[0, :3] < nll[0, :3]).all()


def test_the_counts_equal_a_dictionary_count_of_the_absorbed_documents():
    tokens = make_stream(270)
    spans = [(0, 5), (6, 47), (90, 130), (133, 181)]
    table = tg.NGramTable(tg.Hyperparameters(token_order=3, token_threshold=0.6), SimpleNamespace(tokens=tokens))
    table.absorb(spans, 4)
    counts: dict[tuple, dict[int, int]] = {}
    for s, e in spans:
        for t in range(s + 2, e + 1):  # a span's targets are tokens s + 1 .. e
            c = counts.setdefault(tuple(tokens[t - 2:t].tolist()), {})
            c[int(tokens[t])] = c.get(int(tokens[t]), 0) + 1
    t = torch.arange(2, 269)
    got = table.hint(t, torch.ones_like(t, dtype=torch.bool)).tolist()
    for i, tt in enumerate(t.tolist()):
        c = counts.get(tuple(tokens[tt - 2:tt].tolist()))
        top = min(k for k, v in c.items() if v == max(c.values())) if c else -1
        want = top if c and max(c.values()) / sum(c.values()) >= 0.6 else -1
        assert got[i] == want, (tt, got[i], want, c)
    assert sum(1 for x in got if x >= 0) > 50  # the repeated pattern gives hints


@pytest.mark.parametrize("p", [20, 61, 100, 150, 200, 265])
def test_no_score_made_before_a_changed_token_moves(p, monkeypatch):
    na, nb, event = changed_only_after(lora_cfg(**TILT), p, monkeypatch)
    assert not torch.equal(na, nb)


def test_the_tilt_moves_the_score_and_counting_the_segment_under_way_breaks_causality(monkeypatch):
    """On: another score than off. Mutation: the counts absorb the documents of the segment being scored too, and a
    changed token moves a score made at its own batch: the legality check above fails."""
    from test_ttt_phased import observed_run
    on = observed_run(lora_cfg(**TILT), make_stream(270), monkeypatch)[1]
    off = observed_run(lora_cfg(**(TILT | dict(ngram_tilt_enabled=False))), make_stream(270), monkeypatch)[1]
    assert not torch.equal(on, off)
    real = tg.NGramTable.absorb
    monkeypatch.setattr(tg.NGramTable, "absorb", lambda self, spans, upto: real(self, self.all, upto))
    monkeypatch.setattr(tg.NGramTable, "all", [(s, e) for s, e in zip([0, 5, 6, 47, 90, 130, 133, 181, 260],
                                                                      [5, 6, 47, 90, 130, 133, 181, 260, 269])],
                        raising=False)
    with pytest.raises(AssertionError):
        for p in (20, 61, 100, 150, 200, 265):
            changed_only_after(lora_cfg(**TILT), p, monkeypatch)


def test_two_ranks_equal_one_rank_with_the_tilt():
    tokens = make_stream(270).tolist()
    one, one_nll = _phased_on_rank(0, 1, tokens, TILT)
    (s0, n0), (s1, n1) = spawn(_phased_on_rank, 2, tokens, TILT)
    assert s0 == s1 and s0[2] == one[2] == 269 and s0[0] == pytest.approx(one[0], rel=1e-7)
    both = np.where(np.isnan(n0), n1, n0)
    assert not np.isnan(both).any()
    np.testing.assert_allclose(both, one_nll, rtol=1e-5)
