#!/usr/bin/env bash
# The nightly-length adapter fuzz (docs/reliability.md) on a many-core machine: each adapter's examples are split into
# SHARDS runs of EXAMPLES/SHARDS with distinct seeds (--hypothesis-seed SEED_BASE+1..SEED_BASE+SHARDS: different
# generated sequences), run JOBS at a time. SEED_BASE defaults to today's date, so each night's run tries sequences the
# nights before did not (a fixed seed replays the same ones); the summary names the seeds, to replay a failure.
# Every shard's log keeps hypothesis' statistics (how many examples passed); the summary sums them per adapter, and the
# exit status is non-zero if any shard failed.
# Usage (repo root, qasr and its test requirements importable): bash bench/fuzz_nightly.sh OUTDIR
#   EXAMPLES=100000 SHARDS=8 JOBS=$(nproc) SEED_BASE=$(date +%Y%m%d)000
#   ADAPTERS="audiohook deepgram native openai telnyx twilio vonage"
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out"
examples=${EXAMPLES:-100000} shards=${SHARDS:-8} jobs=${JOBS:-$(nproc)} seed_base=${SEED_BASE:-$(date +%Y%m%d)000}
adapters=${ADAPTERS:-"openai deepgram audiohook telnyx vonage twilio native"}  # slowest first
per_shard=$(( (examples + shards - 1) / shards ))
first_seed=$((seed_base + 1)) last_seed=$((seed_base + shards))
test="tests/fuzz/test_adapters.py::test_no_exception_escapes_an_adapter_and_bad_input_gets_its_protocols_error"
export HYPOTHESIS_PROFILE=nightly QASR_FUZZ_EXAMPLES=$per_shard
start=$(date +%s)
for a in $adapters; do for k in $(seq "$first_seed" "$last_seed"); do echo "$a $k"; done; done \
  | xargs -P "$jobs" -L 1 bash -c 'python3 -m pytest -q -p no:cacheprovider --hypothesis-seed="$1" \
      --hypothesis-show-statistics "'"$test"'[$0]" > "'"$out"'/fuzz-$0-$1.log" 2>&1; echo "$0 $1 rc=$?"' \
  > "$out/shards.txt"
status=0
: > "$out/summary.txt"
for a in $adapters; do
  passed=$(cat "$out"/fuzz-"$a"-*.log | grep -o '[0-9]* passing,' | awk '{s += $1} END {print s + 0}')
  failed=$(grep "^$a " "$out/shards.txt" | grep -c -v 'rc=0$')
  [ "$failed" = 0 ] || status=1
  echo "$a: $passed examples passed over $shards shards (seeds $first_seed-$last_seed), $failed shard(s) failed" >> "$out/summary.txt"
done
echo "wall $(( $(date +%s) - start )) s, $jobs jobs, $per_shard examples per shard" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $status
