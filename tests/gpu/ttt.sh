# legal TTT variants on saved PQB artifacts: ARTIFACTS="path1 path2" (inside the carried tree), no retraining
source tests/gpu/setup.sh
mkdir -p /tmp/e && cp train_gpt.py /tmp/e/ && root=$PWD && cd /tmp/e
run() { env BIGRAM_VOCAB_SIZE=2048 ROPE_BASE=22082 TTT_ENABLED=1 "$@" python3 train_gpt.py 2>&1 | grep -E "legal_ttt|final_int6_sliding|ttt_chunk|Total|Error" | tee -a $OUT/ttt.log; }
for a in $ARTIFACTS; do
  for lr in ${LRS:-0.002 0.006}; do
    echo "== $a TTT_LR=$lr" | tee -a $OUT/ttt.log
    run RUN_ID=ttt EVAL_ONLY=$root/$a TTT_LR=$lr
  done
done
