#!/usr/bin/env bash
# Where the offline engine thread's time goes (#16): py-spy over back-to-back throughput passes of one engine
# (bench/offline_sweep.py), attached once the first pass is done (loading and graph capture stay out of it), then the
# engine thread's functions by share of its samples (bench/pyspy_summary.py; --idle: waits for the device count too).
# Session 21 found the admission's host copies this way (docs/benchmarks.md).
# Usage (repo root; the device tool with carry [".whl"], .whl holding py-spy beside the server's wheels: see
# bench/h200_stream.sh's pip download line): bash bench/h200_offline_pyspy.sh OUTDIR
#   -> OUTDIR/summary.txt (the passes' figures, then the summary), OUTDIR/pyspy.txt (raw folded stacks)
# Env: SLOTS (512), CLIPS (2048), PREFILL (65536: prefill tokens an admission), RUNS (12 passes: enough to outlast the
# sampling), SPY_S (8 s sampled), RATE (200 a second), SIZE (0.6B: the random checkpoint made here), DEVICE (cuda),
# DTYPE (bfloat16), CLIP_S (10.9), TOKENS (40), WHEELS (.whl), WORK (/tmp/pyspy: the build and the checkpoint).
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
work=${WORK:-/tmp/pyspy} wheels=${WHEELS:-.whl}
command -v py-spy > /dev/null || [ -x "$work/site/bin/py-spy" ] || compgen -G "$wheels/py_spy-*.whl" > /dev/null \
  || { echo "no py-spy: pip download it into $wheels (bench/h200_stream.sh's line) or install it" >&2; exit 1; }
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    "$wheels"/*.whl || exit 1
fi
rm -rf "$work/src" "$work/qasr" && mkdir -p "$work/src"
tar -cf - --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./.gpu . | tar -xf - -C "$work/src"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$work/qasr" "$work/src" \
  > "$out/install.log" 2>&1 || { cat "$out/install.log" >&2; exit 1; }
export PYTHONPATH="$work/qasr:$work/site" PYTHONUNBUFFERED=1 PATH="$work/site/bin:$PATH"
model=$work/model-${SIZE:-0.6B}-${DTYPE:-bfloat16}
[ -d "$model" ] || python3 -m qasr.model.testmodel "$model" --size "${SIZE:-0.6B}" --dtype "${DTYPE:-bfloat16}" \
  > /dev/null || exit 1
python3 -m qasr.bench.offline_sweep --model "$model" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" \
  --num-clips "${CLIPS:-2048}" --slots "${SLOTS:-512}" --runs "${RUNS:-12}" --clip-seconds "${CLIP_S:-10.9}" \
  --tokens "${TOKENS:-40}" --vary max_prefill_tokens="${PREFILL:-65536}" > "$out/passes.jsonl" 2> "$out/passes.log" &
sweep=$!
until grep -q '^{"run"' "$out/passes.jsonl" 2> /dev/null; do  # the first pass is done: warm from here on
  kill -0 "$sweep" 2> /dev/null \
    || { echo "the passes ended before one was timed:" >&2; tail -20 "$out/passes.log" >&2; exit 1; }
  sleep 0.2
done
py-spy record --pid "$sweep" --threads --idle --duration "${SPY_S:-8}" --rate "${RATE:-200}" --format raw \
  -o "$out/pyspy.txt" > "$out/pyspy.log" 2>&1 || { cat "$out/pyspy.log" >&2; kill "$sweep"; exit 1; }
wait "$sweep" || { tail -20 "$out/passes.log" >&2; exit 1; }
{
  grep '^{"run"' "$out/passes.jsonl" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    thread = ', '.join(f'{k} {v:.0%}' for k, v in r['qasr_throughput_engine_thread'].items())
    print(f\"pass {r['run']}: {r['qasr_throughput_audio_s_per_s']:,.0f} audio-s/s,\",
          f\"mean batch {r['qasr_mean_decode_batch']:.0f}; engine thread: {thread}\")"
  echo "py-spy, the engine thread (MainThread), ${SPY_S:-8} s from the second pass on:"
  python3 -m qasr.bench.pyspy_summary "$out/pyspy.txt" --thread MainThread
} > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
