#!/usr/bin/env bash
# Behaviour identity of two versions of train_gpt.py on the CPU (a refactor's check):
#     bash tools/identity.sh BEFORE.py AFTER.py [OUT_DIR]
# Three tiny runs per script on the offline sample (data/make_sample.py, built once under OUT_DIR): lora TTT with depth
# recurrence, lanes, GPTQ and SD clip; the same with late QAT and phased global SGD; lora TTT with DOC_ISOLATION and
# coprime sampling; all COMPRESSOR=rans. Compares every train_loss, val and *_exact line (timings stripped), the artifact's md5 and the md5
# of its tensors; prints IDENTICAL or the differences (exit 1).
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); out=$(realpath -m "${3:-/tmp/identity}")
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
[ -f "$out/sample/tokenizers/sample_1024_bpe.model" ] || python3 "$root/data/make_sample.py" --out "$out/sample" --max-docs 3000 >/dev/null
export DATA_PATH=$out/sample/datasets/sample_sp1024 TOKENIZER_PATH=$out/sample/tokenizers/sample_1024_bpe.model
export DEVICE=cpu VOCAB_SIZE=1024 NUM_LAYERS=4 MODEL_DIM=64 NUM_HEADS=4 NUM_KV_HEADS=2 VE_ENABLED=1 VE_LAYERS=2,3
export XSA_LAST_N=2 ROPE_DIMS=8 VE_DIM=32
export TRAIN_SEQ_LEN=128 TRAIN_BATCH_TOKENS=2048 ITERATIONS=24 WARMUP_STEPS=2 WARMDOWN_ITERS=10 EMA_DECAY=0.9
export MUON_MOMENTUM_WARMUP_STEPS=10 MAX_WALLCLOCK_SECONDS=0 TRAIN_LOG_EVERY=4 VAL_LOSS_EVERY=12 EVAL_SEQ_LEN=128
export EVAL_STRIDE=32 VAL_BATCH_SIZE=8192 BIGRAM_VOCAB_SIZE=256 BIGRAM_DIM=32 LATE_QAT_THRESHOLD=0 COMPRESSOR=rans
export TTT_ENABLED=1 OMP_NUM_THREADS=1
lora=(TTT_MODE=lora NUM_LOOPS=1 LOOP_START=1 LOOP_END=2 ENABLE_LOOPING_AT=0.3 PARALLEL_START_LAYER=3
      GPTQ_CALIBRATION_BATCHES=2 MATRIX_CLIP_SIGMAS=12.85 TTT_CHUNK_SIZE=32 TTT_BATCH_SIZE=8)
iso=(TTT_MODE=lora TTT_CHUNK_SIZE=32 TTT_BATCH_SIZE=8 DOC_ISOLATION=1 ATTN_BACKEND=math TRAIN_SAMPLING=coprime)
phased=("${lora[@]}" LATE_QAT_THRESHOLD=0.5 PHASED_TTT_PREFIX_DOCS=12 PHASED_TTT_NUM_PHASES=2 GLOBAL_TTT_CHUNK_TOKENS=512)
runs() {  # script, folder
  rm -rf "$2" && mkdir -p "$2/logs" && cd "$2"
  env RUN_ID=lora "${lora[@]}" python3 "$1" > lora.out 2>&1 & a=$!
  env RUN_ID=phased "${phased[@]}" python3 "$1" > phased.out 2>&1 & b=$!
  env RUN_ID=iso "${iso[@]}" python3 "$1" > iso.out 2>&1
  wait $a $b
  for r in lora phased iso; do
    grep -E "train_loss|_exact|val_bpb:|Serialized" $r.out | grep -v summary \
      | sed -E 's/ (train_time|step_avg|eta|eval_time|compile_time|eval_compile_time|export_time):[0-9.]+m?s//g'
    md5sum < logs/$r.int6.ptz | cut -c1-32
    TRITON_INTERPRET=1 python3 -c "import hashlib, importlib.util, sys
spec = importlib.util.spec_from_file_location('m', sys.argv[1]); m = importlib.util.module_from_spec(spec)
sys.modules['m'] = m; spec.loader.exec_module(m); _, t = m.read_artifact(sys.argv[2]); h = hashlib.md5()
[h.update(k.encode() + t[k].contiguous().numpy().tobytes()) for k in sorted(t)]; print('tensors', h.hexdigest())" \
      "$1" logs/$r.int6.ptz
  done > lines.txt
}
runs "$before" "$out/before"; runs "$after" "$out/after"
if diff "$out/before/lines.txt" "$out/after/lines.txt"; then echo IDENTICAL; else exit 1; fi
