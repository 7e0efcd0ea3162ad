#!/usr/bin/env bash
# The whole pipeline on the offline sample, on CPU, in about two minutes on 2 cores: build the sample (stdlib
# docstrings -> SentencePiece tokenizer -> shards), then the defaults' record stack at a small shape: train -> EMA
# -> GPTQ int6 + LQER artifact (rANS) -> read back -> plain and sliding-window val_bpb -> lora TTT.
# Any setting can be overridden from the environment (e.g. ITERATIONS=50 bash data/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f data/sample/tokenizers/sample_1024_bpe.model ] || python3 data/make_sample.py --out data/sample
export DATA_PATH=${DATA_PATH:-data/sample/datasets/sample_sp1024}
export TOKENIZER_PATH=${TOKENIZER_PATH:-data/sample/tokenizers/sample_1024_bpe.model}
export DEVICE=${DEVICE:-cpu} RUN_ID=${RUN_ID:-quickstart} VOCAB_SIZE=${VOCAB_SIZE:-1024}
export NUM_LAYERS=${NUM_LAYERS:-4} MODEL_DIM=${MODEL_DIM:-128} NUM_HEADS=${NUM_HEADS:-4} NUM_KV_HEADS=${NUM_KV_HEADS:-2}
export ROPE_DIMS=${ROPE_DIMS:-16}
export TRAIN_SEQ_LEN=${TRAIN_SEQ_LEN:-256} TRAIN_BATCH_TOKENS=${TRAIN_BATCH_TOKENS:-8192}
export ITERATIONS=${ITERATIONS:-60} WARMUP_STEPS=${WARMUP_STEPS:-2}
export MUON_MOMENTUM_WARMUP_STEPS=${MUON_MOMENTUM_WARMUP_STEPS:-20} EMA_DECAY=${EMA_DECAY:-0.95}
export MAX_WALLCLOCK_SECONDS=${MAX_WALLCLOCK_SECONDS:-0} TRAIN_LOG_EVERY=${TRAIN_LOG_EVERY:-25}
export EVAL_SEQ_LEN=${EVAL_SEQ_LEN:-256} EVAL_STRIDE=${EVAL_STRIDE:-64} VAL_BATCH_SIZE=${VAL_BATCH_SIZE:-65536}
export PHASED_TTT_PREFIX_DOCS=${PHASED_TTT_PREFIX_DOCS:-15}  # the default's 2,500 of 50,000, of the sample's 301
# the sample's documents average about 30 tokens: with DEVICE=cuda, more in a micro-batch than varlen's cu_seqlens
# holds (one per 256 tokens; FineWeb's average 960), so document isolation takes SDPA's mask (the CPU's backend too)
export ATTN_BACKEND=${ATTN_BACKEND:-math}
exec python3 train_gpt.py
