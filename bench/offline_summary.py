"""One `qasr-bench offline --out` run in two lines, for the H200 scripts' summaries (bench/h200_ab.sh,
bench/h200_kernels.sh): its decode step per bucket, latency, throughput, energy, kernels a step and the engine
loop's step (bench.offline.engine_step_ms), then its correctness checks, GEMV picks and what its throughput run
counted (admissions, those with nothing decoding, garbage collections). Fields a run did not measure
(the step and energy off a GPU) show as "-".

    python -m qasr.bench.offline_summary RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_lines(run: dict, label: str) -> list[str]:
    steps = " / ".join(f"{b}:{ms:.3f}" for b, ms in run.get("decode_step_ms", {}).items()) or "-"
    energy = run.get("qasr_energy_j_per_audio_hour")
    kernels = run.get("decode_kernels_per_step")
    c = run["correctness"]
    picks = "; ".join(f"{k.rsplit(' ', 1)[0]}: {v.removeprefix('GemvConfig')}"
                      for k, v in run.get("gemv_configs", {}).items())  # "products N=.. K=.. bfloat16" -> no dtype
    loop = run.get("engine_step_ms", {})  # a step as the engine's loop makes it, without and with run-ahead
    loop = "; ".join(f"{mode} " + " / ".join(f"{rows}:{ms:.3f}" for rows, ms in by_rows.items())
                     for mode, by_rows in loop.items())
    admissions, collections = run.get("qasr_throughput_admissions"), run.get("qasr_throughput_gc")
    throughput = (f"; throughput run: {admissions['admissions']} admissions, {admissions['admissions_alone']} with "
                  f"nothing decoding" if admissions else "") + (
        f"; collections {collections['collections']} (generations 0/1/2), the longest {collections['longest_ms']} ms"
        if collections else "")
    return [f"{label:<22} step ms {steps} | latency {run['qasr_bs1_latency_ms']:.1f} ms | "
            f"{run['qasr_throughput_audio_s_per_s']:,.0f} audio-s/s | "
            + (f"{energy:.0f} J/audio-h" if energy is not None else "- J/audio-h")
            + (f" | kernels a step {json.dumps(kernels)}" if kernels else "")
            + (f" | engine loop step ms {loop}" if loop else ""),
            f"{'':<22} identical rows failed {c['identical_rows_failed_buckets']}, batch independence "
            f"{c['batch_independence_exact_match']}, eager {c['eager_bs1_exact_match']}"
            + (f", against bf16 {c['bf16_reference_exact_match']} ({c['bf16_reference_token_agreement']:.1%} of tokens)"
               if "bf16_reference_exact_match" in c else "") + f"; gemv {picks or '-'}"
            f"{throughput}"]


def main(argv: list[str] | None = None) -> None:
    for path in map(Path, sys.argv[1:] if argv is None else argv):
        print(*run_lines(json.loads(path.read_text()), path.stem), sep="\n")


if __name__ == "__main__":
    main()
