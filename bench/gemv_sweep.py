"""Whether the GEMV tuner's few candidates miss a faster config (#16): the decode step's products at the model's
shapes over a wider grid of tiles, warps, stages and splits, timed as the tuner times them.

    python -m qasr.bench.gemv_sweep [0.6B|1.7B ...] [--budget-s 240]    # on CUDA

Each config is timed in a CUDA graph cycling through weight copies larger than L2 (gemv._fastest's method), at 1, 16
and 32 rows (at 32, two row tiles, a launch keeps at most 3 stages: GemvConfig.stages). Per product it prints the
tuner's pick (config_for) with its times, and the fastest configs of the grid at 1 row and at 16 + 32 rows; one JSON
object per size. A grid config compiles once (~0.5 s), so the grid is cut short at --budget-s (what was timed is kept;
"timed" says how many).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch

from qasr.model import gemv
from qasr.model.gpu_timing import per_call_ms
from qasr.model.testmodel import SHAPES

ROWS = (1, 16, 32)


def products(size: str) -> dict[str, tuple[str, int, int]]:
    """name -> (gemv kind, N, K) of the decode step's products below the lm_head (at its floor already)."""
    s = SHAPES[size]
    qkv = (s.text_heads + 2 * s.text_kv_heads) * s.head_dim
    return {"qkv": ("products", qkv, s.text_hidden), "o_proj": ("products", s.text_hidden, s.text_heads * s.head_dim),
            "gate_up_silu": ("gate_up_silu", s.text_intermediate, s.text_hidden),
            "down": ("products", s.text_hidden, s.text_intermediate)}


def grid(kind: str, N: int, K: int, programs: int) -> list[gemv.GemvConfig]:
    """Tiles of 32-128 columns x 128-256 of reduction, 4 or 8 warps, 2-4 stages; products split as the tuner's rule
    would for ~`programs` programs, half that and twice that (each split still a whole reduction block)."""
    out = []
    for block_n, block_k, warps, stages in itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 3, 4)):
        if kind == "gate_up_silu":
            splits = [1]
        else:
            base = gemv._split_for(N, K, block_n, block_k, programs)
            splits = sorted({s for s in (base // 2, base, base * 2) if s >= 1 and K // s >= block_k})
        out += [gemv.GemvConfig(block_n, block_k, s, warps, stages) for s in splits]
    return out


def timed(kind: str, N: int, K: int, config: gemv.GemvConfig, weights, inputs) -> dict[int, float]:
    run = {"products": gemv.partial_products, "gate_up_silu": gemv.gate_up_silu}[kind]
    return {M: per_call_ms([functools.partial(run, inputs[M], w, config) for w in weights], runs=5) * 1e3
            for M in ROWS}


def sweep(size: str, budget_s: float) -> dict:
    out = {}
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count  # the tuner's target
    for name, (kind, N, K) in products(size).items():
        deadline = time.monotonic() + budget_s / len(products(size))
        rows = 2 * N if kind == "gate_up_silu" else N
        copies = max(1, min(16, -(-gemv.TUNE_WEIGHT_BYTES // (rows * K * 2))))
        weights = [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        inputs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in ROWS}
        pick = gemv.config_for(kind, N, K, inputs[1])
        results = {pick: timed(kind, N, K, pick, weights, inputs)}
        for config in grid(kind, N, K, programs):
            if time.monotonic() > deadline:
                break
            if config not in results:
                try:
                    results[config] = timed(kind, N, K, config, weights, inputs)
                except Exception as e:  # a tile the GPU cannot hold (shared memory): noted, not fatal
                    results[config] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        ok = {c: t for c, t in results.items() if "error" not in t}
        short = lambda c: f"{c.block_n}x{c.block_k} s{c.split} w{c.num_warps} st{c.num_stages}"  # noqa: E731
        rounded = lambda t: {M: round(us, 2) for M, us in t.items()}  # noqa: E731
        out[name] = {
            "shape": [kind, N, K], "pick": short(pick), "pick_us": rounded(results[pick]), "timed": len(results),
            "errors": sum("error" in t for t in results.values()),
            "fastest_at_1": [[short(c), rounded(t)] for c, t in sorted(ok.items(), key=lambda x: x[1][1])[:8]],
            "fastest_at_16_32": [[short(c), rounded(t)] for c, t in
                                 sorted(ok.items(), key=lambda x: x[1][16] + x[1][32])[:5]]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.gemv_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", default=["0.6B"], choices=("0.6B", "1.7B"))
    parser.add_argument("--budget-s", type=float, default=240.0, help="seconds of sweeping per size (shared evenly "
                        "by its products)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    for size in args.sizes:
        print(json.dumps({"size": size, "products": sweep(size, args.budget_s)}), flush=True)


if __name__ == "__main__":
    main()
