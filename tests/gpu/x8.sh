# nvidia-h200-x8: issue 7's run. Record config, 8-GPU layout (accum 1), 300 steps, zstd export, stride-64
# sliding scoring; then bench on 8 GPUs with --profile and on GPU 0 alone (same machine)
SHARDS=8 source tests/gpu/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tee $OUT/x8.log
root=$PWD; mkdir -p /tmp/t8 && cp train_gpt.py /tmp/t8/ && cd /tmp/t8
env RUN_ID=x8 ITERATIONS=300 MAX_WALLCLOCK_SECONDS=0 VAL_LOSS_EVERY=0 LATE_QAT_THRESHOLD=0 TRAIN_LOG_EVERY=50 \
  COMPRESSOR=zstd timeout 280 torchrun --standalone --nproc_per_node=8 train_gpt.py > $OUT/train8.log 2>&1
grep -E "^layout|^step:|peak memory|final_|post_ema|warmup|compile|bytes|Error|Traceback" $OUT/train8.log | grep -v "^step:[0-9]*/300 train_loss.*step_avg" | tee -a $OUT/x8.log
grep -E "^step:(1|2|10|50|100|150|200|250|300)/300 train" $OUT/train8.log | tee -a $OUT/x8.log
cp logs/*.txt $OUT/ 2>/dev/null; cd $root
export MAX_WALLCLOCK_SECONDS=0 WARMUP_STEPS=3 LATE_QAT_THRESHOLD=0
echo "== 8 GPUs bench --profile" | tee -a $OUT/x8.log
PROFILE_ROWS=3 timeout 150 torchrun --standalone --nproc_per_node=8 tests/bench_gpu.py --steps 10 --profile 2>&1 \
  | grep -E "^bench|^kernels|^comm|^optimizer |^kernel nccl|Error" | tee -a $OUT/x8.log
echo "== 1 GPU bench (GPU 0)" | tee -a $OUT/x8.log
env CUDA_VISIBLE_DEVICES=0 timeout 100 python3 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench|Error" | tee -a $OUT/x8.log
