# step benchmark with a kernel profile; extra env (e.g. ATTN_BACKEND=flash) before the command
source tests/gpu/setup.sh
MAX_WALLCLOCK_SECONDS=0 python3 tests/bench_gpu.py --steps ${STEPS:-12} --profile --qat-check 2>&1 | tee -a $OUT/bench.log | grep -v "^setting"
