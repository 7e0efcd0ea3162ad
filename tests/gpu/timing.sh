# record-config timing run as REFERENCE.md times the anchors (40 steps, no val, no cap, no QAT)
source tests/gpu/setup.sh
mkdir -p /tmp/t && cp train_gpt.py /tmp/t/ && cd /tmp/t
env RUN_ID=timing ITERATIONS=${ITERS:-40} VAL_LOSS_EVERY=0 MAX_WALLCLOCK_SECONDS=0 LATE_QAT_THRESHOLD=0 TRAIN_LOG_EVERY=10 EVAL_STRIDE=2048 "$@" python3 train_gpt.py 2>&1 | tee $OUT/timing.log | grep -v "^setting"
