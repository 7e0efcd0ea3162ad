#!/usr/bin/env bash
# The whole pipeline on the offline sample, on CPU, in a few minutes on 2 cores:
# build the sample (stdlib docstrings -> SentencePiece tokenizer -> shards), then
# train -> EMA -> int6 artifact (zstd/lzma) -> read back -> plain and sliding-window val_bpb.
# Any setting can be overridden from the environment (e.g. ITERATIONS=50 bash data/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f data/sample/tokenizers/sample_1024_bpe.model ] || python3 data/make_sample.py --out data/sample
export DATA_PATH=${DATA_PATH:-data/sample/datasets/sample_sp1024}
export TOKENIZER_PATH=${TOKENIZER_PATH:-data/sample/tokenizers/sample_1024_bpe.model}
export DEVICE=${DEVICE:-cpu} RUN_ID=${RUN_ID:-quickstart}
export NUM_LAYERS=${NUM_LAYERS:-4} MODEL_DIM=${MODEL_DIM:-128} NUM_HEADS=${NUM_HEADS:-4} NUM_KV_HEADS=${NUM_KV_HEADS:-2}
export VE_LAYERS=${VE_LAYERS:-2,3} XSA_LAST_N=${XSA_LAST_N:-2} ROPE_DIMS=${ROPE_DIMS:-16}
export TRAIN_SEQ_LEN=${TRAIN_SEQ_LEN:-256} TRAIN_BATCH_TOKENS=${TRAIN_BATCH_TOKENS:-8192}
export ITERATIONS=${ITERATIONS:-150} WARMUP_STEPS=${WARMUP_STEPS:-2} WARMDOWN_ITERS=${WARMDOWN_ITERS:-50}
export MUON_MOMENTUM_WARMUP_STEPS=${MUON_MOMENTUM_WARMUP_STEPS:-50} EMA_DECAY=${EMA_DECAY:-0.95}
export MAX_WALLCLOCK_SECONDS=${MAX_WALLCLOCK_SECONDS:-0} TRAIN_LOG_EVERY=${TRAIN_LOG_EVERY:-25}
export EVAL_SEQ_LEN=${EVAL_SEQ_LEN:-256} EVAL_STRIDE=${EVAL_STRIDE:-64} VAL_BATCH_SIZE=${VAL_BATCH_SIZE:-65536}
exec python3 train_gpt.py
