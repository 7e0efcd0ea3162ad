# PQB with our defaults (no parity settings), seeds 1337 and 42 in parallel on nvidia-h200-x2 (one GPU
# each), through ema_probe.py (PROBE_HORIZONS, PROBE_STOP); extra env as arguments (e.g. ITERATIONS=3000
# WARMDOWN_ITERS=1500). Logs in $OUT/pqb<seed>.log, artifacts in $OUT.
source tests/gpu/setup.sh
for i in 0 1; do
  seed=$([ $i = 0 ] && echo 1337 || echo 42)
  mkdir -p /tmp/q$i && cp train_gpt.py tests/gpu/ema_probe.py /tmp/q$i/
  (cd /tmp/q$i && env CUDA_VISIBLE_DEVICES=$i RUN_ID=pqb$seed SEED=$seed $PQB "$@" python3 ema_probe.py > $OUT/pqb$seed.log 2>&1; cp final_model.int6.ptz $OUT/pqb$seed.ptz 2>/dev/null) &
done
wait
for s in 1337 42; do echo "== seed $s"; grep -v "^setting\|^warmup_step" $OUT/pqb$s.log | tail -40; done
