#!/usr/bin/env bash
# #16's decode kernels on one lease, one build: the kernel check (GEMV vs cuBLAS at the real shapes, row independence
# across buckets, the step on three paths), then `qasr-bench offline` (0.6B, no official baseline) with the decode
# step's products on cuBLAS (QASR_DECODE_GEMV=0, the state before) and on the GEMV kernels (the default), and a table
# of the two. Every stage has a time limit, so the whole call ends within ~6 minutes on a fresh H200.
# Usage (repo root, from the device tool with carry [".whl"] for tokenizers & co, see h200.sh):
#   bash bench/h200_kernels.sh            -> logs and JSON under $OUT; read $OUT/summary.txt first
# Env: GEMV_ROWS (the GEMV threshold of the "after" run, default the code's), OFFLINE_ARGS (extra offline options).
set -uo pipefail
out=${OUT:?run from the device tool, which sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv > "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"
start=$SECONDS
timeout 120 python3 -m qasr.bench.kernel_check 0.6B > "$out/kernel-check-0.6B.json" 2> "$out/kernel-check-0.6B.log"
echo "kernel_check rc=$? $((SECONDS - start)) s" >> "$out/times.txt"
python3 -m qasr.model.testmodel /tmp/m06 --size 0.6B --dtype bfloat16 > /dev/null || exit 1
# fewer clips and requests than the full bench (h200.sh): the step table, kernels per step, latency, throughput,
# energy and every correctness check, in under 2 minutes a run
args=(--model /tmp/m06 --num-clips 256 --latency-runs 10 --step-runs 30 --independence-requests 32 --eager-requests 6)
for run in before after; do
  start=$SECONDS
  if [ $run = before ]; then rows=0; else rows=${GEMV_ROWS:-}; fi
  env ${rows:+QASR_DECODE_GEMV=$rows} timeout 105 python3 -m qasr.bench.cli offline --size 0.6B "${args[@]}" \
    ${OFFLINE_ARGS:-} --out "$out/offline-0.6B-$run.json" > "$out/offline-0.6B-$run.log" 2>&1
  echo "offline $run rc=$? $((SECONDS - start)) s" >> "$out/times.txt"
done
python3 - "$out" > "$out/summary.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {r: json.loads(p.read_text()) for r in ("before", "after") if (p := out / f"offline-0.6B-{r}.json").exists()}
print((out / "times.txt").read_text())
for name, run in runs.items():
    print(f"{name}: gemv_rows={run.get('gemv_rows')}  bs1 latency {run.get('qasr_bs1_latency_ms', 0):.1f} ms  "
          f"throughput {run.get('qasr_throughput_audio_s_per_s', 0):.0f} audio-s/s  "
          f"energy {run.get('qasr_energy_j_per_audio_hour', float('nan')):.0f} J/audio-h  correctness {run.get('correctness')}")
if runs:
    first = next(iter(runs.values()))
    buckets = list(first.get("decode_step_ms", {}))
    print("bucket        " + " ".join(f"{b:>7}" for b in buckets))
    for name, run in runs.items():
        print(f"step {name:<8} " + " ".join(f"{run['decode_step_ms'].get(b, float('nan')):7.3f}" for b in buckets))
        kernels = run.get("decode_kernels_per_step", {})
        print(f"kernels {name:<5} " + " ".join(f"{kernels[b]:7.0f}" if b in kernels else "      -" for b in buckets))
    print("floor         " + " ".join(f"{first.get('decode_floor_ms', {}).get(b, float('nan')):7.3f}" for b in buckets))
    print("gemv configs:", json.dumps(runs.get("after", {}).get("gemv_configs"), indent=1))
check = out / "kernel-check-0.6B.json"  # one JSON object per line, a section each
res = {}
for line in check.read_text().splitlines() if check.exists() else []:
    if line.startswith("{"):
        res |= json.loads(line)
print("kernel check, sections done:", list(res))
for key in [k for k in res if k.startswith(("decode_step_ms", "kernels_per_step"))] + ["gemv_bf16_vs_cublas"]:
    print(key, json.dumps(res.get(key), indent=1))
EOF
cat "$out/summary.txt"
