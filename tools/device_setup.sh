# The GPU machine's setup, in two halves.
#
# Here, once per checkout (needs ../shared beside it and pip):
#     bash tools/device_setup.sh stage [SHARED_DIR]
#   copies the proxy data (8 train shards, val, sp1024 tokenizer) and its unpacker into .gpu/ and the zstandard
#   wheel the device lacks into .whl/ (both git-ignored; 61 MB of the 64 MiB a device call may carry).
# On the device, at the start of every call (carry: [".gpu", ".whl"]):
#     source tools/device_setup.sh
#   installs the wheels into /tmp/site, unpacks SHARDS (default 8) train shards to /tmp/pg (again when a warm
#   machine holds fewer), exports DATA_PATH, TOKENIZER_PATH and PYTHONPATH, and prints the GPUs and torch.
#   With SP8192=1 it also retokenizes them to the SP8192 vocabulary (data/retokenize.py, about 10 s with 16
#   workers; the SP8192 shards are too large to carry) and sets, unexported, SP8192_DATA and SP8192_TOKENIZER
#   for a variant: --variant v8k="VOCAB_SIZE=8192 DATA_PATH=$SP8192_DATA TOKENIZER_PATH=$SP8192_TOKENIZER".
# Then e.g. `python3 tools/sweep.py --preset pqb-t --variant base= --variant x="K=V" 2>&1 | tee $OUT/sweep.log`.
if [ "${1:-}" = stage ]; then
  set -e
  src=${2:-../shared/data}
  mkdir -p .gpu/data/proxy_sp1024 .gpu/data/tokenizers .whl
  cp "$src"/proxy_sp1024/*.xz .gpu/data/proxy_sp1024/
  cp "$src"/tokenizers/fineweb_1024_bpe.model "$src"/tokenizers/fineweb_8192_bpe.model .gpu/data/tokenizers/
  cp "$src"/../tools/unpack_data.py .gpu/
  ls .whl/zstandard-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl zstandard==0.25.0
  du -sh .gpu .whl
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ "$(ls /tmp/pg/datasets/proxy_sp1024/fineweb_train_*.bin 2>/dev/null | wc -l)" -ge "${SHARDS:-8}" ] \
  || python3 .gpu/unpack_data.py .gpu/data /tmp/pg "${SHARDS:-8}"
export DATA_PATH=/tmp/pg/datasets/proxy_sp1024 TOKENIZER_PATH=/tmp/pg/tokenizers/fineweb_1024_bpe.model PYTHONUNBUFFERED=1
if [ "${SP8192:-0}" = 1 ]; then
  SP8192_DATA=/tmp/pg/datasets/proxy_sp8192 SP8192_TOKENIZER=$PWD/.gpu/data/tokenizers/fineweb_8192_bpe.model
  if [ "$(ls $SP8192_DATA/fineweb_*.bin 2>/dev/null | wc -l)" -lt "$(ls $DATA_PATH/fineweb_*.bin | wc -l)" ]; then
    python3 data/retokenize.py --src $DATA_PATH --src-tokenizer $TOKENIZER_PATH --dst $SP8192_DATA \
      --tokenizer $SP8192_TOKENIZER --workers 16 --overwrite > /tmp/pg/retokenize.log 2>&1 \
      && tail -1 /tmp/pg/retokenize.log || { cat /tmp/pg/retokenize.log; unset SP8192_DATA SP8192_TOKENIZER; }
  fi
fi
# several GPUs, one job each: inductor's default of one compile worker per core (64 per job on a 4-GPU machine) came
# with 100-150 s stalls in every job; 8 workers and 8 OpenMP threads a job did not stall (records/PERFORMANCE.md)
if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8} OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
fi
unset SHARDS SP8192  # train_gpt.py refuses unknown settings that look like its own
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
