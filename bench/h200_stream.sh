#!/usr/bin/env bash
# Streaming capacity on a lent H200: qasr-server on a random 0.6B checkpoint (bf16, CUDA graphs, fused kernels,
# decoding forced to ~3.7 tokens per second of speech), then qasr-bench stream with a rising number of real-time
# clients spread over 8 client processes. The device image lacks websockets, webrtcvad-wheels, soxr, soundfile and
# tqdm: carry them in .whl/ with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl websockets webrtcvad-wheels soxr soundfile tqdm
# Usage (repo root, from the device tool with carry [".whl"]): bash bench/h200_stream.sh OUTDIR "100 400 1000"
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"; counts=${2:-"100 400 1000"}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1
[ -d /tmp/m06 ] || python3 -m qasr.model.testmodel /tmp/m06 --size 0.6B --dtype bfloat16 || exit 1
python3 -m qasr.server.cli --model /tmp/m06 --device cuda --port 8765 --slots 256 --retained-slots 1024 \
  --max-len 640 --max-sessions 2048 --base-tokens 0 --tokens-per-second 3.7 --ignore-eos --log-level warning \
  > "$out/server.log" 2>&1 &
server=$!
ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2)" 2>/dev/null; }
for _ in $(seq 180); do ready && break; sleep 1; done
ready || { echo "server not ready"; tail -30 "$out/server.log"; kill "$server"; exit 1; }
echo "server ready after ${SECONDS}s"
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8765/metrics').read().decode())"; }
# the engine thread's time during one run, from two /metrics snapshots: where it went, per second of the run
engine_time() { python3 - "$1" "$2" <<'PY'
import re, sys
def read(path):
    text = open(path).read()
    out = {k: float(v) for k, v in re.findall(r'^qasr_engine_seconds\{kind="(\w+)"\} (\S+)$', text, re.M)}
    out["steps"] = float(re.search(r"^qasr_engine_steps (\S+)$", text, re.M).group(1))
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
print("engine thread during the run:", ", ".join(f"{k} {b[k] - a[k]:.1f}" + ("" if k == "steps" else " s")
                                                   for k in sorted(b)))
PY
}
for n in $counts; do
  metrics > "$out/metrics-$n-before.txt"
  python3 -m qasr.bench.cli stream --url ws://127.0.0.1:8765/v1/stream --clients "$n" --processes 8 --duration ${DURATION:-40} \
    --stagger-s ${STAGGER:-10} --drain-timeout-s 45 --server-pid "$server" --no-progress --out "$out/stream-$n.json" \
    > "$out/stream-$n.log" 2>&1
  cat "$out/stream-$n.log"
  metrics > "$out/metrics-$n.txt"
  engine_time "$out/metrics-$n-before.txt" "$out/metrics-$n.txt"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$out/metrics-$n.txt"
done
kill -TERM "$server"; wait "$server"
