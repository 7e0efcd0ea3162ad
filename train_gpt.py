"""Parameter Golf: banked GPT + Parallel Muon, int6 artifact, exact sliding-window val_bpb.

Record run:   torchrun --standalone --nproc_per_node=8 train_gpt.py
One process:  python3 train_gpt.py        (the CPU too: tiny configs, SDPA math, no compile)
Every setting is an environment variable named after a Hyperparameters field (README lists them all).
Seed system: PR #399 (parameter banking + Parallel Muon) on the PR #315/#414 model stack. A feature earns its lines
with a measured gain. PQB, pqb-t: the proxy benchmark (records/PERFORMANCE.md "Now"). Budget: 3,750 lines.

Sections, each using only those above it: Config, Runtime, Optimizer, Data, Model, Kernels (and build_model),
Scoring, Legal TTT, Export, Training, main (the pipeline); but TTT_MODE's choices are TTT_MODES' names. Extension
points: FORMATS, TTT_MODES, Adapter (README, "Extending the script")."""
from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import difflib
import faulthandler
import glob
import hashlib
import io
import itertools
import json
import lzma
import math
import os
import platform
import re
import signal
import struct
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

# The optional kernels only where they can run: registering imports inductor (0.7 s), triton 0.16 s a CPU process
KERNELS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
try:
    if not KERNELS_HERE:
        raise ImportError
    import triton
    import triton.language as tl
except ImportError:
    triton, KERNELS_HERE = None, False

# ===== Config =====
DROPPED_SETTINGS = {"SWA_ENABLED", "SWA_EVERY", "DTG_ENABLED", "LATE_QAT", "QAT_ENABLED", "GATED_ATTENTION",
                    "VALUE_RESIDUAL",  # + LAWA_*, MTP_*: the reference's dead ends
                    "FP8_ENABLED",  # ours until 2026-11: no faster at the record micro-batch, 0.002-0.003 bpb worse
                    "ATTN_OUT_GATE_ENABLED",  # ours until 2026-11-26: the dense form of the sparse gate
                    "TTT_LR", "TTT_EPOCHS", "TTT_CHUNK_TOKENS", "TTT_FREEZE_BLOCKS", "TTT_MOMENTUM", "TTT_BATCH_SEQS",
                    "TTT_GRAD_CLIP",  # these TTT_*: the reference's full TTT (our sgd until 11-28); lora gains 8x more
                    "TTT_WARM_START_A"}  # ours until 2026-11-28: -0.0004, under twice the seed spread
DROPPED_PREFIXES = ("LAWA_", "MTP_")
# Environment variables of launchers and libraries that share a word with our fields.
FOREIGN_PREFIXES = ("TORCH", "PYTORCH", "CUDA", "NCCL", "OMP_", "MASTER_", "LOCAL_", "GROUP_", "ROLE_",
                    "TRITON", "PYTHON", "HF_", "MKL", "KMP_", "GLOO", "NVIDIA", "CUBLAS", "CUDNN")
GENERIC_WORDS = {"MAX", "NUM", "RUN", "DATA", "MODEL", "HEAD", "DEVICE", "LOCAL", "WORLD", "RANK"}
# Other scripts' names for our settings (no first word in common: ignored without a word before).
OTHER_NAMES = {"LEARNING_RATE": "MATRIX_LR, SCALAR_LR, TIED_EMBED_LR", "LR": "MATRIX_LR, SCALAR_LR, TIED_EMBED_LR",
               "BATCH_SIZE": "TRAIN_BATCH_TOKENS", "MAX_WALLCLOCK": "MAX_WALLCLOCK_SECONDS", "MAX_STEPS": "ITERATIONS",
               "SEQ_LEN": "TRAIN_SEQ_LEN, EVAL_SEQ_LEN", "WEIGHT_DECAY": "MUON_WD, ADAM_WD, EMBED_WD"}
POSITIVE, NON_NEGATIVE, FRACTION = "> 0", ">= 0", "in [0, 1)"  # a zero head count or a negative lr: a typo, not a run
IN_RANGE = {POSITIVE: lambda v: v > 0, NON_NEGATIVE: lambda v: v >= 0, FRACTION: lambda v: 0 <= v < 1}
FP16_MIN_NORMAL = 2.0 ** -14  # the smallest scale an fp16 row scale holds without losing precision to 0


def setting(default, meaning: str, allowed: str | tuple | Callable = "", model: bool = False, on: str = ""):
    """A setting: default, meaning (README's table), allowed values (a range, an inclusive (lo, hi), choices or a
    function of them), whether it is the model's (stored in artifacts), `on`: the feature it is ignored without."""
    return field(default=default, metadata=dict(meaning=meaning, allowed=allowed, model=model, on=on))


@dataclass(frozen=True)
class Hyperparameters:
    # --- run / data
    data_path: str = setting("./data/datasets/fineweb10B_sp8192_lossless_caps_caseops_v1_reserved", "folder of "
                             "fineweb_{train,val}_*.bin shards (and fineweb_val_bytes_*.bin: each val token's bytes)")
    tokenizer_path: str = setting("./data/tokenizers/fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model",
                                  "SentencePiece model (val_bpb's bytes too, without fineweb_val_bytes_*.bin)")
    run_id: str = setting("", "log logs/<RUN_ID>.txt (letters, digits, -_.); empty = random; a taken one gets a suffix")
    seed: int = setting(1337, "torch/numpy seed: init and nothing else (data order is fixed)", (0, 2 ** 32 - 1))
    vocab_size: int = setting(8192, "must equal the tokenizer's vocabulary (shards store uint16 ids)", (1, 65536), True)
    device: str = setting("auto", "auto = cuda if available, else cpu", ("auto", "cuda", "cpu"))
    eval_only: str = setting("", "path of an existing artifact: skip training, score it (the model settings are its "
                             "own)")
    artifact_path: str = setting("", "where the artifact is written (its folder must exist); empty = "
                                 "logs/<RUN_ID>.int6.ptz")
    checkpoint_every: float = setting(0.0, "seconds of training between checkpoints logs/<RUN_ID>.ckpt (0 = off)",
                                      NON_NEGATIVE)
    resume: str = setting("", "checkpoint to continue from; settings the environment leaves unset are the checkpoint's")
    # --- schedule
    iterations: int = setting(20000, "max optimizer steps", NON_NEGATIVE)
    warmup_steps: int = setting(20, "compile warmup steps, then weights/optimizer/data are restored", NON_NEGATIVE)
    warmdown_frac: float = setting(0.85, "linear lr decay over this last fraction of the run (steps, or the wallclock "
                                   "cap)", (0, 1), on="warmdown_iters=0")
    warmdown_iters: int = setting(0, "the reference's form instead: over the last N steps (as many average steps when "
                                  "capped); 0 = WARMDOWN_FRAC", NON_NEGATIVE)
    max_wallclock_seconds: float = setting(600.0, "training cap (0 = by steps); a step starts only if CAP_MARGIN fits",
                                           NON_NEGATIVE)
    train_batch_tokens: int = setting(786432, "global tokens per optimizer step", POSITIVE)
    train_seq_len: int = setting(2048, "training sequence length (tokens)", POSITIVE)
    train_seq_schedule: str = setting("", "progressive context (#2014's 1024@0.1,2048@0.7,3072@1.0): attention "
                                      "spans of at most LEN (documents cut from their start) until run progress FRAC, "
                                      "in rows of TRAIN_SEQ_LEN = the last LEN; DOC_ISOLATION=1; empty = off")
    seq_change_warmup_steps: int = setting(32, "lr ramp over N steps after a span change", NON_NEGATIVE,
                                           on="train_seq_schedule")
    grad_accum_steps: int = setting(0, "0 = max(1, 8 // WORLD_SIZE), doubled while a micro-batch's activations "
                                    "overrun the memory (activation_bytes): same global batch and math", NON_NEGATIVE)
    compile_enabled: str = setting("auto", "torch.compile: auto = on for CUDA, off for CPU", ("auto", "0", "1"))
    cuda_graphs: str = setting("auto", "each micro-batch's forward+backward as one CUDA graph: auto = on for CUDA",
                               ("auto", "0", "1"))
    train_sampling: str = setting("sequential", "sequential (shards in order) | coprime (strided over all shards)",
                                  ("sequential", "coprime"))
    # --- model
    num_layers: int = setting(11, "transformer blocks", POSITIVE, True)
    model_dim: int = setting(512, "residual width", POSITIVE, True)
    num_heads: int = setting(8, "query heads (head dim = MODEL_DIM / NUM_HEADS)", POSITIVE, True)
    num_kv_heads: int = setting(4, "GQA", POSITIVE, True)
    mlp_mult: float = setting(4.0, "MLP hidden = MLP_MULT * MODEL_DIM", POSITIVE, True)
    mlp_negative_slope: float = setting(0.5, "LeakyReLU(slope)^2 MLP; 0 = relu^2", NON_NEGATIVE, True)
    tie_embeddings: bool = setting(True, "output head = token embedding", model=True)
    tied_embed_init_std: float = setting(0.005, "token embedding init std", NON_NEGATIVE)
    rope_base: float = setting(10000.0, "explicit: no silent length rescaling (the reference's ran at ~22,082)",
                               POSITIVE, True)
    rope_dims: int = setting(16, "partial RoPE: rotate the first ROPE_DIMS of each head (even, <= head dim)",
                             model=True)
    logit_softcap: float = setting(30.0, "tanh softcap on logits (0 = off, with ASYM_LOGIT_RESCALE=0)", NON_NEGATIVE,
                                   True)
    asym_logit_rescale: bool = setting(True, "AsymLogit: two softcaps, s+ on logits >= 0 and s- below, learned from "
                                       "LOGIT_SOFTCAP in training and the phases (the records' never got a "
                                       "gradient)", model=True)
    qk_gain_init: float = setting(5.0, "per-head query gain after q/k RMSNorm")
    ln_scale: bool = setting(True, "scale block inputs by 1/sqrt(layer+1)", model=True)
    xsa_last_n: int = setting(11, "exclusive self-attention on the last N layers", NON_NEGATIVE, True)
    bigram_vocab_size: int = setting(0, "BigramHash buckets (0 = off)", NON_NEGATIVE, True)
    bigram_dim: int = setting(128, "BigramHash table width (projected to MODEL_DIM)", POSITIVE, True,
                              "bigram_vocab_size")
    smear_enabled: bool = setting(False, "the seed's SmearGate: per-channel mix with the previous position, after the "
                                  "norm", model=True)
    ve_enabled: bool = setting(False, "shared value embedding added to V", model=True)
    ve_dim: int = setting(128, "value-embedding table width (projected to the KV width)", POSITIVE, True, "ve_enabled")
    ve_layers: str = setting("-2,-1", "comma-separated layers; negative ones count back from NUM_LAYERS (-1: the last)",
                             model=True, on="ve_enabled")
    num_loops: int = setting(2, "depth recurrence: LOOP_START..LOOP_END run NUM_LOOPS more times (0 = off)",
                             NON_NEGATIVE, True)
    loop_start: int = setting(3, "first layer of the looped segment (a shallower model: clamped, as LOOP_END)",
                              NON_NEGATIVE, True, "num_loops")
    loop_end: int = setting(5, "last layer of the looped segment (inclusive; NUM_LAYERS - 1 at most)", NON_NEGATIVE,
                            True, "num_loops")
    enable_looping_at: float = setting(0.35, "training progress at which the repeats start (scoring always runs them)",
                                       FRACTION, on="num_loops")
    # the 04-27 record's lanes, gates, optimizer settings: -0.033 bpb (pqb-t, equal time; lanes -0.008), +5.2% a step
    parallel_start_layer: int = setting(8, "decoder layers from this one on: two residual lanes (0 = off)",
                                        NON_NEGATIVE, True)
    parallel_final_lane: str = setting("mean", "what leaves the two lanes: mean | attn | mlp", ("mean", "attn", "mlp"),
                                       True)
    skip_gates_enabled: bool = setting(True, "U-Net skips through a gate: sig(g) x + (1 - sig(g)) skip, g0 = 0",
                                       model=True)
    sparse_attn_gate_enabled: bool = setting(True, "per-head attention output x sig(SCALE W h[:GATE_WINDOW])",
                                             model=True)
    sparse_attn_gate_scale: float = setting(0.5, "SCALE of the sparse gate", POSITIVE, True, "sparse_attn_gate_enabled")
    sparse_attn_gate_init_std: float = setting(0.0, "its W's init std (0 = zeros)", NON_NEGATIVE,
                                               on="sparse_attn_gate_enabled")
    smear_gate_enabled: bool = setting(True, "the 04-27 record's SmearGate, before the norm: e_t += lam sig(w "
                                       "e_t[:GATE_WINDOW]) e_(t-1) (w, lam zero: identity at init)", model=True)
    gate_window: int = setting(12, "leading channels the sparse gate (of h) and the SmearGate (of e) read", POSITIVE,
                               True, "sparse_attn_gate_enabled|smear_gate_enabled")
    smear_bos_fix: bool = setting(True, "SmearGate mixes nothing into a document's BOS from the one before", model=True)
    doc_isolation: bool = setting(True, "nothing crosses a BOS: block-diagonal attention, BigramHash (train and score)",
                                  model=True)
    attn_backend: str = setting("auto", "auto on CUDA: fa3 if importable, else varlen to train with DOC_ISOLATION, "
                                "else SDPA cudnn; math on CPU; cudnn_fe: the cuDNN frontend's ragged SDPA",
                                ("auto", "fa3", "flash", "cudnn", "math", "varlen", "cudnn_fe"))
    kernels: str = setting("auto", "q/k norm+RoPE, XSA: auto = triton on CUDA, torch ops on CPU (triton there needs "
                           "TRITON_INTERPRET=1)", ("auto", "triton", "torch"))
    # --- optimizer
    matrix_lr: float = setting(0.028, "Muon lr for the four banks (#2135's; the 04-27 record's 0.026)", NON_NEGATIVE)
    scalar_lr: float = setting(0.02, "AdamW lr for control tensors and small projections", NON_NEGATIVE)
    tied_embed_lr: float = setting(0.03, "AdamW lr for token/bigram/value-embedding tables (tied head)", NON_NEGATIVE,
                                   on="tie_embeddings")
    embed_lr: float = setting(0.6, "table lr when embeddings are untied", NON_NEGATIVE, on="tie_embeddings=0")
    head_lr: float = setting(0.008, "untied lm_head lr", NON_NEGATIVE, on="tie_embeddings=0")
    muon_momentum: float = setting(0.97, "Muon Nesterov momentum after warmup", FRACTION)
    muon_momentum_warmup_start: float = setting(0.92, "Muon momentum at step 0", FRACTION,
                                                on="muon_momentum_warmup_steps")
    muon_momentum_warmup_steps: int = setting(1500, "linear momentum warmup length", NON_NEGATIVE)
    muon_backend_steps: int = setting(5, "Newton-Schulz iterations", POSITIVE)
    muon_polar_express: bool = setting(True, "Polar Express: per-iteration NS coefficients (the last repeats past 5)")
    muon_row_normalize: bool = setting(True, "MuonEq-R: each row of the update divided by its norm before NS")
    muon_wd: float = setting(0.095, "decoupled weight decay on the banks", NON_NEGATIVE)
    min_lr: float = setting(0.1, "floor of the lr scale in the warmdown (must stay below LATE_QAT_THRESHOLD)", FRACTION)
    muon_reduce_dtype: str = setting("auto", "bank grad reduce-scatter, momentum and NS dtype: auto = bf16 CUDA, fp32 "
                                     "CPU", ("auto", "bf16", "fp32"))
    adam_wd: float = setting(0.02, "AdamW weight decay of the control tensors and small projections", NON_NEGATIVE)
    embed_wd: float = setting(0.085, "AdamW weight decay of the embedding tables (not the untied head)", NON_NEGATIVE)
    beta1: float = setting(0.9, "AdamW beta1", FRACTION)
    beta2: float = setting(0.99, "AdamW beta2", FRACTION)
    adam_eps: float = setting(1e-8, "AdamW epsilon", POSITIVE)
    grad_clip_norm: float = setting(0.3, "clip by the global norm of the reduced gradient (0 = off)", NON_NEGATIVE)
    # --- averaging / QAT
    ema_enabled: bool = setting(True, "keep an EMA of all weights and export it")
    ema_decay: float = setting(0.9965, "fixed per-step decay (the reference's 0.997); 0 = from EMA_HORIZON", FRACTION,
                               on="ema_enabled")
    ema_horizon: float = setting(0.08, "EMA time constant, a fraction of the run (steps, or the wallclock cap)",
                                 NON_NEGATIVE, on="ema_decay=0")
    late_qat_threshold: float = setting(0.0, "fake-quantize banks to their int6 export grid once lr scale < this (0 = "
                                        "off)", (0, 1))
    # --- eval / logging / export
    eval_seq_len: int = setting(2048, "sliding-window scoring window", POSITIVE)
    eval_stride: int = setting(64, "tokens scored per window (after the first)", POSITIVE)
    sliding_eval_enabled: bool = setting(True, "the EVAL_STRIDE sliding scores (7.7 + 2.4 s on the proxy, H200); 0 "
                                         "(needs TTT): skip")
    val_loss_every: int = setting(0, "plain val scoring every N steps (0 = only at the end)", NON_NEGATIVE)
    val_batch_size: int = setting(524288, "scoring tokens per forward over all ranks x grad-accum slots", POSITIVE)
    train_log_every: int = setting(500, "train_loss line every N steps (and the first 10)", NON_NEGATIVE)
    compressor: str = setting("rans", "rans (context-modelled rANS, the smallest) | fast (zstd-3 for sweeps: 0.2 s)",
                              ("rans", "fast"))
    int6_scale_floor: float = setting(FP16_MIN_NORMAL, "floor on int6 row scales (the default, fp16's smallest "
                                      "normal, floors no trained row; the sp1024 stack's 1/31 coarsens tiny rows)")
    matrix_clip_sigmas: float = setting(12.85, "bank row scale = k * std(row) / 31 (SD clip); 0 = the clip search",
                                        NON_NEGATIVE)
    mlp_clip_sigmas: float = setting(11.5, "SD clip k of the MLP matrices; 0 = MATRIX_CLIP_SIGMAS", NON_NEGATIVE)
    attn_clip_sigmas: float = setting(13.0, "SD clip k of the attention matrices; 0 = MATRIX_CLIP_SIGMAS", NON_NEGATIVE)
    embed_bits: int = setting(7, "bits of the big tables' codes (EMBED_TABLES, an untied head)", (4, 8))
    embed_clip_sigmas: float = setting(14.0, "their row scale = k * std(row) / (2^(EMBED_BITS-1) - 1); 0 = |w| "
                                       "quantile clip", NON_NEGATIVE)
    lqer_enabled: bool = setting(True, "LQER: the quantization error's rank-LQER_RANK SVD stored for the worst "
                                 "matrices")
    lqer_rank: int = setting(4, "rank of each correction A B (A int2, B int4)", POSITIVE, on="lqer_enabled")
    lqer_top_k: int = setting(3, "the matrices corrected: largest error norm ||W - Q||_F first", POSITIVE,
                              on="lqer_enabled")
    lqer_asym_group: int = setting(32, "B's int4 scale group (one that does not divide B: A and B int4 per row)",
                                   POSITIVE, on="lqer_enabled")
    gptq_calibration_batches: int = setting(16, "GPTQ's X^T X from this many train micro-batches per rank (0 = off)",
                                            NON_NEGATIVE)
    # 16 batches: about 3 s at the record's micro-batch, and 1.5 s of margin (records/PERFORMANCE.md "Now")
    gptq_reserve_seconds: float = setting(4.5, "training stops this much before the wallclock cap, for the calibration",
                                          NON_NEGATIVE, on="gptq_calibration_batches")
    auto_size: float = setting(0.0, "MLP width (or bigram table, MLP_MULT set) filling this fraction of the limit (0 "
                               "= off)", FRACTION)
    # --- legal test-time training (score first, then train; after the final scoring)
    ttt_enabled: bool = setting(True, "run legal TTT on the read-back artifact and log legal_ttt")
    ttt_mode: str = setting("lora", "lora: per-document LoRA adapters (TTT_MODES)", lambda: tuple(TTT_MODES),
                            on="ttt_enabled")
    ttt_lora_rank: int = setting(80, "adapter rank (q, k, v, o and MLP of every layer, and the head)", POSITIVE,
                                 on="ttt_mode=lora")
    ttt_lora_alpha: float = setting(144.0, "adapter output x ALPHA / RANK", POSITIVE, on="ttt_mode=lora")
    ttt_lora_lr: float = setting(1.5e-4, "AdamW lr (betas 0, 0.99; eps 1e-10); with the phases and short chunks "
                                 "1.5e-4 -0.0019, 2e-4 -0.0016 against 3e-4 without them (paired, proxy)",
                                 POSITIVE, on="ttt_mode=lora")
    ttt_weight_decay: float = setting(0.5, "AdamW weight decay of the adapters", NON_NEGATIVE, on="ttt_mode=lora")
    ttt_grad_steps: int = setting(1, "AdamW steps on a chunk after it is scored (0 = score only); 2 at lr 1e-4: "
                                  "-0.0063 vs -0.0055, twice the time", NON_NEGATIVE, on="ttt_mode=lora")
    ttt_chunk_size: int = setting(64, "targets per chunk of a document (scored, then trained on); EVAL_STRIDE: a "
                                  "window each", POSITIVE, on="ttt_mode=lora")
    ttt_batch_size: int = setting(0, "documents per lockstep batch (rows of a step) on each rank; 0 = 64, fewer "
                                  "(multiples of 8) where their activations overrun the memory", NON_NEGATIVE,
                                  on="ttt_mode=lora")
    ttt_short_score_first_steps: str = setting("256:8,2000:24", "smaller chunks for short documents: LEN:CHUNK,... "
                                               "(a document of at most LEN targets: CHUNK; the records'); empty = off",
                                               on="ttt_mode=lora")
    ttt_q_lora: bool = setting(True, "adapters on q (the head's is always on)", on="ttt_mode=lora")
    ttt_k_lora: bool = setting(True, "adapters on k", on="ttt_mode=lora")
    ttt_v_lora: bool = setting(True, "adapters on v", on="ttt_mode=lora")
    ttt_o_lora: bool = setting(True, "adapters on the attention output", on="ttt_mode=lora")
    ttt_mlp_lora: bool = setting(True, "adapters on the MLP output", on="ttt_mode=lora")
    phased_ttt_prefix_docs: int = setting(2500, "phased global SGD: the first N documents lora scores (longest "
                                          "first) train the base weights in phases, after they are scored (0 = off; "
                                          "the records' 2,500 of the 50,000)", NON_NEGATIVE, on="ttt_mode=lora")
    phased_ttt_num_phases: int = setting(3, "phases of the prefix; after phase k, SGD on its first k/N (cumulative)",
                                         POSITIVE, on="phased_ttt_prefix_docs")
    global_ttt_lr: float = setting(0.001, "the phases' SGD lr, cosine over the chunks", NON_NEGATIVE,
                                   on="phased_ttt_prefix_docs")
    global_ttt_momentum: float = setting(0.9, "the phases' SGD momentum", FRACTION, on="phased_ttt_prefix_docs")
    global_ttt_epochs: int = setting(1, "passes over a phase's documents", NON_NEGATIVE, on="phased_ttt_prefix_docs")
    global_ttt_chunk_tokens: int = setting(32768, "tokens per SGD step, as CHUNK_TOKENS // EVAL_SEQ_LEN rows of one "
                                           "document each (the last step's are not trained on, as in the records)",
                                           POSITIVE, on="phased_ttt_prefix_docs")
    global_ttt_grad_clip: float = setting(1.0, "the phases' grad-norm clip", POSITIVE, on="phased_ttt_prefix_docs")
    ngram_tilt_enabled: bool = setting(True, "#2135's token-only n-gram tilt of lora's score (not its training): the "
                                       "next token a context of TOKEN_ORDER - 1 in-document tokens had at least "
                                       "TOKEN_THRESHOLD of its times gets TOKEN_BOOST nats, renormalised; the counts "
                                       "absorb scored documents every NGRAM_UPDATE_DOCS of lora's order (the same on "
                                       "any world size)", on="ttt_mode=lora")
    token_order: int = setting(16, "context tokens + 1", (2, 64), on="ngram_tilt_enabled")
    token_threshold: float = setting(0.8, "share of a context's count its top next token needs", (0.0, 1.0),
                                     on="ngram_tilt_enabled")
    token_boost: float = setting(2.625, "nats added to the hinted token's logit", NON_NEGATIVE, on="ngram_tilt_enabled")
    ngram_update_docs: int = setting(512, "documents between the counts' updates (edges of lora's order, as the "
                                     "phases': a multiple of WORLD_SIZE x TTT rows keeps the batches full)", POSITIVE,
                                     on="ngram_tilt_enabled")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> tuple["Hyperparameters", list[str]]:
        """Parse our variables from `env`; returns (config, warnings). Unknown look-alikes are errors."""
        env = dict(os.environ if env is None else env)
        by_env, values, warnings = {f.name.upper(): f for f in fields(cls)}, {}, []
        heads = {name.split("_")[0] for name in by_env} - GENERIC_WORDS
        for key, raw in env.items():
            if key in by_env:
                values[by_env[key].name] = _parse_value(key, raw, by_env[key].type)
            elif key in DROPPED_SETTINGS or key.startswith(DROPPED_PREFIXES):
                warnings.append(f"setting {key} is not supported by this script and is ignored")
            elif key.startswith(FOREIGN_PREFIXES) or key in ("RANK", "WORLD_SIZE"):
                continue
            elif key in OTHER_NAMES:
                raise ValueError(f"unknown setting {key}={raw!r}; this script's name for it: {OTHER_NAMES[key]}")
            elif key.upper() in by_env:
                raise ValueError(f"setting {key}={raw!r} is not read: settings are upper case ({key.upper()})")
            elif key.split("_")[0] in heads or difflib.get_close_matches(key, list(by_env), n=1, cutoff=0.85):
                close = difflib.get_close_matches(key, list(by_env), n=1, cutoff=0.0)
                raise ValueError(f"unknown setting {key}={raw!r}; closest valid setting: {close[0]}")
        values["run_id"] = values.get("run_id") or str(uuid.uuid4())
        cfg = cls(**values)
        if bool(cfg.resume) == bool(cfg.eval_only):  # else adopt_settings validates, with the stored settings
            cfg.validate()
        return cfg, warnings

    def ignored(self, name: str) -> str:
        """Why setting `name` is not read with these settings ("" if it is): its feature (setting's `on`) is off."""
        if not (on := SETTINGS[name].metadata["on"]):
            return ""
        if "|" in on:  # read while any of these features is on
            return "" if any(getattr(self, k) for k in on.split("|")) else \
                f"is ignored: {' and '.join(k.upper() + '=0' for k in on.split('|'))} turn its features off"
        key, _, mode = on.partition("=")
        value, why = getattr(self, key), self.ignored(key)
        if key == "ttt_mode" and value in TTT_MODES:  # a mode that runs another's scorer reads its settings
            value = TTT_MODES[value].settings or value
        if why or mode:
            return why or ("" if value == _parse_value(key, mode, type(value).__name__)
                           else f"is {key.upper()}={mode}'s; {key.upper()}={value} ignores it")
        return "" if value else f"is ignored: {key.upper()}={value} turns its feature off"

    def unread(self, explicit: set[str]) -> list[str]:
        """Warnings once stored settings are adopted: `explicit` ones not read; a warmdown past a step-capped run."""
        out = [f"setting {n.upper()} {why}" for n in SETTINGS if n in explicit and (why := self.ignored(n) or (
            self.eval_only and n in NOT_SCORING and "is ignored: EVAL_ONLY scores a made artifact"))]
        if self.max_wallclock_seconds == 0 and self.warmdown_iters > self.iterations:
            out.append(f"WARMDOWN_ITERS={self.warmdown_iters} > ITERATIONS={self.iterations} (a step-capped run): "
                       f"the lr starts at {self.iterations / self.warmdown_iters:.3f} of its peak")
        return out

    def validate(self) -> None:
        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)
        for n, f in SETTINGS.items():
            v, allowed = getattr(self, n), f.metadata["allowed"]
            allowed = allowed() if callable(allowed) else allowed
            if isinstance(allowed, tuple) and isinstance(allowed[0], str):
                require(v in allowed, f"{n.upper()}={v!r} is not one of {', '.join(allowed)}")
            elif isinstance(allowed, tuple):
                require(allowed[0] <= v <= allowed[1], f"{n.upper()}={v} is out of range: it must be in "
                     f"{allowed[0]}..{allowed[1]}")
            elif allowed:
                require(IN_RANGE[allowed](v), f"{n.upper()}={v} is out of range: it must be {allowed}")
        require(re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)?", self.run_id) is not None,
             f"RUN_ID {self.run_id!r} is not a plain name (letters, digits, '-', '_', '.'; it names files in logs/)")
        require(not (self.resume and self.eval_only), "RESUME and EVAL_ONLY exclude each other")
        require(self.bigram_vocab_size != 1, "BIGRAM_VOCAB_SIZE must be 0 (off) or >= 2")
        require(self.model_dim % self.num_heads == 0,
             f"MODEL_DIM={self.model_dim} must divide by NUM_HEADS={self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0,
             f"NUM_HEADS={self.num_heads} must divide by NUM_KV_HEADS={self.num_kv_heads}")
        require(round(self.mlp_mult * self.model_dim, 6) >= 1,
             f"MLP_MULT={self.mlp_mult} x MODEL_DIM={self.model_dim} rounds to an MLP of 0 units")
        require(self.rope_dims % 2 == 0 and 0 <= self.rope_dims <= self.head_dim, "ROPE_DIMS: even, <= head dim")
        require(self.eval_stride <= self.eval_seq_len, "EVAL_STRIDE must be in 1..EVAL_SEQ_LEN")
        require(all(s.strip().removeprefix("-").isdigit() for s in self.ve_layers.split(",") if s.strip()),
             f"malformed value for VE_LAYERS: {self.ve_layers!r} (expected comma-separated layer indices)")
        given = [int(s) for s in self.ve_layers.split(",") if s.strip()]
        require(not self.ve_enabled or all(-self.num_layers <= i < self.num_layers for i in given),
             "VE_LAYERS outside -NUM_LAYERS..NUM_LAYERS-1")
        require(len(set(self.ve_layer_list)) == len(self.ve_layer_list), f"VE_LAYERS={self.ve_layers} names a "
                "layer twice")
        require(not self.ema_enabled or self.ema_horizon > 0 or self.ema_decay > 0, "EMA_HORIZON must be > 0 (or "
                "set EMA_DECAY)")
        require(self.num_loops == 0 or self.loop_start <= self.loop_end, "LOOP_START must be <= LOOP_END")
        for looping in (False, True):  # once two lanes, always two: a serial layer after them has no one residual
            lanes = parallel_positions(self, looping)
            require(lanes == sorted(lanes), f"PARALLEL_START_LAYER={self.parallel_start_layer} puts a serial layer "
                 f"after a parallel one in the decoder {layer_order(self, looping)[len(lanes) // 2:]}")
        require(self.gate_window <= self.model_dim or self.ignored("gate_window"), "GATE_WINDOW must be <= MODEL_DIM")
        require(not (self.smear_enabled and self.smear_gate_enabled), "SMEAR_ENABLED=1 (the seed's SmearGate) and "
             "SMEAR_GATE_ENABLED=1 (the 04-27 record's) are two kinds of one gate: set one to 0")
        require(not (self.doc_isolation and (self.smear_enabled or self.smear_gate_enabled) and not self.smear_bos_fix),
             "DOC_ISOLATION=1 needs SMEAR_BOS_FIX=1 (the SmearGate would carry the previous document into a BOS)")
        require(not self.asym_logit_rescale or self.logit_softcap > 0,
             "ASYM_LOGIT_RESCALE=1 needs LOGIT_SOFTCAP > 0 (no cap: set both to 0)")
        require(self.late_qat_threshold == 0 or self.min_lr < self.late_qat_threshold,
             "MIN_LR must be below LATE_QAT_THRESHOLD: late QAT starts when the lr scale falls under it")
        require(bool(re.fullmatch(r"\s*(\d+:[1-9]\d*\s*(,\s*\d+:[1-9]\d*\s*)*)?", self.ttt_short_score_first_steps)),
             f"TTT_SHORT_SCORE_FIRST_STEPS={self.ttt_short_score_first_steps!r}: LEN:CHUNK pairs, e.g. 256:8,2000:24")
        ok = re.fullmatch(r"\s*(\d+@\d*\.?\d+\s*(,\s*\d+@\d*\.?\d+\s*)*)?", self.train_seq_schedule)
        spans = self.seq_spans if ok else [(0.0, 0)]
        require(all(0 < n <= self.train_seq_len for _, n in spans) and [f for f, _ in spans] == sorted({f for f, _ in
                spans}) and (not spans or spans[-1] == (1.0, self.train_seq_len) and self.doc_isolation),
                f"TRAIN_SEQ_SCHEDULE={self.train_seq_schedule!r}: LEN@FRAC, fractions rising to 1.0 where LEN is "
                "TRAIN_SEQ_LEN, every LEN at most that, with DOC_ISOLATION=1")
        require(self.sliding_eval_enabled or self.ttt_enabled,
             "SLIDING_EVAL_ENABLED=0 needs TTT_ENABLED=1 (without TTT the sliding score is the final score)")
        require(self.max_wallclock_seconds == 0 or self.gptq_calibration_batches == 0
             or self.gptq_reserve_seconds < self.max_wallclock_seconds,
             "GPTQ_RESERVE_SECONDS must be below MAX_WALLCLOCK_SECONDS")
        # fp16 scales: under 2^-14 zero rows go 0/0, past 4,094 a coarsened one is inf; 1 zeroes every trained row
        require(FP16_MIN_NORMAL <= self.int6_scale_floor <= 1,
             "INT6_SCALE_FLOOR must be in [2^-14 (6.1e-5, fp16's smallest normal), 1]")

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def attn_gate_window(self) -> int:
        return self.gate_window if self.sparse_attn_gate_enabled else 0

    @property
    def parallel_start(self) -> int:
        """The first parallel layer; NUM_LAYERS when none (off, or the default past a shallow model's depth)."""
        first = self.parallel_start_layer
        return first if 0 < first < self.num_layers else self.num_layers

    @property
    def loop_layers(self) -> tuple[int, int]:
        """LOOP_START..LOOP_END within the depth (the default 3..5 is 1..1 of a 2-layer model)."""
        end = min(self.loop_end, self.num_layers - 1)
        return min(self.loop_start, end), end

    @property
    def seq_spans(self) -> list[tuple[float, int]]:
        """TRAIN_SEQ_SCHEDULE as (progress up to which, span) pairs."""
        return [(float(f), int(n)) for n, f in (p.split("@") for p in self.train_seq_schedule.split(",") if p.strip())]

    def ttt_chunk_for(self, targets: int) -> int:
        steps = sorted(tuple(map(int, p.split(":"))) for p in self.ttt_short_score_first_steps.split(",") if p.strip())
        return next((c for n, c in steps if targets <= n), self.ttt_chunk_size)

    @property
    def ve_layer_list(self) -> list[int]:  # 0..NUM_LAYERS-1 (the default -2,-1: 9,10 of 11, the records')
        return [int(s) % self.num_layers for s in self.ve_layers.split(",") if s.strip()] if self.ve_enabled else []


SETTINGS = {f.name: f for f in fields(Hyperparameters)}
MODEL_SETTINGS = tuple(n for n, f in SETTINGS.items() if f.metadata["model"])
# Model settings added after artifacts existed: what one made before them meant (125da04: the record's SmearGate)
ADDED_MODEL_SETTINGS = {"smear_gate_enabled": False, "asym_logit_rescale": False}
# Read by training and the export only (ITERATIONS..AUTO_SIZE but the model's and these): EVAL_ONLY warns if one is set
NOT_SCORING = {"checkpoint_every", "artifact_path", *list(SETTINGS)[list(SETTINGS).index("iterations"):list(
    SETTINGS).index("auto_size") + 1]} - set(MODEL_SETTINGS) - {"grad_accum_steps", "compile_enabled", "attn_backend",
    "kernels", "eval_seq_len", "eval_stride", "sliding_eval_enabled", "val_batch_size"}
# Banks (PR #399): one 3-D parameter per matrix shape, so Muon orthogonalises a kind's matrices as one batch
BANKS = {"qo_bank": ("attn.q", "attn.o"), "kv_bank": ("attn.k", "attn.v"),  # slot s, layer i: bank[s * L + i]
         "mlp_up_bank": ("mlp.up",), "mlp_down_bank": ("mlp.down",)}
MATRICES = {name: (bank, slot) for bank, names in BANKS.items() for slot, name in enumerate(names)}
ZERO_INIT = ("attn.o", "mlp.down")  # the reference's init: these start at zero, the others orthogonal
EMBED_TABLES = ("tok_emb.weight", "bigram.embed.weight", "ve.embed.weight")  # AdamW's token group


def _parse_value(key: str, raw: str, typ: str):
    try:
        if typ == "bool":
            return {"0": False, "1": True, "false": False, "true": True}[raw.strip().lower()]
        value = {"int": int, "float": float, "str": str}[typ](raw.strip() if typ != "str" else raw)
        if typ == "float" and not math.isfinite(value):
            raise ValueError
    except (KeyError, ValueError):
        raise ValueError(f"malformed value for {key}: {raw!r} (expected {typ})") from None
    return value


def adopt_settings(cfg: Hyperparameters, stored: dict, names: tuple[str, ...], explicit: set[str],
                   source: str, used: str = "the environment's value is used") -> tuple[Hyperparameters, list[str]]:
    """cfg with `stored`'s settings `names`; an `explicit` one keeps its value (a warning; a model one: an error)."""
    dropped = sorted(n for n in stored if n.upper() in DROPPED_SETTINGS)
    stored = {n: v for n, v in ADDED_MODEL_SETTINGS.items() if n in names} | stored
    stored = {n: v for n, v in stored.items() if n not in dropped}
    unknown, missing = set(stored) - set(SETTINGS), set(names) - set(stored)
    if unknown or missing:
        raise ValueError(f"{source} was made by another version of train_gpt.py (settings unknown here: "
                         f"{sorted(unknown)}, missing: {sorted(missing)})")
    warnings = [f"{source} holds {n.upper()}, a setting this version dropped: ignored" for n in dropped]
    for n in (n for n in names if n in explicit and getattr(cfg, n) != stored[n]):
        msg = f"{n.upper()}={getattr(cfg, n)} but {source} was made with {n.upper()}={stored[n]}"
        if n in MODEL_SETTINGS:
            raise ValueError(f"{msg}: leave {n.upper()} unset to use the stored value")
        warnings.append(f"{msg}; {used}")
    cfg = replace(cfg, **{n: stored[n] for n in names if n not in explicit})
    cfg.validate()
    return cfg, warnings


def layer_matrix(banks: dict[str, Tensor], name: str, i: int, num_layers: int) -> Tensor:
    bank, slot = MATRICES[name]
    return banks[bank][slot * num_layers + i]


def layer_order(cfg: Hyperparameters, looping: bool) -> list[int]:
    """Each position's layer (first half: the U-Net encoder); looping, LOOP_START..LOOP_END runs 1 + NUM_LOOPS times."""
    L, (a, b), loops = cfg.num_layers, cfg.loop_layers, cfg.num_loops if looping else 0
    return list(range(a)) + list(range(a, b + 1)) * (loops + 1) + list(range(b + 1, L))


def parallel_positions(cfg: Hyperparameters, looping: bool) -> list[bool]:
    """Which positions of layer_order run two residual lanes: the decoder's, from PARALLEL_START_LAYER on."""
    order = layer_order(cfg, looping)
    return [pos >= len(order) // 2 and i >= cfg.parallel_start for pos, i in enumerate(order)]


# ===== Runtime: the "auto" choices resolved once, distributed helpers, logging, clock =====
SEGMENT_BACKENDS = ("varlen", "fa3", "cudnn_fe")  # DOC_ISOLATION by document_segments' cu_seqlens instead of a mask
RAGGED = ("varlen", "cudnn_fe")  # DOC_ISOLATION's alone; their rows of one document run SDPA's cuDNN
# Activation bytes per (token x layer pass x width), from reserved peaks on an H200: the warmup's (all graphs in one
# pool: 43,240 MiB at 98,304 tokens; 22,654 at 49,152 is 55.5) and TTT's (60,094 MiB at 64 rows of 2,048)
TRAIN_ACT_BYTES, TTT_ACT_BYTES = 53, 55
NGRAM_PEAK_BYTES = 110 * 47_851_520  # the tilt's counts' peak, full validation set (H200)
MEMORY_USE = 0.85  # of what the process may use; the rest: weights, optimizer states, the allocator's fragmentation
# torch >= 2.13 renames the tensor collectives; 2.11 (the GPU machine) has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
HOST = torch.device("cpu")  # now_ms(HOST): the host clock, without waiting for the GPU
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: a closed terminal or ssh session


@dataclass(frozen=True)
class Runtime:
    """What settings and machine decide, resolved once (init_runtime), logged (`layout`); default: one CPU process."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    attn_backend: str = "math"  # fa3 | flash | cudnn | math | varlen | cudnn_fe
    kernels: str = "torch"  # triton | torch: who runs q/k norm+RoPE and XSA
    compile_enabled: bool = False
    cuda_graphs: bool = False
    grad_accum_steps: int = 1
    budget: float = 0.0  # bytes of activations planned for (memory_budget); 0 = no limit known (CPU)
    ttt_rows: int = 64  # TTT_BATCH_SIZE=0's rows (resolve_ttt_rows)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"layout world_size:{self.world_size} grad_accum_steps:{self.grad_accum_steps} attn_backend:"
                f"{self.attn_backend} kernels:{self.kernels} compile:{int(self.compile_enabled)} cuda_graphs:"
                f"{int(self.cuda_graphs)}" + (f" memory:{memory(self.device)}" if self.device.type == "cuda" else ""))


def free_and_cap(device: torch.device) -> tuple[int, float]:
    free, total = torch.cuda.mem_get_info(device)
    return free, torch.cuda.get_per_process_memory_fraction(device) * total


def memory(device: torch.device) -> str:
    (free, cap), reserved = free_and_cap(device), torch.cuda.memory_reserved(device)
    return f"{free / 2 ** 30:.1f} GiB free, {reserved / 2 ** 30:.1f} reserved, cap {cap / 2 ** 30:.1f}"


def activation_bytes(cfg: Hyperparameters, tokens: int, per: int) -> int:
    return per * tokens * cfg.model_dim * len(layer_order(cfg, True))


def memory_budget(device: torch.device) -> float:
    """MEMORY_USE of what every rank may use (the smaller of its free memory and the allocator's cap); 0 off CUDA."""
    return -all_reduce_max(-MEMORY_USE * min(free_and_cap(device)), device) if device.type == "cuda" else 0.0


def ttt_rows(cfg: Hyperparameters, rt: Runtime) -> int:
    return cfg.ttt_batch_size or rt.ttt_rows


def ttt_bytes(cfg: Hyperparameters, rows: int) -> int:
    return activation_bytes(cfg, rows * cfg.eval_seq_len, TTT_ACT_BYTES) + NGRAM_PEAK_BYTES * cfg.ngram_tilt_enabled


def resolve_ttt_rows(cfg: Hyperparameters, budget: float) -> int:
    fit = [r for r in range(64, 8, -8) if ttt_bytes(cfg, r) <= budget]
    return (fit + [8] if budget else [64])[0]


def resolve_grad_accum_steps(cfg: Hyperparameters, world_size: int, budget: float = 0.0) -> int:
    accum = cfg.grad_accum_steps or max(1, 8 // world_size)
    if cfg.eval_only:  # no training batch to divide
        return accum
    seqs = cfg.train_batch_tokens // (world_size * cfg.train_seq_len)
    while not cfg.grad_accum_steps and seqs % (2 * accum) == 0 and activation_bytes(
            cfg, cfg.train_batch_tokens // (world_size * accum), TRAIN_ACT_BYTES) > budget > 0:
        accum *= 2
    if cfg.train_batch_tokens % (world_size * accum * cfg.train_seq_len):
        raise ValueError(f"TRAIN_BATCH_TOKENS={cfg.train_batch_tokens} does not divide into WORLD_SIZE={world_size}"
                         f" x GRAD_ACCUM_STEPS={accum} x TRAIN_SEQ_LEN={cfg.train_seq_len}")
    return accum


def init_runtime(cfg: Hyperparameters, env: dict[str, str] | None = None) -> Runtime:
    """Every "auto" setting resolved, the process group joined, CUDA set up; WORLD_SIZE, RANK, LOCAL_RANK from `env`."""
    env = os.environ if env is None else env
    world_size, rank, local_rank = (int(env.get(k, d)) for k, d in (("WORLD_SIZE", "1"), ("RANK", "0"),
                                                                    ("LOCAL_RANK", "0")))
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("DEVICE=cuda but CUDA is not available")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    for name, value in (("ATTN_BACKEND", cfg.attn_backend), ("CUDA_GRAPHS", cfg.cuda_graphs)):
        if not cuda and value in ("fa3", "flash", "cudnn", "varlen", "cudnn_fe", "1"):
            raise ValueError(f"{name}={value} needs CUDA")
    if cfg.kernels == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("KERNELS=triton off CUDA needs TRITON_INTERPRET=1 (Triton's interpreter)")
    if cfg.kernels == "triton" and triton is None:
        raise ValueError("KERNELS=triton needs the triton package")
    import importlib.util
    if cfg.attn_backend == "cudnn_fe":
        if not hasattr(importlib.util.find_spec("cudnn") and importlib.import_module("cudnn"), "sdpa_torch"):
            raise ValueError("ATTN_BACKEND=cudnn_fe needs nvidia-cudnn-frontend with its torch op (cudnn.sdpa_torch): "
                             "pip install nvidia-cudnn-frontend")
        try:  # 1.32 defines this op in its first backward: a cached graph skips it
            importlib.import_module("cudnn.sdpa.packed_lse")
        except ModuleNotFoundError as e:  # no such module
            if e.name not in ("cudnn.sdpa", "cudnn.sdpa.packed_lse"):
                raise
    if (attn := cfg.attn_backend) == "auto":  # cuDNN SDPA (native GQA): fwd+bwd 2.40 ms vs SDPA flash's 3.71 (H200)
        fa3 = importlib.util.find_spec("flash_attn_interface")
        attn = ("fa3" if fa3 else "varlen" if cfg.doc_isolation and not cfg.eval_only else "cudnn") if cuda else "math"
    # DOC_ISOLATION's rows that cross documents need a mask (varlen's sized by TrainLoader); scoring rows do not
    if cfg.doc_isolation and not cfg.eval_only and attn not in ("math", *SEGMENT_BACKENDS):
        raise ValueError(f"DOC_ISOLATION=1 trains on ATTN_BACKEND=math, {', '.join(SEGMENT_BACKENDS)} (the backend "
                         f"here is {attn}); EVAL_ONLY scoring runs on any")
    if attn in RAGGED and not cfg.doc_isolation:  # and not chosen by auto: not yet measured
        raise ValueError(f"ATTN_BACKEND={attn} is DOC_ISOLATION=1's backend")
    kernels = cfg.kernels if cfg.kernels != "auto" else ("triton" if cuda and triton is not None else "torch")
    auto_on = {"auto": cuda, "1": True, "0": False}
    if auto_on[cfg.compile_enabled]:  # inductor only where it compiles: a CPU run 0.13 s faster
        configure_inductor()
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        for kind in ("flash", "cudnn", "mem_efficient", "math"):  # one SDPA kernel, no silent fallback (RAGGED: cuDNN)
            getattr(torch.backends.cuda, f"enable_{kind}_sdp")(kind == ("cudnn" if attn in RAGGED else attn))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device) if cuda else dist.init_process_group("gloo")
    budget = memory_budget(device)
    return Runtime(rank, world_size, local_rank, device, attn, kernels, auto_on[cfg.compile_enabled],
                   auto_on[cfg.cuda_graphs], resolve_grad_accum_steps(cfg, world_size, budget), budget,
                   resolve_ttt_rows(cfg, budget))


def check_same_on_ranks(env: dict[str, str]) -> None:
    """Every rank's settings (RESUME too) must be rank 0's, else an error: a differing one was silently replaced."""
    if _distributed():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, env)
        for r, other in enumerate(every):
            if diff := sorted(k for k in set(other) | set(every[0]) if other.get(k) != every[0].get(k)):
                dist.barrier()  # all stop here: gloo torn down under a peer aborted rank 0
                dist.destroy_process_group()
                raise ValueError(f"rank {r}'s settings differ from rank 0's ({', '.join(diff)}): start every rank "
                                 "with the same environment")


def configure_inductor() -> None:
    """Inductor's mix-order reductions off unless TORCHINDUCTOR_MIX_ORDER_REDUCTION is set: they cost up to 20 ms
    of a record step (records/PERFORMANCE.md "Now": inductor settings) and assert on the ungated U-Net skip."""
    import torch._inductor.config
    c = torch._inductor.config.triton
    if "TORCHINDUCTOR_MIX_ORDER_REDUCTION" not in os.environ and hasattr(c, "mix_order_reduction"):
        c.mix_order_reduction = False


def compiled(fn, rt: Runtime):
    """The one way this file compiles: whole graphs of fixed shapes, but for dimensions a caller marks dynamic."""
    return torch.compile(fn, dynamic=False, fullgraph=True) if rt.compile_enabled else fn


def autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum_(t: Tensor, async_op: bool = False):
    """Sum over ranks in place (identity on one rank). ReduceOp.AVG is avoided: gloo lacks it."""
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=async_op) if _distributed() else None


class FlatTensors:
    """Tensors as one fp32 buffer: one async all-reduce, one kernel, not 98 (+ stacked NS: optimizer 2.24->1.95 ms)."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors, self.flat = tensors, torch.cat([t.reshape(-1).float() for t in tensors])
        self.work = all_reduce_sum_(self.flat, async_op=True)

    def mean(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.flat.div_(dist.get_world_size())
        return self.flat

    def write_back(self) -> None:
        """One dtype at a time: foreach ops over mixed dtypes take the per-tensor path (49 memcpys, not one)."""
        views = [f.view_as(t) for f, t in zip(self.flat.split([t.numel() for t in self.tensors]), self.tensors)]
        for dtype in {t.dtype for t in self.tensors}:
            pairs = [(t, v) for t, v in zip(self.tensors, views) if t.dtype == dtype]
            torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


def all_reduce_max(x: float | list[float], device: torch.device):
    t = torch.tensor(x if isinstance(x, list) else [x], dtype=torch.float64, device=device)
    if _distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() if isinstance(x, list) else float(t.item())


def now_ms(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() * 1000.0


@contextlib.contextmanager
def memory_advice(rt: Runtime, change: str):
    """CUDA out of memory inside gets a note: the memory here, the setting to change (issue 58: torch's named none)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        e.add_note(f"{memory(rt.device)}; {change}" if rt.device.type == "cuda" else change)
        raise


def on_rank0(rt: Runtime, fn: Callable):
    """fn() on rank 0; its result, or its error raised on every rank (alone, it left the others in a collective)."""
    out: list = [None]
    if rt.is_main:
        try:
            out[0] = fn()
        except (OSError, ValueError) as e:
            out[0] = e
    if _distributed():
        dist.broadcast_object_list(out, src=0)
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def claim_outputs(cfg: Hyperparameters, rt: Runtime) -> Hyperparameters:
    """One run, one log, nothing overwritten: rank 0 creates logs/<RUN_ID>.txt for the first free RUN_ID, RUN_ID_2, ...;
    the artifact (default logs/<RUN_ID>.int6.ptz) is claimed empty; an existing one, a bad folder: refused."""
    def claim() -> Hyperparameters:
        logs, artifact = Path("logs"), Path(cfg.artifact_path)
        logs.mkdir(exist_ok=True)
        for folder, what in ((logs, "the log folder"), (artifact.parent, "ARTIFACT_PATH's folder")):
            if not folder.is_dir():
                raise FileNotFoundError(f"{what} {folder} does not exist: create it, or set another ARTIFACT_PATH")
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{what} {folder} is not writable")
        create = lambda path: os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # or raise
        if cfg.artifact_path and not cfg.eval_only:  # claimed as an empty file now: no other run can take it
            if artifact.suffix in (".txt", ".ckpt") and not artifact.exists():
                raise ValueError(f"ARTIFACT_PATH {artifact} is named like a log or checkpoint (.txt, .ckpt)")
            try:
                create(artifact)
            except FileExistsError:
                raise FileExistsError(f"ARTIFACT_PATH {artifact} exists" + (" (empty: a running run's, or a killed "
                                      "one's)" if artifact.stat().st_size == 0 else "") + ": a run never overwrites a "
                                      "file (move it, or set another path)") from None
        claimed = artifact.resolve() if cfg.artifact_path and not cfg.eval_only else None
        for n in itertools.count(1):
            run_id = cfg.run_id if n == 1 else f"{cfg.run_id}_{n}"
            ptz = logs / f"{run_id}.int6.ptz"
            with contextlib.suppress(FileExistsError):
                if not any(p.exists() and p.resolve() != claimed for p in (logs / f"{run_id}.ckpt", ptz)):
                    create(logs / f"{run_id}.txt")
                    if not (cfg.artifact_path or cfg.eval_only):
                        create(ptz)
                    return replace(cfg, run_id=run_id, artifact_path=cfg.artifact_path or str(ptz))
    return on_rank0(rt, claim)


class Logger:
    """Rank 0 only: `event key:value` lines to stdout and logs/<RUN_ID>.txt."""

    def __init__(self, run_id: str, enabled: bool):
        self.enabled, self.path, self.console = enabled, Path("logs") / f"{run_id}.txt", True  # claim_outputs made it

    def __call__(self, msg: str, console: bool = True) -> None:
        if not self.enabled:
            return
        if console and self.console:
            try:
                print(msg, flush=True)
            except OSError:  # the terminal is gone (SIGHUP, a closed pipe): the log file keeps every line
                self.console, sys.stdout = False, open(os.devnull, "w")
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(msg + "\n")
        except OSError as e:  # "[Errno 28] No space left on device" alone names no file
            raise OSError(e.errno, f"{e.strerror} (writing {self.path})") from None


class Interrupted(KeyboardInterrupt):
    """One of STOP_SIGNALS outside the training loop's own stop: in export, scoring or TTT, or a second signal."""

    def __init__(self, signum: int, hint: str = ""):
        super().__init__(f"interrupted by {signal.Signals(signum).name}" + (f": {hint}" if hint else ""))
        self.signum = signum


def raise_interrupted(signum: int, _) -> None:
    raise Interrupted(signum)


# ===== Optimizer: Parallel Muon for the banks, AdamW for everything else =====
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan, modded-nanogpt)
# Polar Express (Amsel et al. 2025; PR #1344): one (a, b, c) per iteration, the last repeated after 5
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
PARAM_TABLE = (  # (group, name predicate): every parameter's optimizer and lr/wd, matched exactly once
    ("muon", lambda n: n in BANKS), ("token", lambda n: n in EMBED_TABLES),
    ("head", lambda n: n == "lm_head.weight"),
    ("cap", lambda n: n == "softcap_pm"),  # AsymLogit's caps (about 30): weight decay would pull them to 1/ADAM_WD
    ("scalar", lambda n: n not in BANKS and n not in EMBED_TABLES and n not in ("lm_head.weight", "softcap_pm")))


def newton_schulz(G_BMN: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, polar: bool = False) -> Tensor:
    """Each matrix's approximate polar factor U V^T (singular values ~[0.7, 1.2]: Muon's design); bf16 as reference."""
    X = G_BMN.to(dtype)
    if tall := X.size(-2) > X.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for k in range(steps):  # baddbmm fuses the polynomial's sums into the matmuls: 3 kernels per step
        a, b, c = POLAR_EXPRESS[min(k, len(POLAR_EXPRESS) - 1)] if polar else NS_COEFFS
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    return X.mT if tall else X


def newton_schulz_stacked(Gs: list[Tensor], steps: int, dtype: torch.dtype, polar: bool = False) -> list[Tensor]:
    """newton_schulz of banks of one shape up to transposition (MLP up and down) as one batch: half the launches."""
    if len(Gs) == 1:
        return [newton_schulz(Gs[0], steps, dtype=dtype, polar=polar)]
    tall = [g.size(-2) > g.size(-1) for g in Gs]
    X = newton_schulz(torch.cat([g.mT if t else g for g, t in zip(Gs, tall)]), steps, dtype=dtype, polar=polar)
    return [x.mT if t else x for x, t in zip(X.split([g.size(0) for g in Gs]), tall)]


def nesterov_momentum_(bufs: list[Tensor], grads: list[Tensor], momentum: float) -> list[Tensor]:
    """buf = mu * buf + g in place, then the Nesterov direction g + mu * buf; one launch each over all banks."""
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    return list(torch._foreach_add(grads, bufs, alpha=momentum))


class ParallelMuon(torch.optim.Optimizer):
    """Muon over 3-D banks, sharded along the bank dim (PR #399); phases: launch_reduce_scatter, finish_reduce_scatter
    (averaged), [caller clips], step (momentum, NS of the local shard; all-gathers overlap the next stack's NS)."""

    def __init__(self, banks: list[Tensor], lr: float, momentum: float, weight_decay: float, ns_steps: int,
                 comm_dtype: torch.dtype, world_size: int, polar: bool = False, row_normalize: bool = False):
        super().__init__(banks, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        self.comm_dtype, self.world_size, self.polar, self.row_normalize = comm_dtype, world_size, polar, row_normalize
        self.banks = sorted(banks, key=lambda p: -p.numel())  # biggest reduce-scatter first
        self.pending: list[tuple[Tensor, Tensor, object]] = []  # (bank, grad shard, async work)

    def shard_rows(self, p: Tensor) -> int:
        return -(-p.shape[0] // self.world_size)  # bank dim padded to a multiple of world size

    def gathered(self, t: Tensor, async_op: bool = False) -> tuple[Tensor, object]:
        if self.world_size == 1:
            return t, None
        full = t.new_empty((t.shape[0] * self.world_size, *t.shape[1:]))
        return full, _all_gather(full, t.contiguous(), async_op=async_op)

    def whole_momentum(self, p: Tensor) -> Tensor | None:
        """Bank p's momentum gathered from every rank's shard (a collective), on the CPU; None before step 1."""
        m = self.state.get(p, {}).get("momentum")
        return None if m is None else self.gathered(m)[0][: p.shape[0]].to("cpu", copy=True)

    def load_whole_momentum(self, p: Tensor, m: Tensor | None, rank: int) -> None:
        """Inverse of whole_momentum: keep this rank's shard (any world size)."""
        self.state.pop(p, None)
        if m is not None:
            rows = self.shard_rows(p)
            padded = F.pad(m, (0, 0, 0, 0, 0, rows * self.world_size - m.shape[0]))  # bank dim: rows x world size
            self.state[p]["momentum"] = padded[rank * rows: (rank + 1) * rows].to(p.device, self.comm_dtype)

    def launch_reduce_scatter(self) -> None:
        assert not self.pending, "previous step's reduce-scatter was never finished"
        for p in self.banks:
            if self.world_size == 1:
                self.pending.append((p, p.grad.to(self.comm_dtype), None))
                continue
            rows = self.shard_rows(p)
            padded = p.grad.new_zeros((rows * self.world_size, *p.shape[1:]), dtype=self.comm_dtype)
            padded[: p.shape[0]].copy_(p.grad)
            shard = padded.new_empty((rows, *p.shape[1:]))
            self.pending.append((p, shard, _reduce_scatter(shard, padded, async_op=True)))

    def finish_reduce_scatter(self) -> Tensor:
        """Wait for the shards, average them; returns this rank's share of the squared grad norm."""
        shards = [shard for _, shard, _ in self.pending]
        if self.world_size > 1:
            for _, _, work in self.pending:
                work.wait()
            torch._foreach_div_(shards, float(self.world_size))
        return torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32)).square().sum()  # one launch

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, wd, mom, ns = group["lr"], group["weight_decay"], group["momentum"], group["ns_steps"]
        for p, shard, _ in self.pending:
            if "momentum" not in self.state[p]:
                self.state[p]["momentum"] = torch.zeros_like(shard)
        bufs = [self.state[p]["momentum"] for p, _, _ in self.pending]
        directions = nesterov_momentum_(bufs, [shard for _, shard, _ in self.pending], mom)
        if self.row_normalize:  # MuonEq-R (the 2026-04-03 record): rows of equal norm into NS
            directions = [d / d.float().norm(dim=-1, keepdim=True).clamp_min(1e-7).to(d.dtype) for d in directions]
        stacks: dict[tuple, list[int]] = {}  # banks by matrix shape up to transposition, biggest first
        for i, dvec in enumerate(directions):
            stacks.setdefault(tuple(sorted(dvec.shape[-2:])), []).append(i)
        previous = []
        for idx in stacks.values():
            updates = newton_schulz_stacked([directions[i] for i in idx], ns, bufs[idx[0]].dtype, self.polar)
            current = []
            for i, update in zip(idx, updates):
                directions[i] = None  # free each direction once orthogonalised
                current.append((self.pending[i][0], *self.gathered(update, async_op=True)))
            for prev in previous:
                self._apply(*prev, lr, wd)  # overlaps this stack's all-gathers
            previous = current
        for prev in previous:
            self._apply(*prev, lr, wd)
        self.pending = []

    @staticmethod
    def _apply(p: Tensor, full: Tensor, work, lr: float, wd: float) -> None:
        if work is not None:
            work.wait()
        scale = max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5  # keeps RMS update size across aspect ratios
        p.mul_(1.0 - lr * wd).add_(full[: p.shape[0]], alpha=-lr * scale)


def group_parameters(model: nn.Module) -> dict[str, list[tuple[str, Tensor]]]:
    groups: dict[str, list[tuple[str, Tensor]]] = {g: [] for g, _ in PARAM_TABLE}
    for name, p in model.named_parameters():
        hits = [g for g, pred in PARAM_TABLE if pred(name)]
        assert len(hits) == 1, f"parameter {name} matches optimizer groups {hits}: the table must cover it once"
        groups[hits[0]].append((name, p))
    return groups


class Optimizers:
    """Parallel Muon + AdamW (PARAM_TABLE): reduce-scatter the banks and all-reduce the replicated grads (one buffer),
    wait, one scalar all-reduce for the global grad norm, clip, AdamW, Muon with overlapped all-gathers."""

    def __init__(self, model: nn.Module, cfg: Hyperparameters, rt: Runtime):
        groups = group_parameters(model)
        self.keep_grads = False  # zero .grad instead of freeing it (set by the Trainer while CUDA graphs use it)
        self.rank, self.clip_norm = rt.rank, cfg.grad_clip_norm
        bf16 = cfg.muon_reduce_dtype == "bf16" or (cfg.muon_reduce_dtype == "auto" and rt.device.type == "cuda")
        self.muon = ParallelMuon([p for _, p in groups["muon"]], cfg.matrix_lr, cfg.muon_momentum, cfg.muon_wd,
                                 cfg.muon_backend_steps, torch.bfloat16 if bf16 else torch.float32, rt.world_size,
                                 cfg.muon_polar_express, cfg.muon_row_normalize)
        table_lr = cfg.tied_embed_lr if cfg.tie_embeddings else cfg.embed_lr
        adam_groups = [dict(params=[p for _, p in groups[g]], lr=lr, weight_decay=wd, base_lr=lr)
                       for g, lr, wd in (("token", table_lr, cfg.embed_wd), ("scalar", cfg.scalar_lr, cfg.adam_wd),
                                         ("head", cfg.head_lr, 0.0), ("cap", cfg.scalar_lr, 0.0)) if groups[g]]
        self.adam = torch.optim.AdamW(adam_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                      fused=rt.device.type == "cuda")
        self.muon.param_groups[0]["base_lr"] = cfg.matrix_lr
        self.replicated = [p for g, _ in PARAM_TABLE if g != "muon" for _, p in groups[g]]

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=not self.keep_grads)
        self.muon.zero_grad(set_to_none=not self.keep_grads)

    def set_schedule(self, lr_scale: float, muon_momentum: float) -> None:
        for g in self.adam.param_groups + self.muon.param_groups:
            g["lr"] = g["base_lr"] * lr_scale
        self.muon.param_groups[0]["momentum"] = muon_momentum

    @torch.no_grad()
    def step(self) -> Tensor:
        """One optimizer step over reduced gradients; returns the global grad norm (pre-clip)."""
        self.muon.launch_reduce_scatter()
        # never empty: the token table is in every forward
        replicated = FlatTensors([p.grad for p in self.replicated if p.grad is not None])
        sq, flat = self.muon.finish_reduce_scatter(), replicated.mean()
        if self.rank == 0:  # replicated grads are identical on all ranks: count them once
            sq = sq + flat.dot(flat)
        all_reduce_sum_(sq)
        norm = sq.sqrt()
        if self.clip_norm > 0:
            coef = (self.clip_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([shard for _, shard, _ in self.muon.pending], coef)
            flat.mul_(coef)
        replicated.write_back()
        self.adam.step()
        self.muon.step()
        return norm

    def state_dict(self) -> dict:
        """AdamW's state (live references) and Muon's momentum as whole banks (a collective): any world size."""
        return {"adam": self.adam.state_dict(), "momentum": [self.muon.whole_momentum(p) for p in self.muon.banks]}

    def load_state_dict(self, state: dict) -> None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.adam.param_groups]
        self.adam.load_state_dict(state["adam"])
        for group, own in zip(self.adam.param_groups, settings):  # the moments are restored, the settings ours
            group.update(own)
        for p, m in zip(self.muon.banks, state["momentum"]):
            self.muon.load_whole_momentum(p, m, self.rank)


# ===== Data: challenge shards, memory-mapped; every rank/accum split sees the same global batch =====
SHARD_MAGIC, SHARD_VERSION, HEADER_BYTES = 20240520, 1, 1024
GET_DATA = ("get FineWeb with `python3 data/cached_challenge_fineweb.py --variant sp8192_caseops` (network), or run "
            "`bash data/quickstart.sh` for the offline sample")
SAMPLE_MARK = 0x504D4153  # header word 3 of data/make_sample.py's shards (b"SAMP"; FineWeb's hold 0)
BOS_ID = 1  # every document of a shard starts with it: the challenge tokenizers' <s>
CASEOPS_TITLE = "\ue001"  # the first of CaseOps' case operators (U+E001..E004), a piece of its tokenizers only
DOC_BOUNDARY_TOKENS = 256  # varlen: room for a document per 256 tokens (FineWeb: 85 in 98K tokens)


def span_cuts(cfg: Hyperparameters, T: int) -> int:
    """The most a row of T's documents are cut by TRAIN_SEQ_SCHEDULE's shortest span."""
    return (T - 1) // min(n for _, n in cfg.seq_spans) if cfg.seq_spans else 0


def segment_room(B: int, T: int, cuts: int = 0) -> int:
    """varlen's cu_seqlens segments, B rows of T: row starts, `cuts` span cuts, a document per DOC_BOUNDARY_TOKENS."""
    return B * (1 + cuts) + B * T // DOC_BOUNDARY_TOKENS


def tokenizer_sha256(path: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"TOKENIZER_PATH {path} does not exist: {GET_DATA}")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_tokenizer(sp, tokens: np.ndarray, where: str, docs: int = 50) -> None:
    """90% of the first `docs` documents must re-encode to their ids (another tokenizer: 3.18 bpb, not 3.42, exit 0)."""
    starts = np.flatnonzero(np.asarray(tokens[:1 << 22]) == BOS_ID)[:docs + 1]
    ids = [np.asarray(tokens[a + 1:b]).tolist() for a, b in zip(starts, starts[1:])]
    ids = [d for d in ids if max(d, default=0) < sp.get_piece_size()]  # ids out of range: open_shard's to report
    if (exact := sum(a == b for a, b in zip(ids, sp.encode(sp.decode(ids))))) < 0.9 * len(ids):
        raise ValueError(f"TOKENIZER_PATH re-encodes only {exact} of the first {len(ids)} documents of {where} into "
                         "their ids: it is not the tokenizer these shards were made with")


def doc_keys(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each BOS-started document's start, end and a uint64 key of its length and first 4 tokens (0 past its end)."""
    starts = np.flatnonzero(np.asarray(tokens) == BOS_ID)
    ends, at = np.append(starts[1:], len(tokens)).astype(np.int64), starts[:, None] + 1 + np.arange(4)
    first = np.where(at < ends[:, None], np.asarray(tokens)[np.minimum(at, len(tokens) - 1)], 0).astype(np.uint64)
    key = (ends - starts).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # wraps: a hash, not a number
    for j in range(4):
        key ^= first[:, j] << np.uint64(16 * j)
    return starts, ends, key


def val_docs_in(tokens: np.ndarray, val: np.ndarray, val_index: dict) -> tuple[set[int], int]:
    """The val documents in `tokens`, token for token, and their tokens; `val_index`: key -> (start, end, number)."""
    (starts, ends, keys), found, n = doc_keys(tokens), set(), 0
    for i in np.flatnonzero(np.isin(keys, np.fromiter(val_index, np.uint64, len(val_index)))):
        a, b = starts[i], ends[i]
        same = [j for c, d, j in val_index[keys[i]] if np.array_equal(tokens[a:b], val[c:d])]
        found, n = found | set(same), n + (b - a) * bool(same)
    return found, n


class ShardError(ValueError):
    """A bad shard. Met mid-run (shards are range-checked when first opened), it stops training with a checkpoint."""


def shard_token_count(path: str | Path) -> int:
    path = Path(path)
    if (size := path.stat().st_size) < HEADER_BYTES:
        raise ShardError(f"{path}: truncated shard ({size} bytes, header needs {HEADER_BYTES})")
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: not a challenge shard (magic {header[0]}, version {header[1]})")
    if (n := int(header[2])) <= 0:
        raise ShardError(f"{path}: shard holds no tokens")
    if size != HEADER_BYTES + 2 * n:
        raise ShardError(f"{path}: size {size} != {HEADER_BYTES + 2 * n} for {n} tokens (truncated?)")
    return n


def raw_shard(path: str | Path) -> np.ndarray:
    """A shard's tokens, not range-checked (open_shard's check)."""
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(shard_token_count(path),))


def open_shard(path: str | Path, vocab_size: int) -> np.ndarray:
    tokens = raw_shard(path)
    if (top := int(tokens.max())) >= vocab_size:
        raise ShardError(f"{path}: token id {top} >= VOCAB_SIZE {vocab_size}")
    return tokens


def shards_fingerprint(files: list[str]) -> str:
    """16 evenly spaced tokens a shard, hashed: other data of equal sizes differs, a token fixed in place mostly not."""
    h = hashlib.sha256()
    for tokens in map(raw_shard, files):
        h.update(np.ascontiguousarray(tokens[np.linspace(0, len(tokens) - 1, 16).astype(np.int64)]).tobytes())
    return h.hexdigest()[:16]


def is_sample_shard(path: str | Path) -> bool:
    """A shard of the offline sample (stdlib docstrings): its scores are not comparable to FineWeb's."""
    return int(np.fromfile(path, dtype="<i4", count=4)[3]) == SAMPLE_MARK


def shard_files(data_path: str, split: str) -> list[str]:
    if not Path(data_path).is_dir():
        raise FileNotFoundError(f"DATA_PATH {data_path} is not a directory: {GET_DATA}")
    files = sorted(glob.glob(str(Path(data_path) / f"fineweb_{split}_[0-9]*.bin")))  # not the byte sidecar
    if not files:
        raise FileNotFoundError(f"no shards matching {Path(data_path) / f'fineweb_{split}_[0-9]*.bin'}: {GET_DATA}")
    return files


def val_byte_sidecar(data_path: str, n_tokens: int) -> Tensor | None:
    """Each val token's bytes before CaseOps' case transform (fineweb_val_bytes_*.bin); None: the tokenizer's rule."""
    if not (files := sorted(glob.glob(str(Path(data_path) / "fineweb_val_bytes_*.bin")))):
        return None
    counts = np.concatenate([np.fromfile(f, "<u2", shard_token_count(f), offset=HEADER_BYTES) for f in files])
    if counts.size != n_tokens:
        raise ShardError(f"{data_path}: the byte sidecar holds {counts.size} values for {n_tokens} val tokens")
    if not counts.any():
        raise ShardError(f"{data_path}: the byte sidecar is all zeros (val_bpb would divide by 0): rebuild it")
    return torch.from_numpy(counts.astype(np.int64))


def val_manifest(data_path: str) -> tuple[dict, str]:
    """The val set's {docs, tokens, bytes} per DATA_PATH/manifest.json (make_caseops.py) or ../manifest.json; path."""
    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}): restore it or remove it") from None
    ours, export = Path(data_path) / "manifest.json", Path(data_path).parent / "manifest.json"
    if isinstance(val := read(ours).get("val"), dict):
        return {k: val.get(k) for k in ("docs", "tokens", "bytes")}, str(ours)
    for entry in read(export).get("datasets", []):
        if Path(str(entry.get("path", ""))).name == Path(data_path).name:
            stats = entry.get("stats", {})
            return {"docs": stats.get("docs_val"), "tokens": stats.get("tokens_val")}, str(export)
    return {}, ""


class CoprimeSampler:
    """Over all train shards (the later records'): sequence k is slot (k * stride) mod n of n, stride coprime to n (each
    slot once a cycle, shards mixed). 0.0131 better than sequential (1,500-step proxy: 2.5 passes over 80M tokens)."""

    def __init__(self, files: list[str], vocab_size: int, seq_len: int):
        self.shards = [open_shard(f, vocab_size) for f in files]
        self.starts = np.cumsum([0] + [len(t) for t in self.shards])
        self.seq_len, self.n, self.k = seq_len, (int(self.starts[-1]) - 1) // seq_len, 0
        if self.n < 1:
            raise ValueError(f"train shards hold fewer than TRAIN_SEQ_LEN+1={seq_len + 1} tokens")
        self.stride = max(1, round(self.n * 0.6180339887))  # golden-ratio stride: neighbours land far apart
        while math.gcd(self.stride, self.n) != 1:
            self.stride += 1

    def state_dict(self) -> dict:
        return {"k": self.k}

    def load_state_dict(self, s: dict) -> None:
        self.k = s["k"]

    def _tokens(self, lo: int, hi: int) -> np.ndarray:
        parts, i = [], int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            a, b = lo - self.starts[i], min(hi, self.starts[i + 1]) - self.starts[i]
            parts.append(np.asarray(self.shards[i][a:b]))
            lo, i = self.starts[i] + b, i + 1
        return np.concatenate(parts)

    def take_sequences(self, count: int) -> np.ndarray:
        slots = (np.arange(self.k, self.k + count) * self.stride) % self.n
        self.k += count
        return np.stack([self._tokens(int(j) * self.seq_len, (int(j) + 1) * self.seq_len + 1) for j in slots])


class SequentialSampler:
    """The reference's order: the shards front to back, wrapping around, one contiguous chunk per step."""

    def __init__(self, files: list[str], vocab_size: int, seq_len: int):
        self.files, self.vocab_size, self.seq_len, self.file_idx, self.pos = files, vocab_size, seq_len, 0, 0
        self.tokens = open_shard(files[0], vocab_size)

    def state_dict(self) -> dict:
        return {"file_idx": self.file_idx, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        if s["file_idx"] != self.file_idx:
            self.tokens = open_shard(self.files[s["file_idx"]], self.vocab_size)
        self.file_idx, self.pos = s["file_idx"], s["pos"]

    def take_sequences(self, count: int) -> np.ndarray:
        """count sequences of T + 1 tokens from count * T + 1; the last token is read again by the next batch."""
        T, parts, need = self.seq_len, [], count * self.seq_len + 1
        while need:
            if self.pos >= len(self.tokens):
                self.file_idx, self.pos = (self.file_idx + 1) % len(self.files), 0
                self.tokens = open_shard(self.files[self.file_idx], self.vocab_size)
                continue
            k = min(need, len(self.tokens) - self.pos)
            parts.append(np.asarray(self.tokens[self.pos: self.pos + k]))
            self.pos, need = self.pos + k, need - k
        self.pos -= 1  # the peeked token was read from the current shard, so pos >= 1 here
        return np.lib.stride_tricks.sliding_window_view(np.concatenate(parts), T + 1)[::T]


class TrainLoader:
    """Global batch = TRAIN_BATCH_TOKENS / TRAIN_SEQ_LEN sequences; micro-step m of rank r takes [(m * world + r) * s,
    ... + s) at any world size and accumulation. prefetch() builds the next batch in this thread (3-4 ms a record step;
    a worker thread stalled the host 55 ms) into one of two pinned buffers, copied on a side stream as the GPU works."""

    def __init__(self, files: list[str], cfg: Hyperparameters, rt: Runtime):
        sampler = CoprimeSampler if cfg.train_sampling == "coprime" else SequentialSampler
        self.sampler = sampler(files, cfg.vocab_size, cfg.train_seq_len)
        self.tokens = sum(map(shard_token_count, files))  # with the sampling, what a position is in (RESUME checks it)
        self.data = (f"TRAIN_SAMPLING={cfg.train_sampling} over {len(files)} shards of {self.tokens} tokens, sha256 "
                     f"of 16 tokens each {shards_fingerprint(files)}")  # coprime's position counts sequences:
        self.data += f", TRAIN_SEQ_LEN={cfg.train_seq_len}" if cfg.train_sampling == "coprime" else ""
        self.rt, self.seq_len, self.seqs_per_step = rt, cfg.train_seq_len, cfg.train_batch_tokens // cfg.train_seq_len
        self.seqs_per_micro = self.seqs_per_step // (rt.world_size * rt.grad_accum_steps)
        self.ahead = None  # (sampler state before it, x, y, copy-done event) of the prefetched step
        varlen = cfg.doc_isolation and rt.attn_backend in SEGMENT_BACKENDS
        self.cuts = span_cuts(cfg, cfg.train_seq_len)
        self.max_docs = segment_room(self.seqs_per_micro, cfg.train_seq_len, self.cuts) if varlen else 0
        if rt.device.type == "cuda":
            shape = (rt.grad_accum_steps * self.seqs_per_micro, self.seq_len)
            self.host = [[torch.empty(shape, dtype=torch.int64, pin_memory=True) for _ in "xy"] for _ in "ab"]
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]  # last copy out of each pinned pair
            self.stream, self.flip = torch.cuda.Stream(rt.device), 0

    def _load(self) -> tuple:
        state = copy.deepcopy(self.sampler.state_dict())
        try:
            seqs, s, W = self.sampler.take_sequences(self.seqs_per_step), self.seqs_per_micro, self.rt.world_size
            if self.max_docs:  # varlen's fixed cu_seqlens: more documents would merge (every rank's counted: all stop)
                docs = (seqs[:, 1:-1] == BOS_ID).reshape(len(seqs) // s, -1).sum(1) + s * (1 + self.cuts)
                if docs.max() > self.max_docs:
                    raise ShardError(f"a micro-batch holds {docs.max()} documents, more than varlen's cu_seqlens holds"
                                     f" ({self.max_docs}: one per {DOC_BOUNDARY_TOKENS} tokens); use ATTN_BACKEND=math")
        except ShardError:  # the position stays before this batch, where a checkpoint resumes
            self.sampler.load_state_dict(state)
            raise
        mine = np.concatenate([seqs[(m * W + self.rt.rank) * s:][:s] for m in range(self.rt.grad_accum_steps)])
        if self.rt.device.type != "cuda":
            t = torch.from_numpy(mine.astype(np.int64))
            return state, t[:, :-1].contiguous(), t[:, 1:].contiguous(), None
        self.flip ^= 1
        (hx, hy), done = self.host[self.flip], self.copied[self.flip]
        done.synchronize()  # the copy that last read this pair (two steps ago) is finished
        np.copyto(hx.numpy(), mine[:, :-1])
        np.copyto(hy.numpy(), mine[:, 1:])
        with torch.cuda.stream(self.stream):
            x, y = hx.to(self.rt.device, non_blocking=True), hy.to(self.rt.device, non_blocking=True)
            done.record()
        return state, x, y, done

    def prefetch(self) -> None:
        """Queue the next batch once a step is launched: in next_batch, host work idled the GPU (capped steps sync)."""
        if self.ahead is None:
            try:
                self.ahead = self._load()
            except ShardError as e:  # raised by next_batch: the step under way completes first
                self.ahead = e

    def next_batch(self) -> list[tuple[Tensor, Tensor]]:
        self.prefetch()
        if isinstance(self.ahead, ShardError):
            raise self.ahead
        (_, x, y, done), self.ahead = self.ahead, None
        if done is not None:  # the compute stream waits for the copy; the memory is freed after its use
            compute = torch.cuda.current_stream(self.rt.device)
            compute.wait_event(done)
            x.record_stream(compute), y.record_stream(compute)
        s = self.seqs_per_micro
        return [(x[m * s:(m + 1) * s], y[m * s:(m + 1) * s]) for m in range(self.rt.grad_accum_steps)]

    def state_dict(self) -> dict:
        """Position of the next batch next_batch() will return, and the data it is a position in."""
        return dict(copy.deepcopy(self.ahead[0] if isinstance(self.ahead, tuple) else self.sampler.state_dict()),
                    data=self.data)

    def load_state_dict(self, s: dict) -> None:
        if s["data"] != self.data:
            raise ValueError(f"the checkpoint's data position is in {s['data']}; this run reads {self.data}")
        self.ahead = None
        self.sampler.load_state_dict(copy.deepcopy(s))


# ===== Model: banked GPT on plain PyTorch ops (the Kernels section below swaps in Triton versions) =====
def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def rope_tables(seq_len: int, rope_dims: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin (seq_len, rope_dims/2) in fp32, made once (in the kernels pow/sin/cos cost more than loads)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rope_dims, 2, dtype=torch.float32) / rope_dims)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def qk_norm_rope_reference(x_BTHD: Tensor, cos_TF: Tensor, sin_TF: Tensor, gain_H: Tensor | None) -> Tensor:
    """What the kernel fuses: RMSNorm per head, partial RoPE (the first 2F channels, half-split pairs), gain."""
    y, T, half = rms_norm(x_BTHD), x_BTHD.size(1), cos_TF.size(1)
    if half > 0:
        cos, sin = (t[:T, None, :].to(y.dtype) for t in (cos_TF, sin_TF))
        y1, y2, rest = y[..., :half], y[..., half:2 * half], y[..., 2 * half:]
        y = torch.cat((y1 * cos + y2 * sin, y2 * cos - y1 * sin, rest), dim=-1)
    return y if gain_H is None else y * gain_H.to(y.dtype)[:, None]


def segment_starts(ids_BT: Tensor, span: Tensor | None = None) -> Tensor:
    """Segment starts: a row's start, each BOS, every `span` tokens into a document (a tensor: no recompile)."""
    pos = torch.arange(ids_BT.size(1), device=ids_BT.device)
    starts = (ids_BT == BOS_ID) | (pos == 0)
    if span is None:
        return starts
    first = torch.cummax(torch.where(starts, pos, 0), dim=1).values  # the document's first position
    return starts | ((pos - first) % span == 0)


def document_mask(ids_BT: Tensor, span: Tensor | None = None) -> Tensor:
    """(B, 1, T, T) attention mask: causal, within a segment (segment_starts)."""
    docs, T = torch.cumsum(segment_starts(ids_BT, span), dim=1), ids_BT.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids_BT.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def document_segments(ids_BT: Tensor, span: Tensor | None = None, cuts: int = 0) -> Tensor:
    """varlen's int32 cu_seqlens of the rows' segments, padded with B*T to segment_room + 1: one compiled shape."""
    (B, T), dev = ids_BT.shape, ids_BT.device
    starts = segment_starts(ids_BT, span)
    nth = torch.arange(1, segment_room(B, T, cuts) + 1, device=dev)
    return F.pad(torch.searchsorted(starts.flatten().cumsum(0), nth), (0, 1), value=B * T).to(torch.int32)


def attention(q_BTHD: Tensor, k_BTKD: Tensor, v_BTKD: Tensor, backend: str, mask: Tensor | None = None) -> Tensor:
    """Causal attention, in documents given document_mask or document_segments; varlen repeats K/V (0.8% faster)."""
    if mask is not None and backend in SEGMENT_BACKENDS:
        (B, T, H, D), K = q_BTHD.shape, k_BTKD.size(2)
        if backend == "fa3":  # FlashAttention-3's varlen call, as the records make it; its GQA on unrepeated K/V
            from flash_attn_interface import flash_attn_varlen_func
            y = flash_attn_varlen_func(q_BTHD.reshape(B * T, H, D), k_BTKD.reshape(B * T, K, D),
                                       v_BTKD.reshape(B * T, K, D), mask, mask, T, T, causal=True)
            return (y[0] if isinstance(y, tuple) else y).view(B, T, H, D)
        if backend == "cudnn_fe":  # nvidia-cudnn-frontend's op (1.35x varlen's kernel fwd+bwd), GQA unrepeated
            import cudnn  # return_lse: its differentiable form; packed (v: a view of the fused q|k|v)
            q, k, v = (t.reshape(B * T, -1, D).contiguous() for t in (q_BTHD, k_BTKD, v_BTKD))
            return cudnn.sdpa_torch(q, k, v, is_causal=True, cu_seqlens_q=mask, cu_seqlens_kv=mask, max_seqlen_q=T,
                                    max_seqlen_kv=T, return_lse=True)[0].view(B, T, H, D)
        from torch.nn.attention.varlen import varlen_attn
        k, v = (t.repeat_interleave(H // K, 2).reshape(B * T, H, D) for t in (k_BTKD, v_BTKD))
        return varlen_attn(q_BTHD.reshape(B * T, H, D), k, v, mask, mask, T, T, window_size=(-1, 0)).view(B, T, H, D)
    if mask is None and backend == "fa3":
        from flash_attn_interface import flash_attn_func  # FlashAttention-3 (Hopper), optional
        y = flash_attn_func(q_BTHD, k_BTKD, v_BTKD, causal=True)
        return y[0] if isinstance(y, tuple) else y
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTKD, v_BTKD))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return y.transpose(1, 2)


def exclusive_self_attention_reference(y_BTHD: Tensor, v_BTKD: Tensor) -> Tensor:
    """XSA (PR #265 lineage): each head's output minus its part along its token's normalised value (context only)."""
    (B, T, H, D), K = y_BTHD.shape, v_BTKD.size(2)
    y, vn = y_BTHD.reshape(B, T, K, H // K, D), F.normalize(v_BTKD, dim=-1).unsqueeze(-2)
    return (y - (y * vn).sum(-1, keepdim=True) * vn).reshape(B, T, H, D)


def softcap(logits: Tensor, cap: float | Tensor) -> Tensor:
    """c tanh(z / c); cap a Tensor (s+, s-): AsymLogit, s+ where z >= 0, s- below, in the caps' precision (in bf16
    they moved in steps of 0.125 near 30 under eager autocast), the result in the logits' dtype."""
    if isinstance(cap, Tensor):
        z = logits.to(torch.promote_types(logits.dtype, cap.dtype))
        c = torch.where(z >= 0, cap[0], cap[1])
        return (c * torch.tanh(z / c)).to(logits.dtype)
    return cap * torch.tanh(logits / cap) if cap > 0 else logits


def cross_entropy(logits_NV: Tensor, targets_N: Tensor, reduction: str = "mean") -> Tensor:
    """Cross entropy in fp32 of the (capped) logits: the training loss's, and every scorer's."""
    return F.cross_entropy(logits_NV.float(), targets_N, reduction=reduction)


@dataclass(frozen=True)
class Ops:
    """The ops a forward needs that exist twice: as PyTorch ops (below) and as Triton kernels (Kernels)."""
    qk_norm_rope: Callable  # (x_BTHD, cos_TF, sin_TF, gain_H | None) -> BTHD
    xsa: Callable  # (y_BTHD, v_BTKD) -> BTHD


TORCH_OPS = Ops(qk_norm_rope_reference, exclusive_self_attention_reference)


# The grid of late QAT and the export: row scale = clip / qmax, floored, fp16 (as stored); codes round(w / scale).
def grid_scale(clip_R: Tensor, qmax: int, floor: float) -> Tensor:
    return (clip_R / qmax).clamp_min(floor).half().float()


def grid_codes(w_RC: Tensor, clip_R: Tensor, scale_R: Tensor, qmax: int) -> Tensor:
    clip = clip_R[:, None]
    return torch.clamp(torch.round(torch.maximum(torch.minimum(w_RC, clip), -clip) / scale_R[:, None]), -qmax, qmax)


def clip_sigmas(cfg: Hyperparameters, matrix: str) -> float:
    """A bank matrix kind's SD clip k (0: search). MLP 5, attention 7 (PQB, GPTQ): 39 KB less, 0.00011 better than 6."""
    own = cfg.mlp_clip_sigmas if matrix.startswith("mlp.") else cfg.attn_clip_sigmas
    return own if own > 0 else cfg.matrix_clip_sigmas


def fake_quant(w: Tensor, qmax: int, floor: float, sigmas: float = 0.0) -> Tensor:
    """Straight-through fake quantisation of rows to quantize_matrix's grid (clip `sigmas` x std, or the max)."""
    w2 = w.detach().reshape(-1, w.size(-1))
    clip = sigmas * w2.std(dim=1) if sigmas > 0 else w2.abs().amax(dim=1)
    scale = grid_scale(clip, qmax, floor)
    q = (grid_codes(w2, clip, scale, qmax) * scale[:, None]).view_as(w)
    return w + (q - w).detach()


class Mode(NamedTuple):
    """A forward's extras: the loop's repeats, late QAT's grid (codes -qat..qat; 0 = off). Every scorer runs SCORING."""
    looping: bool = True
    qat: int = 0


SCORING = Mode()


def bigram_hash(ids_BT: Tensor, buckets: int, isolate: bool = False) -> Tensor:
    """BigramHash slot of (previous, current) pairs: xor hash into buckets - 1; position 0, isolated BOS: the last."""
    t, mod = ids_BT.long(), buckets - 1  # int64: int32 wrapped past id 59,138 (below, the two agree)
    h = torch.bitwise_xor(36313 * t[:, 1:], 27191 * t[:, :-1]) % mod
    if isolate:
        h = torch.where(t[:, 1:] == BOS_ID, mod, h)
    return torch.cat((torch.full_like(t[:, :1], mod), h), dim=1)


class Block(nn.Module):
    """Per-layer control tensors; the layer's matrices live in the model's banks."""

    def __init__(self, dim: int, num_heads: int, qk_gain_init: float, gate_window: int = 0):
        super().__init__()
        self.attn_scale, self.mlp_scale = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.resid_mix = nn.Parameter(torch.stack((torch.ones(dim), torch.zeros(dim))))  # (x, x0) mix
        self.q_gain = nn.Parameter(torch.full((num_heads,), qk_gain_init))
        if gate_window:  # the sparse attention gate's W
            self.attn_gate_w = nn.Parameter(torch.zeros(num_heads, gate_window))


class Adapter(nn.Module):
    """A test-time adapter, cls(cfg, rows, device) (DocLoRA), a row a document. deltas: additions to outputs `names` (q,
    k, v, o; "mlp"; "head", s = 0) at layer-order position s from their input x, or 0. reset(): the model as it was."""

    def deltas(self, names: tuple[str, ...], s: int, x_BTI: Tensor) -> list[Tensor | int]:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


class Pass(NamedTuple):
    """What the layers of one forward share."""
    banks: dict[str, Tensor]  # in the compute dtype; fake-quantized under late QAT
    ve_BTK: Tensor | None  # the value embedding, projected
    mask: Tensor | None  # document_mask or document_segments (DOC_ISOLATION)
    adapter: Adapter | None
    hessians: dict | None  # GPTQ calibration: {(matrix, layer): sum of X^T X of its input}


class DocLoRA(Adapter):
    """TTT_MODE=lora's adapters (the 04-10..04-27 records'): rank-r pairs adding ALPHA/r * B A x on q, k, v, o, the MLP
    (each layer-order position: a repeat has its own) and the head. reset(): B = 0, A a fixed U(+-1/sqrt(in)) draw."""

    def __init__(self, cfg: Hyperparameters, rows: int, device: torch.device):
        super().__init__()
        D, KV, r = cfg.model_dim, cfg.num_kv_heads * cfg.head_dim, cfg.ttt_lora_rank
        outs = {"attn.q": D, "attn.k": KV, "attn.v": KV, "attn.o": D, "mlp": D}
        on = {"attn.q": cfg.ttt_q_lora, "attn.k": cfg.ttt_k_lora, "attn.v": cfg.ttt_v_lora, "attn.o": cfg.ttt_o_lora,
              "mlp": cfg.ttt_mlp_lora, "head": True}
        every = [(n, s) for s in range(len(layer_order(cfg, True))) for n in outs] + [("head", 0)]
        g = torch.Generator().manual_seed(0)  # a draw per possible adapter: a subset keeps the others' A
        A0 = {key: (torch.rand(r, D, generator=g) * 2 - 1) * D ** -0.5 for key in every}
        keys = [key for key in every if on[key[0]]]
        self.index = {key: j for j, key in enumerate(keys)}
        self.A = nn.ParameterList(torch.empty(rows, r, D, device=device) for _ in keys)
        self.B = nn.ParameterList(torch.empty(rows, outs.get(n, cfg.vocab_size), r, device=device) for n, _ in keys)
        self.A0, self.scale = [A0[key].to(device) for key in keys], cfg.ttt_lora_alpha / r
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        for a, b, a0 in zip(self.A, self.B, self.A0):
            a.copy_(a0.expand_as(a))
            b.zero_()

    def deltas(self, names: tuple[str, ...], s: int, x_BTI: Tensor) -> list[Tensor | int]:
        """Adapters `names` at position s (0 where off), of input x: one bmm down (lora loop 34.4 -> 30.9 s, H100)."""
        js, B = [self.index.get((name, s)) for name in names], x_BTI.size(0)
        if not (on := [j for j in js if j is not None]):
            return [0] * len(names)
        z = x_BTI @ torch.cat([self.A[j][:B] for j in on], 1).mT.to(x_BTI.dtype)
        out = {j: zj @ (self.scale * self.B[j][:B].mT).to(x_BTI.dtype) for zj, j in zip(z.chunk(len(on), -1), on)}
        return [0 if j is None else out[j] for j in js]


class GPT(nn.Module):
    def __init__(self, cfg: Hyperparameters, attn_backend: str = "math", ops: Ops = TORCH_OPS):
        super().__init__()
        L, D, V, kv_dim = cfg.num_layers, cfg.model_dim, cfg.vocab_size, cfg.num_kv_heads * cfg.head_dim
        self.cfg, self.attn_backend, self.ops = cfg, attn_backend, ops
        self.input_scale = [1.0 / math.sqrt(i + 1) if cfg.ln_scale else 1.0 for i in range(L)]  # input scale, by layer
        self.tok_emb = nn.Embedding(V, D)
        mlp = int(round(cfg.mlp_mult * D, 6))  # float-exact: 61 * 64 / 448 * 448 is 3903.99...
        shapes = {"qo_bank": (D, D), "kv_bank": (kv_dim, D), "mlp_up_bank": (mlp, D), "mlp_down_bank": (D, mlp)}
        for bank, names in BANKS.items():
            setattr(self, bank, nn.Parameter(torch.empty(len(names) * L, *shapes[bank])))
        self.blocks = nn.ModuleList(Block(D, cfg.num_heads, cfg.qk_gain_init, cfg.attn_gate_window) for _ in range(L))
        rope = rope_tables(max(cfg.train_seq_len, cfg.eval_seq_len), cfg.rope_dims, cfg.rope_base)
        self.register_buffer("rope_cos", rope[0], persistent=False)  # not in state_dict or the artifact
        self.register_buffer("rope_sin", rope[1], persistent=False)
        # TRAIN_SEQ_SCHEDULE's span, set by the trainer before each step
        self.register_buffer("span", torch.tensor(cfg.train_seq_len) if cfg.seq_spans else None, persistent=False)
        n = len(layer_order(cfg, True))  # U-Net skips: the first half pushes, the second pops (the longest order's)
        self.skip_weights = nn.Parameter(torch.ones(min(n // 2, n - n // 2), D))
        if cfg.skip_gates_enabled:
            self.skip_gates = nn.Parameter(torch.zeros_like(self.skip_weights))
        if cfg.parallel_start < L:  # per parallel layer: lane decays (attn, mlp), and [source, lane] scales
            self.parallel_resid = nn.Parameter(torch.full((L - cfg.parallel_start, 2), 1.1))
            self.parallel_post = nn.Parameter(torch.ones(L - cfg.parallel_start, 2, 2))
        if cfg.bigram_vocab_size > 0:  # BigramHash (PR #162 lineage)
            self.bigram = nn.Module()
            self.bigram.embed = nn.Embedding(cfg.bigram_vocab_size, cfg.bigram_dim)
            self.bigram.proj = nn.Linear(cfg.bigram_dim, D, bias=False)
            self.bigram.scale = nn.Parameter(torch.tensor(0.05))
        if cfg.smear_enabled:  # the seed's SmearGate: per-channel mix with the previous position
            self.smear_gate = nn.Parameter(torch.zeros(D))
        if cfg.smear_gate_enabled:  # the 04-27 record's: one gate per position, from the embedding's first channels
            self.smear_gate_w = nn.Parameter(torch.zeros(1, cfg.gate_window))
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if cfg.ve_layer_list:  # value embeddings: token identity re-injected into V of late layers
            self.ve = nn.Module()
            self.ve.embed, self.ve.proj = nn.Embedding(V, cfg.ve_dim), nn.Linear(cfg.ve_dim, kv_dim, bias=False)
            self.ve.scale = nn.Parameter(torch.tensor(0.1))
            self.ve_layer_scales = nn.Parameter(torch.ones(len(cfg.ve_layer_list)))
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(D, V, bias=False)
        if cfg.asym_logit_rescale:
            self.softcap_pm = nn.Parameter(torch.full((2,), cfg.logit_softcap))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg, L = self.cfg, self.cfg.num_layers
        nn.init.normal_(self.tok_emb.weight, std=cfg.tied_embed_init_std)
        banks = dict(self.named_parameters())
        for i in range(L):  # layer by layer, in MATRICES order: the reference's random stream
            for name in MATRICES:
                w = layer_matrix(banks, name, i, L)
                w.zero_() if name in ZERO_INIT else nn.init.orthogonal_(w)
        if cfg.bigram_vocab_size > 0:
            self.bigram.embed.weight.zero_()
            self._init_linear(self.bigram.proj.weight)
        if cfg.ve_layer_list:
            nn.init.normal_(self.ve.embed.weight, std=0.01)
            self._init_linear(self.ve.proj.weight)
        if not cfg.tie_embeddings:
            self.lm_head.weight.zero_()
        if cfg.sparse_attn_gate_enabled and cfg.sparse_attn_gate_init_std > 0:
            for blk in self.blocks:
                nn.init.normal_(blk.attn_gate_w, std=cfg.sparse_attn_gate_init_std)

    @staticmethod
    def _init_linear(w: Tensor) -> None:  # the reference's rule: every other linear >= 64x64 is orthogonal
        nn.init.orthogonal_(w) if min(w.shape) >= 64 else nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def embed(self, ids_BT: Tensor) -> Tensor:
        x = self.tok_emb(ids_BT)
        if self.cfg.bigram_vocab_size > 0:
            b = self.bigram.proj(self.bigram.embed(bigram_hash(ids_BT, self.cfg.bigram_vocab_size,
                                                               self.cfg.doc_isolation)))
            x = x + b * self.bigram.scale.to(b.dtype)
        not_bos = (ids_BT != BOS_ID).unsqueeze(-1).to(x.dtype) if self.cfg.smear_bos_fix else 1.0
        if self.cfg.smear_gate_enabled:
            g = self.smear_lambda.to(x.dtype) * torch.sigmoid(
                F.linear(x[..., :self.cfg.gate_window], self.smear_gate_w.to(x.dtype)))
            x = x + g * not_bos * F.pad(x[:, :-1], (0, 0, 1, 0))
        x = rms_norm(x)
        if self.cfg.smear_enabled:
            g = torch.sigmoid(self.smear_gate.to(x.dtype)) * not_bos
            x = (1 - g) * x + g * F.pad(x[:, :-1], (0, 0, 1, 0))
        return x

    def hidden(self, ids_BT: Tensor, adapter: Adapter | None = None, one_doc: bool = False, mode: Mode = SCORING,
               hessians: dict | None = None) -> Tensor:
        """Final hidden states. one_doc: each row one document's (the scorer's): no mask. hessians: observe's sums."""
        cfg = self.cfg
        if ids_BT.size(1) > self.rope_cos.size(0):
            raise ValueError(f"sequence length {ids_BT.size(1)} > max(TRAIN_SEQ_LEN, EVAL_SEQ_LEN) = "
                             f"{self.rope_cos.size(0)}")
        x = self.embed(ids_BT)
        f = self.shared(ids_BT, x, adapter, one_doc, mode, hessians)
        order, parallel = layer_order(cfg, mode.looping), parallel_positions(cfg, mode.looping)
        x0, skips, lanes, n_enc = x, [], None, len(order) // 2  # lanes: (attention's, MLP's) once parallel
        for pos, i in enumerate(order):
            if parallel[pos] and lanes is None:
                lanes = (x, x)
            if pos >= n_enc and skips:
                x, lanes = self.skip_in(pos - n_enc, skips.pop(), x, lanes)
            x, lanes = self.layer(i, pos, x, x0, lanes, f)
            if pos < n_enc:
                skips.append(x)
        if lanes is not None:
            x = {"mean": 0.5 * (lanes[0] + lanes[1]), "attn": lanes[0], "mlp": lanes[1]}[cfg.parallel_final_lane]
        return rms_norm(x)

    def shared(self, ids_BT: Tensor, x: Tensor, adapter: Adapter | None, one_doc: bool, mode: Mode,
               hessians: dict | None) -> Pass:
        cfg, banks = self.cfg, {bank: getattr(self, bank) for bank in BANKS}
        if mode.qat:
            banks = {k: fake_quant(b, mode.qat, cfg.int6_scale_floor, clip_sigmas(cfg, BANKS[k][0]))
                     for k, b in banks.items()}
        dtype = torch.bfloat16 if torch.is_autocast_enabled(x.device.type) else x.dtype
        ve_BTK, mask = None, None
        if cfg.ve_layer_list:
            ve_BTK = self.ve.proj(self.ve.embed(ids_BT))
            ve_BTK = ve_BTK * self.ve.scale.to(ve_BTK.dtype)
        if cfg.doc_isolation and not one_doc:  # once for all layers
            mask = (document_segments(ids_BT, self.span, span_cuts(cfg, ids_BT.size(1)))
                    if self.attn_backend in SEGMENT_BACKENDS else document_mask(ids_BT, self.span))
        return Pass({k: b.to(dtype) for k, b in banks.items()}, ve_BTK, mask, adapter, hessians)

    def skip_in(self, j: int, skip: Tensor, x: Tensor, lanes: tuple | None) -> tuple[Tensor, tuple | None]:
        """U-Net skip j into x, or the attention's lane: sig(g) x + (1 - sig(g)) skip, or + skip."""
        skip, into = self.skip_weights[j].to(x.dtype) * skip, x if lanes is None else lanes[0]
        into = (torch.lerp(skip, into, torch.sigmoid(self.skip_gates[j].to(x.dtype)))
                if self.cfg.skip_gates_enabled else into + skip)
        return (into, None) if lanes is None else (x, (into, lanes[1]))

    def layer(self, i: int, s: int, x: Tensor, x0: Tensor, lanes: tuple | None, f: Pass) -> tuple[Tensor, tuple | None]:
        """Layer i at position s: serial, or parallel (2026-03-31 record: each reads its lane, writes both)."""
        mix = self.blocks[i].resid_mix.to(x.dtype)
        if lanes is None:
            x = mix[0] * x + mix[1] * x0
            x = x + self.attn(i, s, x, f)
            return x + self.mlp(i, s, x, f), None
        a, m = self.attn(i, s, mix[0] * lanes[0] + mix[1] * x0, f), self.mlp(i, s, lanes[1], f)
        k = i - self.cfg.parallel_start
        r, post = self.parallel_resid[k].to(x.dtype), self.parallel_post[k].to(x.dtype)
        return x, (r[0] * lanes[0] + post[0, 0] * a + post[1, 0] * m, r[1] * lanes[1] + post[0, 1] * a + post[1, 1] * m)

    def attn(self, i: int, s: int, x: Tensor, f: Pass) -> Tensor:
        cfg, blk, L = self.cfg, self.blocks[i], self.cfg.num_layers
        (B, T, _), H, K, hd = x.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w = {n: layer_matrix(f.banks, n, i, L) for n in ("attn.q", "attn.k", "attn.v", "attn.o")}
        h = observe(f.hessians, ("attn.q", "attn.k", "attn.v"), i, rms_norm(x) * self.input_scale[i])
        # one GEMM for q|k|v (1.6-1.9 ms per record step less than three, in three same-call A/Bs)
        q, k, v = F.linear(h, torch.cat((w["attn.q"], w["attn.k"], w["attn.v"]))).split((H * hd, K * hd, K * hd), -1)
        if f.adapter is not None:
            dq, dk, dv, do = f.adapter.deltas(("attn.q", "attn.k", "attn.v", "attn.o"), s, h)
            q, k, v = q + dq, k + dk, v + dv
        if i in cfg.ve_layer_list:
            v = v + f.ve_BTK * self.ve_layer_scales[cfg.ve_layer_list.index(i)].to(v.dtype)
        v = v.view(B, T, K, hd)
        q = self.ops.qk_norm_rope(q.view(B, T, H, hd), self.rope_cos, self.rope_sin, blk.q_gain)
        k = self.ops.qk_norm_rope(k.view(B, T, K, hd), self.rope_cos, self.rope_sin, None)
        y = attention(q, k, v, self.attn_backend, f.mask)
        y = self.ops.xsa(y, v) if i >= L - cfg.xsa_last_n else y
        if cfg.attn_gate_window:  # per head, from h's first channels
            z = F.linear(h[..., :cfg.attn_gate_window], blk.attn_gate_w.to(h.dtype))
            y = y * torch.sigmoid(cfg.sparse_attn_gate_scale * z)[..., None]
        y = F.linear(observe(f.hessians, ("attn.o",), i, y.reshape(B, T, H * hd)), w["attn.o"])
        return blk.attn_scale.to(x.dtype) * (y if f.adapter is None else y + do)

    def mlp(self, i: int, s: int, x: Tensor, f: Pass) -> Tensor:
        cfg, L = self.cfg, self.cfg.num_layers
        h = observe(f.hessians, ("mlp.up",), i, rms_norm(x) * self.input_scale[i])
        u = F.linear(h, layer_matrix(f.banks, "mlp.up", i, L))
        u = F.leaky_relu(u, cfg.mlp_negative_slope) if cfg.mlp_negative_slope > 0 else F.relu(u)
        u = F.linear(observe(f.hessians, ("mlp.down",), i, u.square()), layer_matrix(f.banks, "mlp.down", i, L))
        u = u if f.adapter is None else u + f.adapter.deltas(("mlp",), s, h)[0]
        return self.blocks[i].mlp_scale.to(x.dtype) * u

    def raw_logits(self, ids_BT: Tensor, adapter: Adapter | None = None, one_doc: bool = False,
                   mode: Mode = SCORING) -> Tensor:
        h = self.hidden(ids_BT, adapter, one_doc, mode)
        z = F.linear(h, self.tok_emb.weight if self.cfg.tie_embeddings else self.lm_head.weight)
        return z if adapter is None else z + adapter.deltas(("head",), 0, h)[0]

    def logits(self, ids_BT: Tensor, adapter: Adapter | None = None, one_doc: bool = False,
               mode: Mode = SCORING) -> Tensor:
        return softcap(self.raw_logits(ids_BT, adapter, one_doc, mode), self.cap)

    @property
    def cap(self) -> float | Tensor:
        return self.softcap_pm if self.cfg.asym_logit_rescale else self.cfg.logit_softcap

    def forward(self, ids_BT: Tensor, targets_BT: Tensor, mode: Mode = SCORING) -> Tensor:
        """The mean training loss (a fused Triton CE was no faster: 1,088.6 against 1,088.8 ms, H200)."""
        return cross_entropy(softcap(self.raw_logits(ids_BT, mode=mode).flatten(0, 1), self.cap), targets_BT.flatten())


def observe(hessians: dict | None, names: tuple[str, ...], i: int, x_BTC: Tensor) -> Tensor:
    """x, the input of layer i's matrices `names`; while calibrating (hessians a dict), its X^T X (fp32) is added."""
    if hessians is not None:  # in fp32 also under autocast: bf16 products made H indefinite (H200)
        x = x_BTC.detach().reshape(-1, x_BTC.size(-1)).float()
        with torch.autocast(x.device.type, enabled=False):
            xtx = x.T @ x
        for n in names:
            hessians[n, i] = hessians.get((n, i), 0) + xtx
    return x_BTC


# ===== Kernels: the Ops above as Triton kernels (optional; KERNELS=triton, the default on CUDA) =====
# Each op is a torch.library.triton_op with its backward registered: inductor launches the kernels from its own code.
QK_ROWS_PER_PROGRAM = 16  # record shapes, H200, 4 warps: 11-14% faster than 64 rows; 128 was slower
# XSA, record shape, H200, 4 warps: 63 / 98 us a call (about 4 TB/s), within 1% of the best of 4-64 rows x 1-8 warps
XSA_ROWS_PER_PROGRAM = 16


def triton_op(name: str) -> Callable:
    """torch.library.triton_op where the kernels can run (KERNELS_HERE); elsewhere the function, unregistered."""
    if KERNELS_HERE:
        return torch.library.triton_op(f"pgolf::{name}", mutates_args=())

    def plain(fn: Callable) -> Callable:
        fn.register_autograd = lambda *args, **kwargs: None
        return fn
    return plain


# q/k RMSNorm + RoPE + gain: inductor's fusion took 39 ms of a 566 ms record step (H200), these 19.7 ms (peak -1.1 GB).
# Rows are (token, head) pairs; the backward recomputes the norm, writes dx and a gain-gradient partial a row; fp32 math
if triton is not None:
    @triton.jit
    def _qk_cols(rows, n_rows, T, H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BF: tl.constexpr,
                 BP: tl.constexpr):
        """Columns, masks of a row's rotated halves [0, F), [F, 2F) and its rest [2F, D); its head and table offsets."""
        rmask = rows < n_rows
        f, p = tl.arange(0, BF), tl.arange(0, BP)
        fmask = rmask[:, None] & (f < F)[None, :]
        pmask = rmask[:, None] & (p < D - 2 * F)[None, :]
        return f[None, :], p[None, :] + 2 * F, fmask, pmask, rows % H, (rows // H % T)[:, None] * F + f[None, :]

    @triton.jit
    def _qk_norm_rope_fwd(x_ptr, cos_ptr, sin_ptr, g_ptr, y_ptr, n_rows, x_stride, T,
                          H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BF: tl.constexpr, BP: tl.constexpr,
                          BR: tl.constexpr, HAS_GAIN: tl.constexpr, EPS: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        f, p, fm, pm, h, t = _qk_cols(rows, n_rows, T, H, D, F, BF, BP)
        xb = (rows // H * x_stride + h * D)[:, None]
        x1 = tl.load(x_ptr + xb + f, mask=fm, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xb + F + f, mask=fm, other=0.0).to(tl.float32)
        xr = tl.load(x_ptr + xb + p, mask=pm, other=0.0).to(tl.float32)
        c, s = tl.load(cos_ptr + t, mask=fm, other=1.0), tl.load(sin_ptr + t, mask=fm, other=0.0)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xr * xr, 1)) / D + EPS)
        if HAS_GAIN:
            r = r * tl.load(g_ptr + h, mask=rows < n_rows, other=0.0)
        r = r[:, None]
        yb = (rows * D)[:, None]
        tl.store(y_ptr + yb + f, ((x1 * c + x2 * s) * r).to(y_ptr.dtype.element_ty), mask=fm)
        tl.store(y_ptr + yb + F + f, ((x2 * c - x1 * s) * r).to(y_ptr.dtype.element_ty), mask=fm)
        tl.store(y_ptr + yb + p, (xr * r).to(y_ptr.dtype.element_ty), mask=pm)

    @triton.jit
    def _qk_load(x_ptr, cos_ptr, sin_ptr, rows, n_rows, x_stride, T, H: tl.constexpr, D: tl.constexpr,
                 F: tl.constexpr, BD: tl.constexpr):
        """x (fp32) and its partner channels for BR rows, the rotation's cos and signed sin."""
        cols = tl.arange(0, BD)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols < D)[None, :]
        tok, h = rows // H, rows % H
        base = x_ptr + tok[:, None] * x_stride + h[:, None] * D
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if F > 0:
            rot = (cols < 2 * F)[None, :] & rmask[:, None]
            partner = tl.where(cols < F, cols + F, cols - F)
            xp = tl.load(base + partner[None, :], mask=rot, other=0.0).to(tl.float32)
            t_f = (tok % T)[:, None] * F + (cols % F)[None, :]
            c = tl.load(cos_ptr + t_f, mask=rot, other=1.0)
            s = tl.load(sin_ptr + t_f, mask=rot, other=0.0)
            s = tl.where((cols < F)[None, :], s, -s)  # first half: x1 cos + x2 sin; second: x2 cos - x1 sin
        else:
            xp, c, s = x, 1.0, 0.0
        return x, xp, c, s, mask, h

    @triton.jit
    def _qk_norm_rope_bwd(dy_ptr, x_ptr, cos_ptr, sin_ptr, g_ptr, dx_ptr, dg_ptr, n_rows, x_stride, T,
                          H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr,
                          BR: tl.constexpr, HAS_GAIN: tl.constexpr, EPS: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        x, xp, c, s, mask, h = _qk_load(x_ptr, cos_ptr, sin_ptr, rows, n_rows, x_stride, T, H, D, F, BD)
        dy, dyp, _, _, _, _ = _qk_load(dy_ptr, cos_ptr, sin_ptr, rows, n_rows, H * D, T, H, D, F, BD)
        r = tl.rsqrt(tl.sum(x * x, 1) / D + EPS)
        if HAS_GAIN:  # dgain: per-row partial sum of dy * rope(norm(x)); summed per head by the caller
            tl.store(dg_ptr + rows, tl.sum(dy * (x * c + xp * s), 1) * r, mask=rows < n_rows)
            g = tl.load(g_ptr + h, mask=rows < n_rows, other=0.0)[:, None]
            dy, dyp = dy * g, dyp * g
        n = x * r[:, None]
        dn = dy * c - dyp * s  # the rotation's transpose
        dx = r[:, None] * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        tl.store(dx_ptr + rows[:, None] * D + tl.arange(0, BD)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _require_packed_heads(t_BTHD: Tensor, op: str) -> None:
    """The kernels' row indexing: unit channel stride, heads back to back, batches of T token rows."""
    T, D = t_BTHD.size(1), t_BTHD.size(3)
    if t_BTHD.stride(3) != 1 or t_BTHD.stride(2) != D or t_BTHD.stride(0) != T * t_BTHD.stride(1):
        raise ValueError(f"{op} needs heads packed in each token's row, got strides {t_BTHD.stride()}")


def _qk_launch_args(x_BTHD: Tensor, cos_TF: Tensor, sin_TF: Tensor, gain_H: Tensor | None) -> tuple:
    """What the kernels assume, checked: they index with 32-bit offsets and read the tables unchecked."""
    B, T, H, D = x_BTHD.shape
    _require_packed_heads(x_BTHD, "qk_norm_rope")
    if x_BTHD.stride(0) * B >= 2**31:
        raise ValueError(f"qk_norm_rope: {B * T} tokens of stride {x_BTHD.stride(1)} overflow 32-bit offsets")
    for t in (cos_TF, sin_TF):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.size(0) < T or 2 * t.size(1) > D:
            raise ValueError(f"qk_norm_rope needs contiguous fp32 (>= {T}, <= {D // 2}) tables, got {tuple(t.shape)}")
    if gain_H is not None and gain_H.shape != (H,):
        raise ValueError(f"qk_norm_rope: gain of shape {tuple(gain_H.shape)} for {H} heads")
    n_rows = B * T * H
    grid = (triton.cdiv(n_rows, QK_ROWS_PER_PROGRAM),)
    # eps a constant: as a float argument inductor's launcher typed it fp64, and the math (backward 21.7 ms, not 14.5)
    F = cos_TF.size(1)
    meta = dict(H=H, D=D, F=F, BR=QK_ROWS_PER_PROGRAM, EPS=torch.finfo(torch.float32).eps)
    fwd = dict(meta, BF=triton.next_power_of_2(max(F, 1)), BP=triton.next_power_of_2(max(D - 2 * F, 1)))
    return grid, n_rows, x_BTHD.stride(1), T, fwd, dict(meta, BD=triton.next_power_of_2(D))


@triton_op("qk_norm_rope")
def qk_norm_rope_triton(x_BTHD: Tensor, cos_TF: Tensor, sin_TF: Tensor, gain_H: Tensor | None) -> Tensor:
    """qk_norm_rope_reference in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    grid, n_rows, stride, T, meta, _ = _qk_launch_args(x_BTHD, cos_TF, sin_TF, gain_H)
    y = torch.empty(x_BTHD.shape, dtype=x_BTHD.dtype, device=x_BTHD.device)
    g = x_BTHD if gain_H is None else gain_H  # without a gain, x stands in for the unread gain pointer
    torch.library.wrap_triton(_qk_norm_rope_fwd)[grid](x_BTHD, cos_TF, sin_TF, g, y, n_rows, stride, T,
                                                       HAS_GAIN=gain_H is not None, **meta)
    return y


@triton_op("qk_norm_rope_backward")
def qk_norm_rope_backward(dy_BTHD: Tensor, x_BTHD: Tensor, cos_TF: Tensor, sin_TF: Tensor,
                          gain_H: Tensor | None) -> tuple[Tensor, Tensor]:
    grid, n_rows, stride, T, _, meta = _qk_launch_args(x_BTHD, cos_TF, sin_TF, gain_H)
    dy, dx = dy_BTHD.contiguous(), torch.empty(x_BTHD.shape, dtype=x_BTHD.dtype, device=x_BTHD.device)
    gain = gain_H is not None
    g, dg_rows = (gain_H, torch.empty(n_rows, dtype=torch.float32, device=x_BTHD.device)) if gain else (x_BTHD, x_BTHD)
    torch.library.wrap_triton(_qk_norm_rope_bwd)[grid](dy, x_BTHD, cos_TF, sin_TF, g, dx, dg_rows, n_rows, stride, T,
                                                       HAS_GAIN=gain, **meta)
    return dx, dg_rows.view(-1, x_BTHD.size(2)).sum(0) if gain else x_BTHD.new_zeros(0, dtype=torch.float32)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _qk_backward(ctx, dy):
    x, cos, sin, gain = ctx.saved_tensors
    dx, dg = qk_norm_rope_backward(dy, x, cos, sin, gain)
    return dx, None, None, (dg.to(gain.dtype) if gain is not None else None)


qk_norm_rope_triton.register_autograd(_qk_backward, setup_context=_save_inputs)

# XSA: inductor's fusion took about 12 ms of a record step (7 kernels, normalised v in fp32); these made it 7.0 ms less.
# A program takes BR (token, kv head) rows: a v row and its G = H/K query heads; fp32 math
if triton is not None:
    @triton.jit
    def _xsa_rows(r, n_rows, v_stride, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BG: tl.constexpr,
                  BD: tl.constexpr):
        """Offsets and masks of rows r = (token, kv head): v's (BR, BD), y's (BR, BG, BD). No pointers in here: with
        them, torch 2.11 took y and v for written and copied the q|k|v projection around each call."""
        d = tl.arange(0, BD)
        v_mask = (r < n_rows)[:, None] & (d < D)[None, :]
        g = tl.arange(0, BG)
        y_off = (r[:, None, None] * G + g[None, :, None]) * D + d[None, None, :]
        y_mask = v_mask[:, None, :] & (g < G)[None, :, None]
        return (r // K * v_stride + r % K * D)[:, None] + d[None, :], v_mask, y_off, y_mask

    @triton.jit
    def _xsa_fwd(y_ptr, v_ptr, out_ptr, n_rows, v_stride, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BG: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        v_off, v_mask, y_off, y_mask = _xsa_rows(r, n_rows, v_stride, K, G, D, BG, BD)
        v = tl.load(v_ptr + v_off, mask=v_mask, other=0.0).to(tl.float32)
        vn = (v / tl.maximum(tl.sqrt(tl.sum(v * v, 1)), EPS)[:, None])[:, None, :]
        y = tl.load(y_ptr + y_off, mask=y_mask, other=0.0).to(tl.float32)
        out = y - tl.sum(y * vn, 2)[:, :, None] * vn
        tl.store(out_ptr + y_off, out.to(out_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _xsa_bwd(dout_ptr, y_ptr, v_ptr, dy_ptr, dv_ptr, n_rows, v_stride, K: tl.constexpr, G: tl.constexpr,
                 D: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        v_off, v_mask, y_off, y_mask = _xsa_rows(r, n_rows, v_stride, K, G, D, BG, BD)
        v = tl.load(v_ptr + v_off, mask=v_mask, other=0.0).to(tl.float32)
        nrm = tl.sqrt(tl.sum(v * v, 1))
        inv = 1.0 / tl.maximum(nrm, EPS)
        vn = v * inv[:, None]
        y = tl.load(y_ptr + y_off, mask=y_mask, other=0.0).to(tl.float32)
        do = tl.load(dout_ptr + y_off, mask=y_mask, other=0.0).to(tl.float32)
        s = tl.sum(y * vn[:, None, :], 2)[:, :, None]  # out = y - s vn
        t = tl.sum(do * vn[:, None, :], 2)[:, :, None]
        tl.store(dy_ptr + y_off, (do - t * vn[:, None, :]).to(dy_ptr.dtype.element_ty), mask=y_mask)
        dvn = -tl.sum(s * do + t * y, 1)  # summed over the kv head's query heads
        # v / max(|v|, eps): the projection's gradient above eps, a plain scaling below it
        dv = tl.where((nrm >= EPS)[:, None], dvn - vn * tl.sum(dvn * vn, 1)[:, None], dvn) * inv[:, None]
        d = tl.arange(0, BD)
        tl.store(dv_ptr + r[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=v_mask)


def _xsa_launch_args(y_BTHD: Tensor, v_BTKD: Tensor) -> tuple:
    (B, T, H, D), K = y_BTHD.shape, v_BTKD.size(2)
    if v_BTKD.shape != (B, T, K, D) or H % K:
        raise ValueError(f"xsa: y {tuple(y_BTHD.shape)} and v {tuple(v_BTKD.shape)} are not (B,T,H,D), "
                         "(B,T,K,D), K | H")
    _require_packed_heads(v_BTKD, "xsa (v)")
    if max(v_BTKD.stride(0), H * D * T) * B >= 2**31:
        raise ValueError(f"xsa: {B * T} tokens overflow 32-bit offsets")
    n_rows = B * T * K
    meta = dict(K=K, G=H // K, D=D, BG=triton.next_power_of_2(H // K), BD=triton.next_power_of_2(D),
                BR=XSA_ROWS_PER_PROGRAM, EPS=1e-12)  # F.normalize's eps
    return (triton.cdiv(n_rows, XSA_ROWS_PER_PROGRAM),), n_rows, v_BTKD.stride(1), meta


@triton_op("xsa")
def exclusive_self_attention_triton(y_BTHD: Tensor, v_BTKD: Tensor) -> Tensor:
    """exclusive_self_attention_reference in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    grid, n_rows, v_stride, meta = _xsa_launch_args(y_BTHD, v_BTKD)
    y = y_BTHD.contiguous()
    out = torch.empty_like(y)
    torch.library.wrap_triton(_xsa_fwd)[grid](y, v_BTKD, out, n_rows, v_stride, **meta)
    return out


@triton_op("xsa_backward")
def exclusive_self_attention_backward(dout_BTHD: Tensor, y_BTHD: Tensor, v_BTKD: Tensor) -> tuple[Tensor, Tensor]:
    grid, n_rows, v_stride, meta = _xsa_launch_args(y_BTHD, v_BTKD)
    dout, y = dout_BTHD.contiguous(), y_BTHD.contiguous()
    dy, dv = torch.empty_like(y), torch.empty(v_BTKD.shape, dtype=v_BTKD.dtype, device=v_BTKD.device)
    torch.library.wrap_triton(_xsa_bwd)[grid](dout, y, v_BTKD, dy, dv, n_rows, v_stride, **meta)
    return dy, dv


exclusive_self_attention_triton.register_autograd(
    lambda ctx, dout: exclusive_self_attention_backward(dout, *ctx.saved_tensors), setup_context=_save_inputs)
TRITON_OPS = Ops(qk_norm_rope_triton, exclusive_self_attention_triton) if KERNELS_HERE else None


def build_model(cfg: Hyperparameters, rt: Runtime) -> GPT:
    """The one constructor of training and scoring models: fp32, but bf16 embedding tables on CUDA (reference)."""
    model = GPT(cfg, rt.attn_backend, TRITON_OPS if rt.kernels == "triton" else TORCH_OPS).to(rt.device)
    for name, p in model.named_parameters():
        if name in EMBED_TABLES and rt.device.type == "cuda":
            p.data = p.data.bfloat16()
    return model


# ===== Scoring: exact sliding-window val_bpb =====
def build_byte_luts(sp, vocab_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """val_bpb's per-token UTF-8 bytes (the challenge's rule): base bytes, leading-space flags, boundary flags."""
    if (n := int(sp.vocab_size())) != vocab_size:
        raise ValueError(f"tokenizer vocabulary {n} != VOCAB_SIZE {vocab_size}")
    if not any(sp.id_to_piece(i) == "\u2581" for i in range(n)):
        raise ValueError("tokenizer has no standalone U+2581 piece: its byte counts would be wrong "
                         "(a known way to fake val_bpb); use a tokenizer trained with the challenge settings")
    base, space, boundary = np.zeros(n, np.int16), np.zeros(n, np.bool_), np.ones(n, np.bool_)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue  # boundary token, 0 bytes
        piece, byte = sp.id_to_piece(i), sp.is_byte(i)
        boundary[i], space[i] = False, not byte and piece.startswith("\u2581")
        base[i] = 1 if byte else len(piece.removeprefix("\u2581").encode("utf-8"))
    return tuple(torch.from_numpy(a).to(device) for a in (base, space, boundary))


def sliding_windows(num_targets: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, first scored, end): window k at k*stride scores its last `stride`, the first all: each target once."""
    out = []
    for start in range(0, num_targets, stride):
        if (lo := start + seq_len - stride if start else 0) >= num_targets:
            break
        out.append((start, lo, min(start + seq_len, num_targets)))
    return out


@dataclass
class Score:
    loss: float
    bpb: float
    tokens: int
    bytes: int
    time_ms: float
    compile_ms: float


def loss_and_bpb(sums: list[float]) -> tuple[float, float]:
    """(mean nll in nats, bits per byte) from summed (nll, tokens, bytes): val_bpb = loss / ln 2 * tokens / bytes."""
    nll, ntok, nbytes = sums
    loss = nll / ntok
    return loss, loss / math.log(2) * ntok / nbytes


class Scorer:
    """Val scoring: windows batched, split across ranks, float64 sums; every scorer runs loop() and rows_nll()."""

    def __init__(self, cfg: Hyperparameters, rt: Runtime, tokens: Tensor, luts, log: Logger | None = None,
                 val_bytes: Tensor | None = None):
        self.cfg, self.rt, self.luts, self.tokens = cfg, rt, luts, tokens.to(rt.device)
        self.val_bytes = None if val_bytes is None else val_bytes.to(rt.device)  # the byte sidecar's, else luts'
        self.byte_rule = "tokenizer" if val_bytes is None else "sidecar"
        self.log = log if log is not None else Logger("", enabled=False)
        self.batch_seqs = max(1, cfg.val_batch_size // (rt.world_size * rt.grad_accum_steps * cfg.eval_seq_len))

    def windows(self, stride: int, per_doc: bool = False) -> Tensor:
        """sliding_windows over the targets, with DOC_ISOLATION (or per_doc) over each document's own (BOS to BOS)."""
        n, T, starts = self.tokens.numel() - 1, self.cfg.eval_seq_len, self.doc_starts(per_doc)
        wins = [(s + a, s + b, s + c) for s, e in zip(starts, starts[1:] + [n])
                for a, b, c in sliding_windows(e - s, T, stride)]
        return torch.tensor(wins, dtype=torch.int64, device=self.rt.device).view(-1, 3)

    def doc_starts(self, per_doc: bool = False) -> list[int]:
        """Each document's first target (its BOS) with DOC_ISOLATION or per_doc, else [0]: one stream."""
        n, per_doc = self.tokens.numel() - 1, per_doc or self.cfg.doc_isolation
        return sorted({0} | set((self.tokens[:n] == BOS_ID).nonzero().flatten().tolist())) if per_doc else [0]

    def logits_fn(self, model: GPT, mode: Mode = SCORING) -> Callable:
        """model.logits of rows of windows (one document each under DOC_ISOLATION), compiled when enabled."""
        return compiled(functools.partial(model.logits, one_doc=True, mode=mode), self.rt)

    def warm(self, fn: Callable) -> None:
        """One fixed-shape call of a logits_fn: its compile."""
        with torch.inference_mode(), autocast(self.rt.device):
            fn(torch.zeros(self.batch_seqs, self.cfg.eval_seq_len, dtype=torch.int64, device=self.rt.device))

    def rows_nll(self, fn: Callable, w_B3: Tensor, length: int, *extra) -> tuple[Tensor, Tensor, tuple]:
        """(logits, nll (B, length), rows (x, y, mask of the scored targets, their bytes)) of windows w (start, first
        scored target, end) as rows of `length` tokens (past the end: clamped, masked), scored by fn(x, *extra)."""
        at = w_B3[:, :1] + torch.arange(length, device=w_B3.device)
        idx = at.clamp(max=self.tokens.numel() - 2)
        x, y, (base, space, boundary) = self.tokens[idx], self.tokens[idx + 1], self.luts
        nbytes = base[y] + (space[y] & ~boundary[x]) if self.val_bytes is None else self.val_bytes[idx + 1]
        with autocast(self.rt.device):
            logits = fn(x, *extra)
        nll = cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(x.shape)
        return logits, nll, (x, y, (at >= w_B3[:, 1:2]) & (at < w_B3[:, 2:3]), nbytes)

    @torch.inference_mode()
    def score_windows(self, fn: Callable, wins: Tensor) -> Tensor:
        """This rank's share of `wins`: its (nll, tokens, bytes) float64 sums, not yet reduced over ranks."""
        rt, B = self.rt, self.batch_seqs
        mine = wins[wins.size(0) * rt.rank // rt.world_size: wins.size(0) * (rt.rank + 1) // rt.world_size]
        sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # nll, tokens, bytes
        for b0 in range(0, mine.size(0), B):
            w = mine[b0: b0 + B]
            _, nll, rows = self.rows_nll(fn, F.pad(w, (0, 0, 0, B - w.size(0))), self.cfg.eval_seq_len)  # zero rows
            sums += self.sums(nll, *rows[2:])  # (all-zero padding rows score nothing)
        return sums

    def sums(self, nll_BT: Tensor, mask_BT: Tensor, bytes_BT: Tensor) -> Tensor:
        m = mask_BT.double()
        return torch.stack(((nll_BT.double() * m).sum(), m.sum(), (bytes_BT.double() * m).sum()))

    def loop(self, warmup: Callable[[], None], steps: list, step: Callable[..., Tensor], progress: str = "",
             done: list[int] | None = None, header: str = "") -> Score:
        """The one scoring loop: warmup() untimed; step(s) (this rank's sums) for `steps`; 8 progress lines; reduce."""
        rt, log, t0 = self.rt, self.log, now_ms(self.rt.device)
        warmup()
        compile_ms, done = now_ms(rt.device) - t0, done or list(range(1, len(steps) + 1))
        if header:
            log(f"{header} compile_time:{compile_ms:.0f}ms")
        sums, t0 = torch.zeros(3, dtype=torch.float64, device=rt.device), now_ms(rt.device)
        for k, s in enumerate(steps):
            sums += step(s)
            if progress and rt.is_main and (k + 1) % max(1, len(steps) // 8) == 0:
                log(f"{progress}:{done[k]}/{done[-1]} rank0_bpb_so_far:{loss_and_bpb(sums.tolist())[1]:.4f} "
                    f"time:{now_ms(rt.device) - t0:.0f}ms")
        all_reduce_sum_(sums)
        totals = sums.tolist()
        (loss, bpb), (_, ntok, nbytes) = loss_and_bpb(totals), totals
        return Score(loss, bpb, int(ntok), int(nbytes), now_ms(rt.device) - t0, compile_ms)

    def __call__(self, model: GPT, stride: int, per_doc: bool = False, mode: Mode = SCORING) -> Score:
        """The sliding-window score at `stride` (EVAL_SEQ_LEN: disjoint windows); per_doc: each document's own."""
        fn = self.logits_fn(model, mode)
        return self.loop(lambda: self.warm(fn), [stride], lambda s: self.score_windows(fn, self.windows(s, per_doc)))


# ===== Legal test-time training: score a chunk, then train on it =====
@contextlib.contextmanager
def grad_flags(model: nn.Module, on: bool):
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(on)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def global_sgd_rows(cfg: Hyperparameters, rt: Runtime) -> tuple[int, int]:
    """global_sgd's rows per step, over all ranks and on each (its one compiled shape)."""
    per = max(1, cfg.global_ttt_chunk_tokens // cfg.eval_seq_len)
    return per, -(-per // rt.world_size)


def global_sgd(cfg: Hyperparameters, rt: Runtime, model: GPT, scorer: Scorer, fn: Callable,
               spans: list[tuple[int, int]]) -> None:
    """Phased TTT's SGD of all base weights on the targets of each span (scored documents), in rows of EVAL_SEQ_LEN
    from each document's start (the records packed full rows); a rank takes every world-th row, padded to `mine`."""
    T, (per, mine) = cfg.eval_seq_len, global_sgd_rows(cfg, rt)
    row_spans = torch.tensor([(a, min(e - a, T)) for s, e in spans for a in range(s, e, T)], dtype=torch.int64,
                             device=rt.device).view(-1, 2)
    steps = row_spans.split(per)[:-1]  # the last step skipped, as in the records
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=cfg.global_ttt_lr, momentum=cfg.global_ttt_momentum)
    with grad_flags(model, True):
        for _ in range(cfg.global_ttt_epochs):
            for c, step in enumerate(steps):
                opt.param_groups[0]["lr"] = cfg.global_ttt_lr * 0.5 * (1 + math.cos(math.pi * c / len(steps)))
                w = torch.stack((step[:, 0], step[:, 0], step.sum(1)), 1)[rt.rank::rt.world_size]  # all scored
                opt.zero_grad(set_to_none=False)
                _, nll, (_, _, mask, _) = scorer.rows_nll(fn, F.pad(w, (0, 0, 0, mine - w.size(0))), T)
                # x world_size: the ranks' gradients are averaged, and each holds 1/world of the batch
                ((nll * mask).sum() * rt.world_size / step[:, 1].sum()).backward()
                if _distributed():
                    with torch.no_grad():
                        grads = FlatTensors([p.grad for p in params if p.grad is not None])  # NUM_LAYERS=1's skips
                        grads.mean()
                        grads.write_back()
                torch.nn.utils.clip_grad_norm_(params, cfg.global_ttt_grad_clip)
                opt.step()
        opt.zero_grad(set_to_none=True)


class NGramTable:
    """#2135's token-only expert, causal in lora's order: (K = TOKEN_ORDER - 1 in-document tokens, next) pairs of scored
    documents counted (absorb), as 64-bit hashes in sorted tensors; hint(): a context's top token at TOKEN_THRESHOLD."""

    def __init__(self, cfg: Hyperparameters, scorer: Scorer):  # its tokens: read inside its loop
        self.k, self.cfg, self.scorer, self.absorbed = cfg.token_order - 1, cfg, scorer, 0
        g, dev = torch.Generator().manual_seed(0), scorer.tokens.device
        self.coef = (torch.randint(1, 2 ** 62, (self.k,), generator=g) * 2 + 1).to(dev)
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self.pairs, self.ctx_of, self.tok_of, self.count = empty, empty, empty, empty
        self.ctx, self.top, self.share = empty, empty, empty.double()

    @property
    def tokens(self) -> Tensor:
        return self.scorer.tokens

    def context(self, t: Tensor) -> Tensor:  # the hash of tokens t - K .. t - 1
        return (self.tokens[t[..., None] - torch.arange(self.k, 0, -1, device=t.device)] * self.coef).sum(-1)

    def absorb(self, spans: list[tuple[int, int]], upto: int) -> None:
        dev = self.tokens.device  # a span's targets are tokens s + 1 .. e
        t = torch.cat([torch.arange(s + self.k, max(e + 1, s + self.k), device=dev) for s, e in spans]
                      + [self.pairs[:0]])
        ctx, tok = self.context(t), self.tokens[t]
        pairs, inv = torch.unique(torch.cat((self.pairs, ctx * 1000003 + tok)), return_inverse=True)
        count = torch.zeros_like(pairs).scatter_add_(0, inv, torch.cat((self.count, torch.ones_like(t))))
        self.ctx_of = torch.zeros_like(pairs).scatter_(0, inv, torch.cat((self.ctx_of, ctx)))
        self.tok_of = torch.zeros_like(pairs).scatter_(0, inv, torch.cat((self.tok_of, tok)))
        self.pairs, self.count, self.absorbed = pairs, count, upto
        self.ctx, cinv = torch.unique(self.ctx_of, return_inverse=True)
        total = torch.zeros_like(self.ctx).scatter_add_(0, cinv, count)
        most = torch.zeros_like(self.ctx).scatter_reduce_(0, cinv, count, "amax", include_self=False)
        top = torch.where(count == most[cinv], self.tok_of, self.tokens.new_tensor(2 ** 62))
        self.top = torch.full_like(self.ctx, 2 ** 62).scatter_reduce_(0, cinv, top, "amin")  # ties: the smallest id
        self.share = most.double() / total

    def hint(self, t: Tensor, ok: Tensor) -> Tensor:
        """The hinted next token of targets t (-1: none), where ok (K in-document predecessors)."""
        if self.ctx.numel() == 0:
            return torch.full_like(t, -1)
        q = self.context(t.clamp(self.k, self.tokens.numel() - 1))  # (padding rows' are out of range)
        i = torch.searchsorted(self.ctx, q).clamp(max=self.ctx.numel() - 1)
        return torch.where(ok & (self.ctx[i] == q) & (self.share[i] >= self.cfg.token_threshold), self.top[i], -1)

    def tilt(self, logits: Tensor, nll: Tensor, y: Tensor, at: Tensor, doc_start: Tensor, mask: Tensor) -> Tensor:
        """Each target's NLL under p'(a) = p(a) e^(beta [a = h]) / (1 + p(h) (e^beta - 1)), h its hint."""
        h = self.hint(at + 1, mask & (at + 1 - self.k >= doc_start[:, None]))
        on, beta = h >= 0, self.cfg.token_boost
        lz = logits[on].float()
        log_ph, out = lz.gather(-1, h[on][:, None])[:, 0] - lz.logsumexp(-1), nll.clone()
        out[on] = nll[on] - beta * (y[on] == h[on]) + torch.log1p(log_ph.exp() * math.expm1(beta))
        return out


class LoraPlan(NamedTuple):
    """lora's schedule: each document's chunks and span; documents longest first; phase ends; this rank's steps
    (documents, how many of `order` global SGD then trains on, where in `order` its segment starts: the counts' end)."""
    chunks: list[list[tuple[int, int, int]]]
    spans: list[tuple[int, int]]
    order: list[int]
    phases: list[int]
    steps: list[tuple[list[int], int, int]]


def lora_plan(cfg: Hyperparameters, rt: Runtime, scorer: Scorer) -> LoraPlan:
    """Per-document chunks (context kept), longest first (the records'), in lockstep batches, as many on every rank."""
    starts = scorer.doc_starts(per_doc=True)  # an adapter learns one document: its windows are the document's own
    ends, rows = starts[1:] + [scorer.tokens.numel() - 1], ttt_rows(cfg, rt)
    chunks: list[list[tuple[int, int, int]]] = [[] for _ in starts]
    size = [cfg.ttt_chunk_for(e - s) for s, e in zip(starts, ends)]
    for s, lo, hi in scorer.windows(cfg.eval_stride, per_doc=True).tolist():
        d = bisect.bisect_right(starts, s) - 1
        chunks[d] += [(s, a, min(a + size[d], hi)) for a in range(lo, hi, size[d])]
    order = sorted(range(len(chunks)), key=lambda i: ends[i] - starts[i], reverse=True)
    prefix, n_phases = min(cfg.phased_ttt_prefix_docs, len(chunks)), cfg.phased_ttt_num_phases
    phases = sorted({prefix * k // n_phases for k in range(1, n_phases + 1)} - {0, len(chunks)})
    tilt = set(range(cfg.ngram_update_docs, len(chunks), cfg.ngram_update_docs)) if cfg.ngram_tilt_enabled else set()
    edges, steps = sorted({0, len(chunks)} | set(phases) | tilt), []
    for a, b in zip(edges, edges[1:]):
        mine, n = order[a:b][rt.rank::rt.world_size], -(-(b - a) // (rt.world_size * rows))
        for j in range(n):
            ids, train_upto = mine[j * rows: (j + 1) * rows], b if j == n - 1 and b in phases else 0
            steps.append((ids, train_upto, a))
    return LoraPlan(chunks, list(zip(starts, ends)), order, phases, steps)


def lora_warmup(cfg: Hyperparameters, rt: Runtime, model: GPT, fn: Callable, adapter: Adapter, phased: bool) -> None:
    """The compiles before the timer: lora's step (one graph for all rows x lengths) and, phased, global_sgd's."""
    if rt.compile_enabled:
        x = torch.zeros(ttt_rows(cfg, rt), cfg.eval_seq_len, dtype=torch.int64, device=rt.device)
        torch._dynamo.maybe_mark_dynamic(x, (0, 1))
        with autocast(rt.device):
            fn(x, adapter).float().sum().backward()
        adapter.zero_grad(set_to_none=True)
        if phased:
            rows = global_sgd_rows(cfg, rt)[1]
            with grad_flags(model, True), autocast(rt.device):
                fn(torch.zeros(rows, cfg.eval_seq_len, dtype=torch.int64, device=rt.device)).float().sum().backward()
            model.zero_grad(set_to_none=True)


def lora_batch(cfg: Hyperparameters, rt: Runtime, scorer: Scorer, fn: Callable, adapter: Adapter,
               batch: list[list[tuple[int, int, int]]], probe: dict | None, ngram: tuple | None = None) -> Tensor:
    """One lockstep batch (most chunks first): step c scores chunk c of each document still going, then takes
    TTT_GRAD_STEPS AdamW steps on each row's mean chunk NLL (none on a last chunk); returns the sums."""
    sums, rows, T = torch.zeros(3, dtype=torch.float64, device=rt.device), ttt_rows(cfg, rt), cfg.eval_seq_len
    plan = torch.zeros(len(batch[0]), rows, 5, dtype=torch.int64)  # step c's rows: window, trained, document start
    for r, d in enumerate(batch):
        plan[:len(d), r, :3] = torch.tensor(d)
        plan[:len(d) - 1, r, 3] = 1  # the last chunk is not trained on
        plan[:, r, 4] = ngram[1][r] if ngram else 0
    if rt.device.type == "cuda":  # pinned, so the copy does not wait for the GPU to drain
        plan = plan.pin_memory().to(rt.device, non_blocking=True)
    adapter.reset()
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.ttt_lora_lr, betas=(0.0, 0.99), eps=1e-10,
                            weight_decay=cfg.ttt_weight_decay, fused=rt.device.type == "cuda")
    for c in range(len(batch[0])):
        going = [d[c] for d in batch if c < len(d)]  # the batch's first rows: most chunks first
        # rows rounded up to 8, as long as the longest window needs (a power of two, max(T/16, 8)..T; below 8
        # dynamo would specialise): a step costs what it holds; causal attention keeps it exact
        n = min(rows, -(-len(going) // 8) * 8)
        length = min(T, max(T // 16, 8, 1 << (max(hi - s for s, _, hi in going) - 1).bit_length()))
        w = plan[c, :n]
        for step in range(max(cfg.ttt_grad_steps, 1)):
            logits, nll, (_, y, mask, nbytes) = scorer.rows_nll(fn, w, length, adapter)
            if step == 0:  # the score: before any step that sees these targets
                at = w[:, :1] + torch.arange(length, device=rt.device)  # its targets are at + 1
                scored = nll.detach() if ngram is None else ngram[0].tilt(logits.detach(), nll.detach(), y, at, w[:, 4],
                                                                          mask)
                sums += scorer.sums(scored, mask, nbytes)
                if probe is not None:
                    probe["nll"][at[mask]] = scored[mask].double()
                    probe["lse"][at[mask]] = logits.detach().float().logsumexp(-1)[mask].double()
            if cfg.ttt_grad_steps == 0 or c == len(batch[0]) - 1:  # the last step trains no row
                break
            ((nll * mask).sum(1) * w[:, 3] / mask.sum(1).clamp(min=1)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return sums


def lora_ttt(cfg: Hyperparameters, rt: Runtime, model: GPT, scorer: Scorer, probe: dict[str, Tensor] | None = None,
             adapter_cls: type[Adapter] | None = None) -> Score:
    """TTT_MODE=lora, score-first per document (lora_plan, lora_batch: the records' scheduler); adapters (DocLoRA or
    adapter_cls) and AdamW restart each batch; global_sgd after each phase. probe (tests): each target's NLL, lse."""
    t0, plan = now_ms(rt.device), lora_plan(cfg, rt, scorer)
    adapter, fn = (adapter_cls or DocLoRA)(cfg, ttt_rows(cfg, rt), rt.device), scorer.logits_fn(model)
    ngram = NGramTable(cfg, scorer) if cfg.ngram_tilt_enabled else None
    setup_ms = now_ms(rt.device) - t0  # in eval_time, as the records' timer holds their plan (1.4 s on FineWeb's)

    def step(s: tuple[list[int], int, int]) -> Tensor:
        ids, train_upto, seg = s
        sums = torch.zeros(3, dtype=torch.float64, device=rt.device)
        if ngram is not None and seg > ngram.absorbed:  # every document before this segment is scored, on every rank
            ngram.absorb([plan.spans[i] for i in plan.order[ngram.absorbed:seg]], seg)
        if ids:  # most chunks first: the documents still going are the first rows
            ids = sorted(ids, key=lambda i: len(plan.chunks[i]), reverse=True)
            sums = lora_batch(cfg, rt, scorer, fn, adapter, [plan.chunks[i] for i in ids], probe,
                              None if ngram is None else (ngram, [plan.spans[i][0] for i in ids]))
        if train_upto:
            global_sgd(cfg, rt, model, scorer, fn, [plan.spans[i] for i in plan.order[:train_upto]])
        return sums
    done = list(itertools.accumulate(len(ids) for ids, *_ in plan.steps))
    with grad_flags(model, False):  # gradients reach the adapters only (and the base weights in global_sgd)
        score = scorer.loop(lambda: lora_warmup(cfg, rt, model, fn, adapter, bool(plan.phases)), plan.steps, step,
                            "ttt_lora_docs", done, f"ttt_lora documents:{len(plan.chunks)} chunks:"
                            f"{sum(map(len, plan.chunks))} rank0_documents:{done[-1]} rows:{ttt_rows(cfg, rt)} "
                            f"phases:{plan.phases}")
    score.time_ms += setup_ms
    return score


@dataclass(frozen=True)
class TTTMode:
    """A legal TTT mode (TTT_MODE): its scorer, whether its gain is measured against per-document windows (then
    scored too), its graphs' precompile. Its rows hold one document each: any attention backend scores them."""
    score: Callable[..., Score]
    per_doc_baseline: bool
    precompile: Callable | None = None
    settings: str = ""  # whose settings (on="ttt_mode=..."): another mode's, whose scorer it runs; "" its own


def lora_precompile(cfg: Hyperparameters, rt: Runtime, model: GPT, scorer: Scorer,
                    adapter_cls: type[Adapter] | None = None) -> None:
    adapter = (adapter_cls or DocLoRA)(cfg, ttt_rows(cfg, rt), rt.device)
    lora_warmup(cfg, rt, model, scorer.logits_fn(model), adapter, cfg.phased_ttt_prefix_docs > 0)


TTT_MODES = {"lora": TTTMode(lora_ttt, True, lora_precompile)}


# ===== Export: int6 banks, int8 tables, fp16 rest on the grid of the Model section; no pickle; compressed =====
INT6_MAX = 31  # the bank matrices' codes (FORMATS["q6"])
CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)  # per-row clip candidates, best MSE wins
INT8_CLIP_QUANTILE = 0.9999984  # the reference's per-row clip for int8 tables
KEEP_FLOAT_MAX_NUMEL = 65536  # tensors up to this size stay float (fp16)
SIZE_LIMIT_BYTES = 16_000_000  # artifact + code, decimal bytes (the challenge's rule)
ARTIFACT_MAGIC, PAYLOAD_MAGIC = b"PGA1", b"PGT2"  # PGT1: before the settings were stored
COMPRESSOR_CODES = {"zstd": 0, "rans": 3}  # 1 (xz) and 2 (an order-0 rANS): older artifacts, no longer read
LZMA_PRESET = 6 | lzma.PRESET_EXTREME  # rANS's side data; on whole PQB payloads 34-38 KB smaller than 9|extreme
ZSTD_FAST_LEVEL = 3  # COMPRESSOR=fast: 0.2 s vs xz's 36 s on a PQB payload; 12.24 MB vs 10.85
GPTQ_BLOCK, GPTQ_DAMP = 128, 0.01  # columns per lazy-update block; damping as a fraction of mean(diag H)
LQER_A_MAX, LQER_B_MAX = 1.5, 7.5  # the scales' divisors: A's codes -2..1, B's -8..7 (the records' asymmetric form)
LQER_ROW_MAX = 7  # the fallback: A and B int4 per row, -7..7
# rANS's bits a code: SD-clipped, a Gaussian row's on steps of k std / qmax (0.07-0.12% under the defaults' trained
# artifacts, records/PERFORMANCE.md session 31); clip-searched, PQB's; 1.59 B a fp16 value; zstd-3 8.1% larger.
PREDICT_SIDE_BYTES, PREDICT_MIN_BITS, PREDICT_CODER = 1.59, 0.5, {"rans": 1.0, "fast": 1.081}
PREDICT_SEARCH_BITS = {"q6": 4.245, "q8": 7.2}  # clip-searched codes (8-bit; about a bit less per bit dropped)
FIT_TRIES, MAX_GRID_LOG2 = 4, 4  # serialize's tries (each corrects the bits by what the last saved); f <= 16
_DTYPES = {"int8": torch.int8, "float16": torch.float16, "float32": torch.float32}
RANS_LANES, RANS_BITS, RANS_LOW = 2048, 14, 1 << 16  # interleaved streams; tables sum to 2^14; states in [2^16, 2^32)
# A code's spread is about its row's RMS x its column's RMS / the rows' typical RMS, both stored as quarter-octave int8
# logs; its table is its predicted spread's: the PQB artifact 14,797,155 B, not 15,467,919 (one order-0 table a tensor)
RANS_TABLES, RANS_TABLE_OFFSET = 64, 24  # table t: predicted code RMS about 2^((t - 24) / 4)


def unbank(state: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Banks -> per-layer matrices named blocks.{i}.{attn.q,...}; other tensors pass through."""
    out = {f"blocks.{i}.{n}": layer_matrix(state, n, i, num_layers) for n in MATRICES for i in range(num_layers)}
    return {k: v for k, v in state.items() if k not in BANKS} | out


def rebank(tensors: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    out = dict(tensors)
    for bank, names in BANKS.items():  # row slot * num_layers + i: layer_matrix's
        out[bank] = torch.stack([out.pop(f"blocks.{i}.{n}") for n in names for i in range(num_layers)])
    return out


def quantize_rows(w: Tensor, qmax: int, quantiles: tuple[float, ...], floor: float) -> tuple[Tensor, Tensor]:
    """Per-row symmetric codes (int8), fp16 scales: the clip candidate (|w| row quantiles) of least matrix MSE."""
    w, best = w.float(), None
    a = w.abs()
    inner = [qt for qt in quantiles if qt < 1.0]  # one sort of |w| serves every quantile
    per_qt = dict(zip(inner, torch.quantile(a, torch.tensor(inner, device=w.device), dim=1))) if inner else {}
    for qt in quantiles:
        clip = a.amax(dim=1) if qt >= 1.0 else per_qt[qt]
        scale = grid_scale(clip, qmax, floor)
        q = grid_codes(w, clip, scale, qmax)
        err = (w - q * scale[:, None]).square().mean().item()
        if best is None or err < best[0]:
            best = (err, q.to(torch.int8), scale.half())
    return best[1], best[2]


def gptq_codes(w_RC: Tensor, h_CC: Tensor, scale_R: Tensor, qmax: int) -> Tensor:
    """GPTQ (Frantar et al. 2022; the records' form): codes on the grid scale_R keeping the output on the calibration
    inputs (H = X^T X) close: columns by decreasing H_jj, each rounding error, weighted by U (Cholesky of H^-1), onto
    those not yet rounded; unreached ones zero. float64 (0.30 s for 512x1536, fp32 0.24); damped more if H singular."""
    w, h = w_RC.double().clone(), h_CC.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead], w[:, dead] = 1.0, 0.0
    order = torch.argsort(h.diagonal(), descending=True)
    w, h, eye = w[:, order], h[order][:, order], torch.eye(h.size(0), dtype=h.dtype)
    for damp in (GPTQ_DAMP, 10 * GPTQ_DAMP, 100 * GPTQ_DAMP):
        try:
            hinv = torch.cholesky_inverse(torch.linalg.cholesky(h + damp * h.diagonal().mean() * eye))
            u = torch.linalg.cholesky(hinv, upper=True)
            break
        except torch.linalg.LinAlgError:
            if damp == 100 * GPTQ_DAMP:
                raise
    q, s = torch.zeros_like(w), scale_R.double()
    for b0 in range(0, w.size(1), GPTQ_BLOCK):
        b1 = min(b0 + GPTQ_BLOCK, w.size(1))
        err = torch.zeros_like(w[:, b0:b1])
        for j in range(b0, b1):
            q[:, j] = torch.clamp(torch.round(w[:, j] / s), -qmax, qmax)
            err[:, j - b0] = (w[:, j] - q[:, j] * s) / u[j, j]
            w[:, j:b1] -= err[:, j - b0, None] * u[j, j:b1]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return torch.empty_like(q).index_copy_(1, order, q).to(torch.int8)


def quantize_matrix(w_RC: Tensor, sigmas: float, floor: float, h_CC: Tensor | None, qmax: int = INT6_MAX,
                    quantiles: tuple[float, ...] = CLIP_QUANTILES, coarsen: float = 1.0) -> tuple[Tensor, Tensor]:
    """Codes in -qmax..qmax, fp16 row scales: SD clip k (`sigmas` x `coarsen`) or the clip search (0); GPTQ given H."""
    if sigmas > 0:
        clip = sigmas * w_RC.std(dim=1)
        scale = (grid_scale(clip, qmax, floor) * coarsen).half().float()  # the stored one
        codes = grid_codes(w_RC, clip, scale, qmax).to(torch.int8)
    else:
        codes, scale = quantize_rows(w_RC, qmax, quantiles, floor)
    if h_CC is not None:
        codes = gptq_codes(w_RC, h_CC, scale.float(), qmax)
    return codes, scale.half()


def lqer_factors(err_RC: Tensor, rank: int, group: int) -> dict[str, Tensor]:
    """LQER: the quantization error's top-`rank` SVD, E ~ A B (A = U S, B = V^T): A int2, one scale max|A| / 1.5; B int4
    in flattened groups of `group`, scales max / 7.5 (both int4 a row, max / 7, if `group` does not divide B).
    Returns lqA, lqAs, lqB, lqBs (int8 codes, fp16 scales); lqer_delta inverts it."""
    u, sv, vh = torch.linalg.svd(err_RC.float(), full_matrices=False)
    r = min(rank, sv.numel())
    a, b = u[:, :r] * sv[:r], vh[:r]
    parts = (((a.reshape(1, -1), -2, 1, LQER_A_MAX), (b.reshape(-1, group), -8, 7, LQER_B_MAX))
             if b.numel() % group == 0 else tuple((m, -LQER_ROW_MAX, LQER_ROW_MAX, LQER_ROW_MAX) for m in (a, b)))
    out = {}
    for key, t, (g, lo, hi, div) in zip(("A", "B"), (a, b), parts):
        scale = (g.abs().amax(dim=1).clamp_min(1e-10) / div).half()
        out[f"lq{key}"] = torch.clamp(torch.round(g / scale.float()[:, None]), lo, hi).to(torch.int8).reshape(t.shape)
        out[f"lq{key}s"] = scale
    return out


def dequantize_runs(q: Tensor, s: Tensor) -> Tensor:
    """Codes times scales, each scale covering an equal run of the codes (a row, an LQER group, or all)."""
    return (q.float().reshape(s.numel(), -1) * s.float()[:, None]).reshape(q.shape)


def lqer_delta(f: dict[str, Tensor]) -> Tensor:
    return dequantize_runs(f["lqA"], f["lqAs"]) @ dequantize_runs(f["lqB"], f["lqBs"])


def sd_clip_bits(k: float, qmax: int = INT6_MAX) -> float:
    """An SD-clipped code's predicted bits (0 at k = 0: no SD clip)."""
    return max(math.log2(qmax * math.sqrt(2 * math.pi * math.e) / k), PREDICT_MIN_BITS) if k > 0 else 0.0


def bank_matrix(name: str) -> tuple[str, int] | None:
    """(matrix, layer) of a bank matrix of unbank(state) ("blocks.3.attn.q": ("attn.q", 3)), else None."""
    parts = name.split(".", 2)
    return (parts[2], int(parts[1])) if len(parts) == 3 and parts[0] == "blocks" and parts[2] in MATRICES else None


@dataclass(frozen=True)
class Format:
    """How the artifact stores a weight of unbank(state), as tensors name.<part>; a new format: a new row of FORMATS."""
    kind: str  # its first part (codes or values), naming the format in an artifact
    label: str  # what tools/artifact_report.py calls it
    holds: Callable[[Hyperparameters, str, Tensor], bool] | None  # its weights (first that holds); None: a correction
    quantize: Callable  # (cfg, name, w fp32 on the CPU, GPTQ's H or None, grid coarsening) -> {part: tensor}
    dequantize: Callable[[dict[str, Tensor]], Tensor]  # {part: tensor} -> the weight (a correction's: its delta)
    bits: Callable[[Hyperparameters, str], float]  # predicted bits a weight after rANS (+ a side value a grid row)
    parts: tuple[str, ...] = ()  # its other parts
    qmax: Callable[[Hyperparameters], int] = lambda cfg: 0  # a grid's codes: -qmax..qmax, a fp16 scale a row
    clip: Callable[[Hyperparameters, str], float] = lambda cfg, name: 0.0  # a grid's SD clip k (0: clip search)
    hessian: Callable[[Hyperparameters, str], tuple | None] = lambda cfg, name: None  # GPTQ's H: its key


def embed_qmax(cfg: Hyperparameters) -> int:
    return 2 ** (cfg.embed_bits - 1) - 1


def int6_matrix(cfg: Hyperparameters, name: str, w: Tensor, h: Tensor | None, coarsen: float) -> dict[str, Tensor]:
    sigmas = clip_sigmas(cfg, bank_matrix(name)[0])
    return dict(zip(("q6", "scale"), quantize_matrix(w, sigmas, cfg.int6_scale_floor, h, INT6_MAX, coarsen=coarsen)))


def embed_table(cfg: Hyperparameters, name: str, w: Tensor, h: Tensor | None, coarsen: float) -> dict[str, Tensor]:
    """A big table at EMBED_BITS; the output head (tok_emb when tied) GPTQ'd on the final hidden states' H."""
    qmax, k = embed_qmax(cfg), cfg.embed_clip_sigmas
    floor = FP16_MIN_NORMAL if k > 0 else 1 / qmax
    return dict(zip(("q8", "scale"), quantize_matrix(w, k, floor, h, qmax, (INT8_CLIP_QUANTILE,), coarsen)))


FORMATS = {f.kind: f for f in (
    Format("q6", "int6", lambda cfg, name, t: bank_matrix(name) is not None, int6_matrix,
           lambda p: dequantize_runs(p["q6"], p["scale"]), lambda cfg, name: sd_clip_bits(
               clip_sigmas(cfg, bank_matrix(name)[0]), INT6_MAX) or PREDICT_SEARCH_BITS["q6"], ("scale",),
           lambda cfg: INT6_MAX, lambda cfg, name: clip_sigmas(cfg, bank_matrix(name)[0]),
           lambda cfg, name: bank_matrix(name)),
    Format("q8", "int8 tables", lambda cfg, name, t: t.numel() > KEEP_FLOAT_MAX_NUMEL and t.ndim == 2, embed_table,
           lambda p: dequantize_runs(p["q8"], p["scale"]), lambda cfg, name: sd_clip_bits(
               cfg.embed_clip_sigmas, embed_qmax(cfg)) or PREDICT_SEARCH_BITS["q8"] - (8 - cfg.embed_bits),
           ("scale",), embed_qmax, lambda cfg, name: cfg.embed_clip_sigmas,
           lambda cfg, name: ("head", 0) if name == ("tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight")
           else None),
    Format("f16", "fp16 tensors", lambda cfg, name, t: True, lambda cfg, name, w, h, coarsen: {"f16": w.half()},
           lambda p: p["f16"].float(), lambda cfg, name: 8 * PREDICT_SIDE_BYTES),
    Format("lqA", "LQER factors", None,  # not predicted: LQER_TOP_K x LQER_RANK x (rows + columns) small codes
           lambda cfg, name, err, h, coarsen: lqer_factors(err, cfg.lqer_rank, cfg.lqer_asym_group), lqer_delta,
           lambda cfg, name: 0.0, ("lqAs", "lqB", "lqBs")))}


def format_of(cfg: Hyperparameters, name: str, t: Tensor) -> Format:
    return next(f for f in FORMATS.values() if f.holds is not None and f.holds(cfg, name, t))


def stored_weights(packed: dict[str, Tensor]) -> dict[str, list[tuple[Format, dict[str, Tensor]]]]:
    """An artifact's tensors by weight: name -> (format, {part: tensor}) of each format it holds, its own first."""
    by_name, out = {}, {}  # name -> {part: tensor}; name -> [(format, its parts)]
    for key, t in packed.items():
        name, part = key.rsplit(".", 1)
        by_name.setdefault(name, {})[part] = t
    for name, parts in by_name.items():
        formats = [f for f in FORMATS.values() if f.kind in parts]
        known = {p for f in formats for p in (f.kind, *f.parts)}
        if not formats or known != set(parts):
            raise ValueError(f"artifact holds an unknown tensor kind, or misses one: {name}."
                             f"{sorted(known ^ set(parts) or parts)[0]}")
        out[name] = [(f, {p: parts[p] for p in (f.kind, *f.parts)}) for f in formats]
    return out


def quantize_state(state: dict[str, Tensor], cfg: Hyperparameters, hessians: dict | None = None,
                   grids: dict[str, float] | None = None, reuse: dict | None = None) -> dict[str, Tensor]:
    """Each weight in its FORMATS row (GPTQ given its H), LQER on the worst LQER_TOP_K; `reuse`d but for `grids`."""
    out, errors, grids = {}, {}, grids or {}
    for name, t in unbank(state, cfg.num_layers).items():
        t, fmt = t.detach().float().cpu(), format_of(cfg, name, t)
        keys, key = [f"{name}.{p}" for p in (fmt.kind, *fmt.parts)], fmt.hessian(cfg, name)
        if reuse is not None and fmt.qmax(cfg) and name not in grids:
            out.update({k: reuse[k] for k in keys})
        else:
            h = hessians[key].cpu() if hessians is not None and key is not None else None
            out.update(zip(keys, fmt.quantize(cfg, name, t, h, grids.get(name, 1.0)).values()))
        if fmt.qmax(cfg) and cfg.lqer_enabled:
            errors[name] = t - fmt.dequantize({p: out[k] for p, k in zip((fmt.kind, *fmt.parts), keys)})
    for name in sorted(errors, key=lambda n: -errors[n].norm().item())[: cfg.lqer_top_k]:
        out.update({f"{name}.{k}": v for k, v in FORMATS["lqA"].quantize(cfg, name, errors[name], None, 1.0).items()})
    if bad := [k for k, v in out.items() if v.is_floating_point() and not torch.isfinite(v).all()]:  # it scored NaN
        raise ValueError(f"export: {', '.join(bad)} not finite (a one-column matrix's SD clip: its std is NaN; or "
                         "weights past fp16's range): set that kind's *_CLIP_SIGMAS=0, the clip search")
    return out


def code_errors(packed: dict[str, Tensor], state: dict[str, Tensor], cfg: Hyperparameters,
                hessians: dict | None) -> dict[str, tuple[float, int]]:
    """GPTQ's tr(E H E^T) (E = Q - W; H = I uncalibrated) per code, and the codes, of SD-clipped matrices with an H."""
    out = {}
    for name, w in unbank(state, cfg.num_layers).items():
        fmt = format_of(cfg, name, w)
        key = fmt.hessian(cfg, name)
        if not fmt.qmax(cfg) or fmt.clip(cfg, name) == 0 or (hessians is not None and key is None):
            continue
        e = fmt.dequantize({p: packed[f"{name}.{p}"] for p in (fmt.kind, *fmt.parts)}) - w.detach().float().cpu()
        err = (e @ hessians[key].float().cpu() * e).sum() if hessians is not None else e.square().sum()
        if err > 0:  # a zero matrix (never trained) codes exactly: no bits to trade, and coarser_grids takes log2
            out[name] = (float(err) / e.numel(), e.numel())
    return out


def coarser_grids(errors: dict[str, tuple[float, int]], bits: float) -> dict[str, float]:
    """Grid steps x f for about `bits` fewer bits (reverse water-filling): a code's bits fall by log2 f, its squared
    error grows f^2, so f = sqrt(L / c) for matrices of error per code c < L; L: sum codes * log2 f = bits."""
    step = lambda x, c: min(max(0.0, x - math.log2(c)) / 2, MAX_GRID_LOG2)  # log2 f at the level 2^x
    saved = lambda x: sum(n * step(x, c) for c, n in errors.values())
    logs = [math.log2(c) for c, _ in errors.values()]
    lo, hi = min(logs), max(logs) + 2 * bits / sum(n for _, n in errors.values()) + 1  # saved(hi) >= bits, or capped
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if saved(mid) < bits else (lo, mid)
    return {name: 2 ** step(hi, c) for name, (c, _) in errors.items() if math.log2(c) < hi}


def predict_artifact_bytes(cfg: Hyperparameters) -> int:
    """The artifact's size for these settings, from the shapes (a meta-device model) and PREDICT_*: an estimate."""
    with torch.device("meta"):
        state = GPT(cfg).state_dict()
    total = 0.0
    for name, t in unbank(state, cfg.num_layers).items():
        fmt = format_of(cfg, name, t)
        total += t.numel() * fmt.bits(cfg, name) / 8 + (PREDICT_SIDE_BYTES * t.shape[0] if fmt.qmax(cfg) else 0)
    return round(total * PREDICT_CODER[cfg.compressor])


def fit_to_limit(cfg: Hyperparameters, explicit: set[str], code_bytes: int) -> Hyperparameters:
    """AUTO_SIZE=f: the widest MLP (MLP_MULT set: bigram table), in 64s, whose predicted total is <= f of the limit."""
    if (name := next((f for f in ("mlp_mult", "bigram_vocab_size") if f not in explicit), None)) is None:
        raise ValueError("AUTO_SIZE sizes MLP_MULT or BIGRAM_VOCAB_SIZE: leave one of them unset")
    value = (lambda n: n * 64 / cfg.model_dim) if name == "mlp_mult" else (lambda n: n * 64)
    budget = cfg.auto_size * SIZE_LIMIT_BYTES - code_bytes
    fits = lambda n: predict_artifact_bytes(replace(cfg, **{name: value(n)})) <= budget
    if not fits(1):
        raise ValueError(f"AUTO_SIZE={cfg.auto_size}: even {name}={value(1)} is predicted over the limit")
    n = next(n for n in itertools.count(1) if not fits(n + 1))  # one step of 64 at a time (a prediction takes 18 ms)
    fitted = replace(cfg, **{name: value(n)})
    fitted.validate()
    return fitted


@torch.no_grad()
def calibrate(model: GPT, loader: TrainLoader, batches: int) -> dict[tuple[str, int], Tensor]:
    """GPTQ's H = X^T X (summed over ranks) of every bank matrix and the head on `batches` train micro-batches each."""
    # X^T X under the run's TF32, as the records: 2.4x faster than without, 3e-6 bpb worse (PERFORMANCE.md "Now")
    hessians, seen = {}, 0
    while seen < batches:
        for x, _ in loader.next_batch()[: batches - seen]:
            with autocast(x.device):
                observe(hessians, ("head",), 0, model.hidden(x, hessians=hessians))
            seen += 1
    for h in hessians.values():
        all_reduce_sum_(h)
    return hessians


def dequantize_state(packed: dict[str, Tensor], template: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Inverse of quantize_state, checked against the state_dict of a freshly built model."""
    flat = {name: functools.reduce(torch.add, (fmt.dequantize(parts) for fmt, parts in stored))
            for name, stored in stored_weights(packed).items()}
    want = unbank(template, num_layers)
    missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
    if missing or extra:
        raise ValueError(f"artifact does not match the model settings: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in want.items():
        if flat[name].shape != t.shape:
            raise ValueError(f"artifact tensor {name} has shape {tuple(flat[name].shape)}, model wants "
                             f"{tuple(t.shape)}")
    state = rebank(flat, num_layers)
    return {k: state[k].to(template[k].dtype) for k in template}


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=_DTYPES[dtype]).element_size()


def pack_tensors(tensors: dict[str, Tensor], cfg: Hyperparameters, meta: dict | None = None) -> bytes:
    """The container: magic, u32 header length, JSON {"settings": the MODEL_SETTINGS, meta ("tokenizer_sha256",
    "byte_rule": what scored the val set), "tensors": [[name, dtype, shape], ...]}, raw data."""
    layout = [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()]
    header = json.dumps({"settings": {n: getattr(cfg, n) for n in MODEL_SETTINGS}, **(meta or {"tokenizer_sha256": ""}),
                         "tensors": layout}, separators=(",", ":")).encode()
    body = b"".join(t.contiguous().numpy().tobytes() for t in tensors.values())
    return PAYLOAD_MAGIC + struct.pack("<I", len(header)) + header + body


def unpack_tensors(buf: bytes) -> tuple[dict, dict[str, Tensor]]:
    """(header: the model's settings and its tokenizer's sha256, tensors)."""
    if buf[:4] != PAYLOAD_MAGIC or len(buf) < 8:
        raise ValueError("artifact payload is corrupt (bad magic), or it was written by an older train_gpt.py")
    (hlen,) = struct.unpack("<I", buf[4:8])
    try:
        header = json.loads(buf[8: 8 + hlen])
    except ValueError:
        raise ValueError("artifact payload is corrupt (unreadable header)") from None
    out, offset = {}, 8 + hlen
    for name, dtype, shape in header["tensors"]:
        n = _nbytes(dtype, shape)
        if offset + n > len(buf):
            raise ValueError(f"artifact payload is truncated at tensor {name}")
        out[name] = torch.frombuffer(bytearray(buf[offset: offset + n]), dtype=_DTYPES[dtype]).reshape(shape) if n \
            else torch.empty(shape, dtype=_DTYPES[dtype])  # frombuffer refuses 0 bytes (NUM_LAYERS=1's skips)
        offset += n
    if offset != len(buf):
        raise ValueError(f"artifact payload has {len(buf) - offset} trailing bytes")
    return {k: v for k, v in header.items() if k != "tensors"}, out


def _zstd():
    try:
        import zstandard
        return zstandard
    except ImportError:
        return None


def rans_tables(sym: np.ndarray, tid: np.ndarray, n_tables: int, n_sym: int) -> np.ndarray:
    """Order-0 frequencies of each table's symbols, scaled to sum to 2^RANS_BITS (a seen symbol keeps >= 1)."""
    counts = np.bincount(tid * n_sym + sym, minlength=n_tables * n_sym).reshape(n_tables, n_sym)
    freq = counts * (1 << RANS_BITS) // np.maximum(counts.sum(1, keepdims=True), 1)
    freq[(counts > 0) & (freq == 0)] = 1
    freq[np.arange(n_tables), freq.argmax(1)] += (1 << RANS_BITS) - freq.sum(1)
    return freq


def _by_step(a: np.ndarray, steps: int) -> np.ndarray:
    """Symbol i at [i // RANS_LANES, i % RANS_LANES]; the last step padded with zeros."""
    return np.concatenate([a, np.zeros(steps * RANS_LANES - a.size, a.dtype)]).reshape(steps, RANS_LANES)


def _freq_cum(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return freq.astype(np.uint64), (np.cumsum(freq, 1) - freq).astype(np.uint64)


def rans_encode(sym: np.ndarray, tid: np.ndarray, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interleaved rANS (Duda 2013; 32-bit states, 16-bit words): symbol i (table tid[i]) goes to stream i % RANS_LANES,
    numpy coding one symbol a stream a step, back to front. (final states, word counts, words in decoding order)."""
    steps = -(-sym.size // RANS_LANES)
    f_all, c_all = _freq_cum(freq)
    sym_g, tid_g, live = _by_step(sym, steps), _by_step(tid, steps), _by_step(np.ones(sym.size, bool), steps)
    x = np.full(RANS_LANES, RANS_LOW, np.uint64)
    words, out = np.zeros((steps, RANS_LANES), np.uint16), np.zeros((steps, RANS_LANES), bool)
    for t in range(steps - 1, -1, -1):
        f = np.where(live[t], f_all[tid_g[t], sym_g[t]], 1)
        out[t] = live[t] & (x >= (np.uint64((RANS_LOW >> RANS_BITS) << 16) * f))  # one word keeps x in range
        words[t] = x & np.uint64(0xFFFF)
        x = np.where(out[t], x >> np.uint64(16), x)
        x = np.where(live[t], (x // f << np.uint64(RANS_BITS)) + x % f + c_all[tid_g[t], sym_g[t]], x)
    return x.astype(np.uint32), out.sum(0).astype(np.uint32), words.T[out.T]


def rans_decode(states: np.ndarray, counts: np.ndarray, words: np.ndarray, tid: np.ndarray,
                freq: np.ndarray) -> np.ndarray:
    """Inverse of rans_encode for len(tid) symbols; checks that every stream ends where encoding began."""
    steps, mask = -(-tid.size // RANS_LANES), np.uint64((1 << RANS_BITS) - 1)
    tid_g, live = _by_step(tid, steps), _by_step(np.ones(tid.size, bool), steps)
    f_all, c_all = _freq_cum(freq)
    slot_sym = np.stack([np.repeat(np.arange(freq.shape[1]), f) for f in freq])  # (tables, 2^RANS_BITS)
    ptr = np.concatenate([[0], np.cumsum(counts[:-1], dtype=np.int64)])
    end = ptr + counts
    x, out = states.astype(np.uint64), np.zeros((steps, RANS_LANES), np.int64)
    padded = np.concatenate([words, np.zeros(1, np.uint16)]).astype(np.uint64)
    for t in range(steps):
        slot = x & mask
        s = slot_sym[tid_g[t], slot]
        x = np.where(live[t], f_all[tid_g[t], s] * (x >> np.uint64(RANS_BITS)) + slot - c_all[tid_g[t], s], x)
        need = live[t] & (x < RANS_LOW)
        x = np.where(need, (x << np.uint64(16)) | padded[np.minimum(ptr, len(words))], x)
        ptr += need
        out[t] = s
    if (x != RANS_LOW).any() or (ptr != end).any() or int(counts.sum()) != len(words):
        raise ValueError("artifact is corrupt: an entropy-coded stream does not decode to its start")
    return out.reshape(-1)[: tid.size]


def _tensor_layout(payload: bytes) -> tuple[int, list[tuple[bool, int, list[int]]]]:
    """Where the tensor data starts, and each tensor's (rANS-coded: int8 codes of a non-empty matrix, bytes, shape)."""
    (hlen,) = struct.unpack("<I", payload[4:8])
    return 8 + hlen, [(dtype == "int8" and len(shape) == 2 and math.prod(shape) > 0, _nbytes(dtype, shape), shape)
                      for _, dtype, shape in json.loads(payload[8: 8 + hlen])["tensors"]]


def rans_scale_logs(codes_RC: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows' and columns' code RMS as rounded quarter-octave logs (int8), the side data of the context."""
    ms = codes_RC.astype(np.float64) ** 2
    q = lambda m: np.clip(np.round(2 * np.log2(m + 1e-3)), -127, 127).astype(np.int8)  # 4 log2 sqrt(m)
    return q(ms.mean(1)), q(ms.mean(0))


def rans_contexts(row_log: np.ndarray, col_log: np.ndarray) -> np.ndarray:
    """Every code's table (row-major), from the stored logs alone: in integers, the same on every machine."""
    mean = int(row_log.astype(np.int64).sum()) // len(row_log)
    ctx = row_log[:, None].astype(np.int64) + col_log[None, :] - mean + RANS_TABLE_OFFSET
    return np.clip(ctx, 0, RANS_TABLES - 1).reshape(-1)


def rans_compress(payload: bytes) -> bytes:
    """COMPRESSOR=rans: int6 and int8 codes rANS-coded by their predicted spread's table; the rest xz-coded beside."""
    start, layout = _tensor_layout(payload)
    codes, rest, logs, ctx, at = [], [], [], [], start
    for is_code, n, shape in layout:
        chunk, at = payload[at: at + n], at + n
        if is_code:
            row_log, col_log = rans_scale_logs(np.frombuffer(chunk, np.int8).reshape(shape[0], -1))
            codes.append(chunk)
            logs += [row_log.tobytes(), col_log.tobytes()]
            ctx.append(rans_contexts(row_log, col_log))
        else:
            rest.append(chunk)
    sym = np.frombuffer(b"".join(codes), np.uint8).astype(np.int64)
    tid = np.concatenate(ctx) if ctx else np.zeros(0, np.int64)
    freq = rans_tables(sym, tid, RANS_TABLES, 256)
    states, counts, words = rans_encode(sym, tid, freq)
    side = lzma.compress(payload[:start] + b"".join(rest) + b"".join(logs) + freq.astype("<u2").tobytes() +
                         states.astype("<u4").tobytes() + counts.astype("<u4").tobytes(), preset=LZMA_PRESET)
    return struct.pack("<I", len(side)) + side + words.astype("<u2").tobytes()


def rans_decompress(body: bytes) -> bytes:
    """Inverse of rans_compress: the payload, byte for byte."""
    (side_len,) = struct.unpack("<I", body[:4])
    side = lzma.decompress(body[4: 4 + side_len], format=lzma.FORMAT_XZ)
    start, layout = _tensor_layout(side)
    at = start + sum(n for is_code, n, _ in layout if not is_code)  # the logs, tables, states and counts follow
    ctx = []
    for is_code, n, shape in layout:
        if is_code:
            rows, cols = shape[0], n // shape[0]
            row_log, col_log = np.frombuffer(side, np.int8, rows, at), np.frombuffer(side, np.int8, cols, at + rows)
            ctx.append(rans_contexts(row_log, col_log))
            at += rows + cols
    freq = np.frombuffer(side, "<u2", RANS_TABLES * 256, at).reshape(RANS_TABLES, 256).astype(np.int64)
    states = np.frombuffer(side, "<u4", RANS_LANES, at + 512 * RANS_TABLES)
    counts = np.frombuffer(side, "<u4", RANS_LANES, at + 512 * RANS_TABLES + 4 * RANS_LANES)
    tid = np.concatenate(ctx) if ctx else np.zeros(0, np.int64)
    sym = rans_decode(states, counts, np.frombuffer(body, "<u2", offset=4 + side_len), tid, freq).astype(np.uint8)
    pieces, rest_at, sym_at = [side[:start]], start, 0
    for is_code, n, _ in layout:
        pieces.append(sym[sym_at: sym_at + n].tobytes() if is_code else side[rest_at: rest_at + n])
        sym_at, rest_at = sym_at + n * is_code, rest_at + n * (not is_code)
    return b"".join(pieces)


def compress(payload: bytes, method: str) -> tuple[bytes, str]:
    """COMPRESSOR=rans (PERFORMANCE.md "Now": rANS coder) or fast (zstd, sweeps), integrity-checked: (blob, coder)."""
    if method == "rans":
        return ARTIFACT_MAGIC + bytes([COMPRESSOR_CODES["rans"]]) + rans_compress(payload), "rans"
    if _zstd() is None:
        raise RuntimeError(f"COMPRESSOR={method} but the zstandard package is not installed")
    blob = _zstd().ZstdCompressor(level=ZSTD_FAST_LEVEL, write_checksum=True).compress(payload)
    return ARTIFACT_MAGIC + bytes([COMPRESSOR_CODES["zstd"]]) + blob, "zstd"


def decompress(blob: bytes) -> bytes:
    if len(blob) < 5 or blob[:4] != ARTIFACT_MAGIC or blob[4] not in COMPRESSOR_CODES.values():
        raise ValueError("not an artifact of this script (bad magic or compressor byte; bytes 1 and 2 are coders of "
                         "an older train_gpt.py: export it again)")
    try:
        if blob[4] == COMPRESSOR_CODES["rans"]:
            return rans_decompress(blob[5:])
        if _zstd() is None:
            raise RuntimeError("artifact is zstd-compressed but the zstandard package is not installed")
        dec = _zstd().ZstdDecompressor().decompressobj()
        out = dec.decompress(blob[5:])
        if not dec.eof or dec.unused_data:  # one-shot APIs silently accept truncation / trailing junk
            raise EOFError("stream incomplete or followed by extra bytes")
        return out
    except (lzma.LZMAError, EOFError, struct.error, IndexError, ValueError) as e:  # ValueError: an odd length
        raise ValueError(f"artifact is corrupt or truncated: {e}") from None
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise ValueError(f"artifact is corrupt or truncated: {e}") from None
        raise


def serialize(model: GPT, cfg: Hyperparameters, meta: dict, hessians: dict | None = None,
              budget: float = math.inf) -> tuple[bytes, str, dict | None]:
    """(the artifact's bytes, its coder, the fit). Over `budget` bytes, rANS's is quantized again on coarser_grids
    until it fits: the fit is {"unfitted": the tensors before, "bytes": their artifact's size, "grids"}, else None."""
    state = model.state_dict()
    packed = quantize_state(state, cfg, hessians)
    first, coder = compress(pack_tensors(packed, cfg, meta), cfg.compressor)
    if len(first) <= budget or coder != "rans":
        return first, coder, None
    errors, need = code_errors(packed, state, cfg, hessians), 8 * (len(first) - budget)
    if not errors:
        raise ValueError(f"the artifact is {len(first)} bytes, over the {budget:.0f} left beside the code, and no "
                         "matrix has an SD clip and an error to coarsen (*_CLIP_SIGMAS=0, the clip search; all zero)")
    bits = 1.02 * need
    for _ in range(FIT_TRIES):
        grids = coarser_grids(errors, bits)
        blob = compress(pack_tensors(quantize_state(state, cfg, hessians, grids, packed), cfg, meta), "rans")[0]
        if len(blob) <= budget:
            return blob, coder, dict(unfitted=packed, bytes=len(first), grids=grids)
        bits *= 1.02 * need / max(8 * (len(first) - len(blob)), 1)
    raise ValueError(f"the artifact is {len(blob)} bytes after {FIT_TRIES} coarser grids, over the {budget:.0f} left "
                     "beside the code")


def deserialize(blob: bytes) -> tuple[dict, dict[str, Tensor]]:
    """Inverse of serialize up to the quantisation: (header with "coder" and "bytes", tensors for artifact_model)."""
    header, tensors = unpack_tensors(decompress(blob))
    return dict(header, coder={v: k for k, v in COMPRESSOR_CODES.items()}[blob[4]], bytes=len(blob)), tensors


def read_artifact(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"artifact {path} does not exist")
    return deserialize(Path(path).read_bytes())


def artifact_model(cfg: Hyperparameters, rt: Runtime, tensors: dict[str, Tensor]) -> GPT:
    model = build_model(cfg, rt)
    model.load_state_dict(dequantize_state(tensors, model.state_dict(), cfg.num_layers))
    return model


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside `path`, then rename over it: a crash or a full disk never leaves a partial file there."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:  # "[Errno 28] No space left on device" alone names no file
        raise OSError(e.errno, f"{e.strerror} (writing {path}, {len(data)} bytes)") from None
    finally:
        tmp.unlink(missing_ok=True)


def shipped_code(source: str) -> bytes:
    """The train_gpt.py a record ships (code_bytes): this source without prose (comments, docstrings, setting meanings)
    or this function (package_record.py runs it), an indent a space, xz + base85 in a stub (linecache: @triton.jit)."""
    import ast
    import base64
    import io
    import lzma
    import tokenize
    lines, docs, meanings, drop, fixed, depth_at, depth = source.split("\n"), {}, [], set(), set(), {}, 0
    todo = [ast.parse(source)]  # statements only: ast.walk's every node took a third of the time
    while node := todo and todo.pop():
        body = getattr(node, "body", None)
        if getattr(node, "name", "") == "shipped_code":
            drop.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs[body[0].lineno, body[0].col_offset] = len(body) == 1  # alone: it becomes `pass`
        elif isinstance(v := getattr(node, "value", None), ast.Call) and getattr(v.func, "id", "") == "setting":
            meanings += v.args[1:2]
        todo += [n for f in ("body", "orelse", "handlers", "finalbody") for n in getattr(node, f, ())]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        (r0, c0), (r1, c1) = tok.start, tok.end
        if r0 not in depth_at:  # > 0: a continuation line
            depth_at[r0] = depth + (r0 > 1 and lines[r0 - 2].endswith("\\"))
        if tok.type == tokenize.OP:
            depth += (tok.string in "([{") - (tok.string in ")]}")
        elif tok.type == tokenize.COMMENT:
            drop.update(() if lines[r0 - 1][:c0].strip() else (r0,))
            lines[r0 - 1] = lines[r0 - 1][:c0]
        elif tok.type == tokenize.STRING and (r0, c0) in docs:
            drop.update(range(r0 + (docs[r0, c0]), r1 + 1))
            lines[r0 - 1] = " " * c0 + "pass"
        elif tok.type == tokenize.STRING and r1 > r0:
            fixed.update(range(r0 + 1, r1 + 1))  # inside a multi-line string: as it is
    char = lambda r, c: len(lines[r - 1].encode("utf-8")[:c].decode("utf-8"))  # ast's columns count UTF-8 bytes
    for m in meanings:  # after the comments' cuts, which come later on their lines
        lines[m.lineno - 1] = lines[m.lineno - 1][:char(m.lineno, m.col_offset)] + '""' + \
            lines[m.end_lineno - 1][char(m.end_lineno, m.end_col_offset):]
        drop.update(range(m.lineno + 1, m.end_lineno + 1))
    kept = [(r, line if r in fixed else line.rstrip()) for r, line in enumerate(lines, 1)]
    kept = [(r, code) for r, code in kept if r in fixed or (r not in drop and code)]
    indents = [len(code) - len(code.lstrip(" ")) for r, code in kept if r not in fixed and not depth_at.get(r)]
    unit = min((n for n in indents if n), default=1)  # 4 here; 1 in what this returns: the same again
    out, level = [], 0  # a continuation line one space past its statement's: Triton's jit dedents a kernel's source
    for r, code in kept:
        if r not in fixed:
            if not depth_at.get(r):
                level = (len(code) - len(code.lstrip(" "))) // unit
            code = " " * (level + bool(depth_at.get(r))) + code.lstrip(" ")
        out.append(code)
    s = "\n".join(out) + "\n"
    xz = [dict(id=lzma.FILTER_LZMA2, preset=9 | lzma.PRESET_EXTREME, dict_size=2 ** 20)]  # 64 MiB: +35 ms, same size
    packed = base64.b85encode(lzma.compress(s.encode("utf-8"), filters=xz)).decode()
    return (f'import base64,linecache,lzma\ns=lzma.decompress(base64.b85decode("{packed}")).decode()\n'
            'f=__file__+"#source"\nlinecache.cache[f]=(len(s),None,s.splitlines(True),f)\nREADABLE_SOURCE=s\n'
            'exec(compile(s,f,"exec"))\n').encode("utf-8")


def shipped_bytes(code: str) -> int:
    """The size of shipped_code's stub; in a run of the stub, its own."""
    return Path(__file__).stat().st_size if "READABLE_SOURCE" in globals() else len(shipped_code(code))


# ===== Training: EMA, schedule, the step (CUDA graphs), the timed loop =====
CHECKPOINT_MAGIC = b"pgolf-checkpoint-2\n"  # then the sha256 of the payload (32 bytes), then torch.save's bytes
CAP_MARGIN = 1.5  # a step starts if the clock + CAP_MARGIN x the slowest of the last 10 fits the cap (0.05% of 600 s)
PROGRESS_EVERY_S = 10.0  # a progress line (no loss: no host sync) when no step line came for this long


def read_checkpoint(path: str) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"RESUME {path} does not exist")
    data, n = Path(path).read_bytes(), len(CHECKPOINT_MAGIC)
    if not data.startswith(CHECKPOINT_MAGIC):
        raise ValueError(f"RESUME {path} is an artifact: score it with EVAL_ONLY={path}" if data[:4] == ARTIFACT_MAGIC
                         else f"RESUME {path} is not a checkpoint of this version of train_gpt.py")
    payload = memoryview(data)[n + 32:]  # (a view: a record checkpoint is 270 MB)
    if hashlib.sha256(payload).digest() != data[n:n + 32]:
        raise ValueError(f"RESUME {path} is corrupt: its checksum does not match its {len(payload)} bytes")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


class EMA:
    """fp32 EMA of all parameters, applied after training; its time constant a fraction of the run, fitting any length:
    decay exp(-dp / horizon) a progress step dp (0.08 best at 1,500 and 3,000 proxy steps); EMA_DECAY > 0 fixes it."""

    def __init__(self, model: nn.Module, horizon: float, fixed_decay: float = 0.0):
        self.horizon, self.fixed_decay, self.params = horizon, fixed_decay, list(model.parameters())
        self.shadow = [p.detach().float().clone() for p in self.params]

    def decay(self, progress_delta: float) -> float:
        return self.fixed_decay if self.fixed_decay > 0 else math.exp(-max(progress_delta, 0.0) / self.horizon)

    @torch.no_grad()
    def update(self, progress_delta: float) -> None:
        torch._foreach_lerp_(self.shadow, [p.float() for p in self.params], 1.0 - self.decay(progress_delta))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.shadow)  # rounds to each parameter's dtype


def train_cap_ms(cfg: Hyperparameters) -> float:
    reserve = cfg.gptq_reserve_seconds if cfg.gptq_calibration_batches > 0 else 0.0
    return 1000.0 * (cfg.max_wallclock_seconds - reserve) if cfg.max_wallclock_seconds > 0 else 0.0


def run_progress(cfg: Hyperparameters, steps: int, elapsed_ms: float) -> float:
    """How far the run is, 0..1: by steps or, capped, by the clock, whichever is further (warmdown, EMA, loops)."""
    cap_ms = train_cap_ms(cfg)
    return max(steps / max(cfg.iterations, 1), elapsed_ms / cap_ms if cap_ms > 0 else 0.0)


def lr_scale_at(cfg: Hyperparameters, step: int, elapsed_ms: float) -> float:
    """Linear warmdown, floored at MIN_LR: over the last WARMDOWN_FRAC of run_progress, or over the last
    WARMDOWN_ITERS steps or, capped, as many average steps of wallclock, whichever ends first."""
    if cfg.warmdown_iters > 0:
        scale = min(1.0, max(0.0, (cfg.iterations - step) / cfg.warmdown_iters))
        if cfg.max_wallclock_seconds > 0:
            warmdown_ms = cfg.warmdown_iters * elapsed_ms / max(step, 1)
            scale = min(scale, max(train_cap_ms(cfg) - elapsed_ms, 0.0) / max(warmdown_ms, 1e-9))
    elif cfg.warmdown_frac > 0:
        scale = min(1.0, max(0.0, 1.0 - run_progress(cfg, step, elapsed_ms)) / cfg.warmdown_frac)
    else:
        return 1.0
    return max(scale, cfg.min_lr)


def muon_momentum_at(cfg: Hyperparameters, step: int) -> float:
    frac = min(step / cfg.muon_momentum_warmup_steps, 1.0) if cfg.muon_momentum_warmup_steps > 0 else 1.0
    return (1 - frac) * cfg.muon_momentum_warmup_start + frac * cfg.muon_momentum


class TrainClock:
    """The loop's clocks: training time (paused to score), iteration times (for CAP_MARGIN), the last line's time."""

    def __init__(self, device: torch.device, train_ms: float, slowest: float | None):
        self.device, self.train_ms, self.recent_ms, self.t_prev = device, train_ms, [slowest] if slowest else [], None
        self.t0 = self.last_line = now_ms(device)  # t_prev (above): the previous iteration's start, set by tick()

    def now(self) -> float:
        return self.train_ms + now_ms(self.device) - self.t0

    def pause(self) -> None:
        self.train_ms += now_ms(self.device) - self.t0

    def restart(self) -> None:
        self.t0, self.t_prev = now_ms(self.device), None

    def tick(self) -> tuple[float, float]:
        """At an iteration's start: (training ms, when the next step would end at CAP_MARGIN x the slowest of 10)."""
        t = now_ms(self.device)
        if self.t_prev is not None:
            self.recent_ms.append(t - self.t_prev)
        self.t_prev, now = t, self.train_ms + t - self.t0
        return now, now + CAP_MARGIN * self.slowest()

    def slowest(self) -> float:
        return max(self.recent_ms[-10:], default=0.0)


class Trainer:
    """Model, optimizers and data through warmup (then a full restore), the timed loop, and checkpoints."""

    def __init__(self, cfg: Hyperparameters, rt: Runtime, model: GPT, loader: TrainLoader, log: Logger,
                 tokenizer: str = "", code: str = ""):
        self.cfg, self.rt, self.model, self.loader, self.log = cfg, rt, model, loader, log
        self.tokenizer, self.code = tokenizer, code  # their sha256s, stored in checkpoints: RESUME checks them
        self.opt, self.fwd = Optimizers(model, cfg, rt), compiled(model, rt)
        self.graphed = self.opt.keep_grads = rt.cuda_graphs  # graphs accumulate into fixed .grad
        self.graphs: dict[Mode, tuple] = {}  # mode -> (graph, static x, static y, static loss)
        self.warm: set[Mode] = set()  # the modes the warmup compiled
        self.clock = dict(step=0, train_ms=0.0, progress=0.0, qat=False, loop=False)  # train()'s start (RESUME: saved)
        self.mode, self.qat_grid = Mode(looping=False), FORMATS["q6"].qmax(cfg)  # late QAT: the banks' export grid
        self.ckpt_path, self.signal = Path("logs") / f"{cfg.run_id}.ckpt", 0

    def fwd_bwd(self, x: Tensor, y: Tensor) -> Tensor:
        if not self.graphed:
            return self._fwd_bwd(x, y)
        graph, sx, sy, loss = self.graphs.get(self.mode) or self._capture(x, y)
        sx.copy_(x)
        sy.copy_(y)
        graph.replay()
        return loss.clone()  # the graph's output is overwritten by the next replay

    def _fwd_bwd(self, x: Tensor, y: Tensor) -> Tensor:
        with autocast(self.rt.device):
            loss = self.fwd(x, y, self.mode)
        (loss / self.rt.grad_accum_steps).backward()
        return loss.detach()

    def _capture(self, x: Tensor, y: Tensor) -> tuple:
        """Capture fwd_bwd in the current mode (zero grads: a first micro-batch); an unwarmed mode compiles first."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if any(p.grad is not None and p.grad.any() for p in params):
            raise RuntimeError("CUDA graph capture needs zero gradients (a step's first micro-batch)")
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sx, sy = x.clone(), y.clone()
        if self.mode not in self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._fwd_bwd(sx, sy)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        shared = next(iter(self.graphs.values()))[0].pool() if self.graphs else None  # modes never overlap
        # thread_local: the NCCL watchdog thread's event queries during capture are not this capture's business
        with torch.cuda.graph(graph, pool=shared, capture_error_mode="thread_local"):
            loss = self._fwd_bwd(sx, sy)
        torch._foreach_zero_([p.grad for p in params])
        self.graphs[self.mode] = (graph, sx, sy, loss)
        return self.graphs[self.mode]

    def modes(self) -> list[Mode]:
        """The loop's modes in order (a compile, a graph each): repeats, then late QAT (with them: the final model)."""
        loops, qat, at = self.cfg.num_loops > 0, self.cfg.late_qat_threshold > 0, self.cfg.enable_looping_at
        out = [Mode(loops and at == 0)] + [Mode(True)] * (loops and at > 0)
        return out + [Mode(loops, self.qat_grid)] * qat

    def step(self, step: int, lr_scale: float) -> Tensor:
        self.opt.set_schedule(lr_scale, muon_momentum_at(self.cfg, step))
        loss_sum = sum(self.fwd_bwd(x, y) for x, y in self.loader.next_batch())
        self.loader.prefetch()  # host work while the GPU runs the micro-batches
        with torch.profiler.record_function("optimizer"):  # tools/bench_gpu.py --profile finds its kernels by it
            self.opt.step()
            self.opt.zero_grad()
        return loss_sum / self.rt.grad_accum_steps

    def warmup(self) -> None:
        """Compile every mode on real steps (none in the timed window), capture the graphs, then restore all exactly."""
        cfg, modes = self.cfg, self.modes()
        if cfg.warmup_steps <= 0:
            return
        if cfg.warmup_steps < len(modes):
            self.log(f"warning WARMUP_STEPS < {len(modes)}: the modes {modes[cfg.warmup_steps:]} will compile (and "
                     "capture) inside the timed window")
        saved = copy.deepcopy(self.state(None, self.clock))
        plan = (modes[:1] * (cfg.warmup_steps - len(modes)) + modes)[:cfg.warmup_steps]
        # all modes compile, then are captured into one pool: a compile beside another's pool reserved 42 GB, not 21
        graphed, self.graphed, cuda = self.graphed, False, self.rt.device.type == "cuda"
        if cuda:  # TRAIN_ACT_BYTES's measure (step 1 adds the optimizer's states)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() // 2 ** 20
        for i, self.mode in enumerate(plan):
            self.step(i, 1.0)
            self.log(f"warmup_step:{i + 1}/{cfg.warmup_steps}")
        self.warm, self.graphed = set(plan), graphed
        if cuda:
            self.log(f"warmup_memory before:{before}MiB peak:{torch.cuda.max_memory_allocated() // 2 ** 20}MiB")
        if graphed:
            torch.cuda.empty_cache()
            x, y = self.loader.next_batch()[0]
            for self.mode in dict.fromkeys(plan):  # each replayed once here: its upload is not the timed loop's
                self._capture(x, y)[0].replay()
                self.opt.zero_grad()
        self.load(saved, None)

    def mean_loss(self, loss: Tensor) -> float:
        t = loss.detach().double().reshape(1)
        all_reduce_sum_(t)
        return t.item() / self.rt.world_size

    def train(self, scorer: Scorer, ema: EMA | None) -> tuple[int, float, int, dict | None]:
        """The timed loop, GPTQ's Hessians, the final checkpoint: (steps, training ms, stop signal or 0, Hessians)."""
        if self.clock.get("done"):
            step, train_ms = self.clock["step"], self.clock["train_ms"]
            return step, train_ms, 0, self.end_training(ema, step, train_ms)
        # STOP_SIGNALS: the loop writes a checkpoint at the next step's start and stops (after the loop: the final)
        self.handlers = {s: signal.signal(s, self.on_signal) for s in STOP_SIGNALS}
        try:
            clocks = TrainClock(self.rt.device, self.clock["train_ms"], self.clock.get("recent_ms"))
            step, train_ms, stopped, clock = self.finish(ema, clocks, *self.timed_loop(scorer, ema, clocks))
            try:
                hessians = None if stopped else self.end_training(ema, step, train_ms)
            except BaseException:  # one process keeps what it trained (ranks alone would wait in collectives)
                if self.rt.world_size == 1:
                    self.save_checkpoint(ema, clock)
                raise
            # after the Hessians, which end the 600 s (1 s on 2 H200s): no trained model is lost to a later
            # failure (RESUME=it exports and scores again); run() deletes it unless CHECKPOINT_EVERY is on
            try:
                self.save_checkpoint(ema, clock)
            except OSError as e:  # a disk that holds the artifact but not the checkpoint still gets the artifact
                if stopped or self.cfg.checkpoint_every > 0:
                    raise
                self.log(f"warning the trained state was not written ({e}): export goes on without it")
        finally:
            for s, handler in self.handlers.items():
                signal.signal(s, handler)
        late = 0 if stopped else int(all_reduce_max(float(self.signal), self.rt.device))  # one rank's: all stop
        if late:  # after the loop: the checkpoint is on disk
            raise Interrupted(late)
        if stopped:
            self.log(f"interrupted by {signal.Signals(stopped).name} at step {step}: resume with "
                     f"RESUME={self.ckpt_path} and the same settings")
        return step, train_ms, stopped, hessians

    def on_signal(self, signum: int, _) -> None:
        self.signal = signum
        signal.signal(signum, self.handlers[signum])  # a second one acts as it would without this loop

    def timed_loop(self, scorer: Scorer, ema: EMA | None, clocks: TrainClock) -> tuple[int, float, Tensor]:
        """Steps until ITERATIONS, the cap or a signal; returns (steps, progress, the first non-finite loss's step)."""
        cfg, rt, cap_ms = self.cfg, self.rt, train_cap_ms(self.cfg)
        # one host sync per iteration where ranks must agree on a clock: the cap, checkpoints, or a signal
        clocked = cap_ms > 0 or cfg.checkpoint_every > 0 or rt.world_size > 1
        first_bad = torch.full((), -1, dtype=torch.int64, device=rt.device)  # first non-finite loss step
        step, progress = self.clock["step"], self.clock["progress"]
        start, last_ckpt = (step, clocks.train_ms), clocks.train_ms
        while step < cfg.iterations:
            if cfg.val_loss_every > 0 and step > 0 and step % cfg.val_loss_every == 0:
                self.validate(scorer, step, clocks)
            elapsed, stop = 0.0, self.signal
            if clocked:  # all ranks agree on the clock, so on stopping, lr scale, the QAT switch and checkpoints
                elapsed, predicted, stop = all_reduce_max([*clocks.tick(), float(self.signal)], rt.device)
                if cap_ms > 0 and predicted > cap_ms:  # a step starts only if its predicted end fits the cap
                    self.log(f"stopping_early: wallclock_cap train_time:{elapsed:.0f}ms step:{step}/{cfg.iterations}")
                    break
            if stop:
                break
            if cfg.checkpoint_every > 0 and elapsed - last_ckpt >= 1000 * cfg.checkpoint_every:
                clocks.train_ms = last_ckpt = elapsed  # agreed: ranks' clocks drift, and all must take part
                self.save_checkpoint(ema, self.where(step, progress, clocks, elapsed))
                clocks.restart()
            lr_scale, ramp = lr_scale_at(cfg, step, elapsed), self.set_span(step, progress)
            self.switch_modes(step, lr_scale, progress)  # on the schedule's scale, not the span change's ramp
            try:
                loss = self.step(step, lr_scale * ramp)
            except ShardError as e:  # raised before the step's work: keep what was trained
                self.save_checkpoint(ema, self.where(step, progress, clocks, clocks.now()))
                raise ShardError(f"{e}; checkpoint {self.ckpt_path} written at step {step}: fix the data (or the "
                                 f"setting named), then resume with RESUME={self.ckpt_path}") from None
            # progress on the agreed clock; a stall counts as at most 3 average steps: no snapshot dominates the EMA
            done = run_progress(cfg, step + 1, elapsed)
            if ema is not None:
                ema.update(min(done - progress, 3 * done / (step + 1)))
            progress, step = done, step + 1
            first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss), step, first_bad)
            self.log_step(step, loss, first_bad, clocks, start)
        return step, progress, first_bad

    def finish(self, ema: EMA | None, clocks: TrainClock, step: int, progress: float,
               first_bad: Tensor) -> tuple[int, float, int, dict]:
        """After the loop: (steps, training ms, the signal that stopped it or 0, the final checkpoint's clock)."""
        clocks.pause()
        cap_ms, train_ms = train_cap_ms(self.cfg), clocks.train_ms
        if 0 < cap_ms < train_ms:
            self.log(f"warning wallclock_overrun train_time:{train_ms:.0f}ms cap:{cap_ms:.0f}ms "
                     f"over_by:{train_ms - cap_ms:.0f}ms")
        self.check_finite(first_bad)
        stopped = int(all_reduce_max(float(self.signal), self.rt.device))  # one in the last step counts
        return step, train_ms, stopped, self.where(step, progress, clocks, train_ms, done=not stopped)

    def end_training(self, ema: EMA | None, steps: int, train_ms: float) -> dict | None:
        """train_done, then GPTQ's Hessians of the EMA weights (train data: in the 600 s); the live weights put back."""
        if self.graphed:  # the rest needs the graphs' pool and the gradient buffers
            self.graphs.clear()
            self.graphed = self.opt.keep_grads = False
            self.opt.zero_grad()
            torch.cuda.empty_cache()
        cfg, model, log = self.cfg, self.model, self.log
        if cfg.num_loops > 0 and not self.mode.looping:  # stopped before ENABLE_LOOPING_AT: the repeats still score
            log(f"layer_loop:enabled after training step:{steps} (scoring, calibration and export run the repeats)")
        log(f"train_done steps:{steps} train_time:{train_ms:.0f}ms step_avg:{train_ms / max(steps, 1):.2f}ms")
        self.done_at = time.perf_counter()
        if self.rt.device.type == "cuda":
            log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
        if cfg.gptq_calibration_batches == 0:
            return None
        live = [p.detach().clone() for p in model.parameters()] if ema is not None else None
        if ema is not None:
            ema.copy_to_model()
        t0, position = now_ms(self.rt.device), self.loader.state_dict()
        try:
            hessians = calibrate(model, self.loader, cfg.gptq_calibration_batches)
        finally:  # the checkpoint's position: a RESUME calibrates on these batches again
            self.loader.load_state_dict(position)
            if live is not None:
                with torch.no_grad():
                    torch._foreach_copy_(list(model.parameters()), live)
        log(f"gptq_calibration batches:{cfg.gptq_calibration_batches} time:{now_ms(self.rt.device) - t0:.0f}ms "
            f"reserved:{1000 * cfg.max_wallclock_seconds - train_cap_ms(cfg):.0f}ms")
        return hessians

    def validate(self, scorer: Scorer, step: int, clocks: TrainClock) -> None:
        """VAL_LOSS_EVERY's score, outside the training time, in the loop's mode without QAT."""
        clocks.pause()
        s = scorer(self.model, self.cfg.eval_seq_len, mode=self.mode._replace(qat=0))
        self.log(f"step:{step}/{self.cfg.iterations} val_loss:{s.loss:.4f} val_bpb:{s.bpb:.4f} "
                 f"train_time:{clocks.train_ms:.0f}ms step_avg:{clocks.train_ms / step:.2f}ms")
        clocks.restart()

    def switch_modes(self, step: int, lr_scale: float, progress: float) -> None:
        cfg = self.cfg
        if cfg.late_qat_threshold > 0 and lr_scale < cfg.late_qat_threshold and not self.mode.qat:
            self.mode = self.mode._replace(qat=self.qat_grid)
            self.log(f"late_qat:enabled step:{step} lr_scale:{lr_scale:.4f}")
        if cfg.num_loops > 0 and not self.mode.looping and (progress >= cfg.enable_looping_at or self.mode.qat):
            self.mode = self.mode._replace(looping=True)
            self.log(f"layer_loop:enabled step:{step} progress:{progress:.3f} layers:{layer_order(cfg, True)}")

    def set_span(self, step: int, progress: float) -> float:
        """TRAIN_SEQ_SCHEDULE: the span at this progress into the model; returns the lr ramp after a change."""
        spans, ramp = self.cfg.seq_spans, self.cfg.seq_change_warmup_steps
        if not spans:
            return 1.0
        if (span := next((n for f, n in spans if progress <= f), spans[-1][1])) != self.clock.get("span", spans[0][1]):
            self.clock.update(span=span, span_step=step)
            self.log(f"seq_span:{span} step:{step} progress:{progress:.3f}")
        self.model.span.fill_(span)
        return min(1.0, (step - self.clock["span_step"] + 1) / ramp) if ramp and "span_step" in self.clock else 1.0

    def log_step(self, step: int, loss: Tensor, first_bad: Tensor, clocks: TrainClock, start: tuple) -> None:
        """A train_loss line (steps 1-10, every TRAIN_LOG_EVERY), else every PROGRESS_EVERY_S one without (no sync)."""
        cfg = self.cfg
        if cfg.train_log_every > 0 and (step <= 10 or step % cfg.train_log_every == 0):
            self.check_finite(first_bad)
            mean, now = self.mean_loss(loss), clocks.now()
            self.log(f"step:{step}/{cfg.iterations} train_loss:{mean:.4f} train_time:{now:.0f}ms "
                     f"step_avg:{now / step:.2f}ms eta:{self.eta_s(step, now, start):.0f}s")
            clocks.last_line = now_ms(HOST)
        elif self.rt.is_main and now_ms(HOST) - clocks.last_line >= 1000 * PROGRESS_EVERY_S:
            clocks.last_line = now_ms(HOST)
            now = clocks.train_ms + clocks.last_line - clocks.t0
            self.log(f"step:{step}/{cfg.iterations} train_time:{now:.0f}ms eta:{self.eta_s(step, now, start):.0f}s")

    @staticmethod
    def where(step: int, progress: float, clocks: TrainClock, ms: float, **more) -> dict:
        """The clock of a checkpoint taken now: where it resumes."""
        return dict(step=step, train_ms=ms, progress=progress, recent_ms=clocks.slowest(), **more)

    def eta_s(self, step: int, t_ms: float, start: tuple[int, float]) -> float:
        """Seconds left at this run's mean step time, or to the cap if that comes first."""
        left = (t_ms - start[1]) / max(step - start[0], 1) * (self.cfg.iterations - step)
        cap_ms = train_cap_ms(self.cfg)
        return max(min(left, cap_ms - t_ms) if cap_ms > 0 else left, 0.0) / 1000

    def state(self, ema: EMA | None, clock: dict) -> dict:
        """All the loop needs to go on exactly (warmup's snapshot, a checkpoint): a collective; holds live tensors."""
        return dict(settings=asdict(self.cfg), tokenizer_sha256=self.tokenizer, code_sha256=self.code,
                    model=self.model.state_dict(), opt=self.opt.state_dict(), loader=self.loader.state_dict(),
                    ema=ema.shadow if ema is not None else None, rng=torch.get_rng_state(), clock=clock,
                    cuda_rng=torch.cuda.get_rng_state(self.rt.device) if self.rt.device.type == "cuda" else None)

    def load(self, state: dict, ema: EMA | None) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.loader.load_state_dict(state["loader"])
        if ema is not None and state["ema"] is not None:
            torch._foreach_copy_(ema.shadow, [t.to(self.rt.device) for t in state["ema"]])
        elif ema is not None:  # a checkpoint of a run without EMA: the average starts from its weights
            ema.shadow = [p.detach().float().clone() for p in ema.params]
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and self.rt.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.rt.device)
        self.clock = state["clock"]
        self.mode = Mode(self.clock["loop"], self.qat_grid if self.clock["qat"] and self.cfg.late_qat_threshold else 0)

    def save_checkpoint(self, ema: EMA | None, clock: dict) -> None:
        t0, spans = now_ms(HOST), {k: self.clock[k] for k in ("span", "span_step") if k in self.clock}
        state = self.state(ema, dict(clock, qat=bool(self.mode.qat), loop=self.mode.looping, **spans))

        def write() -> None:
            buf = io.BytesIO()
            torch.save(state, buf)
            payload = buf.getvalue()
            write_atomic(self.ckpt_path, CHECKPOINT_MAGIC + hashlib.sha256(payload).digest() + payload)
            self.log(f"checkpoint step:{clock['step']} path:{self.ckpt_path} bytes:{buf.tell()} "
                     f"time:{now_ms(HOST) - t0:.0f}ms")
        on_rank0(self.rt, write)

    def check_finite(self, first_bad: Tensor) -> None:
        local = float(first_bad.item())
        bad = -all_reduce_max(-local if local >= 0 else -math.inf, self.rt.device)  # earliest over ranks
        if bad < math.inf:
            raise FloatingPointError(f"non-finite training loss at step {int(bad)}")


# ===== main: the pipeline (log header, data, train, export, scoring) and the entry point =====
LEAK_LIMIT = 0.01  # of the val documents: more found in train shards stops the run (#2127 trained on 80%)
ERROR_WAIT_SECONDS = 10.0  # report_error: ample for torchrun, which polls its workers every 0.1 s


def log_header(log: Logger, cfg: Hyperparameters, rt: Runtime, warnings: list[str], code: str, code_bytes: int) -> None:
    """The log's start: source, versions, machine, settings, warnings, layout, model shape, predicted size."""
    log(f"==== source: train_gpt.py ====\n{code}\n==== end source ====", console=False)
    log(f"versions python:{platform.python_version()} torch:{torch.__version__} numpy:{np.__version__} "
        f"platform:{platform.platform()}")
    if rt.device.type == "cuda":
        p = torch.cuda.get_device_properties(rt.device)
        log(f"device name:{p.name.replace(' ', '_')} memory_mib:{p.total_memory // 2**20} "
            f"count:{torch.cuda.device_count()}")
    else:
        log(f"device name:cpu threads:{torch.get_num_threads()}")
    log(f"world_size:{rt.world_size}")
    log("\n".join(f"setting {n}:{getattr(cfg, n)}" for n in sorted(SETTINGS)), console=False)
    for w in warnings:
        log(f"warning {w}")
    log(rt.describe())
    if rt.budget:  # the estimates (GiB) behind GRAD_ACCUM_STEPS and TTT_BATCH_SIZE
        micro, rows, G = cfg.train_batch_tokens // (rt.world_size * rt.grad_accum_steps), ttt_rows(cfg, rt), 2 ** 30
        sgd = global_sgd_rows(cfg, rt)[1] if cfg.phased_ttt_prefix_docs > 0 else 0  # phased TTT's rows, a rank
        est = (activation_bytes(cfg, micro, TRAIN_ACT_BYTES) * (not cfg.eval_only),
               ttt_bytes(cfg, max(rows, sgd)) * cfg.ttt_enabled)
        train = "" if cfg.eval_only else f" micro_batch_tokens:{micro} est:{est[0] / G:.1f}"  # EVAL_ONLY trains not
        log(f"memory_plan budget:{rt.budget / G:.1f}{train} ttt_rows:{rows} global_sgd_rows:{sgd} est:{est[1] / G:.1f}")
        ttt = "lower TTT_BATCH_SIZE" + (" and GLOBAL_TTT_CHUNK_TOKENS (phased TTT's rows)" if sgd > rows else "")
        for advice, e in zip(("raise GRAD_ACCUM_STEPS (or shrink the model)", ttt), est):
            if e > rt.budget:
                log(f"warning memory_plan: {e / G:.1f} GiB estimated over the {rt.budget / G:.1f} planned for: "
                    f"expect out of memory; {advice}")
    if not cfg.eval_only:  # known at step 0: a config that will not fit, or one that leaves bytes unused
        predicted = predict_artifact_bytes(cfg) + code_bytes
        log(f"predicted_size total:{predicted} limit:{SIZE_LIMIT_BYTES} headroom:{SIZE_LIMIT_BYTES - predicted}")
    with torch.device("meta"):
        log(f"model_params:{sum(p.numel() for p in GPT(cfg).parameters())}")
    order, first = layer_order(cfg, True), cfg.parallel_start_layer
    lanes = sorted({i for i, two in zip(order, parallel_positions(cfg, True)) if two})
    log(f"layers order:{order} parallel:{lanes or 'none'}" + (f" (PARALLEL_START_LAYER={first} is past NUM_LAYERS="
                                                              f"{cfg.num_layers})" if first >= cfg.num_layers else ""))


def log_score(log: Logger, key: str, s: Score, extra: str = "") -> None:
    log(f"{key} val_loss:{s.loss:.4f} val_bpb:{s.bpb:.4f}{extra} eval_time:{s.time_ms:.0f}ms "
        f"compile_time:{s.compile_ms:.0f}ms scored_tokens:{s.tokens} scored_bytes:{s.bytes}")
    log(f"{key}_exact val_loss:{s.loss:.8f} val_bpb:{s.bpb:.8f}")


def check_train_shards(cfg: Hyperparameters, rt: Runtime, log: Logger, sp, val: np.ndarray) -> None:
    """Each rank's share of the train shards: this tokenizer's, holding <= LEAK_LIMIT of the val documents."""
    t0, files, index = time.perf_counter(), shard_files(cfg.data_path, "train"), {}
    starts, ends, keys = doc_keys(val)
    for j, (a, b, key) in enumerate(zip(starts, ends, keys)):
        index.setdefault(key, []).append((a, b, j))
    # a flag per val document, the tokens found, a flag per shard of another tokenizer
    found = torch.zeros(len(starts) + 1 + len(files), dtype=torch.int64)
    for i, (f, tokens) in enumerate(zip(files, map(raw_shard, files))):  # every header on every rank
        if i % rt.world_size == rt.rank:
            try:
                check_tokenizer(sp, tokens, f)
            except ValueError:  # raised after the sum, on every rank
                found[len(starts) + 1 + i] = 1
                continue
            docs, n = val_docs_in(tokens, val, index)
            found[list(docs)], found[len(starts)] = 1, found[len(starts)] + n
    found = found.to(rt.device)
    all_reduce_sum_(found)
    found, bad = found[:len(starts) + 1], found[len(starts) + 1:].nonzero().flatten().tolist()
    if bad:
        check_tokenizer(sp, raw_shard(files[bad[0]]), files[bad[0]])
    docs, tokens = int((found[:-1] > 0).sum()), int(found[-1])
    log(f"train_shards_checked shards:{len(files)} val_docs_in_train:{docs}/{len(starts)} tokens:{tokens} "
        f"time:{1000 * (time.perf_counter() - t0):.0f}ms")
    if docs > LEAK_LIMIT * len(starts):
        raise ValueError(f"{docs} of the {len(starts)} validation documents ({tokens} tokens) are also in the train "
                         f"shards of {cfg.data_path}: rebuild them without (data/make_caseops.py, data/make_shards.py)")


def validation_scorer(cfg: Hyperparameters, rt: Runtime, log: Logger, tokenizer: str) -> tuple[Scorer, bool]:
    """The val shards' scorer, once the tokenizer is shown theirs (and the train's), and whether they are the sample."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=cfg.tokenizer_path)
    log(f"tokenizer path:{cfg.tokenizer_path} sha256:{tokenizer}")
    if (cfg.smear_bos_fix or cfg.doc_isolation) and sp.bos_id() != BOS_ID:
        raise ValueError(f"SMEAR_BOS_FIX=1 and DOC_ISOLATION=1 find documents by BOS id {BOS_ID}; "
                         f"TOKENIZER_PATH's is {sp.bos_id()}")
    luts, val_files = build_byte_luts(sp, cfg.vocab_size, rt.device), shard_files(cfg.data_path, "val")
    val_tokens = torch.from_numpy(np.concatenate([open_shard(f, cfg.vocab_size) for f in val_files]).astype(np.int64))
    val_bytes = val_byte_sidecar(cfg.data_path, val_tokens.numel())
    if val_bytes is None and sp.piece_to_id(CASEOPS_TITLE) != sp.unk_id():  # its pieces' bytes are not the text's
        raise ValueError("TOKENIZER_PATH is a CaseOps tokenizer, and DATA_PATH has no byte sidecar "
                         "(fineweb_val_bytes_*.bin, which data/make_caseops.py writes) to score the original text")
    counts, manifest = {"docs": int((val_tokens == BOS_ID).sum()),
                        "tokens": val_tokens.numel()}, val_manifest(cfg.data_path)
    counts["bytes"] = None if val_bytes is None else int(val_bytes.sum())  # the sidecar's sum: val_bpb's denominator
    for key, want in manifest[0].items():  # a partial validation set, one that leaked into training, a bad sidecar
        if want is not None and counts[key] is not None and want != counts[key]:
            raise ValueError(f"the val shards hold {counts[key]} {key}, {manifest[1]} says {want}")
    check_tokenizer(sp, val_tokens.numpy(), val_files[0])
    if not (val_tokens[1:] != BOS_ID).any():  # found now, not after training
        raise ValueError(f"the val shards of {cfg.data_path} hold no target but BOS: no bytes to score")
    if not cfg.eval_only:
        check_train_shards(cfg, rt, log, sp, val_tokens.numpy())
    scorer = Scorer(cfg, rt, val_tokens, luts, log, val_bytes)
    log(f"val_tokens:{counts['tokens']} val_docs:{counts['docs']} scored_targets:{val_tokens.numel() - 1} "
        f"eval_batch_seqs:{scorer.batch_seqs} byte_rule:{scorer.byte_rule} manifest:{manifest[1] or 'none'}")
    if sample := is_sample_shard(val_files[0]):
        log("sample_data: the offline sample (data/make_sample.py): scores are not comparable to FineWeb scores")
    return scorer, sample


def precompile_eval(cfg: Hyperparameters, rt: Runtime, log: Logger, scorer: Scorer) -> None:
    """Every eval graph (scorer's, TTT mode's) compiled before any clock, on a random model: the artifact's reuses."""
    if not rt.compile_enabled:
        return
    t0, model, mode = now_ms(rt.device), build_model(cfg, rt), TTT_MODES[cfg.ttt_mode]
    scorer.warm(scorer.logits_fn(model))
    if cfg.ttt_enabled and mode.precompile is not None:
        with grad_flags(model, False):
            mode.precompile(cfg, rt, model, scorer)
    del model
    torch.cuda.empty_cache()  # a no-op without CUDA
    log(f"eval_precompile time:{now_ms(rt.device) - t0:.0f}ms")


def train(cfg: Hyperparameters, rt: Runtime, log: Logger, scorer: Scorer, ckpt: dict | None,
          tokenizer: str, code: str = "") -> tuple[GPT, dict | None, float, int, float]:
    """(trained model, EMA applied; GPTQ's Hessians or None; training ms; stopping signal or 0; train_done's time)."""
    model, files = build_model(cfg, rt), shard_files(cfg.data_path, "train")
    loader = TrainLoader(files, cfg, rt)
    log(f"train_data shards:{len(files)} tokens:{loader.tokens} epochs_at_max_iterations:"
        f"{cfg.iterations * cfg.train_batch_tokens / max(loader.tokens, 1):.2f} sampling:{cfg.train_sampling}")
    trainer = Trainer(cfg, rt, model, loader, log, tokenizer, code)
    if ckpt is None or not ckpt["clock"].get("done"):  # a finished run's checkpoint trains no more
        trainer.warmup()
    ema = EMA(model, cfg.ema_horizon, cfg.ema_decay) if cfg.ema_enabled else None
    if ckpt is not None:
        trainer.load(ckpt, ema)
        log(f"resumed_from:{cfg.resume} step:{trainer.clock['step']} train_time:{trainer.clock['train_ms']:.0f}ms")
    steps, train_ms, stopped_by, hessians = trainer.train(scorer, ema)
    if stopped_by:
        return model, None, train_ms, stopped_by, 0.0
    s = scorer(model, cfg.eval_seq_len)
    log(f"step:{steps}/{cfg.iterations} val_loss:{s.loss:.4f} val_bpb:{s.bpb:.4f} train_time:{train_ms:.0f}ms "
        f"step_avg:{train_ms / max(steps, 1):.2f}ms eval_time:{s.time_ms:.0f}ms eval_compile_time:{s.compile_ms:.0f}ms")
    if ema is not None:
        ema.copy_to_model()
        log_score(log, "post_ema", scorer(model, cfg.eval_seq_len))
    if cfg.asym_logit_rescale:  # the caps learned (the records' never left LOGIT_SOFTCAP)
        log("asym_logit_caps pos:{:.4f} neg:{:.4f}".format(*model.softcap_pm.tolist()))
    return model, hessians, train_ms, 0, trainer.done_at


def export(cfg: Hyperparameters, rt: Runtime, log: Logger, model: GPT, hessians: dict | None, meta: dict,
           code_bytes: int) -> dict | None:
    """Rank 0 writes ARTIFACT_PATH (rANS's fitted to the limit); then all ranks return the unfitted tensors or None."""
    def write() -> dict | None:
        t0 = time.perf_counter()
        blob, coder, fit = serialize(model, cfg, meta, hessians, SIZE_LIMIT_BYTES - code_bytes)
        write_atomic(Path(cfg.artifact_path), blob)
        if fit:
            g = fit["grids"].values()
            log(f"size_fit bytes:{fit['bytes']}->{len(blob)} coarser_grids:{len(g)} x{min(g):.4f}..x{max(g):.4f} "
                "(over the limit: least GPTQ error per code first; its cost is scored after the final scores)")
        log(f"Serialized model int6+{coder}: {len(blob)} bytes export_time:{1000 * (time.perf_counter() - t0):.0f}ms")
        return fit and fit["unfitted"]
    return on_rank0(rt, write)


def score_artifact(cfg: Hyperparameters, rt: Runtime, log: Logger, scorer: Scorer, tensors: dict[str, Tensor],
                   unfitted: dict | None) -> tuple[str, Score]:
    """The artifact's scores from its tensors alone: round trip, sliding (per document: TTT's baseline), TTT, unfit."""
    model = artifact_model(cfg, rt, tensors)
    log_score(log, "final_int6_roundtrip", roundtrip := scorer(model, cfg.eval_seq_len))
    if cfg.sliding_eval_enabled:  # without it TTT gives the only EVAL_STRIDE score (the records)
        score, key = scorer(model, cfg.eval_stride), "final_int6_sliding_window"
        log_score(log, key, score, f" stride:{cfg.eval_stride}")
        if cfg.ttt_enabled and TTT_MODES[cfg.ttt_mode].per_doc_baseline and not cfg.doc_isolation:
            log_score(log, "final_int6_sliding_window_per_doc", scorer(model, cfg.eval_stride, per_doc=True),
                      f" stride:{cfg.eval_stride}")
    if cfg.ttt_enabled:
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        score, key = TTT_MODES[cfg.ttt_mode].score(cfg, rt, model, scorer), "legal_ttt"
        log_score(log, key, score)
        if rt.device.type == "cuda":  # training's cached blocks included: what the whole run needs
            log(f"ttt_peak_memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    if unfitted is not None:
        unfit = scorer(artifact_model(cfg, rt, unfitted), cfg.eval_seq_len)
        log(f"size_fit_cost roundtrip_val_bpb:{roundtrip.bpb - unfit.bpb:+.8f} (fitted {roundtrip.bpb:.8f}, "
            f"unfitted {unfit.bpb:.8f})")
    return key, score


def main() -> int:
    # the readable source: this file, or what the shipped stub (shipped_code) unpacked before running it
    code = globals().get("READABLE_SOURCE") or Path(__file__).read_text(encoding="utf-8")
    cfg, warnings = Hyperparameters.from_env()
    explicit, code_sha = {n for n in SETTINGS if n.upper() in os.environ}, hashlib.sha256(code.encode()).hexdigest()
    if (ckpt := read_checkpoint(cfg.resume) if cfg.resume else None) is not None:  # its settings, but this run's names
        names = tuple(n for n in SETTINGS if n not in ("run_id", "resume", "eval_only", "artifact_path"))
        used = "the environment's value is used" + (" where it still acts (a finished run's checkpoint: export and "
                                                    "scoring only)" if ckpt["clock"].get("done") else "")
        cfg, more = adopt_settings(cfg, ckpt["settings"], names, explicit, f"checkpoint {cfg.resume}", used)
        warnings += more
        if ckpt.get("code_sha256") not in (None, "", code_sha):  # the packager refuses such a run's log
            warnings.append(f"checkpoint {cfg.resume} was written by another train_gpt.py: a record of this run "
                            "ships this one, which did not train all of it")
    t_read = time.perf_counter()  # EVAL_ONLY: decoding is in eval_wall
    stored, decode_s = read_artifact(cfg.eval_only) if cfg.eval_only else None, time.perf_counter() - t_read
    if stored is not None:  # NOT_SCORING's settings at their defaults: warned about (unread), neither checked nor used
        cfg, _ = adopt_settings(replace(cfg, **{n: SETTINGS[n].default for n in NOT_SCORING}), stored[0]["settings"],
                                MODEL_SETTINGS, explicit, f"artifact {cfg.eval_only}")
    tokenizer = tokenizer_sha256(cfg.tokenizer_path)
    for made, source in ((ckpt, f"checkpoint {cfg.resume}"), (stored and stored[0], f"artifact {cfg.eval_only}")):
        if made and made.get("tokenizer_sha256") not in (None, "", tokenizer):  # None, "": files that predate the hash
            raise ValueError(f"TOKENIZER_PATH {cfg.tokenizer_path} (sha256 {tokenizer}) is not the tokenizer {source} "
                             f"was made with (sha256 {made['tokenizer_sha256']})")
    if cfg.auto_size > 0 and ckpt is None and stored is None:  # a resumed or scored model keeps its shapes
        cfg = fit_to_limit(cfg, explicit, shipped_bytes(code))
    warnings += cfg.unread(explicit)
    rt = init_runtime(cfg)
    check_same_on_ranks({k: v for k, v in os.environ.items() if k.lower() in SETTINGS})
    if (claimed := claim_outputs(cfg, rt)).run_id != cfg.run_id:
        warnings.append(f"RUN_ID {cfg.run_id} is taken in logs/: this run is RUN_ID={claimed.run_id}")
    cfg = claimed
    log = Logger(cfg.run_id, rt.is_main)
    for s in STOP_SIGNALS:  # the training loop stops at a step's end on the first one
        signal.signal(s, raise_interrupted)
    try:
        return run(cfg, rt, log, code, warnings, ckpt, stored, tokenizer, code_sha, decode_s)
    except BaseException as e:  # say how to finish from what is on disk
        artifact, trained = Path(cfg.eval_only or cfg.artifact_path), Path("logs") / f"{cfg.run_id}.ckpt"
        resume, written = trained if trained.is_file() else cfg.resume, artifact.is_file() and artifact.stat().st_size
        if rt.is_main and not (written or cfg.eval_only):  # the claim, made empty, goes back
            artifact.unlink(missing_ok=True)
        hint = (f"score the artifact with EVAL_ONLY={artifact}" if written else
                f"finish with RESUME={resume} (the same settings)" if resume else
                "no checkpoint was written, the training is lost")
        if isinstance(e, KeyboardInterrupt):
            e = Interrupted(getattr(e, "signum", signal.SIGINT), hint)
        elif trained.is_file():  # a failure after training (export, scoring, TTT, a lost rank)
            e.add_note(hint)
        log(f"error {error_text(e)}", console=False)
        e.log_path = log.path  # report_error: another rank's own error goes there too
        raise e


def run(cfg: Hyperparameters, rt: Runtime, log: Logger, code: str, warnings: list[str], ckpt: dict | None,
        stored: tuple | None, tokenizer: str, code_sha: str, decode_s: float) -> int:
    """The pipeline: train -> export -> score the artifact file (and TTT on it); EVAL_ONLY scores `stored`."""
    t_start, code_bytes = time.perf_counter(), shipped_bytes(code)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    log_header(log, cfg, rt, warnings, code, code_bytes)
    log(f"outputs log:{log.path} artifact:{cfg.eval_only or cfg.artifact_path}" + (f" checkpoints:logs/{cfg.run_id}"
        ".ckpt" if cfg.checkpoint_every and not (cfg.eval_only or ckpt and ckpt["clock"].get("done")) else ""))
    scorer, sample = validation_scorer(cfg, rt, log, tokenizer)
    eval_memory = (f"lower TTT_BATCH_SIZE={ttt_rows(cfg, rt)} (documents a TTT step) or VAL_BATCH_SIZE="
                   f"{cfg.val_batch_size} (tokens a scoring step)")
    with memory_advice(rt, eval_memory):
        precompile_eval(cfg, rt, log, scorer)
    train_ms, unfitted, eval_start = 0.0, None, time.perf_counter()  # EVAL_ONLY: eval_wall from here
    if not cfg.eval_only:
        with memory_advice(rt, f"GRAD_ACCUM_STEPS={2 * rt.grad_accum_steps} halves the micro-batch (the same global "
                           "batch and math); CUDA_GRAPHS=0 frees the graphs' pool in the optimizer step"):
            model, hessians, train_ms, stopped_by, eval_start = train(cfg, rt, log, scorer, ckpt, tokenizer, code_sha)
        if stopped_by:
            if rt.is_main:  # nothing exported: the claim goes back
                Path(cfg.artifact_path).unlink(missing_ok=True)
            return 128 + stopped_by  # the shell's convention for a process ended by a signal
        unfitted = export(cfg, rt, log, model, hessians, dict(tokenizer_sha256=tokenizer,
                                                              byte_rule=scorer.byte_rule), code_bytes)
        del model
    artifact = Path(cfg.eval_only or cfg.artifact_path)
    header, tensors = stored or read_artifact(artifact)  # the file, not the model in memory, is what is scored
    total = header["bytes"] + code_bytes
    log(f"code_bytes:{code_bytes}")
    log(f"Total submission size int6+{header['coder']}: {total} bytes limit:{SIZE_LIMIT_BYTES} "
        f"headroom:{SIZE_LIMIT_BYTES - total}")
    with memory_advice(rt, eval_memory):
        key, score = score_artifact(cfg, rt, log, scorer, tensors, unfitted)
    trained, over = Path("logs") / f"{cfg.run_id}.ckpt", total > SIZE_LIMIT_BYTES
    if rt.is_main and not cfg.checkpoint_every and not over and trained.is_file():  # the artifact is written, scored
        trained.unlink()
        log(f"checkpoint removed: {trained} (CHECKPOINT_EVERY > 0 keeps it)")
    # eval_time: the final score's pass (the records' count); eval_wall: all from train_done on (README)
    now = time.perf_counter()
    log(f"summary score:{key} val_bpb:{score.bpb:.8f} artifact:{artifact} total_bytes:{total} train_time:"
        f"{train_ms / 1000:.1f}s eval_time:{score.time_ms / 1000:.1f}s eval_wall:{now - eval_start + decode_s:.1f}s "
        f"wall_time:{now - t_start + decode_s:.1f}s" + (" sample_data:not_comparable_to_FineWeb" if sample else ""))
    if over:
        again = trained if trained.is_file() else cfg.resume
        log(f"ERROR submission_over_limit total:{total} limit:{SIZE_LIMIT_BYTES} over_by:{total - SIZE_LIMIT_BYTES}"
            + (f" (export again from RESUME={again})" if again else ""))
    return int(over)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" + "".join(f"; {n}" for n in getattr(e, "__notes__", ()))


def report_error(e: BaseException) -> int:
    """One line on stderr, and from a rank but 0 in rank 0's log too, for an error that ends the run. One every rank
    meets comes from rank 0: the others wait to be ended by torchrun (an early exit got rank 0 killed), else report."""
    rank = int(os.environ.get("RANK", "0"))
    if rank and isinstance(e, (ValueError, OSError, FloatingPointError, KeyboardInterrupt)):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(ERROR_WAIT_SECONDS)
    what = (str(e) or "interrupted") if isinstance(e, KeyboardInterrupt) else error_text(e)
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP): the log has the line
        print(f"error{f' (rank {rank})' if rank else ''}: {what} (DEBUG=1 shows the traceback)", file=sys.stderr,
              flush=True)
    if rank and getattr(e, "log_path", None) and e.log_path.is_file():  # rank 0's log: on this machine, or shared
        with contextlib.suppress(OSError), open(e.log_path, "a", encoding="utf-8") as f:
            f.write(f"error (rank {rank}) {what}\n")
    return 128 + getattr(e, "signum", signal.SIGINT) if isinstance(e, KeyboardInterrupt) else 1


def entry() -> None:
    """The script's start and end: main(), one line for an error a user can act on, no interpreter finalization."""
    faulthandler.enable()  # a C++ abort (gloo, NCCL) prints every thread's Python stack, not one bare line
    try:
        rc = main()
    except (ValueError, OSError, RuntimeError, FloatingPointError, KeyboardInterrupt) as e:
        if os.environ.get("DEBUG") == "1":
            raise
        rc = report_error(e)  # no barrier: the other ranks may never get there
    else:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.barrier()  # tearing gloo down while a peer is still talking aborts the process
                dist.destroy_process_group()
            except RuntimeError:  # a peer ended first, and said why
                rc = rc or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    # no interpreter finalization: a gloo thread that frees a tensor then cannot take the GIL and aborts (pytorch
    # PR #179291; a 3-rank CI run's rank 1 ended so: "terminate called without an active exception")
    os._exit(rc)


if __name__ == "__main__":
    entry()
