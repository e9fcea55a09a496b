#!/usr/bin/env bash
# Everything in docs/benchmarks.md in one device call (run from the repo root with carry [".whl"], see h200.sh and
# h200_stream.sh for the wheels): offline 0.6B and 1.7B beside the official backend, then live streams ($COUNTS, default 500 600 700).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/qasr .
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1
L=$OUT/all.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $L
python3 -m qasr.bench.cli offline --size 0.6B --official --official-clips 256 --out $OUT/offline-0.6B.json 2>&1 | grep --line-buffered -v pad_token_id >> $L
python3 -m qasr.bench.cli offline --size 1.7B --official --official-clips 256 --independence-requests 24 --eager-requests 6 --out $OUT/offline-1.7B.json 2>&1 | grep --line-buffered -v pad_token_id >> $L
# the runs' files packed into one (the device tool brings back at most 8 files)
WARMUP=100 DURATION=20 STAGGER=5 TAR=$OUT/stream.tgz bash bench/h200_stream.sh /tmp/st "${COUNTS:-500 600 700}" >> $L 2>&1
