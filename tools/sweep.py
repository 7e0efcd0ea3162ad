#!/usr/bin/env python3
"""Sweep runner: variants x seeds of train_gpt.py on every visible GPU, then one table that judges them.

    python3 tools/sweep.py --preset pqb-t --seeds 1337,42 \\
        --variant base="" --variant lr30="MATRIX_LR=0.03" [--base "K=V ..."] [--gpus-per-run N] [--plot]
    python3 tools/sweep.py ... --dry-run          # the command of each run and its GPU; no data, no GPU needed

Settings are layered calling environment < preset < --base < --variant, each a string of `K=V` words (shell
quoting allowed). Presets join by commas in any order: a settings preset (sp1024) goes under the run preset (pqb,
pqb-t or timing; at most one), so `sp1024,pqb-t` and `pqb-t,sp1024` are one run. Every setting goes through
train_gpt.py's own strict parsing before the first run starts, so a typo stops the sweep at once, naming the
setting. The runner sets RUN_ID (<sweep>_<variant>_s<seed>), SEED and ARTIFACT_PATH (not with EVAL_ONLY)
itself. SCRIPT=path in a variant runs that variant with another copy of train_gpt.py (a code change's
before/after), its settings checked by that copy's parser. --export-only: the first variant trains and
the others only export and score its final checkpoint again (RESUME), with their own export settings:
quantisers and coders compared on the same weights, at a fraction of a run's cost. Each export run has the
settings a training run of its variant would have (a key the first variant sets and an export variant leaves to
the environment is set back to its default, else it would come from the checkpoint); one whose model settings
(MODEL_SETTINGS, e.g. NUM_LAYERS) differ from the first variant's is refused before any run.
Ctrl-C (or SIGTERM, SIGHUP) passes SIGINT to the running runs, which write logs/<RUN_ID>.ckpt at their next
step and stop; the sweep waits up to 120 s for them (STOP_WAIT_S; a second Ctrl-C stops the wait), kills what still
runs, and prints each run's last line and the command that resumes it (exit status 130).
Runs start in the calling directory: logs/<RUN_ID>.txt (the script's log), logs/<RUN_ID>.out (everything the
run printed), logs/<RUN_ID>.int6.ptz (its artifact), and at the end logs/<sweep>.json (the table, every run's
numbers and where its wall time went). With no visible GPU the runs go one at a time on the CPU.

Placement: run (variant v, seed s) goes to GPU slot (v + s) mod slots, so across seeds every variant moves to
another GPU (under a wallclock cap a slower GPU means fewer steps). Compare only runs of one sweep: the presets
were calibrated on H200s (one run per GPU), and H200s of one host differ by a few percent in step time.

Score: `legal_ttt_exact` val_bpb when TTT ran, else `final_int6_sliding_window_exact` (the last score a run
logs, the rule of records/package_record.py). p: one-sided Welch t-test that a variant's mean score is lower
than the first variant's (records/package_record.py's test with margin 0). `±` is the std over seeds. The seed
spread is max - min over the seeds, never less than RERUN_SPREAD (what rerunning one seed moves): a default changes
only on a difference beyond twice it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "records"))
import package_record as pr  # noqa: E402  (log parsing, score rule and Welch test shared with records)


@dataclass(frozen=True)
class Preset:
    settings: str
    about: str
    train_shards: int | None = None  # train shards DATA_PATH must hold (None: any)
    stack: bool = False  # settings only, no run length: layered under the run preset, whatever the order named


# The proxy quality benchmark (the reference's 1,500 steps of 131,072 tokens on one GPU, 8 proxy train shards:
# records/PERFORMANCE.md, "Presets") with accumulation 1 (same math, faster). COMPRESSOR=fast: xz took 36 s of
# each run, zstd-3 0.2 s (the coder is lossless; the runner reports the default coder's size as bytes_auto, coded
# on the CPU while the GPU goes on).
DEFAULT_CODER = "rans"  # train_gpt.py's COMPRESSOR default (and what "auto" picked before 2026-11-26)
# TRAIN_LOG_EVERY=100 only adds points to the loss curves. PHASED_TTT_PREFIX_DOCS=45: the default's 2,500 of the real
# set's 50,000 documents, as a share of the proxy validation's 902. NGRAM_UPDATE_DOCS=64: the tilt's counts updated 14
# times over the 902 (the default's 512 would update them once); the interval its proxy measure used (2026-11-28).
PQB = ("TRAIN_BATCH_TOKENS=131072 WARMDOWN_ITERS=750 MUON_MOMENTUM_WARMUP_STEPS=400 VAL_LOSS_EVERY=0 "
       "EVAL_STRIDE=64 GRAD_ACCUM_STEPS=1 COMPRESSOR=fast TRAIN_LOG_EVERY=100 PHASED_TTT_PREFIX_DOCS=45 "
       "NGRAM_UPDATE_DOCS=64")
# Settings only (no run length): layered under a run preset, --preset sp1024,pqb-t. The tiny test configs use it.
SP1024_STACK = ("VOCAB_SIZE=1024 MLP_MULT=3 QK_GAIN_INIT=1.5 BIGRAM_VOCAB_SIZE=1536 VE_ENABLED=1 NUM_LOOPS=0 "
                "DOC_ISOLATION=0 MATRIX_LR=0.025 SCALAR_LR=0.025 TIED_EMBED_LR=0.035 MUON_WD=0.04 ADAM_WD=0.04 "
                "EMBED_WD=0.04 EMA_DECAY=0 LATE_QAT_THRESHOLD=0.15 WARMDOWN_ITERS=3500 INT6_SCALE_FLOOR=0.03225806451612903 "
                "MATRIX_CLIP_SIGMAS=0 MLP_CLIP_SIGMAS=0 ATTN_CLIP_SIGMAS=0 EMBED_BITS=8 EMBED_CLIP_SIGMAS=0 "
                "LQER_ENABLED=0 GPTQ_CALIBRATION_BATCHES=0 TTT_ENABLED=0 SMEAR_ENABLED=1 SMEAR_GATE_ENABLED=0 "
                "ASYM_LOGIT_RESCALE=0")
PRESETS = {
    "pqb": Preset(f"{PQB} ITERATIONS=1500 MAX_WALLCLOCK_SECONDS=0", train_shards=8,
                  about="step-capped proxy quality benchmark: 1,500 steps whatever they cost"),
    "pqb-t": Preset(f"{PQB} ITERATIONS=20000 MAX_WALLCLOCK_SECONDS=120", train_shards=8,
                    about="time-capped proxy benchmark: 120 s of training, wallclock warmdown; a slower step "
                          "gets fewer steps, as in the real run"),
    "sp1024": Preset(SP1024_STACK, stack=True,
                     about="the sp1024 stack: our defaults until 2026-11-26, chosen on the 80M-token proxy "
                     "(VOCAB_SIZE=1024: its data and tokenizer come from DATA_PATH and TOKENIZER_PATH)"),
    "timing": Preset("ITERATIONS=40 VAL_LOSS_EVERY=0 MAX_WALLCLOCK_SECONDS=0 LATE_QAT_THRESHOLD=0 "
                     "TRAIN_LOG_EVERY=10 EVAL_STRIDE=2048 COMPRESSOR=fast",
                     about="record config, 40 steps, no late QAT (its steps cost more; the reference was timed "
                           "without it too): read step_avg and peak memory"),
}
CALIBRATED_ON = "one H200 per run (nvidia-h200-x2, torch 2.11)"
RERUN_SPREAD = 0.0008  # the seed spread's floor: what rerunning one seed moved a pqb-t score (2026-11, pqb-t)
RUNNER_SETTINGS = ("RUN_ID", "SEED", "ARTIFACT_PATH")  # set per run by the runner, never by a variant
# (column, parse_log event, key) of the final metrics; score, steps, step_avg, bytes and memory come after
BPB_METRICS = (("post_ema", "post_ema_exact"), ("roundtrip", "final_int6_roundtrip_exact"),
               ("sliding", "final_int6_sliding_window_exact"), ("legal_ttt", "legal_ttt_exact"))
# wall-time phases of a run, each ending at the first (or last) line that starts with the marker
PHASES = (("startup", "model_params:", "first"), ("warmup", "warmup_step:", "last"), ("train", "train_done", "first"),
          ("score_export", "Serialized model", "first"))
# Ctrl-C: how long the runs get to reach their next step, write their checkpoints and end before they are killed
# (a step takes under a second; writing a record-size checkpoint a few seconds; torchrun gives its workers 30 s)
STOP_WAIT_S = 120.0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
KEY_RE = re.compile(r"[A-Z][A-Z0-9_]*")


class SweepError(Exception):
    """Bad input, found before any run starts; the message names what and where."""


# ---------------------------------------------------------------------------------------------------
# Plan: settings, checks, placement
# ---------------------------------------------------------------------------------------------------

def parse_assignments(text: str, where: str) -> dict[str, str]:
    out = {}
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise SweepError(f"{where}: {e}") from None
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not KEY_RE.fullmatch(key):
            raise SweepError(f"{where}: {word!r} is not a K=V setting (K in capitals, e.g. MATRIX_LR=0.03)")
        if key in RUNNER_SETTINGS:
            raise SweepError(f"{where}: {key} is set by the runner for each run (use --seeds for SEED)")
        out[key] = value
    return out


def parse_variant(arg: str) -> tuple[str, dict[str, str]]:
    name, eq, text = arg.partition("=")
    if not eq or not NAME_RE.fullmatch(name):
        raise SweepError(f"--variant {arg!r}: expected NAME=\"K=V ...\" with NAME of letters, digits, '.', '_', '-'")
    return name, parse_assignments(text, f"variant {name}")


def load_script(path: Path):
    """Import train_gpt.py (or a copy) by path; importing it has no side effects."""
    spec = importlib.util.spec_from_file_location(f"sweep_script_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def coder_setting(settings: dict[str, str]) -> str:
    """A run's COMPRESSOR: its variant's, else the sweep's environment's (the runs inherit it), else the default."""
    return settings.get("COMPRESSOR", os.environ.get("COMPRESSOR", DEFAULT_CODER))


def check_settings(tg, name: str, settings: dict[str, str], world_size: int) -> None:
    """Refuse what the script would refuse, and what it would silently ignore: a key that is neither one of
    its settings nor an environment variable of a library it uses (TORCH*, CUDA*, NCCL*, ...)."""
    fields = {f.name.upper() for f in dataclasses.fields(tg.Hyperparameters)}
    for key in settings:
        if key in fields or key.startswith(tg.FOREIGN_PREFIXES):
            continue
        if key in tg.DROPPED_SETTINGS or key.startswith(tg.DROPPED_PREFIXES):
            raise SweepError(f"variant {name}: {key} is ignored by train_gpt.py (a dropped reference setting)")
        close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.0)
        raise SweepError(f"variant {name}: unknown setting {key}; closest valid setting: {close[0]}")
    if coder_setting(settings) != DEFAULT_CODER and tg._zstd() is None:
        raise SweepError(f"variant {name}: COMPRESSOR={coder_setting(settings)} needs the zstandard package, which "
                         "this Python lacks")
    try:
        cfg, _ = tg.Hyperparameters.from_env(settings | {"RUN_ID": "check"})
        # the divisibility check (named grad_accum_steps until 2026-11-26; a --script from before 2026-11-23 has none)
        resolve = getattr(tg, "resolve_grad_accum_steps", None) or getattr(tg, "grad_accum_steps", None)
        if callable(resolve):
            resolve(cfg, world_size)
    except ValueError as e:
        raise SweepError(f"variant {name}: {e}") from None
    try:
        tg.Hyperparameters.from_env(dict(os.environ, **settings, RUN_ID="check"))
    except ValueError as e:
        raise SweepError(f"variant {name}, with the calling environment: {e}") from None


def export_settings(modules: dict, variants: dict[str, dict[str, str]]) -> None:
    """--export-only: give every export variant (all but the first) the settings a training run of it would have
    (calling environment < preset < --base < --variant), although it runs with RESUME=the first variant's
    checkpoint, from which train_gpt.py takes every setting its environment leaves unset. The environment reaches
    an export run as it reaches a training run; a key the first variant sets, which neither the environment nor
    the export variant sets, is set to its default. A variant whose model (MODEL_SETTINGS) differs from the
    first variant's is refused: it would score another model's settings on the trained weights. modules: each
    variant's script module."""
    first, *others = variants
    tg = modules[first]
    env = {name: dict(os.environ, **settings, RUN_ID="check") for name, settings in variants.items()}  # checked
    trained = tg.Hyperparameters.from_env(env[first])[0]
    fitted = None  # AUTO_SIZE: the setting that training fits to the size limit, its value unknown before
    if trained.auto_size > 0 and hasattr(tg, "fit_to_limit"):
        fitted = next((k for k in ("MLP_MULT", "BIGRAM_VOCAB_SIZE") if k not in env[first]), None)
    model = getattr(tg, "MODEL_SETTINGS", ())
    for name in others:
        settings, mine = variants[name], modules[name].Hyperparameters.from_env(env[name])[0]
        for n in model:
            key, theirs, ours = n.upper(), getattr(trained, n), getattr(mine, n, None)
            if key == fitted and key in settings:
                raise SweepError(f"variant {name}: {key}={settings[key]}, but the first variant ({first}) sets "
                                 f"AUTO_SIZE={trained.auto_size}: its training fits {key}, a model setting, which "
                                 "an export variant (--export-only) keeps: leave it unset")
            if key != fitted and ours != theirs:
                unset = "" if key in env[name] else " (unset: the default)"
                raise SweepError(f"variant {name}: {key}={ours}{unset}, but the first variant ({first}), whose "
                                 f"trained model it exports (--export-only), has {key}={theirs}: a model setting "
                                 "(train_gpt.py's MODEL_SETTINGS) must be the same in every variant (set it in "
                                 "--base)")
        defaults = {f.name.upper(): f.default for f in dataclasses.fields(modules[name].Hyperparameters)}
        settings |= {k: str(int(defaults[k]) if isinstance(defaults[k], bool) else defaults[k])
                     for k in variants[first] if k in defaults and k not in settings and k not in os.environ}


def visible_gpus() -> list[str]:
    """Device ids as CUDA_VISIBLE_DEVICES names them (CUDA stops at the first negative id), else all."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = []
        for s in (s.strip() for s in cvd.split(",")):
            if not s or s.startswith("-"):
                break
            ids.append(s)
        return ids
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass
class Run:
    variant: str
    seed: int
    slot: int
    gpus: list[str]  # empty: CPU
    run_id: str
    settings: dict[str, str]  # what the runner adds to the calling environment
    cmd: list[str]
    # filled in when it has run
    rc: int | None = None
    wall_s: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train_loss, train ms)

    @property
    def ok(self) -> bool:
        return self.error is None and "score" in self.metrics


def plan_runs(sweep: str, variants: dict[str, dict[str, str]], seeds: list[int], scripts: dict[str, Path],
              gpus_per_run: int, gpus: list[str], export_only: bool = False) -> tuple[list[Run], list[list[str]]]:
    """export_only: the first variant trains (and leaves its final checkpoint); the others export and score that
    checkpoint again (RESUME) on the same slot after it, one seed per slot: quantisers compared on one model."""
    slots = [gpus[i: i + gpus_per_run] for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)] or [[]]
    if gpus and len(gpus) < gpus_per_run:
        raise SweepError(f"--gpus-per-run {gpus_per_run} but only {len(gpus)} GPU(s) visible: {','.join(gpus)}")
    # CPU threads per process: the host's cores shared by the runs of a round, unless the caller set them. With
    # the default (every core in each process) two runs on nvidia-h200-x2 oversubscribed its 32 cores: start-up
    # took 20-35 s against 7 s alone on a 16-core host, and one run's quantisation 25 s against 0.6.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // (len(slots) * gpus_per_run)))
    launcher = [sys.executable] if gpus_per_run == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus_per_run}"]
    runs, V, G = [], len(variants), len(slots)
    for s, seed in enumerate(seeds):
        for v, (name, settings) in enumerate(variants.items()):
            # round robin over the whole sweep fills every slot; when V is a multiple of the slot count that
            # alone would keep each variant on one GPU, so each seed's block is also turned by one
            slot = s % G if export_only else (s * V + v + (s if V % G == 0 else 0)) % G
            run_id = f"{sweep}_{name}_s{seed}"
            env = dict(settings, RUN_ID=run_id, SEED=str(seed))
            if not settings.get("EVAL_ONLY", os.environ.get("EVAL_ONLY")):  # else it writes none (and warns)
                env["ARTIFACT_PATH"] = f"logs/{run_id}.int6.ptz"
            if export_only:  # CHECKPOINT_EVERY > 0: the trained state is written at the end
                env |= dict(CHECKPOINT_EVERY="1e9") if v == 0 else dict(
                    RESUME=f"logs/{sweep}_{next(iter(variants))}_s{seed}.ckpt")
            if "OMP_NUM_THREADS" not in settings and "OMP_NUM_THREADS" not in os.environ:
                env["OMP_NUM_THREADS"] = threads
            if slots[slot]:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(slots[slot])
            runs.append(Run(name, seed, slot, slots[slot], run_id, env, launcher + [str(scripts[name])]))
    return runs, slots


def shell_line(run: Run) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in run.settings.items()) + " " + shlex.join(run.cmd)


# ---------------------------------------------------------------------------------------------------
# Execution: one thread per slot, runs in turn; each run's output timestamped line by line
# ---------------------------------------------------------------------------------------------------

class Executor:
    def __init__(self, tg, cwd: Path, run_timeout: float | None, workers: int):
        self.tg, self.cwd, self.run_timeout = tg, cwd, run_timeout
        self.lock = threading.Lock()
        self.procs: dict[subprocess.Popen, Run] = {}  # the running runs
        self.stopping = False
        self.stopped: list[Run] = []  # the runs stop() interrupted
        self.slots_running = 0
        self.coder = ThreadPoolExecutor(workers)  # the coders release the GIL: one core per pending artifact
        self.recoded: dict[str, Future] = {}  # run_id -> COMPRESSOR=rans size of its artifact

    def say(self, msg: str) -> None:
        with self.lock:
            print(msg, flush=True)

    def start(self, slots: list[list[Run]]) -> None:
        """One thread per slot, its runs in turn. wait() counts their ends, not Thread.is_alive: a join that Ctrl-C
        interrupts marks its thread ended while it runs on (CPython 3.11)."""
        self.slots_running = len(slots)
        for runs in slots:
            threading.Thread(target=self._slot, args=(runs,), daemon=True).start()

    def _slot(self, runs: list[Run]) -> None:
        try:
            self.run_slot(runs)
        finally:
            with self.lock:
                self.slots_running -= 1

    def wait(self, seconds: float = float("inf")) -> bool:
        """Until every slot has ended (True) or `seconds` have passed (False)."""
        deadline = time.monotonic() + seconds
        while self.slots_running and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.slots_running

    def run_slot(self, runs: list[Run]) -> None:
        for run in runs:
            try:
                if not self.execute(run):
                    return  # stopping
            except Exception:  # noqa: BLE001  (a broken run must not take the slot's later runs with it)
                run.error, run.metrics = "runner error\n" + traceback.format_exc(), {}
            if any(run is r for r in self.stopped):
                return  # interrupted: main() says how to resume it
            self.say(finish_line(run))

    def execute(self, run: Run) -> bool:
        env = dict(os.environ, **run.settings, PYTHONUNBUFFERED="1")
        out_path = self.cwd / "logs" / f"{run.run_id}.out"
        marks: dict[str, float] = {}
        t0 = time.monotonic()
        with open(out_path, "w", encoding="utf-8") as out:
            with self.lock:  # a run either starts before stop() or not at all
                if self.stopping:
                    return False
                proc = subprocess.Popen(run.cmd, cwd=self.cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
                self.procs[proc] = run
            timer = threading.Timer(self.run_timeout, _kill, (proc,)) if self.run_timeout else None
            if timer:
                timer.start()
            for line in proc.stdout:
                out.write(line)
                t = time.monotonic() - t0
                if line.startswith("Serialized model int6+") and coder_setting(run.settings) != DEFAULT_CODER:
                    # written and closed before this line: recode it while the run scores it
                    artifact = self.cwd / run.settings["ARTIFACT_PATH"]
                    self.recoded[run.run_id] = self.coder.submit(self.default_coder_size, artifact)
                for _, marker, which in PHASES:
                    if line.startswith(marker) and (which == "last" or marker not in marks):
                        marks[marker] = t
            run.rc = proc.wait()
            if timer:
                timer.cancel()
        with self.lock:
            self.procs.pop(proc)
        run.wall_s = time.monotonic() - t0
        run.phases_s = phase_times(marks, run.wall_s)
        collect(run, self.cwd, out_path, timed_out=bool(timer) and run.wall_s >= self.run_timeout)
        return True

    def default_coder_size(self, artifact: Path) -> int:
        """The artifact's size had the run used the default coder (COMPRESSOR=rans), as a record would."""
        return len(self.tg.compress(self.tg.decompress(artifact.read_bytes()), DEFAULT_CODER)[0])

    def add_auto_sizes(self, runs: list[Run]) -> None:
        for run in runs:
            if run.ok and run.run_id in self.recoded and "code_bytes" in run.metrics:
                try:
                    run.metrics["bytes_auto"] = float(self.recoded[run.run_id].result() + run.metrics["code_bytes"])
                except Exception as e:  # noqa: BLE001  (the column stays empty for this run)
                    print(f"sweep: warning: COMPRESSOR=rans coding of {run.run_id}'s artifact failed: {e!r}",
                          file=sys.stderr)

    def stop(self) -> None:
        """SIGINT to every running run (to torchrun, which passes it to its workers): train_gpt.py writes its
        checkpoint at the next step and ends. No run starts after this."""
        with self.lock:
            self.stopping = True
            for proc, run in self.procs.items():
                self.stopped.append(run)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
        self.coder.shutdown(wait=False, cancel_futures=True)

    def kill(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.procs:
                _kill(proc)


def stop_runs(ex: Executor) -> None:
    """Ctrl-C: SIGINT to the running runs, then wait up to STOP_WAIT_S for them to checkpoint and end (a second
    Ctrl-C stops the wait); whatever still runs then is killed."""
    try:
        ex.stop()
        print(f"sweep: interrupted: SIGINT to {len(ex.stopped)} running run(s), which write a checkpoint at their "
              f"next step; waiting up to {STOP_WAIT_S:.0f} s for them (Ctrl-C again kills them)", file=sys.stderr,
              flush=True)
        ex.wait(STOP_WAIT_S)
    except KeyboardInterrupt:
        pass
    ex.kill()
    with contextlib.suppress(KeyboardInterrupt):
        ex.wait(5)  # the slots close their runs' .out files and end


def stopped_line(run: Run, cwd: Path) -> str:
    """An interrupted run's own last word on it (train_gpt.py says what it left), and the command that resumes it."""
    out = cwd / "logs" / f"{run.run_id}.out"
    lines = [ln.strip() for ln in out.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    said = next((ln for ln in reversed(lines) if "interrupted by" in ln), lines[-1] if lines else "(no output)")
    where = f"gpu:{','.join(run.gpus)}" if run.gpus else "cpu"
    line = f"sweep: run {run.variant} seed:{run.seed} {where} stopped: {said}"
    ckpt = Path("logs") / f"{run.run_id}.ckpt"
    if (cwd / ckpt).is_file() and not (cwd / run.settings.get("ARTIFACT_PATH", "")).exists():
        line += f"\n  resume it: RESUME={ckpt} {shell_line(run)}"
    return line


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group and every process under it: torchrun starts each worker in a session of
    its own, so its group alone would leave the workers running (and holding their GPUs and our pipe)."""
    below = _descendants(proc.pid)
    for pid, kill in [(proc.pid, os.killpg)] + [(pid, os.kill) for pid in below]:
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The processes under pid, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...", where comm may hold spaces and parentheses
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def phase_times(marks: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds per phase: start-up (imports, data, model), warmup (compile, graph capture, warmup steps),
    train, score_export (pre/post-EMA scoring, quantisation, compression), final_scoring (the read-back
    artifact's scores, TTT). A phase whose marker never came is left out and its time goes to the next."""
    out, prev = {}, 0.0
    for name, marker, _ in PHASES:
        if marker in marks:
            out[name], prev = marks[marker] - prev, marks[marker]
    out["final_scoring"] = wall_s - prev
    return out


def collect(run: Run, cwd: Path, out_path: Path, timed_out: bool) -> None:
    """Final metrics from the script's own log. A run counts when it exited 0 with its last score logged, or
    exited 1 only because its artifact is over the size limit (the table's bytes columns show by how much)."""
    log_path = cwd / "logs" / f"{run.run_id}.txt"
    log = pr.parse_log(log_path) if log_path.is_file() and not timed_out else None
    why = None
    if timed_out:
        why = "timed out"
    elif log is None or log.score_event is None:
        why = f"exit status {run.rc}, no final score line"
    elif log.settings.get("ttt_enabled") == "True" and log.score_event != "legal_ttt_exact":
        why = f"exit status {run.rc}, TTT_ENABLED but no legal_ttt line"
    elif run.rc != 0 and not (run.rc == 1 and "ERROR submission_over_limit" in log_path.read_text(encoding="utf-8")):
        why = f"exit status {run.rc} after its last score"
    if why:
        tail = out_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        run.error = why + "\n" + "\n".join("    " + line for line in tail)
        return
    m = {"score": log.val_bpb}
    for column, event in BPB_METRICS:
        if event in log.events:
            m[column] = float(log.events[event]["val_bpb"])
    if "train_done" in log.events:  # not with EVAL_ONLY (e.g. TTT settings swept on one saved artifact)
        m["steps"] = float(log.steps)
        m["step_avg_ms"] = float(log.events["train_done"]["step_avg"].removesuffix("ms"))
    if log.total_bytes is not None:
        m["bytes"], m["code_bytes"] = float(log.total_bytes), float(log.code_bytes)
        if log.compressor == DEFAULT_CODER:  # the artifact's own coder (an EVAL_ONLY run's is its artifact's)
            m["bytes_auto"] = m["bytes"]
    if log.peak_mib is not None:
        m["peak_alloc_mib"], m["peak_reserved_mib"] = map(float, log.peak_mib)
    run.metrics = m
    run.curve = log.curve


def finish_line(run: Run) -> str:
    where = f"gpu:{','.join(run.gpus)}" if run.gpus else "cpu"
    head = f"run {run.variant} seed:{run.seed} {where}"
    if not run.ok:
        return f"{head} FAILED ({run.error})"
    if run.rc == 1:
        head += " OVER_LIMIT"
    m = run.metrics
    phases = " ".join(f"{k}:{v:.0f}s" for k, v in run.phases_s.items())
    steps = f" steps:{m['steps']:.0f} step_avg:{m['step_avg_ms']:.2f}ms" if "steps" in m else ""
    return f"{head} score:{m['score']:.5f}{steps} wall:{run.wall_s:.0f}s ({phases})"


# ---------------------------------------------------------------------------------------------------
# Table: mean and std over seeds per variant, difference and Welch p against the first variant
# ---------------------------------------------------------------------------------------------------

COLUMNS = (("score", 5), *((c, 5) for c, _ in BPB_METRICS), ("steps", 1), ("step_avg_ms", 2), ("bytes", 0),
           ("bytes_auto", 0), ("peak_alloc_mib", 0), ("wall_s", 0))


def summarize(runs: list[Run], variants: list[str]) -> list[dict]:
    rows = []
    for name in variants:
        mine = [r for r in runs if r.variant == name]
        ok = [r for r in mine if r.ok]
        row = {"variant": name, "runs": len(mine), "ok": len(ok), "seeds": [r.seed for r in ok]}
        for col, _ in COLUMNS:
            vals = [r.wall_s if col == "wall_s" else r.metrics[col] for r in ok if col == "wall_s" or col in r.metrics]
            if vals:
                row[col] = {"mean": pr.mean(vals), "std": pr.sample_std(vals) if len(vals) > 1 else None,
                            "spread": max(vals) - min(vals) if len(vals) > 1 else None, "values": vals}
        rows.append(row)
    first = rows[0].get("score")
    for row in rows:
        score = row.get("score")
        row["diff"] = score["mean"] - first["mean"] if score and first else None
        row["p"] = None
        if row is not rows[0] and score and first and len(score["values"]) > 1 and len(first["values"]) > 1:
            row["p"] = pr.welch_margin_test(score["values"], first["values"], margin=0.0).p_value
    return rows


def render_table(rows: list[dict]) -> str:
    cols = [(c, d) for c, d in COLUMNS if any(c in r for r in rows)]
    head = ["variant", "runs", "score", "diff", "p"] + [c for c, _ in cols if c != "score"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], f"{r['ok']}/{r['runs']}", _cell(r.get("score"), 5),
                 "" if r["diff"] is None else f"{r['diff']:+.5f}", "" if r["p"] is None else f"{r['p']:.3g}"]
        cells += [_cell(r.get(c), d) for c, d in cols if c != "score"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _cell(stat: dict | None, digits: int) -> str:
    if stat is None:
        return "-"
    s = f"{stat['mean']:.{digits}f}"
    return s if stat["std"] is None else f"{s} ± {stat['std']:.{digits}f}"


# ---------------------------------------------------------------------------------------------------
# Plots (matplotlib: an optional extra of this tool only)
# ---------------------------------------------------------------------------------------------------

def plot(runs: list[Run], rows: list[dict], logs: Path, sweep: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        curves = [r.curve for r in runs if r.variant == row["variant"] and r.ok and r.curve]
        if not curves:
            continue
        steps = sorted(set.intersection(*({p[0] for p in c} for c in curves)))  # logged in every seed
        by_step = [{p[0]: p for p in c} for c in curves]
        loss = [pr.mean([c[s][1] for c in by_step]) for s in steps]
        secs = [pr.mean([c[s][2] for c in by_step]) / 1000 for s in steps]
        label = f"{row['variant']} ({len(curves)} seeds)"
        ax_step.plot(steps, loss, label=label)
        ax_time.plot(secs, loss, label=label)
    for ax, xlabel in ((ax_step, "step"), (ax_time, "train time (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("train loss (mean over seeds)")
        ax.set_yscale("log")
        ax.legend()
    curves_png = logs / f"{sweep}_curves.png"
    fig.tight_layout()
    fig.savefig(curves_png, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows)), 4.5))
    scored = [r for r in rows if r.get("score")]
    ax.bar([r["variant"] for r in scored], [r["score"]["mean"] for r in scored],
           yerr=[r["score"]["std"] or 0.0 for r in scored], capsize=6)
    lo = min(r["score"]["mean"] - 3 * (r["score"]["std"] or 0.0) for r in scored) if scored else 0.0
    hi = max(r["score"]["mean"] + 3 * (r["score"]["std"] or 0.0) for r in scored) if scored else 1.0
    ax.set_ylim(lo - 0.1 * (hi - lo + 1e-3), hi + 0.1 * (hi - lo + 1e-3))
    ax.set_ylabel("score val_bpb (mean ± std over seeds)")
    scores_png = logs / f"{sweep}_scores.png"
    fig.tight_layout()
    fig.savefig(scores_png, dpi=120)
    plt.close(fig)
    return [curves_png, scores_png]


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="presets: " + "; ".join(
        f"{k}: {p.settings}" for k, p in PRESETS.items()))
    ap.add_argument("--preset", default="", help="one of " + ", ".join(sorted(PRESETS)) + ", or several joined by "
                    "commas in any order: settings presets (" + ", ".join(n for n, p in PRESETS.items() if p.stack)
                    + ") go under the run preset (at most one): sp1024,pqb-t")
    ap.add_argument("--base", default="", help='settings for every variant, "K=V ..." (over the preset)')
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="K=V ..."',
                    help='repeatable; NAME="" is the defaults; the first variant is the one the others are judged against')
    ap.add_argument("--seeds", default="1337,42", help="comma-separated (default 1337,42)")
    ap.add_argument("--gpus-per-run", type=int, default=1, help="torchrun with N processes per run (default 1)")
    ap.add_argument("--script", type=Path, default=ROOT / "train_gpt.py",
                    help="the train_gpt.py to run (a variant's SCRIPT=path overrides it: before/after A/Bs)")
    ap.add_argument("--name", help="sweep name, the prefix of every RUN_ID (default sweep_<UTC time>)")
    ap.add_argument("--run-timeout", type=float, help="seconds; a run still going then is killed and reported failed")
    ap.add_argument("--dry-run", action="store_true", help="print each run's command and GPU, run nothing")
    ap.add_argument("--plot", action="store_true", help="also write PNGs of the loss curves and scores (matplotlib)")
    ap.add_argument("--export-only", action="store_true",
                    help="the first variant trains; the others only export and score its final checkpoint (paired "
                         "comparisons of export settings: quantisers, coders), after it on the same GPU")
    return ap.parse_args(argv)


def build(args: argparse.Namespace):
    """(the first variant's script module, sweep name, variants' settings, seeds, runs, GPU slots), or SweepError."""
    names = [n for n in args.preset.split(",") if n]
    if unknown := [n for n in names if n not in PRESETS]:
        raise SweepError(f"--preset {unknown[0]!r}: not one of {', '.join(sorted(PRESETS))}")
    if len(runs := [n for n in names if not PRESETS[n].stack]) > 1:
        raise SweepError(f"--preset {args.preset}: {' and '.join(runs)} are both run presets: pick one")
    names.sort(key=lambda n: not PRESETS[n].stack)  # stable: settings presets first, so the order named is irrelevant
    common: dict[str, str] = {}
    for n in names:
        common |= parse_assignments(PRESETS[n].settings, f"preset {n}")
    common |= parse_assignments(args.base, "--base")
    train_shards = next((PRESETS[n].train_shards for n in names if PRESETS[n].train_shards), None)
    variants: dict[str, dict[str, str]] = {}
    for arg in args.variant or ['base=']:
        name, settings = parse_variant(arg)
        if name in variants:
            raise SweepError(f"variant {name} is given twice")
        variants[name] = common | settings
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"--seeds {args.seeds!r}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {args.seeds!r}: need at least one seed, none repeated")
    if args.gpus_per_run < 1:
        raise SweepError("--gpus-per-run must be >= 1")
    if args.export_only and (len(variants) < 2 or any({"RESUME", "CHECKPOINT_EVERY"} & set(v) for v in variants.values())):
        raise SweepError("--export-only needs a trained first variant and others to export again, none of them "
                         "setting RESUME or CHECKPOINT_EVERY (the runner sets those)")
    sweep = args.name or datetime.now(timezone.utc).strftime("sweep_%Y%m%d_%H%M%S")
    if not NAME_RE.fullmatch(sweep):
        raise SweepError(f"--name {sweep!r}: letters, digits, '.', '_', '-' only")
    scripts, modules = {}, {}  # variant -> its train_gpt.py (SCRIPT=path, else --script); path -> module
    for name, settings in variants.items():
        scripts[name] = Path(settings.pop("SCRIPT", args.script)).resolve()
        if not scripts[name].is_file():
            raise SweepError(f"variant {name}: script {scripts[name]} does not exist")
        if scripts[name] not in modules:
            modules[scripts[name]] = load_script(scripts[name])
        check_settings(modules[scripts[name]], name, settings, args.gpus_per_run)
    tg = modules[scripts[next(iter(variants))]]
    if args.export_only:
        export_settings({name: modules[scripts[name]] for name in variants}, variants)
    runs, slots = plan_runs(sweep, variants, seeds, scripts, args.gpus_per_run, visible_gpus(), args.export_only)
    if train_shards and not args.dry_run:
        for name, settings in variants.items():
            data = settings.get("DATA_PATH", os.environ.get("DATA_PATH", tg.Hyperparameters.data_path))
            n = len(list(Path(data).glob("fineweb_train_*.bin")))
            if n != train_shards:
                raise SweepError(f"variant {name}: preset {args.preset} needs {train_shards} train shards in "
                                 f"DATA_PATH={data}, found {n}")
    return tg, sweep, variants, seeds, runs, slots


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tg, sweep, variants, seeds, runs, slots = build(args)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise SweepError("--plot needs matplotlib, an optional extra of this tool: pip install matplotlib")
        logs = Path.cwd() / "logs"
        # train_gpt.py gives a RUN_ID whose log, checkpoint or artifact exists a suffix; the sweep reads the names it set
        taken = [f"{r.run_id}{ext}" for r in runs for ext in (".txt", ".ckpt", ".int6.ptz")
                 if (logs / f"{r.run_id}{ext}").exists()]
        if taken and not args.dry_run:
            raise SweepError(f"logs/{taken[0]} exists already: pick another --name")
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    where = ", ".join("gpu " + ",".join(s) for s in slots) if slots[0] else "cpu (no visible GPU)"
    print(f"sweep {sweep}: {len(variants)} variant(s) x {len(seeds)} seed(s) = {len(runs)} runs on {where}"
          + (f"; preset {args.preset} ({'; '.join(PRESETS[n].about for n in args.preset.split(',') if n)}; "
             f"calibrated on {CALIBRATED_ON})" if args.preset else ""), flush=True)
    if args.dry_run:
        for r in runs:
            print(f"# {r.variant} seed {r.seed}: " + (f"gpu {','.join(r.gpus)}" if r.gpus else "cpu"))
            print(shell_line(r))
        return 0
    logs.mkdir(exist_ok=True)
    ex = Executor(tg, Path.cwd(), args.run_timeout, len(slots))
    t0 = time.monotonic()
    # as Ctrl-C: the runs, in sessions of their own, get none of these; SIGINT too: a sweep started in the background
    # (`cmd &`, nohup) has it ignored, which its runs would inherit, and then SIGINT would stop none of them
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        ex.start([[r for r in runs if r.slot == i] for i in range(len(slots))])
        ex.wait()
        ex.add_auto_sizes(runs)
    except KeyboardInterrupt:
        stop_runs(ex)
        for run in ex.stopped:
            print(stopped_line(run, Path.cwd()), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # not sys.exit: that would wait for a coding job already under way (up to 40 s)
    rows = summarize(runs, list(variants))
    table = render_table(rows)
    first = next(iter(variants))
    print(f"\nsweep {sweep}: {time.monotonic() - t0:.0f} s\n")
    print(table)
    print(f"\nscore: legal_ttt_exact val_bpb when TTT ran, else final_int6_sliding_window_exact; ± is the std over "
          f"seeds (n-1); diff and p (one-sided Welch t-test that the score is lower) against {first}.")
    for row in rows:  # the project's rule: max - min, at least RERUN_SPREAD; a difference beyond twice it counts
        if row.get("score") and row["score"]["spread"] is not None:
            print(f"seed spread {row['variant']}: {row['score']['spread']:.5f} (max - min; the rule takes at least "
                  f"{RERUN_SPREAD}: a default changes on a difference beyond "
                  f"{2 * max(row['score']['spread'], RERUN_SPREAD):.5f})")
    result = dict(sweep=sweep, preset=args.preset, calibrated_on=CALIBRATED_ON if args.preset else None,
                  scripts={r.variant: r.cmd[-1] for r in runs}, base=args.base, variants=variants, seeds=seeds, table=rows,
                  runs=[{k: v for k, v in asdict(r).items() if k != "cmd"} | {"cmd": shlex.join(r.cmd)}
                        for r in runs])
    (logs / f"{sweep}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote logs/{sweep}.json")
    if args.plot:
        for png in plot(runs, rows, logs, sweep):
            print(f"wrote {png.relative_to(Path.cwd())}")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
