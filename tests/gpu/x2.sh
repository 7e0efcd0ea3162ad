# nvidia-h200-x2: 1-GPU vs 2-GPU step time in the same call, then TTT on 2 GPUs on ARTIFACT (optional)
source tests/gpu/setup.sh
export MAX_WALLCLOCK_SECONDS=0
nvidia-smi topo -m | head -4
echo "== 1 GPU"; CUDA_VISIBLE_DEVICES=0 python3 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench" | tee -a $OUT/x2.log
echo "== 2 GPUs"; torchrun --standalone --nproc_per_node=2 tests/bench_gpu.py --steps 10 2>&1 | grep -E "^bench|Error" | tee -a $OUT/x2.log
[ -n "$ARTIFACT" ] || exit 0
mkdir -p /tmp/e && cp train_gpt.py /tmp/e/ && root=$PWD && cd /tmp/e
env BIGRAM_VOCAB_SIZE=2048 ROPE_BASE=22082 TTT_ENABLED=1 EVAL_ONLY=$root/$ARTIFACT RUN_ID=ttt2 torchrun --standalone --nproc_per_node=2 train_gpt.py 2>&1 | grep -E "legal_ttt|final_int6|ttt_chunk|Error|layout" | tee -a $OUT/x2.log
