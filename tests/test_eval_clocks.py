"""The evaluation's graphs compiled before any clock, and its two clocks (issue 57), through train_gpt's own main()
in this process on the tiny CPU config: compile on (COMPILE_ENABLED=1) with torch.compile itself stubbed, so the
precompile, every warmup and every scoring loop run the code a GPU run runs.

No validation token enters a forward, a backward or a warmup before it is scored: the scorer's tokens are poisoned
(ids past the vocabulary, BOS kept so documents stay findable: reading val for its document lengths is allowed)
from the scorer's start to each scoring loop's timed steps, and again during every loop's warmup. A forward, a
backward or a byte lookup of a poisoned token raises. Within a loop, score-before-train is
tests/test_ttt_phased.py's and tests/test_ttt_lora.py's claim."""
from __future__ import annotations

import re
import time

import pytest
import torch

from conftest import run_main

import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")


def poisoned(tokens: torch.Tensor) -> torch.Tensor:
    return torch.where(tokens == tg.BOS_ID, tokens, torch.full_like(tokens, 10 ** 6))


def poison_the_scorer(monkeypatch) -> list[int]:
    """Scorer with poisoned tokens but in its loops' timed steps; returns the steps of each loop, as they come."""
    real_init, real_loop, loops = tg.Scorer.__init__, tg.Scorer.loop, []

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.real_tokens, self.tokens = self.tokens, poisoned(self.tokens)

    def loop(self, warmup, steps, step, *args, **kwargs):
        warmup()  # poisoned
        self.tokens = self.real_tokens
        loops.append(len(steps))
        try:
            return real_loop(self, lambda: None, steps, step, *args, **kwargs)
        finally:
            self.tokens = poisoned(self.real_tokens)
    monkeypatch.setattr(tg.Scorer, "__init__", init)
    monkeypatch.setattr(tg.Scorer, "loop", loop)
    monkeypatch.setattr(tg, "compiled", lambda fn, rt: fn)
    return loops


@pytest.mark.parametrize("ttt", [dict(PHASED_TTT_PREFIX_DOCS=6, PHASED_TTT_NUM_PHASES=2, GLOBAL_TTT_CHUNK_TOKENS=64,
                                      DOC_ISOLATION=0), dict(DOC_ISOLATION=1)], ids=["phased", "isolated"])
def test_no_validation_token_enters_a_forward_before_its_scoring_and_the_clocks(monkeypatch, tmp_path, dataset, tokenizer_path,
                                                                   ttt):
    loops = poison_the_scorer(monkeypatch)
    log = run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "poison", COMPILE_ENABLED=1, TTT_ENABLED=1,
                   GPTQ_CALIBRATION_BATCHES=2, VAL_LOSS_EVERY=3, **ttt)
    assert re.search(r"^eval_precompile time:\d+ms$", log, re.M)  # the precompile ran, on poisoned tokens
    # mid-training, post-training, post-EMA, roundtrip, sliding, (per document), TTT: all scored, each after warmup
    assert len(loops) >= 6 and "legal_ttt_exact" in log
    if "PHASED_TTT_PREFIX_DOCS" in ttt:
        assert "phases:[3, 6]" in log  # the phases' global SGD ran (on scored documents only)
    # the summary's clocks: eval_time, the final score's pass (here TTT's) as its own line times it; eval_wall, all
    # from train_done on
    ttt_ms = float(re.search(r"^legal_ttt .* eval_time:(\d+)ms", log, re.M).group(1))
    summary = log.strip().splitlines()[-1]
    eval_s, wall_s = (float(re.search(rf" {k}:([\d.]+)s", summary).group(1)) for k in ("eval_time", "eval_wall"))
    assert summary.startswith("summary score:legal_ttt ") and eval_s == pytest.approx(ttt_ms / 1000, abs=0.051)
    assert wall_s >= eval_s


def test_eval_only_counts_the_artifacts_decoding_in_eval_wall(monkeypatch, tmp_path, dataset, tokenizer_path):
    """A training run decodes its artifact inside eval_wall; EVAL_ONLY read it before run() and left it out (a
    review). The decoding slowed by 0.5 s shows in both wall clocks; the outputs line names no checkpoint (none is
    written)."""
    run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "made", ITERATIONS=2, GPTQ_CALIBRATION_BATCHES=0)
    read = tg.read_artifact

    def slow_read(path):
        time.sleep(0.5)
        return read(path)
    monkeypatch.setattr(tg, "read_artifact", slow_read)
    log = run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "scored", EVAL_ONLY="logs/made.int6.ptz",
                   CHECKPOINT_EVERY=100)
    assert re.search(r"^outputs log:logs/scored.txt artifact:logs/made.int6.ptz$", log, re.M)  # no checkpoint named
    summary = log.strip().splitlines()[-1]
    assert summary.startswith("summary ")
    assert all(float(re.search(rf" {k}:([\d.]+)s", summary).group(1)) >= 0.5 for k in ("eval_wall", "wall_time"))
