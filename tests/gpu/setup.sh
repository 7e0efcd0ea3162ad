# sourced at the start of every device call: zstandard wheel, proxy data unpacked to /tmp/pg (SHARDS train shards)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# a warm machine may hold fewer shards from an earlier call (SHARDS=2): unpack again unless enough are there
[ "$(ls /tmp/pg/datasets/proxy_sp1024/fineweb_train_*.bin 2>/dev/null | wc -l)" -ge "${SHARDS:-8}" ] || python3 .gpu/unpack_data.py .gpu/data /tmp/pg ${SHARDS:-8}
export DATA_PATH=/tmp/pg/datasets/proxy_sp1024 TOKENIZER_PATH=/tmp/pg/tokenizers/fineweb_1024_bpe.model PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
# the PQB settings (REFERENCE.md) shared by pqb.sh, pqb_pair.sh and pqb_ab.sh
PQB="TRAIN_BATCH_TOKENS=131072 ITERATIONS=1500 WARMDOWN_ITERS=750 MUON_MOMENTUM_WARMUP_STEPS=400 MAX_WALLCLOCK_SECONDS=0 VAL_LOSS_EVERY=0 EVAL_STRIDE=64 TRAIN_LOG_EVERY=250"
