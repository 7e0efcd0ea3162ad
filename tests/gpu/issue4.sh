# nvidia-h200-x2, the speed issue's open figures (all on one machine, in two calls: PART=bench, PART=curve):
#  1. bench_gpu.py at the record config on GPU 0: default, FP8_ENABLED=1, TRAIN_SAMPLING=coprime
#  2. the same default on 2 GPUs (scaling efficiency, optimizer with its communication)
#  3. 50 record-config steps on 1 GPU vs 2 GPUs (bench_gpu.py --curve: same seed, global batch and
#     schedule): per-step loss compared (bf16 tolerance), no scoring
# Each bench compiles for about 95 s, so PART=bench (1, 2) and PART=curve (3) fit one call each; VARIANTS
# overrides the 1-GPU list (e.g. VARIANTS="TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1").
SHARDS=${SHARDS:-2} source tests/gpu/setup.sh
export MAX_WALLCLOCK_SECONDS=0 WARMUP_STEPS=${WARMUP_STEPS:-3}
if [ "${PART:-bench}" = bench ]; then
for v in ${VARIANTS:-default FP8_ENABLED=1 TRAIN_SAMPLING=coprime}; do
  [ $v = default ] && v=""
  echo "== 1 GPU ${v:-default}"
  env CUDA_VISIBLE_DEVICES=0 $v python3 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench|Error" | tee -a $OUT/issue4.log
done
echo "== 2 GPUs default"
torchrun --standalone --nproc_per_node=2 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench|Error" | tee -a $OUT/issue4.log
exit 0
fi
export ITERATIONS=50 WARMDOWN_ITERS=20 LATE_QAT_THRESHOLD=0
env CUDA_VISIBLE_DEVICES=0 python3 tests/bench_gpu.py --curve 50 > $OUT/curve1.log 2>&1
torchrun --standalone --nproc_per_node=2 tests/bench_gpu.py --curve 50 > $OUT/curve2.log 2>&1
python3 - $OUT/curve1.log $OUT/curve2.log <<'PY' | tee -a $OUT/issue4.log
import re, sys
a, b = ([float(x) for x in re.findall(r"^curve step:\d+ loss:([\d.]+)", open(f).read(), re.M)] for f in sys.argv[1:])
d = [abs(x - y) / x for x, y in zip(a, b)]
print(f"curve steps:{len(a)}/{len(b)} max_rel_diff:{max(d):.2e} at_step:{d.index(max(d)) + 1} "
      f"first10_max:{max(d[:10]):.2e} last:{a[-1]:.4f}/{b[-1]:.4f}")
for i in (0, 1, 4, 9, 19, 29, 39, 49):
    print(f"curve step:{i + 1} one_gpu:{a[i]:.6f} two_gpus:{b[i]:.6f} rel:{d[i]:.2e}")
PY
