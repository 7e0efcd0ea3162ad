# sourced at the start of every device call: zstandard wheel, proxy data unpacked to /tmp/pg (SHARDS train shards)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
[ -d /tmp/pg/datasets ] || python3 .gpu/unpack_data.py .gpu/data /tmp/pg ${SHARDS:-8}
export DATA_PATH=/tmp/pg/datasets/proxy_sp1024 TOKENIZER_PATH=/tmp/pg/tokenizers/fineweb_1024_bpe.model PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
