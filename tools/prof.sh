# nvidia-h200: record-config bench with the kernel profile (by kind, top kernels, memset issuers) and the
# inductor output code of the working tree's train_gpt.py (extra env: PROFILE_ENV); then 10-step benches
# of RUNS, one per line: "FILE [VAR=VALUE ...]" with FILE copied over train_gpt.py (- = the working
# tree's; a FILE must have today's API: the bench calls init_runtime, Trainer and friends, so a version from
# before the clean-house refactor (5a3e30b and older) fails); BENCH_ARGS: extra bench flags (e.g. --sync).
# No late QAT (its steps cost more: time without it, as the reference was timed), 3 warmup steps.
SHARDS=2 source tools/device_setup.sh
export MAX_WALLCLOCK_SECONDS=0 WARMUP_STEPS=3 LATE_QAT_THRESHOLD=0 VAL_LOSS_EVERY=0 PROFILE_ROWS=${PROFILE_ROWS:-5}
cp train_gpt.py /tmp/train_gpt.orig.py
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== profile ${PROFILE_ENV}" | tee -a $OUT/prof.log
  env TORCH_LOGS=output_code TORCH_LOGS_OUT=/tmp/oc.log $PROFILE_ENV timeout ${PROFILE_TIMEOUT:-400} python3 tools/bench_gpu.py --steps 10 --profile 2>&1 | grep -v "^setting" | tee -a $OUT/prof.log
  [ -f /tmp/oc.log ] && xz -T4 -c /tmp/oc.log > $OUT/output_code.log.xz
fi
echo "$RUNS" | while read -r f v; do
  [ -z "$f" ] && continue
  echo "== $f $v" | tee -a $OUT/prof.log
  if [ "$f" = - ]; then cp /tmp/train_gpt.orig.py train_gpt.py; else cp "$f" train_gpt.py; fi
  env $v timeout ${RUN_TIMEOUT:-300} python3 tools/bench_gpu.py --steps 10 $BENCH_ARGS 2>&1 | grep -E "^bench|Error" | tee -a $OUT/prof.log
done
cp /tmp/train_gpt.orig.py train_gpt.py
