"""Package training logs into a Parameter Golf record folder, refusing runs that break the rules.

Usage (from the repository root):
    python3 records/package_record.py --name NAME --author "A" --github-id GH --blurb "..." \
        [--date YYYY-MM-DD] [--track track_10min_16mb] [--root records] [--force] [--allow-partial-val] \
        [--prev-record-logs F1 F2 ... | --prev-record-losses 1.9 1.91 ...] -- LOG [LOG ...]
(the `--` ends a --prev-record-* list; without one, put the LOGs before those options.)

Reads logs/<RUN_ID>.txt files written by train_gpt.py (the source between `==== source: train_gpt.py ====`
and `==== end source ====`, then `event key:value ...` lines) and writes <root>/<track>/<date>_<name>/ with
train_gpt.py (the shipped stub: the embedded source compressed by the source's own `shipped_code`, whose size
the run logged as code_bytes), train_gpt_readable.py (the embedded source), train_seed<seed>.log copies,
README.md and submission.json.
A run's score is its `legal_ttt_exact` line if present, else its `final_int6_sliding_window_exact` line.

Refused (exit 1, each problem named with its log): a log holding more than one run, a run on the offline
sample (its `sample_data:` line), a run scored on fewer than the 50,000 validation documents of the challenge
(the full FineWeb val set; the `val_docs:` count on the `val_tokens:` line, a log without one is refused too),
an EVAL_ONLY run (it trained nothing), a run that logged an `error` line after it trained or scored, different
embedded code, a setting that differs between the logs (all must come from one command: only seed, run_id,
artifact_path and resume, which name the run and its own files, may differ), Total submission size over
16,000,000 bytes, no final score line, train_done train_time over 600,000 ms, a repeated seed, and an
existing output folder without --force.
--allow-partial-val packages runs scored on fewer validation documents (or an unknown number) for checks: the
record is then marked not a submission (`"not_a_submission": "<why>"` in submission.json and a
`**NOT A SUBMISSION**` line at the top of README.md). So is a record trained on other machines than 8 H100s (the
`device name:` and `world_size:` lines; submission.json's "hardware" says which).
A file that is not a train_gpt.py log (missing, unreadable, not UTF-8 text, without the source block its logs start
with, or with a line the packager reads that lacks its numbers) stops the tool with one stderr line naming it.
Skipped (one stderr line each, no refusal, so `logs/*.txt` works): a log of a run that failed at the start,
i.e. an `error <Type>: <msg>` line but no `step:` line and no score or train_done line.
With previous-record values (numbers, or logs whose final val_loss is read), a one-sided Welch t-test asks
whether our mean val_loss is at least 0.005 nats below theirs (the challenge's record rule: p < 0.01); the
Student-t tail is computed here, no scipy.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path

MAX_TOTAL_BYTES = 16_000_000  # decimal MB cap on code + compressed model
MAX_TRAIN_MS = 600_000.0  # 10 minutes of training on 8xH100: the loop, its checkpoints, GPTQ's calibration
MAX_EVAL_MS = 600_000.0  # 10 minutes of evaluation: the final score's pass, as the records count it
RECORD_MARGIN_NATS = 0.005  # a new record must beat the previous mean val_loss by this much ...
RECORD_P_VALUE = 0.01  # ... at this one-sided significance level
SOURCE_START, SOURCE_END = "==== source: train_gpt.py ====", "==== end source ===="
SCORE_EVENTS = ("legal_ttt_exact", "final_int6_sliding_window_exact")  # first present wins
FULL_VAL_DOCS = 50_000  # documents (BOS tokens) of the challenge's validation set, the full FineWeb val split
# Settings that may differ between a record's logs: the seed, and what names the run and its own files (the log
# and artifact paths follow RUN_ID; RESUME is each run's own checkpoint, whose settings the resumed run logs).
PER_RUN_SETTINGS = ("seed", "run_id", "artifact_path", "resume")


# ---------------------------------------------------------------------------------------------------
# Statistics: mean, sample std, Student-t upper tail, one-sided Welch test
# ---------------------------------------------------------------------------------------------------

def mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def sample_std(xs: list[float]) -> float:
    """Std with Bessel's correction (n - 1); needs at least two values."""
    if len(xs) < 2:
        raise ValueError("sample std needs at least 2 values")
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _beta_cf(a: float, b: float, x: float, eps: float = 1e-15, max_iter: int = 100_000) -> float:
    """Continued fraction of I_x(a, b) by the modified Lentz method (Numerical Recipes, 3rd ed., 6.4)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        # Even step d_2m, then odd step d_2m+1 of the fraction.
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(a: float, b: float, x: float, one_minus_x: float | None = None) -> float:
    """I_x(a, b). Pass one_minus_x when 1 - x would lose digits to cancellation."""
    y = 1.0 - x if one_minus_x is None else one_minus_x
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)
    # The fraction converges fast for x < (a+1)/(a+b+2); otherwise use I_x(a,b) = 1 - I_{1-x}(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, y) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T_df >= t) for any real df > 0: P(|T| >= |t|) = I_{df/(df+t^2)}(df/2, 1/2)."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if df > 1e7:  # normal limit; the t tail differs by O(1/df), below 1e-7 here
        return 0.5 * math.erfc(t / math.sqrt(2.0))
    both_tails = regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t), t * t / (df + t * t))
    return 0.5 * both_tails if t >= 0 else 1.0 - 0.5 * both_tails


@dataclass(frozen=True)
class WelchResult:
    t: float
    df: float
    p_value: float  # P(T_df >= t): small means "ours is lower by more than the margin"


def welch_margin_test(ours: list[float], prev: list[float], margin: float = RECORD_MARGIN_NATS) -> WelchResult:
    """One-sided Welch test of mean(prev) - mean(ours) > margin (Welch-Satterthwaite df)."""
    if len(ours) < 2 or len(prev) < 2:
        raise ValueError("Welch test needs at least 2 values on each side")
    v_ours, v_prev = sample_std(ours) ** 2 / len(ours), sample_std(prev) ** 2 / len(prev)
    diff = mean(prev) - mean(ours) - margin
    if v_ours + v_prev == 0.0:  # no spread at all: the comparison is deterministic
        return WelchResult(math.copysign(math.inf, diff) if diff else 0.0, math.inf,
                           0.0 if diff > 0 else (0.5 if diff == 0 else 1.0))
    t = diff / math.sqrt(v_ours + v_prev)
    df = (v_ours + v_prev) ** 2 / (v_ours ** 2 / (len(ours) - 1) + v_prev ** 2 / (len(prev) - 1))
    return WelchResult(t, df, student_t_sf(t, df))


# ---------------------------------------------------------------------------------------------------
# Log parsing
# ---------------------------------------------------------------------------------------------------

class Refusal(Exception):
    """A log (or the set of logs) does not qualify as a record; the message says which and why."""


class NotALog(Exception):
    """A file given as a log is none: the message names it and says why (one line)."""


@dataclass
class RunLog:
    path: Path
    source: bytes | None = None  # embedded train_gpt.py, None when the log carries no source block
    shipped: bytes | None = None  # the stub a record ships, built by the source's own shipped_code
    settings: dict[str, str] = field(default_factory=dict)
    events: dict[str, dict[str, str]] = field(default_factory=dict)  # last line of each event, key:value
    total_bytes: int | None = None
    model_bytes: int | None = None
    code_bytes: int | None = None
    compressor: str | None = None
    stopped_early: bool = False
    peak_mib: tuple[int, int] | None = None  # (allocated, reserved), CUDA runs only
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train_loss, train_time ms)
    runs: int = 0  # source blocks: one per run that wrote to this log
    sample_data: bool = False  # trained or scored on the offline sample (train_gpt.py's `sample_data:` line)
    val_docs: int | None = None  # validation documents scored (`val_docs:` of the `val_tokens:` line)
    error: str | None = None  # `<Type>: <msg>` of the first `error ` line (the run ended with an exception)
    stepped: bool = False  # a `step:N/M ...` line: training steps ran (or were validated)
    checkpoint_ms: float = 0.0  # the checkpoints' writes before train_done: the loop's clock pauses for them
    other_code: str | None = None  # a `warning` that the run resumed a checkpoint another train_gpt.py wrote
    device: str | None = None  # the `device name:` line's GPU (or cpu)
    world_size: int | None = None

    @property
    def failed_at_start(self) -> bool:
        """The run ended with an error before any training step and before any score."""
        return self.runs == 1 and self.error is not None and not self.stepped and not self.events

    @property
    def score_event(self) -> str | None:
        return next((e for e in SCORE_EVENTS if e in self.events), None)

    @property
    def val_loss(self) -> float:
        return float(self.events[self.score_event]["val_loss"])

    @property
    def val_bpb(self) -> float:
        return float(self.events[self.score_event]["val_bpb"])

    @property
    def seed(self) -> int:
        return int(self.settings["seed"])

    @property
    def steps(self) -> int:
        return int(self.events["train_done"]["steps"])

    @property
    def train_ms(self) -> float:
        return _ms(self.events["train_done"]["train_time"])

    @property
    def train_side_ms(self) -> float:
        """train_time and the rest of the training side: the loop's checkpoints (its clock pauses for them; the final
        one comes after train_done and the Hessians, outside) and GPTQ's calibration on train data."""
        return self.train_ms + self.checkpoint_ms + _ms(self.events.get("gptq_calibration", {}).get("time", "0"))

    @property
    def eval_ms(self) -> float:
        """The final score's pass (the summary line's eval_time, the records' count); in logs without a summary
        line, the sum of the logged scoring times (roundtrip, sliding window, TTT)."""
        if "eval_time" in self.events.get("summary", {}):
            return 1000 * float(self.events["summary"]["eval_time"].removesuffix("s"))
        return sum(_ms(self.events[e]["eval_time"]) for e in ("final_int6_roundtrip", "final_int6_sliding_window",
                                                              "legal_ttt") if "eval_time" in self.events.get(e, {}))


def _ms(value: str) -> float:
    return float(value.removesuffix("ms"))


def _key_values(line: str) -> dict[str, str]:
    return dict(tok.split(":", 1) for tok in line.split() if ":" in tok)


def _extract_source(lines: list[str]) -> tuple[bytes | None, int]:
    """(source, index of the first line after the block); the block is taken verbatim between markers."""
    if SOURCE_START not in lines:
        return None, 0
    start = lines.index(SOURCE_START) + 1
    try:
        end = lines.index(SOURCE_END, start)
    except ValueError:
        raise Refusal(f"`{SOURCE_START}` without a matching `{SOURCE_END}` line") from None
    return "".join(line + "\n" for line in lines[start:end]).encode("utf-8"), end + 1


# The event lines kept, the keys each must have, and the keys read as numbers (ms or not): a line without them is
# none that train_gpt.py wrote (README.md's table of log lines has `train_done steps:S train_time:Tms`)
EVENTS = ("train_done", "post_ema_exact", "final_int6_roundtrip", "final_int6_roundtrip_exact",
          "final_int6_sliding_window", "legal_ttt", "gptq_calibration", "summary", *SCORE_EVENTS)
REQUIRED = {"train_done": ("steps", "train_time"), **dict.fromkeys(SCORE_EVENTS, ("val_loss", "val_bpb"))}
NUMBER_KEYS = ("steps", "train_time", "step_avg", "eval_time", "val_loss", "val_bpb", "time")
CURVE_RE = re.compile(r"step:(\d+)/\d+ train_loss:(\S+) train_time:(\S+)ms .*")


def _is_number(value: str) -> bool:
    try:
        float(value.removesuffix("ms").removesuffix("s"))
    except ValueError:
        return False
    return True


def _unreadable(line: str, event: str, values: dict[str, str]) -> str | None:
    """The first value of the line that this tool would read as a number and cannot (None: all can be)."""
    if missing := [k for k in REQUIRED.get(event, ()) if k not in values]:
        return missing[0]
    if bad := [k for k in NUMBER_KEYS if k in values and not _is_number(values[k])]:
        return bad[0]
    if (m := re.fullmatch(r"setting seed:(.*)", line)) and not re.fullmatch(r"-?\d+", m[1]):
        return "seed"
    if (m := CURVE_RE.fullmatch(line)) and not (_is_number(m[2]) and _is_number(m[3])):
        return "train_loss or train_time"
    return None


def parse_log(path: Path) -> RunLog:
    """The run a log records (a train_gpt.py log, or for --prev-record-logs any script's); NotALog if it is none."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise NotALog(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise NotALog(f"{path}: not a log: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") \
            from None
    lines = text.split("\n")
    run = RunLog(path)
    run.source, first = _extract_source(lines)
    run.runs = lines.count(SOURCE_START)
    for n, line in enumerate(lines[first:], first + 1):  # never read key:value lines out of the embedded source
        event = line.split(" ", 1)[0]
        run.stepped |= re.match(r"step:\d+/\d+ ", line) is not None
        values = _key_values(line) if event in EVENTS else {}
        if bad := _unreadable(line, event, values):
            raise NotALog(f"{path}: line {n} is not as train_gpt.py writes it (no number for {bad}): {line[:80]!r}")
        if m := re.fullmatch(r"setting (\w+):(.*)", line):
            run.settings[m[1]] = m[2]
        elif m := re.fullmatch(r"Total submission size int6\+(\w+): (\d+) bytes( .*)?", line):
            run.compressor, run.total_bytes = m[1], int(m[2])
        elif m := re.fullmatch(r"Serialized model int6\+\w+: (\d+) bytes.*", line):
            run.model_bytes = int(m[1])
        elif m := re.fullmatch(r"code_bytes:(\d+)", line):
            run.code_bytes = int(m[1])
        elif event == "stopping_early:":
            run.stopped_early = True
        elif event == "checkpoint" and "train_done" not in run.events and _is_number(t := _key_values(line).get(
                "time", "")):
            run.checkpoint_ms += _ms(t)
        elif event == "warning" and "was written by another train_gpt.py" in line:
            run.other_code = line.removeprefix("warning ")
        elif m := re.fullmatch(r"device name:(\S+).*", line):
            run.device = m[1]
        elif m := re.fullmatch(r"world_size:(\d+)", line):
            run.world_size = int(m[1])
        elif event == "sample_data:":
            run.sample_data = True
        elif event.startswith("val_tokens:"):
            docs = _key_values(line).get("val_docs")
            run.val_docs = int(docs) if docs is not None and docs.isdigit() else None
        elif event == "error" and run.error is None:
            run.error = line.removeprefix("error ")
        elif m := re.fullmatch(r"peak memory allocated: (\d+) MiB reserved: (\d+) MiB", line):
            run.peak_mib = (int(m[1]), int(m[2]))
        elif m := CURVE_RE.fullmatch(line):
            run.curve.append((int(m[1]), float(m[2]), float(m[3])))
        elif event in EVENTS:
            run.events[event] = values
    if run.source is not None:  # a newline of the log's own may follow the source: the logged code_bytes decides
        for source in (run.source[:-1], run.source):
            run.source, run.shipped = source, shipped_code(source)
            if run.shipped is None or len(run.shipped) == run.code_bytes:
                break
    return run


def shipped_code(source: bytes) -> bytes | None:
    """The shipped train_gpt.py, made by the shipped_code function of the source itself (taken out with ast and
    run alone, so this tool never imports the script); None if the source has no such function."""
    try:
        fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "shipped_code")
    except (StopIteration, SyntaxError, ValueError):
        return None
    namespace: dict = {}
    exec(compile(ast.Module([fn], type_ignores=[]), "<shipped_code>", "exec"), namespace)
    return namespace["shipped_code"](source.decode("utf-8"))


def problems_of(run: RunLog, allow_partial_val: bool = False) -> list[str]:
    """Reasons this single log cannot be part of a record (empty when it qualifies). With allow_partial_val, a run
    scored on fewer than FULL_VAL_DOCS validation documents (or an unknown number) qualifies, for checks only."""
    out = []
    if run.runs > 1:
        out.append(f"the log holds {run.runs} runs (a reused RUN_ID before train_gpt.py gave each run its own log)")
    if run.error is not None:
        out.append(f"the run failed: `error {run.error}`")
    if run.sample_data:
        out.append("trained or scored on the offline sample (data/make_sample.py), not FineWeb")
    if run.other_code is not None:
        out.append(f"resumed under other code ({run.other_code}): the record would ship code that did not train "
                   "all of its model")
    if run.settings.get("eval_only"):
        out.append(f"an EVAL_ONLY run (it scored the artifact {run.settings['eval_only']}, it trained nothing)")
    if allow_partial_val:  # the record is marked not a submission instead (build_submission)
        pass
    elif run.val_docs is None:
        out.append(f"no `val_docs:` count on a `val_tokens:` line (a log of an older train_gpt.py), so nothing shows "
                   f"that all {FULL_VAL_DOCS:,} validation documents were scored (--allow-partial-val packages it, "
                   f"marked not a submission)")
    elif run.val_docs < FULL_VAL_DOCS:
        out.append(f"scored on {run.val_docs:,} validation documents, fewer than the challenge's {FULL_VAL_DOCS:,} "
                   f"(the full FineWeb val set) (--allow-partial-val packages it, marked not a submission)")
    if run.code_bytes is None:
        out.append("no `code_bytes:N` line")
    elif run.shipped is None:
        out.append("the embedded source has no shipped_code function (the size of the code a record ships): a log of "
                   "the shipped stub, which leaves it out? Package runs of the readable train_gpt.py")
    elif len(run.shipped) != run.code_bytes:
        out.append(f"the shipped train_gpt.py rebuilt from the embedded source is {len(run.shipped)} bytes but "
                   f"code_bytes says {run.code_bytes}")
    if "seed" not in run.settings:
        out.append("no `setting seed:N` line")
    if run.total_bytes is None:
        out.append("no `Total submission size int6+<comp>: N bytes` line")
    elif run.total_bytes > MAX_TOTAL_BYTES:
        out.append(f"Total submission size {run.total_bytes:,} bytes is over the {MAX_TOTAL_BYTES:,} limit")
    if "train_done" not in run.events:
        out.append("no `train_done` line (did training finish?)")
    elif run.train_side_ms > MAX_TRAIN_MS:
        out.append(f"train_time {run.train_ms:,.0f} ms (with the loop's checkpoints and GPTQ's calibration on train "
                   f"data {run.train_side_ms:,.0f} ms) is over the {MAX_TRAIN_MS:,.0f} ms limit")
    if run.eval_ms > MAX_EVAL_MS:
        out.append(f"eval_time {run.eval_ms:,.0f} ms is over the {MAX_EVAL_MS:,.0f} ms limit")
    if run.score_event is None:
        out.append(f"no final score line ({' or '.join(SCORE_EVENTS)})")
    elif run.settings.get("ttt_enabled", "").lower() in ("1", "true") and run.score_event != "legal_ttt_exact":
        out.append("ttt_enabled is on but there is no legal_ttt_exact line (did TTT finish?)")
    return out


def differing_settings(runs: list[RunLog]) -> list[str]:
    """One line per setting, other than PER_RUN_SETTINGS, whose value is not the same in all the logs."""
    out = []
    for key in sorted(set().union(*(r.settings for r in runs)) - set(PER_RUN_SETTINGS)):
        by_value: dict[str | None, list[str]] = {}
        for run in runs:
            by_value.setdefault(run.settings.get(key), []).append(str(run.path))
        if len(by_value) > 1:
            out.append(f"setting {key} differs between the logs: " + "; ".join(
                f"{key}:{'(absent)' if v is None else v} in {', '.join(paths)}" for v, paths in by_value.items()))
    return out


def load_runs(paths: list[Path], allow_partial_val: bool = False) -> list[RunLog]:
    """Parse and check every log; raise one Refusal listing all problems found (NotALog for a file that is no
    train_gpt.py log). A log of a run that failed at the start is left out, with one line on stderr."""
    problems, runs = [], []
    for path in paths:
        try:
            run = parse_log(path)
        except Refusal as e:
            problems.append(f"{path}: {e}")
            continue
        if run.source is None:
            raise NotALog(f"{path}: not a log of train_gpt.py: no `{SOURCE_START}` line (its logs start with one)")
        if run.failed_at_start:
            print(f"package_record: skipped {path}: the run failed at the start (no training step, no score): "
                  f"error {run.error}", file=sys.stderr)
            continue
        problems += [f"{path}: {p}" for p in problems_of(run, allow_partial_val)]
        runs.append(run)
    if not problems and not runs:
        problems.append("no run left to package: every log given is of a run that failed at the start")
    if not problems:
        first, seen = runs[0], {}
        for run in runs:
            if run.source != first.source:
                problems.append(f"{run.path}: embedded train_gpt.py differs from the one in {first.path}")
            if run.seed in seen:
                problems.append(f"{run.path}: seed {run.seed} is also used by {seen[run.seed]}")
            seen.setdefault(run.seed, run.path)
            if run.score_event != first.score_event:
                problems.append(f"{run.path}: scored by {run.score_event} but {first.path} by {first.score_event}")
        problems += differing_settings(runs)
    if problems:
        raise Refusal("\n".join(problems))
    return runs


FOREIGN_SCORE = re.compile(r"(\S+) val_loss:(\d+\.\d+) val_bpb:\d+\.\d+( .*)?")  # the records' scripts' score lines


def prev_record_losses(paths: list[Path]) -> list[float]:
    """Final val_loss of each previous-record log (no other checks, any script's log): ours by the same score rule,
    another script's by its last score line (the 2026-04-27 record's `quantized_ttt_phased val_loss:...`)."""
    losses = []
    for path in paths:
        try:
            run = parse_log(path)
        except Refusal as e:
            raise Refusal(f"{path}: {e}") from None
        if run.score_event is not None:
            losses.append(run.val_loss)
            continue
        if run.source is not None:  # ours without its final line: not another script's score line
            raise Refusal(f"{path}: previous-record log has no final score line ({' or '.join(SCORE_EVENTS)})")
        scores = [m for line in path.read_text(encoding="utf-8").splitlines()
                  if (m := FOREIGN_SCORE.fullmatch(line)) and not m[1].startswith("step:")]
        if not scores:
            raise Refusal(f"{path}: previous-record log has no final score line ({' or '.join(SCORE_EVENTS)}, or "
                          "any script's `NAME val_loss:X val_bpb:Y`)")
        losses.append(float(scores[-1][2]))
    return losses


# ---------------------------------------------------------------------------------------------------
# Record folder: submission.json and README.md
# ---------------------------------------------------------------------------------------------------

def build_submission(runs: list[RunLog], meta: dict, prev: list[float] | None) -> dict:
    losses, bpbs = [r.val_loss for r in runs], [r.val_bpb for r in runs]
    sub, why = dict(meta), []
    hardware = sorted({f"{r.world_size} x {r.device}" for r in runs})
    if hardware != [h for h in hardware if re.fullmatch(r"8 x \S*H100\S*", h)]:
        why.append(f"trained on {' and '.join(hardware)}, not the challenge's 8 x H100")
    partial = [r for r in runs if r.val_docs is None or r.val_docs < FULL_VAL_DOCS]
    if partial:  # only with --allow-partial-val: load_runs refuses them otherwise
        why.append(f"scored on fewer than the challenge's {FULL_VAL_DOCS:,} validation documents (packaged with "
                   f"--allow-partial-val, for checks only): " + "; ".join(
                       f"seed {r.seed}: " + ("unknown (no val_docs line)" if r.val_docs is None else f"{r.val_docs:,}")
                       for r in partial))
    if why:
        sub["not_a_submission"] = "; ".join(why)
    sub["hardware"] = hardware
    sub.update(
        val_bpb=round(mean(bpbs), 8), val_loss=round(mean(losses), 8),
        val_bpb_std=round(sample_std(bpbs), 8) if len(runs) > 1 else None,
        val_loss_std=round(sample_std(losses), 8) if len(runs) > 1 else None,
        bytes_total=max(r.total_bytes for r in runs), bytes_code=runs[0].code_bytes,
        score_line=runs[0].score_event, seeds=[r.seed for r in runs],
        per_seed=[dict(seed=r.seed, val_loss=r.val_loss, val_bpb=r.val_bpb, steps=r.steps, train_time_ms=r.train_ms,
                       stopped_early=r.stopped_early, eval_time_ms=r.eval_ms, val_docs=r.val_docs,
                       bytes_total=r.total_bytes,
                       bytes_model=r.model_bytes, log=f"train_seed{r.seed}.log") for r in runs],
    )
    if prev is not None:
        sig = dict(prev_val_losses=prev, margin_nats=RECORD_MARGIN_NATS, threshold=RECORD_P_VALUE)
        try:
            w = welch_margin_test(losses, prev)
            sig.update(prev_mean_val_loss=mean(prev), t=w.t, df=w.df, p_value=w.p_value,
                       significant=w.p_value < RECORD_P_VALUE)
        except ValueError as e:
            sig.update(p_value=None, significant=None, note=str(e))
        sub["significance"] = sig
    return sub


def render_readme(sub: dict, runs: list[RunLog], track: str) -> str:
    std = lambda key, digits=4: "n/a (1 seed)" if sub[key] is None else f"{sub[key]:.{digits}f}"  # noqa: E731
    out = [f"# {sub['name']}", ""]
    if "not_a_submission" in sub:
        out += [f"**NOT A SUBMISSION**: {sub['not_a_submission']}.", ""]
    out += [f"**val_bpb: {sub['val_bpb']:.4f}** ({len(runs)}-seed mean, std {std('val_bpb_std')}) | "
           f"**{sub['bytes_total']:,} bytes** (largest seed, int6+{runs[0].compressor}) | {track}", "",
           sub["blurb"], "",
           f"By {sub['author']} (@{sub['github_id']}), {sub['date']}. Score: `{sub['score_line']}` of each log "
           f"(limits checked: total bytes <= {MAX_TOTAL_BYTES:,}, train time with the checkpoints' writes and GPTQ's "
           f"calibration <= {MAX_TRAIN_MS / 1000:.0f} s, the final score's eval time <= {MAX_EVAL_MS / 1000:.0f} s"
           + ("" if "not_a_submission" in sub else f", all {FULL_VAL_DOCS:,} validation documents scored") + ").", "",
           "## Results", "",
           "| Seed | steps | train time | step_avg | eval time | val_loss | val_bpb | bytes total |",
           "|---|---|---|---|---|---|---|---|"]
    for r, s in zip(runs, sub["per_seed"]):
        early = " (cap)" if r.stopped_early else ""
        out.append(f"| {s['seed']} | {s['steps']:,} | {s['train_time_ms'] / 1000:.1f} s{early} | "
                   f"{s['train_time_ms'] / max(s['steps'], 1):.1f} ms | {s['eval_time_ms'] / 1000:.1f} s | "
                   f"{s['val_loss']:.8f} | {s['val_bpb']:.8f} | {s['bytes_total']:,} |")
    out += [f"| **Mean** | | | | | **{sub['val_loss']:.8f}** | **{sub['val_bpb']:.8f}** | |",
            f"| Std | | | | | {std('val_loss_std', 8)} | {std('val_bpb_std', 8)} | |", ""]
    if sig := sub.get("significance"):
        out += ["## Significance", "",
                f"One-sided Welch t-test that our mean val_loss is at least {sig['margin_nats']} nats below the "
                f"previous record's (values: {', '.join(f'{x:.8f}' for x in sig['prev_val_losses'])}).", ""]
        if sig["p_value"] is None:
            out.append(f"Not computable: {sig['note']}.")
        else:
            verdict = "significant" if sig["significant"] else "**not** significant"
            out.append(f"previous mean {sig['prev_mean_val_loss']:.8f}, ours {sub['val_loss']:.8f}: "
                       f"t = {sig['t']:.3f}, df = {sig['df']:.2f}, p = {sig['p_value']:.3g} -> "
                       f"{verdict} at p < {sig['threshold']}.")
        out.append("")
    out += ["## Files", "", "- `train_gpt.py`: the script as shipped and counted (code_bytes): a stub that "
            "decompresses `train_gpt_readable.py` without its prose and packaging code and runs it; `python3 "
            "train_gpt.py` or `torchrun ... train_gpt.py`",
            "- `train_gpt_readable.py`: the script's source, extracted from the logs (identical in all of them)",
            *[f"- `{s['log']}`: full log of seed {s['seed']}" for s in sub["per_seed"]],
            "- `submission.json`: the numbers above", "",
            "## Settings (seed " + str(runs[0].seed) + ")", "", "```",
            *[f"{k}={v}" for k, v in runs[0].settings.items()], "```", ""]
    return "\n".join(out)


def package(logs: list[Path], meta: dict, root: Path, track: str, prev: list[float] | None = None,
            force: bool = False, allow_partial_val: bool = False) -> Path:
    runs = sorted(load_runs(logs, allow_partial_val), key=lambda r: r.seed)
    folder = root / track / f"{meta['date']}_{re.sub(r'[^A-Za-z0-9._-]+', '_', meta['name']).strip('_')}"
    if folder.exists():
        if not force:
            raise Refusal(f"{folder} already exists (pass --force to replace it)")
        shutil.rmtree(folder)
    sub = build_submission(runs, meta, prev)
    folder.mkdir(parents=True)
    (folder / "train_gpt.py").write_bytes(runs[0].shipped)
    (folder / "train_gpt_readable.py").write_bytes(runs[0].source)
    for run in runs:
        shutil.copyfile(run.path, folder / f"train_seed{run.seed}.log")
    (folder / "README.md").write_text(render_readme(sub, runs, track), encoding="utf-8")
    (folder / "submission.json").write_text(json.dumps(sub, indent=2) + "\n", encoding="utf-8")
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, metavar="LOG")
    ap.add_argument("--name", required=True)
    ap.add_argument("--author", required=True)
    ap.add_argument("--github-id", required=True)
    ap.add_argument("--blurb", required=True)
    ap.add_argument("--date", default=datetime.now(timezone.utc).date().isoformat(), type=date.fromisoformat,
                    help="YYYY-MM-DD (default: today, UTC)")
    ap.add_argument("--track", default="track_10min_16mb")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent, help="default: records/")
    ap.add_argument("--force", action="store_true", help="replace an existing record folder")
    ap.add_argument("--allow-partial-val", action="store_true",
                    help=f"package runs scored on fewer than {FULL_VAL_DOCS:,} validation documents (or an unknown "
                         f"number), for checks: the record is marked not a submission")
    prev = ap.add_mutually_exclusive_group()
    prev.add_argument("--prev-record-logs", nargs="+", type=Path, metavar="F")
    prev.add_argument("--prev-record-losses", nargs="+", type=float, metavar="X")
    args = ap.parse_args(argv)
    meta = dict(name=args.name, author=args.author, github_id=args.github_id, blurb=args.blurb,
                date=args.date.isoformat())
    try:
        prev_losses = prev_record_losses(args.prev_record_logs) if args.prev_record_logs else args.prev_record_losses
        folder = package(args.logs, meta, args.root, args.track, prev_losses, args.force, args.allow_partial_val)
    except Refusal as e:
        print(f"package_record: REFUSED\n{e}", file=sys.stderr)
        return 1
    except NotALog as e:
        print(f"package_record: error: {e}", file=sys.stderr)
        return 1
    sub = json.loads((folder / "submission.json").read_text())
    print(f"package_record: wrote {folder}\nval_bpb mean {sub['val_bpb']:.8f} val_loss mean {sub['val_loss']:.8f} "
          f"bytes_total {sub['bytes_total']:,} seeds {sub['seeds']}")
    if "not_a_submission" in sub:
        print(f"NOT A SUBMISSION: {sub['not_a_submission']}")
    if sig := sub.get("significance"):
        print(f"significance: p={sig['p_value']} significant={sig['significant']} (p < {RECORD_P_VALUE} needed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
