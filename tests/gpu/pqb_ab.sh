# A/B on nvidia-h200-x2: the PQB with env $A and with env $B (our defaults otherwise) side by side, each over
# $SEEDS (default "1337 42") in turn, through ema_probe.py: A on GPU 0, B on GPU 1 (their step times compare two
# GPUs, so only a large gap means anything; GPU_A=0 GPU_B=0 shares one GPU, e.g. on nvidia-h200). Extra env for
# both as arguments. Logs: $OUT/<A|B><seed>.log
source tests/gpu/setup.sh
seeds=${SEEDS:-1337 42} ga=${GPU_A:-0} gb=${GPU_B:-1}
unset SEEDS GPU_A GPU_B  # train_gpt.py refuses unknown settings that look like its own (SEEDS ~ SEED)
run() {  # gpu tag env...
  local i=$1 tag=$2; shift 2
  for seed in $seeds; do
    mkdir -p /tmp/$tag$seed && cp train_gpt.py tests/gpu/ema_probe.py /tmp/$tag$seed/
    (cd /tmp/$tag$seed && env CUDA_VISIBLE_DEVICES=$i RUN_ID=$tag$seed SEED=$seed $PQB "$@" python3 ema_probe.py > $OUT/$tag$seed.log 2>&1)
  done
}
run $ga A $A "$@" & run $gb B $B "$@" & wait
for f in $OUT/*.log; do echo "== $f"; grep -v "^setting\|^warmup_step\|^step:[0-9]/\|^versions\|^device" $f | tail -24; done
