# proxy quality benchmark with the parity settings; extra env as arguments (e.g. SEED=42)
source tests/gpu/setup.sh
mkdir -p /tmp/q && cp train_gpt.py /tmp/q/ && cd /tmp/q
env RUN_ID=pqb $PQB BIGRAM_VOCAB_SIZE=2048 ROPE_BASE=22082 LATE_QAT_THRESHOLD=0 EMA_DECAY=0.997 "$@" python3 train_gpt.py 2>&1 | tee $OUT/pqb.log | grep -v "^setting"
cp final_model.int6.ptz $OUT/ 2>/dev/null; true
