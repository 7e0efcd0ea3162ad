"""Issue 36: no interrupt, path or mismatched file loses a trained model or prints a wrong score. Whole runs as a user
makes them (signals, a wrong tokenizer, outputs that exist), and the pieces behind them (the claim of a RUN_ID, the
checkpoint's checksum, the messages of bad settings)."""
from __future__ import annotations

import hashlib
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (SCRIPT, TINY_VOCAB, make_cfg, run_inline, run_script, run_script_interrupted, sample_text,
                      tiny_env)
from test_training import make_trainer

import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")


def log_of(cwd: Path, run_id: str) -> str:
    return (cwd / "logs" / f"{run_id}.txt").read_text()


def exact(log: str, key: str) -> str:
    return re.search(rf"^{key}_exact .*$", log, re.M).group(0)


@pytest.fixture(scope="module")
def baseline(dataset, tokenizer_path, tmp_path_factory):
    """An uninterrupted tiny run (6 steps): its folder; it leaves no checkpoint (CHECKPOINT_EVERY=0)."""
    cwd = tmp_path_factory.mktemp("baseline")
    with pytest.MonkeyPatch.context() as mp:
        r = run_inline(mp, tiny_env(dataset, tokenizer_path, ITERATIONS=6, RUN_ID="base"), cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return cwd


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer of the same vocabulary size and settings, trained on other text (the words reversed)."""
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("other_tok")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(" ".join(w[::-1] for w in doc.split()) for doc in sample_text(400, seed=5)))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "other"), model_type="bpe", vocab_size=TINY_VOCAB, byte_fallback=True,
        split_digits=True, normalization_rule_name="nmt_nfkc", add_dummy_prefix=False, pad_id=0, bos_id=1, eos_id=2,
        unk_id=3, character_coverage=1.0, num_threads=1, minloglevel=2)
    return d / "other.model"


# =============================================================================================
# 3. No trained model is lost
# =============================================================================================

def test_a_finished_run_leaves_no_checkpoint_and_records_the_tokenizer(baseline, tokenizer_path):
    assert not (baseline / "logs" / "base.ckpt").exists()  # written when training ended, removed once scored
    sha = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    assert f"tokenizer path:{tokenizer_path} sha256:{sha}" in log_of(baseline, "base")
    header, _ = tg.read_artifact(baseline / "logs" / "base.int6.ptz")
    assert header["tokenizer_sha256"] == sha


def test_sigterm_while_scoring_before_export_leaves_the_trained_state_and_says_how_to_finish(
        baseline, dataset, tokenizer_path, tmp_path, monkeypatch):
    """It used to exit 143 with no checkpoint, no artifact and no log line. Now the trained state is on disk when
    training ends; RESUME=it exports and scores, with the uninterrupted run's scores."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS=6, RUN_ID="base")
    rc, out, err = run_script_interrupted(env, tmp_path, after="train_done ", sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    hint = "interrupted by SIGTERM: finish with RESUME=logs/base.ckpt (the same settings)"
    assert f"error: {hint} (DEBUG=1 shows the traceback)" in err.splitlines()
    assert log_of(tmp_path, "base").strip().splitlines()[-1] == f"error Interrupted: {hint}"
    assert not (tmp_path / "logs" / "base.int6.ptz").exists()
    sha = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    assert tg.read_checkpoint(str(tmp_path / "logs" / "base.ckpt"))["tokenizer_sha256"] == sha
    r = run_inline(monkeypatch, dict(env, RESUME="logs/base.ckpt"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, base = log_of(tmp_path, "base_2"), log_of(baseline, "base")
    assert "\nwarmup_step:" not in resumed
    for key in ("post_ema", "final_int6_roundtrip", "final_int6_sliding_window"):
        assert exact(resumed, key) == exact(base, key)


def test_sigterm_after_export_says_to_score_the_artifact(dataset, tokenizer_path, tmp_path):
    env = tiny_env(dataset, tokenizer_path, ITERATIONS=4, RUN_ID="late")
    rc, out, err = run_script_interrupted(env, tmp_path, after="final_int6_roundtrip ", sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "error: interrupted by SIGTERM: score the artifact with EVAL_ONLY=logs/late.int6.ptz" in err
    tg.read_artifact(tmp_path / "logs" / "late.int6.ptz")  # whole: EVAL_ONLY scores it


def test_an_interrupt_before_training_says_no_checkpoint_was_written(dataset, tokenizer_path, tmp_path):
    env = tiny_env(dataset, tokenizer_path, RUN_ID="warm")
    rc, out, err = run_script_interrupted(env, tmp_path, after="warmup_step:1/", sig=signal.SIGINT)
    assert rc == 128 + signal.SIGINT, err[-3000:]
    assert "error: interrupted by SIGINT: no checkpoint was written, the training is lost" in err, err[-3000:]


def test_a_second_signal_within_a_step_stops_at_once_without_a_checkpoint(dataset, tokenizer_path, monkeypatch,
                                                                          tmp_path):
    """The first SIGINT asks for a checkpoint at the next step's start; a second one within the step stops now (the
    step's state is half-updated, so nothing is written) and main() then says that no checkpoint was written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    before = signal.signal(signal.SIGINT, tg.raise_interrupted)  # as main() installs it
    try:
        tr = make_trainer(dataset, tokenizer_path, ITERATIONS=6, LATE_QAT_THRESHOLD=0, RUN_ID="twice")

        def step(k, lr_scale):
            if k == 2:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return torch.tensor(1.0)
        tr.step = step
        with pytest.raises(tg.Interrupted):
            tr.train(scorer=None, ema=None)
        assert not tr.ckpt_path.exists()
        assert signal.getsignal(signal.SIGINT) is tg.raise_interrupted  # the loop put main()'s handler back
    finally:
        signal.signal(signal.SIGINT, before)


def _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch, **settings):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir(exist_ok=True)
    tr = make_trainer(dataset, tokenizer_path, ITERATIONS=3, LATE_QAT_THRESHOLD=0, RUN_ID="end", **settings)
    tr.step = lambda k, lr_scale: torch.tensor(1.0)
    return tr


def test_a_final_checkpoint_the_disk_cannot_hold_does_not_stop_the_export(dataset, tokenizer_path, tmp_path,
                                                                          monkeypatch):
    """Without CHECKPOINT_EVERY the artifact (16 MB) still gets its chance where the checkpoint (327 MB) does not
    fit; with it, the failure stops the run as before."""
    lines = []
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch)
    tr.log = lines.append

    def full(*_):
        raise OSError(28, "No space left on device (writing logs/end.ckpt, 9 bytes)")
    tr.save_checkpoint = full
    assert tr.train(scorer=None, ema=None)[::2] == (3, 0)
    assert any(x.startswith("warning the trained state was not written ([Errno 28] No space left") for x in lines)
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch, CHECKPOINT_EVERY=1000)
    tr.save_checkpoint = full
    with pytest.raises(OSError, match="No space left"):
        tr.train(scorer=None, ema=None)


def _train_until_interrupted(tr) -> dict:
    """tr.train() under main()'s SIGTERM handler, which it must end with Interrupted; the checkpoint it left."""
    before = signal.signal(signal.SIGTERM, tg.raise_interrupted)
    try:
        with pytest.raises(tg.Interrupted):
            tr.train(scorer=None, ema=None)
    finally:
        signal.signal(signal.SIGTERM, before)
    return tg.read_checkpoint("logs/end.ckpt")


def test_a_signal_during_the_final_checkpoint_leaves_it_whole(dataset, tokenizer_path, tmp_path, monkeypatch):
    """The loop's own handler stays until the final checkpoint is on disk; the signal then stops the run (main()
    says: finish with RESUME=it). It used to raise inside the write, and the temporary file was deleted."""
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch)
    save = tr.save_checkpoint

    def signalled_save(ema, clock):
        os.kill(os.getpid(), signal.SIGTERM)
        save(ema, clock)
    tr.save_checkpoint = signalled_save
    assert _train_until_interrupted(tr)["clock"]["done"]


def test_the_final_checkpoint_follows_the_hessians_and_a_signal_during_them_stops_after_it(dataset, tokenizer_path,
                                                                                          tmp_path, monkeypatch):
    """GPTQ's Hessians end the 600 s of training, so the final checkpoint is written after them (it took 1 s on 2
    H200s); a signal during them finds the loop's handler still there: the checkpoint is written, then the run stops."""
    lines = []
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch, GPTQ_CALIBRATION_BATCHES=1)
    tr.log = lines.append
    hessians = tg.calibrate

    def signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return hessians(*args)
    monkeypatch.setattr(tg, "calibrate", signalled)
    assert _train_until_interrupted(tr)["clock"]["done"]
    order = [next(i for i, x in enumerate(lines) if x.startswith(k)) for k in ("train_done", "gptq_calibration",
                                                                                  "checkpoint")]
    assert order == sorted(order)


def test_a_resume_of_the_final_checkpoint_calibrates_on_the_same_batches(dataset, tokenizer_path, tmp_path,
                                                                        monkeypatch):
    """The final checkpoint's data position is before GPTQ's calibration batches, so RESUME=it gets the same Hessians
    (a review: written after them, it held the position past them, and the resumed artifact differed)."""
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch, GPTQ_CALIBRATION_BATCHES=2)
    hessians = tr.train(scorer=None, ema=None)[3]
    again = make_trainer(dataset, tokenizer_path, ITERATIONS=3, LATE_QAT_THRESHOLD=0, RUN_ID="end",
                         GPTQ_CALIBRATION_BATCHES=2)
    again.load(tg.read_checkpoint("logs/end.ckpt"), None)
    resumed = again.train(scorer=None, ema=None)[3]
    assert again.clock["done"] and hessians.keys() == resumed.keys()
    assert all(torch.equal(hessians[k], resumed[k]) for k in hessians)


def test_a_failure_in_the_hessians_of_one_process_still_writes_the_trained_state(dataset, tokenizer_path, tmp_path,
                                                                                 monkeypatch):
    """One process (one GPU) writes the final checkpoint when the Hessians fail (out of memory, a second signal);
    ranks alone would wait in each other's collectives."""
    tr = _trainer_with_fake_steps(dataset, tokenizer_path, tmp_path, monkeypatch, GPTQ_CALIBRATION_BATCHES=1)

    def out_of_memory(*_):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(tg, "calibrate", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        tr.train(scorer=None, ema=None)
    assert tg.read_checkpoint("logs/end.ckpt")["clock"]["done"]


def test_a_failure_after_training_says_how_to_finish(dataset, tokenizer_path, tmp_path, monkeypatch):
    """Any error once the trained state is on disk (export, scoring, TTT out of memory, a lost rank) carries the
    hint; so does an interrupt of a run that resumed a checkpoint and wrote none of its own."""
    monkeypatch.chdir(tmp_path)
    for k, v in tiny_env(dataset, tokenizer_path, RUN_ID="late").items():
        monkeypatch.setenv(k, v)

    def failing_run(cfg, *_):
        Path(f"logs/{cfg.run_id}.ckpt").write_bytes(b"trained")
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(tg, "run", failing_run)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(RuntimeError) as e:
            tg.main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.__notes__ == ["finish with RESUME=logs/late.ckpt (the same settings)"]
    assert e.value.log_path == Path("logs/late.txt")  # where report_error on another rank adds its line
    assert tg.report_error(e.value) == 1
    assert log_of(tmp_path, "late").strip().splitlines()[-1] == (
        "error RuntimeError: CUDA out of memory; finish with RESUME=logs/late.ckpt (the same settings)")


def test_an_interrupted_resume_of_a_finished_checkpoint_says_to_resume_it_again(dataset, tokenizer_path, tmp_path):
    (tmp_path / "logs").mkdir()
    tr = make_trainer(dataset, tokenizer_path, RUN_ID="done", ITERATIONS=2)
    tr.ckpt_path = tmp_path / "logs" / "done.ckpt"
    tr.save_checkpoint(None, dict(tr.clock, step=2, done=True))
    env = tiny_env(dataset, tokenizer_path, RUN_ID="again", RESUME="logs/done.ckpt", ITERATIONS=2)
    rc, out, err = run_script_interrupted(env, tmp_path, after="resumed_from:", sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "error: interrupted by SIGTERM: finish with RESUME=logs/done.ckpt (the same settings)" in err, err


# =============================================================================================
# 4. The tokenizer is the data's
# =============================================================================================

def test_a_tokenizer_that_is_not_the_datas_is_refused(dataset, tokenizer_path, other_tokenizer, tmp_path, monkeypatch):
    """Another 512-token tokenizer used to train and score (a wrong val_bpb, exit 0)."""
    r = run_inline(monkeypatch, tiny_env(dataset, other_tokenizer, RUN_ID="wrong"), tmp_path)
    assert r.returncode == 1 and "step:" not in r.stdout, r.stdout[-2000:]
    assert re.search(r"TOKENIZER_PATH re-encodes only \d+ of the first 39 documents of .*fineweb_val_000000.bin into "
                     r"their ids: it is not the tokenizer these shards were made with", r.stderr), r.stderr[-2000:]
    # the training shards are checked too (EVAL_ONLY reads only the validation shards): another tokenizer's data
    import sentencepiece as spm
    ours, other = (spm.SentencePieceProcessor(model_file=str(p)) for p in (tokenizer_path, other_tokenizer))
    shard = np.array([t for d in sample_text(60, seed=9) for t in [1] + other.encode(d)], dtype=np.uint16)
    tg.check_tokenizer(other, shard, "theirs")
    with pytest.raises(ValueError, match=r"re-encodes only \d+ of the first 50 documents of ours into their ids"):
        tg.check_tokenizer(ours, shard, "ours")


def test_a_train_shard_of_another_tokenizer_stops_every_rank_with_one_line(dataset, tokenizer_path, other_tokenizer,
                                                                          tmp_path):
    """The bad shard is rank 1's to check (2 ranks): every rank raises its error after the sum. Rank 1 alone raising
    left rank 0 in the sum, to die of a broken connection: a second error line, and a log without the cause."""
    import shutil
    import sentencepiece as spm
    from conftest import write_shard
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    other = spm.SentencePieceProcessor(model_file=str(other_tokenizer))
    write_shard(data / "fineweb_train_000001.bin", [t for d in sample_text(60, seed=9) for t in [1] + other.encode(d)])
    r = run_script(tiny_env(data, tokenizer_path, RUN_ID="two"), tmp_path, nproc=2)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert re.search(r"re-encodes only \d+ of the first 50 documents of .*fineweb_train_000001.bin", errors[0])
    assert "fineweb_train_000001.bin" in (tmp_path / "logs" / "two.txt").read_text().splitlines()[-1]


def test_eval_only_and_resume_with_another_tokenizer_stop_naming_both(baseline, dataset, tokenizer_path,
                                                                      other_tokenizer, tmp_path, monkeypatch):
    ours, other = (hashlib.sha256(p.read_bytes()).hexdigest() for p in (tokenizer_path, other_tokenizer))
    artifact = baseline / "logs" / "base.int6.ptz"
    r = run_inline(monkeypatch, tiny_env(dataset, other_tokenizer, EVAL_ONLY=artifact, RUN_ID="e"), tmp_path)
    assert r.returncode == 1
    assert (f"TOKENIZER_PATH {other_tokenizer} (sha256 {other}) is not the tokenizer artifact {artifact} was made "
            f"with (sha256 {ours})") in r.stderr, r.stderr[-2000:]
    # a checkpoint as a run writes it (a real run's: the SIGTERM test above)
    (tmp_path / "logs").mkdir()
    tr = make_trainer(dataset, tokenizer_path, RUN_ID="ck")
    tr.ckpt_path, tr.tokenizer = tmp_path / "logs" / "ck.ckpt", ours
    tr.save_checkpoint(None, dict(tr.clock, done=True))
    env = tiny_env(dataset, other_tokenizer, RUN_ID="ck", RESUME="logs/ck.ckpt")
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 1 and f"is not the tokenizer checkpoint logs/ck.ckpt was made with (sha256 {ours})" \
        in r.stderr, r.stderr[-2000:]


# =============================================================================================
# 5. Outputs never overwrite
# =============================================================================================

def test_an_artifact_path_that_exists_or_names_a_log_is_refused_at_the_start(dataset, tokenizer_path, tmp_path,
                                                                             monkeypatch):
    """It used to replace another run's log (or its own) with the artifact, after training."""
    (tmp_path / "logs").mkdir()
    for name in ("old.txt", "other.int6.ptz"):
        (tmp_path / "logs" / name).write_text("keep me")
    r = run_inline(monkeypatch, tiny_env(dataset, tokenizer_path, ARTIFACT_PATH="logs/old.txt", RUN_ID="new"), tmp_path)
    assert r.returncode == 1 and "step:" not in r.stdout
    assert "error: FileExistsError: ARTIFACT_PATH logs/old.txt exists: a run never overwrites a file" in r.stderr
    monkeypatch.chdir(tmp_path)
    for path, why, error in (("logs/other.int6.ptz", "exists", FileExistsError),  # a name, not a file: a ValueError
                             ("logs/new.txt", "is named like a log or checkpoint", ValueError),
                             ("logs/x.ckpt", "is named like a log or checkpoint", ValueError)):
        with pytest.raises(error, match=f"ARTIFACT_PATH {path} {why}"):
            tg.claim_outputs(tg.Hyperparameters(run_id="new", artifact_path=path), tg.Runtime())
    assert all((tmp_path / "logs" / n).read_text() == "keep me" for n in ("old.txt", "other.int6.ptz"))
    assert not (tmp_path / "logs" / "new.txt").exists()  # a refused run claims no name
    # EVAL_ONLY writes no artifact: its ARTIFACT_PATH is not its business
    tg.claim_outputs(tg.Hyperparameters(run_id="ev", artifact_path="logs/old.txt", eval_only="a.ptz"), tg.Runtime())


def test_a_run_id_is_claimed_atomically(tmp_path, monkeypatch):
    """The log is created exclusively: a run that took the name between another's look and its claim keeps it (two
    runs started together used to share a log). A name whose checkpoint or artifact is left also moves on."""
    monkeypatch.chdir(tmp_path)
    cfg = tg.Hyperparameters(run_id="r")
    (tmp_path / "logs").mkdir()
    with monkeypatch.context() as m:
        m.setattr(Path, "exists", lambda self: False)  # every look says "free": only the exclusive create decides
        first, second = tg.claim_outputs(cfg, tg.Runtime()), tg.claim_outputs(cfg, tg.Runtime())
    assert (first.run_id, second.run_id) == ("r", "r_2")
    assert second.artifact_path == str(Path("logs") / "r_2.int6.ptz")
    (tmp_path / "logs" / "r_3.ckpt").write_bytes(b"")
    assert tg.claim_outputs(cfg, tg.Runtime()).run_id == "r_4"


# =============================================================================================
# 6. Checkpoints carry a checksum
# =============================================================================================

def test_a_flipped_byte_in_a_checkpoint_is_refused(dataset, tokenizer_path, monkeypatch, tmp_path):
    """It used to resume and end with another score."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    tr = make_trainer(dataset, tokenizer_path, RUN_ID="flip")
    tr.save_checkpoint(None, dict(tr.clock))
    good = tr.ckpt_path.read_bytes()
    assert tg.read_checkpoint(str(tr.ckpt_path))["clock"]["step"] == 0
    for at in (len(good) // 2, len(good) - 1, len(tg.CHECKPOINT_MAGIC) + 3):  # a weight, the end, the checksum
        bad = bytearray(good)
        bad[at] ^= 0x10
        tr.ckpt_path.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=r"RESUME logs/flip.ckpt is corrupt: its checksum does not match"):
            tg.read_checkpoint("logs/flip.ckpt")
    (tmp_path / "a.ptz").write_bytes(tg.ARTIFACT_MAGIC + b"\0rest")
    with pytest.raises(ValueError, match=r"^RESUME a.ptz is an artifact: score it with EVAL_ONLY=a.ptz$"):
        tg.read_checkpoint("a.ptz")  # it used to print torch's weights_only advice


# =============================================================================================
# 9. Messages a user can act on
# =============================================================================================

@pytest.mark.parametrize("env, message", [
    ({"MODEL_DIM": "30", "NUM_HEADS": "4"}, "MODEL_DIM=30 must divide by NUM_HEADS=4"),
    ({"NUM_HEADS": "8", "NUM_KV_HEADS": "3"}, "NUM_HEADS=8 must divide by NUM_KV_HEADS=3"),
    ({"SEED": "-1"}, "SEED=-1 is out of range: it must be in 0..4294967295"),
    ({"SEED": str(2 ** 32)}, f"SEED={2 ** 32} is out of range"),
    ({"MLP_MULT": "0.001"}, "MLP_MULT=0.001 x MODEL_DIM=512 rounds to an MLP of 0 units"),
    ({"LATE_QAT_THRESHOLD": "1.5"}, "LATE_QAT_THRESHOLD=1.5 is out of range"),
    ({"num_layers": "5"}, "setting num_layers='5' is not read: settings are upper case (NUM_LAYERS)"),
])
def test_bad_settings_are_one_clear_error(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tg.Hyperparameters.from_env(env)


def test_settings_that_would_do_nothing_are_reported():
    explicit = {"ttt_lora_rank", "loop_start", "bigram_dim"}
    cfg = tg.Hyperparameters(ttt_enabled=False, num_loops=0, ttt_lora_rank=8, loop_start=2, bigram_vocab_size=0)
    assert cfg.unread(explicit) == ["setting BIGRAM_DIM is ignored: BIGRAM_VOCAB_SIZE=0 turns its feature off",
                                    "setting LOOP_START is ignored: NUM_LOOPS=0 turns its feature off",
                                    "setting TTT_LORA_RANK is ignored: TTT_ENABLED=False turns its feature off"]
    assert tg.Hyperparameters(num_loops=0, bigram_vocab_size=64).unread(explicit) == [
        "setting LOOP_START is ignored: NUM_LOOPS=0 turns its feature off"]  # (a checkpoint's TTT_ENABLED=1)
    steps = tg.Hyperparameters(max_wallclock_seconds=0, iterations=100, warmdown_iters=3500)
    assert steps.unread({"warmdown_frac"}) == [
        "setting WARMDOWN_FRAC is WARMDOWN_ITERS=0's; WARMDOWN_ITERS=3500 ignores it",
        "WARMDOWN_ITERS=3500 > ITERATIONS=100 (a step-capped run): the lr starts at 0.029 of its peak"]
    assert tg.Hyperparameters(iterations=100, warmdown_iters=3500).unread(set()) == []  # capped: by wallclock
    assert tg.Hyperparameters(ema_decay=0.99).unread({"ema_horizon"}) == [
        "setting EMA_HORIZON is EMA_DECAY=0's; EMA_DECAY=0.99 ignores it"]
    lrs = {"tied_embed_lr", "embed_lr", "head_lr", "muon_momentum_warmup_start"}  # a bool's "=0" is False
    assert tg.Hyperparameters().unread(lrs) == ["setting EMBED_LR is TIE_EMBEDDINGS=0's; TIE_EMBEDDINGS=True ignores it",
                                                "setting HEAD_LR is TIE_EMBEDDINGS=0's; TIE_EMBEDDINGS=True ignores it"]
    assert tg.Hyperparameters(tie_embeddings=False, muon_momentum_warmup_steps=0).unread(lrs) == [
        "setting TIED_EMBED_LR is ignored: TIE_EMBEDDINGS=False turns its feature off",
        "setting MUON_MOMENTUM_WARMUP_START is ignored: MUON_MOMENTUM_WARMUP_STEPS=0 turns its feature off"]


def test_a_resumed_run_reports_against_the_checkpoints_settings(baseline, dataset, tokenizer_path, tmp_path,
                                                                 monkeypatch):
    """The reports come after the checkpoint's (or artifact's) settings are adopted: a checkpoint made with TTT on
    does not make TTT_LORA_RANK 'ignored' in the resumed run."""
    (tmp_path / "logs").mkdir()
    tr = make_trainer(dataset, tokenizer_path, RUN_ID="t", TTT_ENABLED=1, ITERATIONS=2)
    tr.ckpt_path = tmp_path / "logs" / "t.ckpt"
    tr.save_checkpoint(None, dict(tr.clock, step=2, done=True))
    env = tiny_env(dataset, tokenizer_path, RUN_ID="t", RESUME="logs/t.ckpt", TTT_LORA_RANK=4, ENABLE_LOOPING_AT=0.5)
    del env["TTT_ENABLED"]  # the checkpoint's
    r = run_inline(monkeypatch, env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = log_of(tmp_path, "t_2")
    assert "setting ttt_enabled:True" in log and "TTT_LORA_RANK is ignored" not in log
    assert "warning setting ENABLE_LOOPING_AT is ignored: NUM_LOOPS=0 turns its feature off" in log


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "full.txt").symlink_to("/dev/full")  # every write: ENOSPC, "[Errno 28]" alone named no file
    with pytest.raises(OSError, match=re.escape("No space left on device (writing logs/full.txt)")):
        tg.Logger("full", True)("a line")
    def full(self, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match=re.escape(f"No space left on device (writing {tmp_path / 'a.ckpt'}, 3 bytes)")):
        tg.write_atomic(tmp_path / "a.ckpt", b"abc")


def test_resume_on_other_data_is_refused_naming_both(dataset, tokenizer_path, tmp_path):
    """RESUME with fewer shards or another TRAIN_SAMPLING used to end in IndexError / KeyError (or read other data):
    a data position is one in its data, and loading it elsewhere is a ValueError (one line, as every ValueError)."""
    one = tmp_path / "one"
    one.mkdir()
    for f in ("fineweb_val_000000.bin", "fineweb_train_000000.bin"):
        (one / f).write_bytes((dataset / f).read_bytes())
    loader = lambda data, **more: tg.TrainLoader(tg.shard_files(str(data), "train"), make_cfg(
        **tiny_env(data, tokenizer_path, **more)), tg.Runtime())
    state = loader(dataset).state_dict()
    loader(dataset).load_state_dict(state)  # the same data: fine
    for other, want in ((loader(one), "this run reads TRAIN_SAMPLING=sequential over 1 shards"),
                        (loader(dataset, TRAIN_SAMPLING="coprime"), "this run reads TRAIN_SAMPLING=coprime over 2")):
        with pytest.raises(ValueError, match="the checkpoint's data position is in TRAIN_SAMPLING=sequential over "
                                             f"2 shards of \\d+ tokens, sha256 of 16 tokens each \\w+; {want}"):
            other.load_state_dict(state)


@pytest.mark.parametrize("where, setting", [("Trainer.warmup", "GRAD_ACCUM_STEPS=2 halves the micro-batch"),
                                            ("Scorer.warm", "lower TTT_BATCH_SIZE=64"),
                                            ("lora_ttt", "lower TTT_BATCH_SIZE=64")])
def test_out_of_memory_names_the_setting_to_change(where, setting, monkeypatch, tmp_path, dataset, tokenizer_path):
    """CUDA running out of memory in the training warmup, the evaluation's precompile or TTT (issue 58: a 32-GB card
    stopped with a line naming no setting): the error carries a note naming the setting for that stage."""
    from conftest import run_main
    import train_gpt as tg

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    owner, name = where.split(".") if "." in where else (None, where)
    monkeypatch.setattr(getattr(tg, owner) if owner else tg, name, oom)
    if name == "lora_ttt":
        monkeypatch.setitem(tg.TTT_MODES, "lora", tg.TTTMode(oom, True))
    with pytest.raises(torch.cuda.OutOfMemoryError) as e:
        run_main(monkeypatch, tmp_path, dataset, tokenizer_path, "oom", TTT_ENABLED=1, GRAD_ACCUM_STEPS=1,
                 COMPILE_ENABLED=1 if name == "warm" else 0, DEBUG=1)  # DEBUG=1: the error itself, not its line
    assert any(n.startswith(setting) for n in getattr(e.value, "__notes__", [])), e.value.__notes__


def test_the_memory_a_process_may_use_is_logged_and_in_the_out_of_memory_note(monkeypatch):
    """On CUDA the layout line and an out-of-memory note say the free memory, this process's reserve and its cap (here
    faked: no GPU on the CPU machines)."""
    import types
    import train_gpt as tg
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * 2 ** 30, 80 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 3 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.4, raising=False)
    cuda = torch.device("cuda")
    rt = tg.Runtime(0, 1, 0, cuda, "varlen", "triton", True, True, 8)
    assert rt.describe().endswith(" memory:10.0 GiB free, 3.0 reserved, cap 32.0")
    with pytest.raises(torch.cuda.OutOfMemoryError) as e:
        with tg.memory_advice(types.SimpleNamespace(device=cuda), "lower X"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert e.value.__notes__ == ["10.0 GiB free, 3.0 reserved, cap 32.0; lower X"]


# =============================================================================================
# 7. RESUME and EVAL_ONLY take the stored settings first (session 37's review)
# =============================================================================================

def test_a_model_setting_equal_to_the_stored_one_is_checked_with_the_stored_others(dataset, tokenizer_path, tmp_path,
                                                                                   monkeypatch):
    """NUM_HEADS=3, an artifact's and checkpoint's own value, set again: it was validated against the defaults' other
    model settings first ("MODEL_DIM=512 must divide by NUM_HEADS=3"), which this run never uses. The checkpoint
    holds its script's sha256: resumed by an edited train_gpt.py, the log warns (the packager refuses such a log:
    the record would ship code that did not train all of its model); by the same one, not."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS=2, MODEL_DIM=48, NUM_HEADS=3, NUM_KV_HEADS=1,
                   CHECKPOINT_EVERY=1000, TTT_ENABLED=0, RUN_ID="h3")
    assert run_inline(monkeypatch, env, tmp_path).returncode == 0
    user = {k: v for k, v in env.items() if k.lower() not in tg.MODEL_SETTINGS or k == "NUM_HEADS"}
    edited = tmp_path / "edited.py"
    edited.write_text(SCRIPT.read_text() + "# edited\n")
    for extra, script in ((dict(EVAL_ONLY="logs/h3.int6.ptz"), SCRIPT), (dict(RESUME="logs/h3.ckpt"), SCRIPT),
                          (dict(RESUME="logs/h3.ckpt"), edited)):
        again = dict(user, RUN_ID="again", **extra)  # the edited script: a process of its own
        r = run_script(again, tmp_path, script=script) if script == edited else run_inline(monkeypatch, again, tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        warned = "warning checkpoint logs/h3.ckpt was written by another train_gpt.py" in r.stdout
        assert warned == (script == edited), r.stdout[-2000:]


def test_a_resume_with_late_qat_off_trains_without_it(dataset, tokenizer_path, tmp_path, monkeypatch):
    """A checkpoint taken once late QAT was on, resumed with LATE_QAT_THRESHOLD=0 (off; the log says the environment's
    value is used): the resumed steps kept fake-quantizing."""
    env = tiny_env(dataset, tokenizer_path, ITERATIONS=20, LATE_QAT_THRESHOLD=0.5, RUN_ID="q")
    rc, _, err = run_script_interrupted(env, tmp_path, "late_qat:enabled", signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM and (tmp_path / "logs" / "q.ckpt").is_file(), err[-2000:]
    seen, step = [], tg.Trainer.step
    monkeypatch.setattr(tg.Trainer, "step", lambda self, s, lr: (seen.append((s, self.mode.qat)), step(self, s, lr))[1])
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.lower() in tg.SETTINGS]:
        monkeypatch.delenv(k)
    for k, v in dict(env, LATE_QAT_THRESHOLD="0", RESUME="logs/q.ckpt", RUN_ID="q_off").items():
        monkeypatch.setenv(k, str(v))
    assert tg.main() == 0
    resumed = [qat for s, qat in seen if s >= 18]
    assert resumed and not any(resumed), seen


def test_eval_only_does_not_need_a_training_batch_that_divides(baseline, dataset, tokenizer_path, tmp_path):
    """3 ranks score an artifact whose training batch (512 tokens of 32) does not divide by 3: nothing trains."""
    r = run_script(tiny_env(dataset, tokenizer_path, EVAL_ONLY=baseline / "logs" / "base.int6.ptz", TTT_ENABLED=0,
                            RUN_ID="e3"), tmp_path, nproc=3)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_val_set_without_a_target_to_score_stops_before_training(dataset, tokenizer_path, tmp_path, monkeypatch):
    """One BOS token, or BOS alone: no bytes, so val_bpb would divide by 0 (a traceback after the whole training)."""
    from conftest import write_shard
    data = tmp_path / "data"
    data.mkdir()
    for f in dataset.glob("fineweb_train_*.bin"):
        (data / f.name).write_bytes(f.read_bytes())
    write_shard(data / "fineweb_val_000000.bin", [1])
    r = run_inline(monkeypatch, tiny_env(data, tokenizer_path, RUN_ID="v"), tmp_path)
    assert r.returncode == 1 and "step:" not in r.stdout, r.stdout[-2000:]
    assert "hold no target but BOS: no bytes to score" in r.stderr, r.stderr[-2000:]

