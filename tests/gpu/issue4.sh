# nvidia-h200-x2 or -x4 (NGPU=2|4), the speed issue's several-GPU figures, all on one machine:
#  PART=curve  50 record-config steps on 1 GPU vs NGPU GPUs (bench_gpu.py --curve: same seed, global batch
#              and schedule), per-step loss compared (bf16 tolerance); no scoring
#  PART=bench  bench_gpu.py at the record config on GPU 0 (VARIANTS: env settings, one bench each; default
#              "default"), then on NGPU GPUs with --profile (scaling efficiency, optimizer with its
#              communication, NCCL time exposed on rank 0)
#  PART=all    curve, then bench
SHARDS=${SHARDS:-2} source tests/gpu/setup.sh
export MAX_WALLCLOCK_SECONDS=0 WARMUP_STEPS=${WARMUP_STEPS:-3}
N=${NGPU:-2}
if [ "${PART:-bench}" != bench ]; then
  (
  export ITERATIONS=50 WARMDOWN_ITERS=20 LATE_QAT_THRESHOLD=0
  env CUDA_VISIBLE_DEVICES=0 python3 tests/bench_gpu.py --curve 50 > $OUT/curve1.log 2>&1
  torchrun --standalone --nproc_per_node=$N tests/bench_gpu.py --curve 50 > $OUT/curve$N.log 2>&1
  python3 - $OUT/curve1.log $OUT/curve$N.log <<'PY' | tee -a $OUT/issue4.log
import re, sys
a, b = ([float(x) for x in re.findall(r"^curve step:\d+ loss:([\d.]+)", open(f).read(), re.M)] for f in sys.argv[1:])
d = [abs(x - y) / x for x, y in zip(a, b)]
print(f"curve steps:{len(a)}/{len(b)} max_rel_diff:{max(d):.2e} at_step:{d.index(max(d)) + 1} "
      f"first10_max:{max(d[:10]):.2e} last:{a[-1]:.4f}/{b[-1]:.4f}")
for i in (0, 1, 4, 9, 19, 29, 39, 49):
    print(f"curve step:{i + 1} one_gpu:{a[i]:.6f} n_gpus:{b[i]:.6f} rel:{d[i]:.2e}")
PY
  )
fi
[ "${PART:-bench}" = curve ] && exit 0
export LATE_QAT_THRESHOLD=0
for v in ${VARIANTS:-default}; do
  [ $v = default ] && v=""
  echo "== 1 GPU ${v:-default}" | tee -a $OUT/issue4.log
  env CUDA_VISIBLE_DEVICES=0 $v python3 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench|Error" | tee -a $OUT/issue4.log
done
echo "== $N GPUs default, --profile" | tee -a $OUT/issue4.log
PROFILE_ROWS=3 torchrun --standalone --nproc_per_node=$N tests/bench_gpu.py --steps 10 --profile 2>&1 \
  | grep -E "^bench|^kernels|^comm|^optimizer|^kernel nccl|Error" | tee -a $OUT/issue4.log
