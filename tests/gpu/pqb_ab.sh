# A/B on nvidia-h200-x2: the PQB with env $A and with env $B (our defaults otherwise) side by side, each over
# $SEEDS (default "1337 42") in turn, through ema_probe.py: A on GPU 0, B on GPU 1 (their step times compare two
# GPUs, so only a large gap means anything; GPU_A=0 GPU_B=0 shares one GPU, e.g. on nvidia-h200). Extra env for
# both as arguments. Logs: $OUT/<A|B><seed>.log
source tests/gpu/setup.sh
run() {  # gpu tag env...
  local i=$1 tag=$2; shift 2
  for seed in ${SEEDS:-1337 42}; do
    mkdir -p /tmp/$tag$seed && cp train_gpt.py tests/gpu/ema_probe.py /tmp/$tag$seed/
    (cd /tmp/$tag$seed && env CUDA_VISIBLE_DEVICES=$i RUN_ID=$tag$seed SEED=$seed $PQB "$@" python3 ema_probe.py > $OUT/$tag$seed.log 2>&1)
  done
}
run ${GPU_A:-0} A $A "$@" & run ${GPU_B:-1} B $B "$@" & wait
for f in $OUT/*.log; do echo "== $f"; grep -v "^setting\|^warmup_step\|^step:[0-9]/\|^versions\|^device" $f | tail -24; done
