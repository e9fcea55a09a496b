#!/usr/bin/env bash
# The soak (#14) on a lent H200: qasr-server on a random 0.6B checkpoint (bf16, CUDA graphs, fused kernels, decoding
# forced to ~3.7 tokens per second of speech, as in h200_stream.sh) with front-end workers and admission control off,
# then qasr.bench.soak: STREAMS real-time streams with partials for MINUTES, each reconnecting every 30 s of audio,
# spread over client processes (one per 100 streams), the server sampled from /proc (supervisor, workers, engine).
# It passes (soak exit 0) when every criterion of the issue holds: 0 failed streams, exactly one final per segment,
# RSS growth < 5% after the warm-up, no fd or task growth once idle.
# The device image lacks websockets, webrtcvad-wheels, soxr, soundfile, tqdm and prometheus-client: carry them in
# .whl/ (the download command is in h200_stream.sh's header).
# Usage (repo root, from the device tool with carry [".whl"]): bash bench/h200_soak.sh OUTDIR [STREAMS] [MINUTES]
#   defaults 600 streams, 5 minutes: with the install, the model and the server's start (~2 min) and the run's tail
#   (the last streams' finals, the idle wait: ~1 min) that is ~8.5 min, inside a 10-minute device call.
# Env: WORKERS (qasr-server --workers, 4), DEVICES (--devices, 0), CLIENTS (soak --client-processes, default one per
# 100 streams), PARTIALS=0 (soak --no-partials), SOAK_ARGS (more soak flags, e.g. "--stream-seconds 20").
# Writes to OUTDIR: soak.json (the report: verdict, failures by kind with the first 50 timed, samples per process,
# the idle series after the run), soak.log, server.log (info: every refusal and disconnect), metrics-before.txt and
# metrics-after.txt, tcp.txt (the host's TCP counters over the run: listen-queue overflows, resets, aborts) and
# server-log-counts.txt (refusals, disconnects, handshake failures, dropped slow readers, by kind): 7 files.
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"; streams=${2:-600}; minutes=${3:-5}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
[ -d /tmp/m06 ] || python3 -m qasr.model.testmodel /tmp/m06 --size 0.6B --dtype bfloat16 || exit 1
python3 -m qasr.server.cli --model /tmp/m06 --workers "${WORKERS:-4}" --device cuda --devices "${DEVICES:-0}" \
  --admission-target-ms 0 --port 8765 --slots 256 --retained-slots 1024 --max-len 640 --max-sessions 2048 \
  --max-pending-per-address 4096 --base-tokens 0 --tokens-per-second 3.7 --ignore-eos --log-level info \
  > "$out/server.log" 2>&1 &
server=$!
ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2)" 2>/dev/null; }
for _ in $(seq 240); do ready && break; kill -0 "$server" 2>/dev/null || break; sleep 1; done  # a server that died says why
ready || { echo "server not ready"; tail -30 "$out/server.log"; kill "$server"; exit 1; }
echo "server ready after ${SECONDS}s"
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8765/metrics').read().decode())"; }
tcp() { cat /proc/net/netstat /proc/net/snmp; }
metrics > "$out/metrics-before.txt"; tcp > /tmp/tcp-before.txt  # OUTDIR keeps 7 files: the device tool returns 8
partials=(); [ "${PARTIALS:-1}" = 0 ] && partials=(--no-partials)
# shellcheck disable=SC2086  # SOAK_ARGS is a list of flags
python3 -m qasr.bench.soak --url ws://127.0.0.1:8765/v1/stream --server-pid "$server" --streams "$streams" \
  --minutes "$minutes" ${CLIENTS:+--client-processes "$CLIENTS"} "${partials[@]}" ${SOAK_ARGS:-} --out "$out/soak.json" \
  > "$out/soak.log" 2>&1
code=$?
metrics > "$out/metrics-after.txt"; tcp > /tmp/tcp-after.txt
cat "$out/soak.log"
echo "soak exit $code (0: every criterion held)"
python3 - /tmp/tcp-before.txt /tmp/tcp-after.txt > "$out/tcp.txt" <<'PY'
import sys
def counters(path):
    lines, values = open(path).read().splitlines(), {}
    for head, row in zip(lines[::2], lines[1::2]):
        names, numbers = head.split()[1:], row.split()[1:]
        values.update({f"{head.split(':')[0]}.{n}": int(v) for n, v in zip(names, numbers) if v.lstrip("-").isdigit()})
    return values
a, b = counters(sys.argv[1]), counters(sys.argv[2])
wanted = ("ListenOverflows", "ListenDrops", "TCPAbortOnData", "TCPAbortOnClose", "TCPAbortOnTimeout", "EstabResets",
          "OutRsts", "AttemptFails", "TCPReqQFullDrop", "TCPBacklogDrop", "TCPTimeouts", "TCPSynRetrans")
for key in sorted(b):
    if key.split(".")[1] in wanted:
        print(f"{key} {b[key] - a.get(key, 0)}")
PY
echo "TCP over the run (listen-queue overflows, resets, aborts):"; cat "$out/tcp.txt"
{ for pattern in "refused" "client disconnected" "opening handshake failed" "took none of our frames" \
                 "closed with 1000" "closed with 1001" "closed with 1011" "closed with 1013" "Traceback" "ERROR"; do
    echo "$(grep -c -- "$pattern" "$out/server.log") $pattern"
  done; } > "$out/server-log-counts.txt"
echo "server log:"; cat "$out/server-log-counts.txt"
kill -TERM "$server"; wait "$server"
exit $code
