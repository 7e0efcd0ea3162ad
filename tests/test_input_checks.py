"""Inputs that used to pass without a word (issue 55): other scripts' setting names, a byte sidecar at odds with its
manifest or all zeros, a manifest that is not JSON, validation documents in the train shards, a train shard of
another tokenizer, RESUME on other train data, an artifact a byte short or long, SIGHUP with the terminal gone, an
artifact path two runs claim, and settings that differ between ranks."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import torch

from conftest import TINY_VOCAB, _script_command, free_port, sample_text, tiny_cfg, tiny_env, write_shard
from test_byte_sidecar import copy_dataset, val_scorer
from test_run_safety import other_tokenizer  # noqa: F401 (a fixture)
import train_gpt as tg

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(tg.OTHER_NAMES))
def test_other_scripts_names_stop_the_run_naming_ours(name):
    with pytest.raises(ValueError, match=f"unknown setting {name}='1'; this script's name for it: "
                                         f"{re.escape(tg.OTHER_NAMES[name])}"):
        tg.Hyperparameters.from_env({name: "1"})


def test_a_sidecar_must_hold_the_manifests_bytes_and_not_only_zeros(dataset, tokenizer_path, tmp_path):
    data = copy_dataset(dataset, tmp_path)
    tokens = np.fromfile(data / "fineweb_val_000000.bin", "<u2", offset=1024)
    true = np.where(tokens == 1, 0, 3)
    (data / "manifest.json").write_text(json.dumps({"val": {"docs": int((tokens == 1).sum()), "tokens": tokens.size,
                                                            "bytes": int(true.sum())}}))
    write_shard(data / "fineweb_val_bytes_000000.bin", true)
    assert val_scorer(data, tokenizer_path)[0].byte_rule == "sidecar"
    write_shard(data / "fineweb_val_bytes_000000.bin", 2 * true)  # the values doubled
    with pytest.raises(ValueError, match=f"the val shards hold {2 * true.sum()} bytes, .*says {true.sum()}"):
        val_scorer(data, tokenizer_path)
    write_shard(data / "fineweb_val_bytes_000000.bin", 0 * true)
    with pytest.raises(tg.ShardError, match="the byte sidecar is all zeros"):
        val_scorer(data, tokenizer_path)
    (data / "manifest.json").write_text('{"val": {"docs": 3,')
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        tg.val_manifest(str(data))


def train_check(data, tokenizer_path, rank=0, world_size=1):
    """check_train_shards on `data` as rank `rank` of `world_size` (alone: its own share); returns its log line."""
    lines, sp = [], spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    cfg = tiny_cfg(data_path=str(data), tokenizer_path=str(tokenizer_path))
    val = np.concatenate([np.asarray(tg.open_shard(f, TINY_VOCAB)) for f in tg.shard_files(str(data), "val")])
    tg.check_train_shards(cfg, tg.Runtime(rank, world_size, rank), lambda m, console=True: lines.append(m), sp,
                          val.astype(np.int64))
    return lines[0]


def docs_of(tokens):
    starts = np.flatnonzero(tokens == 1).tolist() + [len(tokens)]
    return [tuple(tokens[a:b].tolist()) for a, b in zip(starts, starts[1:])]


def test_validation_documents_in_train_shards_are_counted_and_many_stop_the_run(dataset, tokenizer_path, tmp_path):
    """Found token for token (a brute-force set of documents is the reference), each rank its shards; at most 1% of
    the val documents pass (the web's own duplicates), more stop the run before training."""
    data = copy_dataset(dataset, tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    val = [[1] + sp.encode(d) for d in sample_text(250, seed=11)]
    write_shard(data / "fineweb_val_000000.bin", [t for d in val for t in d])
    train = [np.asarray(tg.open_shard(f, TINY_VOCAB)) for f in tg.shard_files(str(data), "train")]
    leaked = [val[7], val[200], val[7]]  # one document twice, one once: 3 documents
    near = val[9][:-1] + [val[9][-1] + 1 if val[9][-1] + 1 < TINY_VOCAB else 5]  # same length and start, not equal
    write_shard(data / "fineweb_train_000001.bin", np.concatenate([train[1]] + [np.array(d) for d in leaked + [near]]))
    shards = [np.asarray(tg.open_shard(f, TINY_VOCAB)) for f in tg.shard_files(str(data), "train")]
    want = [d for s in shards for d in docs_of(s) if d in set(map(tuple, val))]
    assert len(want) == 3 and len(set(want)) == 2  # one twice: two documents, three copies' tokens
    line = train_check(data, tokenizer_path)
    assert re.match(rf"train_shards_checked shards:2 val_docs_in_train:2/250 tokens:{sum(map(len, want))} ", line)
    parts = [train_check(data, tokenizer_path, r, 2) for r in (0, 1)]  # each rank counts its own shards
    assert [int(re.search(r"val_docs_in_train:(\d+)", p)[1]) for p in parts] == [0, 2]
    write_shard(data / "fineweb_train_000001.bin", np.concatenate([train[1]] + [np.array(d) for d in val[:3]]))
    with pytest.raises(ValueError, match=r"3 of the 250 validation documents \(\d+ tokens\) are also in the train "
                                         r"shards of .*: rebuild them without"):
        train_check(data, tokenizer_path)


def test_every_train_shard_must_be_the_tokenizers(dataset, tokenizer_path, other_tokenizer, tmp_path):  # noqa: F811
    data = copy_dataset(dataset, tmp_path)
    other = spm.SentencePieceProcessor(model_file=str(other_tokenizer))
    write_shard(data / "fineweb_train_000001.bin", [t for d in sample_text(60, seed=9) for t in [1] + other.encode(d)])
    with pytest.raises(ValueError, match=r"re-encodes only \d+ of the first 50 documents of .*fineweb_train_000001"):
        train_check(data, tokenizer_path)


def test_resume_on_other_train_data_of_the_same_sizes_is_refused(dataset, tmp_path):
    cfg = tiny_cfg(data_path=str(dataset))
    files = tg.shard_files(str(dataset), "train")
    state = tg.TrainLoader(files, cfg, tg.Runtime()).state_dict()
    other = tmp_path / "other"
    other.mkdir()
    for f in files:  # the same shards and token counts, other tokens
        tokens = np.asarray(tg.open_shard(f, TINY_VOCAB)).copy()
        tokens[len(tokens) // 2:] = tokens[len(tokens) // 2:][::-1].copy()
        write_shard(other / os.path.basename(f), tokens)
    again = tg.TrainLoader(files, cfg, tg.Runtime())
    again.load_state_dict(state)  # the same data resumes
    with pytest.raises(ValueError, match="the checkpoint.s data position is in .* sha256 of 16 tokens each"):
        tg.TrainLoader(tg.shard_files(str(other), "train"), cfg, tg.Runtime()).load_state_dict(state)


@pytest.mark.parametrize("method", ["rans", "fast"])
def test_an_artifact_a_byte_short_or_long_is_corrupt(method):
    cfg = tiny_cfg(compressor=method)
    from conftest import perturbed_model
    blob = tg.serialize(perturbed_model(cfg, 1, 0.05, 0.1), cfg, {"tokenizer_sha256": ""})[0]
    tg.decompress(blob)
    for bad in (blob[:-1], blob + b"\0", blob[:-2], blob + b"\0\0"):
        with pytest.raises(ValueError, match="artifact is corrupt or truncated"):
            tg.decompress(bad)


def test_sighup_with_the_terminal_gone_checkpoints_and_the_log_keeps_every_line(dataset, tokenizer_path, tmp_path):
    """stdout closed first (a terminal that went away), then SIGHUP: the run stops at a step's end as for SIGTERM,
    writes its checkpoint, gives back its claimed artifact path, and its log has every line to the last."""
    env = tiny_env(dataset, tokenizer_path, RUN_ID="hup", ITERATIONS="100000")
    cmd, full = _script_command(env, 1)
    p = subprocess.Popen(cmd, env=full, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step:3/"):
            break
    os.kill(p.pid, signal.SIGSTOP)
    p.stdout.close()
    for s in (signal.SIGHUP, signal.SIGCONT):
        os.kill(p.pid, s)
    assert p.wait(timeout=120) == 128 + signal.SIGHUP, p.stderr.read()[-2000:]
    log = (tmp_path / "logs" / "hup.txt").read_text()
    m = re.search(r"^checkpoint step:(\d+) path:logs/hup.ckpt", log, re.M)
    assert m and (tmp_path / "logs" / "hup.ckpt").is_file()
    assert re.search(rf"^step:{m[1]}/100000 ", log, re.M)  # lines printed after the terminal went are in the log
    assert log.rstrip().splitlines()[-1].startswith(f"interrupted by SIGHUP at step {m[1]}: resume with RESUME=")
    assert not (tmp_path / "logs" / "hup.int6.ptz").exists()


def test_an_artifact_path_is_claimed_at_the_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg(run_id="a", artifact_path=str(tmp_path / "x.ptz"))
    assert tg.claim_outputs(cfg, tg.Runtime()).artifact_path == str(tmp_path / "x.ptz")
    assert (tmp_path / "x.ptz").stat().st_size == 0  # claimed: created empty
    with pytest.raises(FileExistsError, match=r"x.ptz exists \(empty: a running run's, or a killed one's\)"):
        tg.claim_outputs(tg.replace(cfg, run_id="b"), tg.Runtime())
    default = tg.claim_outputs(tiny_cfg(run_id="c"), tg.Runtime())
    assert default.artifact_path == "logs/c.int6.ptz" and (tmp_path / "logs" / "c.int6.ptz").is_file()
    named = tg.claim_outputs(tiny_cfg(run_id="d", artifact_path="logs/d.int6.ptz"), tg.Runtime())
    assert named.run_id == "d"  # its own claim does not make the RUN_ID taken
    assert tg.claim_outputs(tiny_cfg(run_id="c"), tg.Runtime()).run_id == "c_2"


def test_a_rank_started_with_other_settings_stops_the_run(dataset, tokenizer_path, tmp_path):
    """Ranks started by hand, rank 1 with GRAD_ACCUM_STEPS=2 (it used to exit 0 with another score): both stop after
    comparing, rank 0 naming the setting, and exits cleanly (1, not gloo's abort)."""
    port, procs = free_port(), []
    for rank in (0, 1):
        cmd, env = _script_command(tiny_env(dataset, tokenizer_path, RUN_ID="ranks",
                                            **({"GRAD_ACCUM_STEPS": "2"} if rank else {})), 1)
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = procs[0].communicate(timeout=120)
    procs[1].terminate()  # as torchrun ends the other ranks once one has exited (rank 1 waits 10 s for it)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == 1 and procs[1].returncode != 0
    assert "rank 1's settings differ from rank 0's (GRAD_ACCUM_STEPS)" in out[1], out[1][-2000:]
    assert "step:" not in out[0]
