#!/usr/bin/env bash
# #16's decode kernels on one lease, one build, programmatic dependent launch measured off and on:
#  1. the kernel check with QASR_PDL=1 (python -m qasr.bench.kernel_check): first the decode step captured with
#     QASR_PDL=0 and =1 on one runner (graph replay ms at B=1,8,32,64,256, the two steps' logits bit for bit, kernels
#     per step by kind: Triton launches PDL can chain vs cuBLAS/PyTorch), then every kernel against its PyTorch
#     reference and the GEMV kernels against cuBLAS with PDL on, then the step on three paths;
#  2. `qasr-bench offline` (0.6B, no official baseline) with QASR_PDL=0, then =1: latency, throughput, energy, the
#     step table and the row correctness checks, before and after (OFFLINE=pdl: only the run with PDL on; none: neither).
# Every stage has a time limit; ~3 minutes on a fresh H200 (measured: install ~20 s, kernel check 53 s, offline 33 s).
# Usage (repo root, from the device tool with carry [".whl"] for tokenizers & co, see h200.sh):
#   bash bench/h200_kernels.sh [OUTDIR]   -> 7 files under OUTDIR (default $OUT); read OUTDIR/summary.txt first
# Env: OFFLINE (both | pdl | none, default both), GEMV_ROWS (QASR_DECODE_GEMV for every stage), OFFLINE_ARGS.
set -uo pipefail
out=${1:-${OUT:?give an output directory or run from the device tool, which sets OUT}}
mkdir -p "$out"
tmp=$(mktemp -d)  # gpu.txt and times.txt go into summary.txt: the device tool brings back at most 8 files
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1
[ -n "${GEMV_ROWS:-}" ] && export QASR_DECODE_GEMV=$GEMV_ROWS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv > "$tmp/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> "$tmp/gpu.txt"
: > "$tmp/times.txt"
start=$SECONDS
QASR_PDL=1 timeout 300 python3 -m qasr.bench.kernel_check 0.6B > "$out/kernel-check-0.6B.json" 2> "$out/kernel-check-0.6B.log"
echo "kernel_check (QASR_PDL=1) rc=$? $((SECONDS - start)) s" >> "$tmp/times.txt"
case ${OFFLINE:-both} in pdl) runs="1";; none) runs="";; *) runs="0 1";; esac
if [ -n "$runs" ]; then
  [ -d /tmp/m06 ] || python3 -m qasr.model.testmodel /tmp/m06 --size 0.6B --dtype bfloat16 > /dev/null || exit 1
fi
# fewer clips and requests than the full bench (h200.sh): the step table, kernels per step, latency, throughput,
# energy and every correctness check, in under 2 minutes a run
args=(--model /tmp/m06 --num-clips 256 --latency-runs 10 --step-runs 30 --independence-requests 32 --eager-requests 6)
for pdl in $runs; do
  start=$SECONDS
  QASR_PDL=$pdl timeout 110 python3 -m qasr.bench.cli offline --size 0.6B "${args[@]}" ${OFFLINE_ARGS:-} \
    --out "$out/offline-0.6B-pdl$pdl.json" > "$out/offline-0.6B-pdl$pdl.log" 2>&1
  echo "offline QASR_PDL=$pdl rc=$? $((SECONDS - start)) s" >> "$tmp/times.txt"
done
python3 - "$out" "$tmp" > "$out/summary.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
print((tmp / "gpu.txt").read_text())
print((tmp / "times.txt").read_text())
res = {}
check = out / "kernel-check-0.6B.json"  # one JSON object per line, a section each
for line in check.read_text().splitlines() if check.exists() else []:
    if line.startswith("{"):
        res |= json.loads(line)
print("kernel check, sections done:", list(res))
print("pdl:", res.get("pdl"))
step = res.get("decode_step_pdl")
if step:
    buckets = list(step["step_ms"]["pdl0"])
    print(f"decode step, graph replay at context 200 (capture {step['capture_s']:.0f} s, PDL on: "
          f"{step['use_pdl_when_on']})")
    print("bucket            " + " ".join(f"{b:>7}" for b in buckets))
    for name in ("pdl0", "pdl1"):
        print(f"step ms {name:<9} " + " ".join(f"{step['step_ms'][name][b]:7.3f}" for b in buckets))
    print("pdl1 / pdl0       " + " ".join(f"{step['step_ms']['pdl1'][b] / step['step_ms']['pdl0'][b]:7.3f}"
                                         for b in buckets))
    print("logits identical  " + " ".join(f"{step['logits_identical'][b]:7.4f}" for b in buckets))
    print("logits max |diff| " + " ".join(f"{step['logits_max_abs'][b]:7.4f}" for b in buckets))
    for b, kinds in step["kinds"].items():
        print(f"kernels per step at B={b}: triton {kinds['triton']:.0f}, other {kinds['other']:.0f}, "
              f"copies {kinds['copy']:.0f}, triton chain breaks {kinds['chain_breaks']:.0f}")
        print("  other:", json.dumps(kinds["other_names"]))
for key in ["kernels_bf16_vs_pytorch", "gemv_bf16_vs_cublas"] + [k for k in res if k.startswith(("decode_step_ms",
                                                                                                  "kernels_per_step"))]:
    print(key, json.dumps(res.get(key), indent=1))
EOF
for run in "$out"/offline-0.6B-pdl*.json; do  # each offline run: bench/offline_summary.py
  [ -f "$run" ] && python3 -m qasr.bench.offline_summary "$run" >> "$out/summary.txt" 2>&1
done
cat "$out/summary.txt"
