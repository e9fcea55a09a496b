#!/usr/bin/env bash
# An A/B of two qasr builds on one lent H200 (#16's method since session 14): the checkout (the candidate) against a
# `git archive` of the base, installed side by side and run alternately (base, candidate, base, ...) so a lease's
# drift falls on both; one table of each run's decode step per bucket, latency, throughput, correctness checks and
# GEMV picks (summary.txt). No official baseline: this compares qasr with qasr (bench/h200.sh runs the official).
# Prepare here, in the repo root (both folders in .git/info/exclude):
#   git archive -o .gpu/base.tar REF          # the base build, e.g. HEAD before the candidate's uncommitted change
#   .whl/: the server's wheels the image lacks (bench/h200_stream.sh's pip download line)
# Run (device tool, carry [".whl", ".gpu"]):  bash bench/h200_ab.sh [OUTDIR]   -> OUTDIR/summary.txt, OUTDIR/runs.tar
# ~30-60 s a run after ~30 s of install and checkpoints: two rounds at 0.6B fit in ~4 minutes (session 19).
# Env: ROUNDS (base/candidate pairs per size, default 2), SIZES (default "0.6B"; "0.6B 1.7B"), RUN_S (time limit of
# a run, default 100), OFFLINE_ARGS (replace the quick offline args below), DTYPE (default bfloat16), DEVICE (default
# cuda; cpu tries the plumbing here), KERNEL_CHECK=SECTIONS (first `kernel_check --sections SECTIONS` on the
# candidate, e.g. gemv: each product against cuBLAS and a row's bits at 1, 16 and 32 rows); BASE_TAR (.gpu/base.tar),
# WHEELS (.whl), WORK (/tmp/ab: the builds, their sources and the checkpoints).
set -uo pipefail
out=${1:-${OUT:?give an output directory or run from the device tool, which sets OUT}}
mkdir -p "$out"
runs=$(mktemp -d)  # everything but the summary goes into runs.tar: the device tool brings back at most 8 files
t0=$SECONDS
base_tar=${BASE_TAR:-.gpu/base.tar} wheels=${WHEELS:-.whl} work=${WORK:-/tmp/ab}
[ -f "$base_tar" ] || { echo "no $base_tar: git archive -o $base_tar REF first" >&2; exit 1; }
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    "$wheels"/*.whl || exit 1
fi
# each build from a copy of its own (an install writes build/ and *.egg-info beside the sources)
rm -rf "$work/src-base" "$work/src-candidate" && mkdir -p "$work/src-base" "$work/src-candidate"
tar -xf "$base_tar" -C "$work/src-base" || exit 1
tar -cf - --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./.gpu . | tar -xf - -C "$work/src-candidate"
for build in base candidate; do
  rm -rf "${work:?}/$build"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$work/$build" \
    "$work/src-$build" > "$runs/install-$build.log" 2>&1 || { cat "$runs/install-$build.log" >&2; exit 1; }
done
with_build() { local build=$1; shift; PYTHONPATH="$work/$build:$work/site" PYTHONUNBUFFERED=1 "$@"; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  with_build base python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  with_build base python3 -m qasr.bench.host_speed 2>/dev/null | tail -1
  echo "install $((SECONDS - t0)) s"
} > "$runs/times.txt"
if [ -n "${KERNEL_CHECK:-}" ]; then
  s=$SECONDS
  with_build candidate timeout 300 python3 -m qasr.bench.kernel_check "${SIZES%% *}" --sections "$KERNEL_CHECK" \
    > "$runs/kernel-check.json" 2> "$runs/kernel-check.log"
  echo "kernel_check --sections $KERNEL_CHECK rc=$? $((SECONDS - s)) s" >> "$runs/times.txt"
fi
quick=(--num-clips 256 --latency-runs 10 --step-runs 30 --independence-requests 8 --eager-requests 2)
read -r -a args <<< "${OFFLINE_ARGS:-${quick[*]}}"
for size in ${SIZES:-0.6B}; do
  model=$work/model-$size
  [ -d "$model" ] || with_build base python3 -m qasr.model.testmodel "$model" --size "$size" \
    --dtype "${DTYPE:-bfloat16}" > /dev/null || exit 1
  for round in $(seq "${ROUNDS:-2}"); do
    for build in base candidate; do
      s=$SECONDS
      with_build "$build" timeout "${RUN_S:-100}" python3 -m qasr.bench.cli offline --size "$size" --model "$model" \
        --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" "${args[@]}" \
        --out "$runs/$size-$round-$build.json" > "$runs/$size-$round-$build.log" 2>&1
      echo "$size round $round $build rc=$? $((SECONDS - s)) s (total $((SECONDS - t0)) s)" >> "$runs/times.txt"
    done
  done
done
{
  cat "$runs/times.txt"
  with_build candidate python3 -m qasr.bench.offline_summary "$runs"/*-*-*.json
} > "$out/summary.txt" 2>&1
if [ -f "$runs/kernel-check.json" ]; then  # a JSON object a section, or why there is none
  grep '^{' "$runs/kernel-check.json" | cut -c1-2000 | sed 's/^/kernel check: /' >> "$out/summary.txt" \
    || { echo "kernel check printed nothing; its log ends:"; tail -5 "$runs/kernel-check.log"; } >> "$out/summary.txt"
fi
tar -cf "$out/runs.tar" -C "$runs" .
cat "$out/summary.txt"
