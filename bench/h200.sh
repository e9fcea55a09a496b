#!/usr/bin/env bash
# Reproduce docs/benchmarks.md on a lent H200 (run from the repo root; `.whl/` holds the official backend's wheels:
# transformers 4.57.6, tokenizers 0.22.1, huggingface_hub 0.36.0, accelerate 1.12.0, qwen-asr 0.0.6).
# Usage: bash bench/h200.sh OUTDIR [extra qasr-bench offline args for every size]
set -uo pipefail
out=${1:?OUTDIR}; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m qasr.bench.kernel_check 0.6B 2>&1 | tee "$out/kernel-check-0.6B.json"
for size in ${SIZES:-0.6B 1.7B}; do
  extra=""
  [ "$size" = "1.7B" ] && extra="--independence-requests 24 --eager-requests 6"
  python3 -m qasr.bench.cli offline --size "$size" --official --out "$out/offline-$size.json" $extra "$@" 2>&1 \
    | grep --line-buffered -v "pad_token_id" | tee "$out/offline-$size.log"
done
# the int8 KV cache (--kv-int8) on the same lease as the bf16 0.6B run above: its steps, throughput and agreement
python3 -m qasr.bench.cli offline --size 0.6B --kv-int8 --out "$out/offline-0.6B-int8.json" "$@" 2>&1 \
  | grep --line-buffered -v "pad_token_id" | tee "$out/offline-0.6B-int8.log"
# the opt-in options (the int8 cache, FP8 prefill, both, both with FP8 encoder products) against bf16 as engines on one
# loaded model, alternating in one process (session 36 on an H100: 1.015x, 1.051x, 1.088x; all three 1.092x against
# both's 1.076x in another call); their tokens against bf16's come first
M=/tmp/model-0.6B; [ -d $M ] || python3 -m qasr.model.testmodel $M --size 0.6B --dtype bfloat16 > /dev/null
python3 -m qasr.bench.engine_ab --model $M --num-clips 2048 --slots 512 --prefill-tokens 65536 --runs 3 \
  --variant bf16 --variant int8:kv_int8=1 --variant fp8:fp8_prefill=1 --variant both:kv_int8=1,fp8_prefill=1 \
  --variant all:kv_int8=1,fp8_prefill=1,fp8_encoder=1 2>&1 \
  | tee "$out/engine-ab-0.6B.log"
