# same-call A/B on one H200: the reference script (.ref/ref_train_gpt.py + SDPA stand-in) vs ours, record config
source tests/gpu/setup.sh
export MAX_WALLCLOCK_SECONDS=0 VAL_LOSS_EVERY=0
echo "== ours (default attention)"; python3 tests/bench_gpu.py --steps 12 2>&1 | grep -E "^bench" | tee -a $OUT/ab.log
echo "== ours (ATTN_BACKEND=flash)"; ATTN_BACKEND=flash python3 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench" | tee -a $OUT/ab.log
mkdir -p /tmp/r && cp .ref/*.py /tmp/r/ && cd /tmp/r
echo "== reference, ITERATIONS=40"; PYTHONPATH=/tmp/r:$PYTHONPATH ITERATIONS=40 RUN_ID=ref timeout 190 python3 ref_train_gpt.py 2>&1 | grep -E "^step:(10|20|30|40)/|peak memory" | tee -a $OUT/ab.log
