#!/usr/bin/env bash
# Streaming capacity on a lent H200: qasr-server on a random 0.6B checkpoint (bf16, CUDA graphs, fused kernels,
# decoding forced to ~3.7 tokens per second of speech), then qasr-bench stream with a rising number of real-time
# clients spread over 8 client processes. The device image lacks websockets, webrtcvad-wheels, soxr, soundfile,
# tqdm and prometheus-client (and py-spy for PYSPY=1): carry them in .whl/ with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl websockets webrtcvad-wheels soxr soundfile tqdm prometheus-client orjson pybase64 py-spy cffi pycparser
# Usage (repo root, from the device tool with carry [".whl"]): bash bench/h200_stream.sh OUTDIR "600 800"
# Env: LABEL (the run's line on a scaling curve: qasr-bench stream --label), DURATION (s per client, 40), STAGGER (s over which clients start, 10), WARMUP=N (N clients for 10 s first,
# not reported), PYSPY=N (sample the server's and the engine process's Python stacks mid-run into OUTDIR, in run N
# only, so the other runs are not perturbed; PYSPY=all: every run; PYSPY_NATIVE=1: the engine process's native
# frames too), ALIGNER=1
# (word times: a random Qwen3-ForcedAligner-0.6B-shaped aligner beside the model, every client asks with --words),
# WORDS_FRACTION=F (with ALIGNER=1: only this fraction of the clients ask, --words-fraction F; each run then prints
# final latency apart for the streams with and without words),
# WORKERS=N (front-end worker processes: qasr-server --workers N; /metrics then sums the workers, and the server CPU
# below is all workers' together), DEVICES=0,1 (qasr-server --devices: an engine per GPU; default every visible GPU;
# the engine rows below are then summed over the engines), ADMISSION_MS=N (qasr-server --admission-target-ms: 0 turns
# admission control off to see raw capacity; each run prints the streams it refused and the partials it thinned),
# INTERVAL_MS=N (qasr-server --admission-interval-ms: decoding between two admissions), STEPS_AHEAD=N (qasr-server
# --decode-steps-ahead: decode steps queued beside an admission's host work, at most), RUN_AHEAD=1 (qasr-server
# --decode-run-ahead: the next decode step queued before the last is read),
# PROFILE=N (the engine's GPU timeline, engine/gpu_timeline.py: a ${PROFILE_S:-2} s window of torch's profiler mid-run
# in run N only, or every run with PROFILE=all; prints each CUDA stream's busy share and top kernels, JSON in OUTDIR).
# After each run it prints where the engine's time went and how late the event loop ran (from /metrics).
# TAR=FILE: at the end, OUTDIR packed into FILE (the device tool brings back at most 8 files from $OUT, and a run
# leaves ~6 in OUTDIR: point OUTDIR outside $OUT and TAR into it, or the runs' JSON for --plot stays behind).
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"; counts=${2:-"100 400 1000"}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/qasr . || exit 1
export PYTHONPATH=/tmp/qasr:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
[ -d /tmp/m06 ] || python3 -m qasr.model.testmodel /tmp/m06 --size 0.6B --dtype bfloat16 || exit 1
python3 -m qasr.bench.host_speed  # leases differ (steps/s 87-127 on one, 155-191 on others): this one's host, timed
aligner=() words=()
if [ -n "${ALIGNER:-}" ]; then
  [ -d /tmp/a06 ] || python3 -m qasr.model.testmodel /tmp/a06 --aligner --size 0.6B --dtype bfloat16 || exit 1
  aligner=(--aligner /tmp/a06) words=(--words-fraction "${WORDS_FRACTION:-1}" --language English)  # a forced language: random weights detect none the aligner takes
fi
[ -n "${PROFILE:-}" ] && export QASR_ENGINE_PROFILE="$out/profile" QASR_ENGINE_PROFILE_S=${PROFILE_S:-2}
python3 -m qasr.server.cli --model /tmp/m06 "${aligner[@]}" --workers "${WORKERS:-1}" --device cuda ${DEVICES:+--devices "$DEVICES"} \
  ${ADMISSION_MS:+--admission-target-ms "$ADMISSION_MS"} ${INTERVAL_MS:+--admission-interval-ms "$INTERVAL_MS"} ${STEPS_AHEAD:+--decode-steps-ahead "$STEPS_AHEAD"} $([ "${RUN_AHEAD:-}" = 1 ] && echo --decode-run-ahead) --port 8765 --slots 256 --retained-slots 1024 \
  --max-len 640 --max-sessions 2048 --max-pending-per-address 4096 --base-tokens 0 --tokens-per-second 3.7 --ignore-eos --log-level warning \
  > "$out/server.log" 2>&1 &
server=$!
ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/readyz', timeout=2)" 2>/dev/null; }
for _ in $(seq 180); do ready && break; kill -0 "$server" 2>/dev/null || break; sleep 1; done  # a server that died says why
ready || { echo "server not ready"; tail -30 "$out/server.log"; kill "$server"; exit 1; }
echo "server ready after ${SECONDS}s"
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8765/metrics').read().decode())"; }
# one run's load from two /metrics snapshots, per second of the run: where the engine thread's wall time went, the
# CPU of the engine thread, the engine process and the server process, and how late the event loop woke its timers
run_split() { python3 - "$1" "$2" <<'PY'
import re, sys
def merged(text):
    """An engine pool's per-engine samples summed over its engines (the engine label dropped), one line each."""
    sums = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, _, value = line.rpartition(" ")
        key = re.sub(r'engine="\d+",?', "", key).replace(",}", "}").replace("{}", "")
        sums[key] = sums.get(key, 0.0) + float(value)
    return "\n".join(f"{key} {value}" for key, value in sums.items())
def read(path):
    raw = open(path).read()
    text = merged(raw)
    out = {k: float(v) for k, v in re.findall(r'^qasr_engine_seconds\{kind="(\w+)"\} (\S+)$', text, re.M)}
    for name in ("qasr_engine_steps", "qasr_engine_thread_cpu_seconds", "process_cpu_seconds_total",
                 "qasr_engine_process_cpu_seconds", "qasr_worker_cpu_seconds",
                 "qasr_event_loop_lag_seconds_sum", "qasr_event_loop_lag_seconds_count"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    for what, prio, stage, v in re.findall(r'^qasr_engine_stage_seconds_(sum|count)\{priority="(\w+)",stage="(\w+)"\} (\S+)$', text, re.M):
        out[f"stage {prio} {stage} {what}"] = float(v)
    for what in ("sum", "count"):
        m = re.search(rf"^qasr_final_latency_seconds_{what} (\S+)$", text, re.M)
        out[f"final {what}"] = float(m.group(1)) if m else 0.0
    for kind in ("prefill_tokens", "prefill_computed_tokens", "encoder_tokens", "encoder_computed_tokens",
                 "conv_computed_chunks", "decode_launches"):
        m = re.search(rf'^qasr_engine_counters\{{kind="{kind}"\}} (\S+)$', text, re.M)
        out[kind] = float(m.group(1)) if m else 0.0
    for kind in ("device_allocs", "device_frees", "alloc_retries", "reserved_bytes"):  # the CUDA caching allocator
        m = re.search(rf'^qasr_engine_device_memory\{{kind="{kind}"\}} (\S+)$', text, re.M)
        out[kind] = float(m.group(1)) if m else 0.0
    out["engines"] = len(set(re.findall(r'^qasr_engine_steps\{engine="(\d+)"\}', raw, re.M))) or 1
    m = re.search(r'^qasr_streams_refused_total\{reason="headroom"\} (\S+)$', text, re.M)
    out["refused"] = float(m.group(1)) if m else 0.0
    m = re.search(r'^qasr_engine_partials_thinned_total (\S+)$', text, re.M)
    out["thinned"] = float(m.group(1)) if m else 0.0
    out["lag"] = {le: float(v) for le, v in re.findall(r'^qasr_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
d = {k: b[k] - a.get(k, 0.0) for k in b if k != "lag"}
if b["qasr_worker_cpu_seconds"]:  # WORKERS=N: every worker's CPU (the supervisor's own is negligible)
    d["process_cpu_seconds_total"] = d["qasr_worker_cpu_seconds"]
kinds = [k for k in ("admit", "decode_gpu", "decode_host", "align", "idle") if k in d]  # align: with an aligner
wall = sum(d[k] for k in kinds) or 1.0
engines = int(b["engines"])  # DEVICES: the engine rows are summed over the engines: per second, per engine
run_s = wall / engines
print(f"engine thread over {wall:.1f} s:", ", ".join(f"{k} {d[k] / wall:.0%}" for k in kinds),
      f"| steps/s {d['qasr_engine_steps'] / wall:.0f}"
      + (f" ({d['qasr_engine_steps'] / d['decode_launches']:.2f} a launch)" if d["decode_launches"] else "")
      + f" | CPU/s: engine thread {d['qasr_engine_thread_cpu_seconds'] / wall:.2f},"
      f" engine process {d['qasr_engine_process_cpu_seconds'] / wall:.2f}, server process {d['process_cpu_seconds_total'] / run_s:.2f}"
      + (f" | {engines} engines, per engine" if engines > 1 else ""))
for prio in ("final", "partial"):
    parts = [(st, d.get(f"stage {prio} {st} sum", 0) / d[f"stage {prio} {st} count"] * 1e3)
             for st in ("queue", "encode", "prefill", "decode") if d.get(f"stage {prio} {st} count")]
    if parts:
        total = f"; server final latency mean {d['final sum'] / d['final count'] * 1e3:.0f} ms" if prio == "final" and d.get("final count") else ""
        print(f"engine stages, {prio}s (mean ms): " + ", ".join(f"{st} {ms:.0f}" for st, ms in parts) + total)
if d["prefill_computed_tokens"] and d["encoder_computed_tokens"]:  # what the buckets' padding costs the GPU
    print(f"admissions' device work per second: prefill {d['prefill_tokens'] / wall:.0f} positions"
          f" ({d['prefill_computed_tokens'] / wall:.0f} computed, {1 - d['prefill_tokens'] / d['prefill_computed_tokens']:.0%} padding),"
          f" encoder {d['encoder_tokens'] / wall:.0f} ({d['encoder_computed_tokens'] / wall:.0f} computed,"
          f" {1 - d['encoder_tokens'] / d['encoder_computed_tokens']:.0%} padding),"
          f" conv {d['conv_computed_chunks'] / wall:.0f} chunks computed (graph buckets' padding included)")
if b["reserved_bytes"]:
    print(f"CUDA allocator in the run: {d['device_allocs']:.0f} cudaMalloc, {d['device_frees']:.0f} cudaFree, "
          f"{d['alloc_retries']:.0f} retries after freeing the cache; {b['reserved_bytes'] / 2**30:.1f} GiB reserved")
n = d["qasr_event_loop_lag_seconds_count"]
if n:
    lag = {le: b["lag"][le] - a["lag"].get(le, 0) for le in b["lag"]}
    over = ", ".join(f"> {le} s {1 - lag[le] / n:.0%}" for le in ("0.005", "0.02", "0.05", "0.1") if le in lag)
    print(f"event loop lag: mean {d['qasr_event_loop_lag_seconds_sum'] / n * 1e3:.1f} ms over {n:.0f} timers; {over}")
print(f"admission control: {d['refused']:.0f} streams refused (no headroom), {d['thinned']:.0f} partials thinned")
PY
}
# PYSPY: sample the server's Python stacks mid-run (all threads, then only the thread holding the GIL), raw folded;
# PYSPY_NATIVE=1: then the engine process (the first GPU compute process: with DEVICES, one engine) with native
# frames too, where its thread waits in C++ and CUDA calls (py-spy stops the process for each such sample: no
# --nonblocking, a lower rate). Read them
# with python -m qasr.bench.pyspy_summary FILE --process PID --thread MainThread
pyspy() { sleep $(( ${STAGGER:-10} + 2 ))
  py-spy record --pid "$server" --subprocesses --nonblocking --threads --duration 8 --rate 250 --format raw -o "$out/pyspy-$1-all.txt" > /dev/null 2>&1
  py-spy record --pid "$server" --subprocesses --nonblocking --threads --gil --duration 8 --rate 250 --format raw -o "$out/pyspy-$1-gil.txt" > /dev/null 2>&1
  [ "${PYSPY_NATIVE:-}" = 1 ] && py-spy record --pid "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -1 | tr -d ' ')" \
    --native --threads --duration 6 --rate 50 --format raw -o "$out/pyspy-$1-native.txt" > "$out/pyspy-$1-native.log" 2>&1; }
# PROFILE: open the engines' profiler window mid-run, then print what each saw
profile_start() { sleep $(( ${STAGGER:-10} + 4 )); echo "$1" > "$out/profile/start"; }
profile_report() { python3 - "$out/profile" "$1" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/engine-*-{sys.argv[2]}.json")):
    s = json.load(open(path))
    print(f"GPU timeline ({path.rsplit('/', 1)[1]}): {s['window_s']:.1f} s, GPU busy {s['gpu_busy_fraction']:.0%}, "
          f"{s['kernels']} kernels, streams overlapping {s['streams_overlap_ms']:.0f} ms")
    for stream, v in s["streams"].items():
        top = ", ".join(f"{k['name'][:40]} {k['ms']:.0f} ms" for k in v["top_kernels"][:4])
        print(f"  stream {stream}: busy {v['busy_fraction']:.0%} ({v['kernels']} kernels): {top}")
    idle = s["idle"]
    lengths = ", ".join(f"{name} {v['count']} / {v['ms']:.0f} ms" for name, v in idle["by_length"].items())
    print(f"  idle between kernels {idle['between_kernels_ms']:.0f} ms by stretch length (count / ms): {lengths}")
PY
}
if [ -n "${WARMUP:-}" ]; then  # WARMUP=N: N clients for 10 s first, not reported (first-use costs of a fresh server)
  python3 -m qasr.bench.cli stream --url ws://127.0.0.1:8765/v1/stream --clients "$WARMUP" --processes 8 --duration 10 \
    "${words[@]}" --stagger-s 2 --drain-timeout-s 30 --no-progress --out "$out/warmup.json" > "$out/warmup.log" 2>&1
  echo "warm-up: $(grep -m1 '^# .* segments' "$out/warmup.log")"
fi
run=0
for spec in $counts; do  # a count may repeat ("1000 1000 1000": consecutive runs on one lease); each run its own files
  # with ALIGNER=1 a count may name its own words fraction: "600@0 600@0.5" (one server: none ask, then half ask)
  n=${spec%@*}; run=$((run + 1)); r="$n-r$run"
  [ "$spec" != "$n" ] && words=(--words-fraction "${spec#*@}" --language English)
  metrics > "$out/metrics-$r-before.txt"
  # how busy the GPU(s) were: nvidia-smi's share of time a kernel ran, sampled every 250 ms through the run
  nvidia-smi --query-gpu=index,utilization.gpu,power.draw --format=csv,noheader,nounits -lms 250 > "$out/gpu-$r.csv" 2>/dev/null &
  gpu_sampler=$!
  [ -n "${PYSPY:-}" ] && { [ "$PYSPY" = all ] || [ "$PYSPY" = "$run" ]; } && { pyspy "$r" & }
  profiling=""; [ -n "${PROFILE:-}" ] && { [ "$PROFILE" = all ] || [ "$PROFILE" = "$run" ]; } && { profiling=1; profile_start "$r" & }
  python3 -m qasr.bench.cli stream --url ws://127.0.0.1:8765/v1/stream --clients "$n" --processes 8 --duration ${DURATION:-40} \
    "${words[@]}" ${LABEL:+--label "$LABEL"} --stagger-s ${STAGGER:-10} --drain-timeout-s 45 --server-pid "$server" --no-progress --out "$out/stream-$r.json" \
    > "$out/stream-$r.log" 2>&1
  cat "$out/stream-$r.log"
  metrics > "$out/metrics-$r.txt"
  kill "$gpu_sampler" 2>/dev/null; wait "$gpu_sampler" 2>/dev/null
  python3 - "$out/gpu-$r.csv" <<'PY'
import sys
rows = [line.split(",") for line in open(sys.argv[1]) if line.count(",") == 2]
for gpu in sorted({r[0].strip() for r in rows}):
    busy = sorted(float(r[1]) for r in rows if r[0].strip() == gpu)
    print(f"GPU {gpu} busy (nvidia-smi utilization, {len(busy)} samples): mean {sum(busy) / len(busy):.0f}%, "
          f"median {busy[len(busy) // 2]:.0f}%, max {busy[-1]:.0f}%")
PY
  run_split "$out/metrics-$r-before.txt" "$out/metrics-$r.txt"
  [ -n "$profiling" ] && profile_report "$r"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$out/metrics-$r.txt"
done
kill -TERM "$server"; wait "$server"
# the engine process logs its garbage collection at exit, as a warning when one collection stopped it for 50 ms+
grep -h "garbage collection" "$out/server.log" || echo "garbage collection: no pause of 50 ms or more in the engine process"
if [ -n "${TAR:-}" ]; then tar -czf "$TAR" -C "$out" .; fi
