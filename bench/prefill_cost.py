"""What a prefill costs a token on the GPU (#16): its attention's tile, and the graph's number of sequences.

    python -m qasr.bench.prefill_cost [0.6B|1.7B] [--sections attention,buckets]    # on CUDA, ~1 min

- attention: kernels.prefill_attention at the model's heads over B sequences of ~150 new tokens, for several tiles
  (tile rows, warps): us a call (a graph replayed, median of 50 replays timed by CUDA events) and whether its output
  equals the default tile's bit for bit (on the H200 other tiles round differently).
- buckets: the runner's prefill graph of B sequences x 160 tokens (a 10.9 s clip's prompt is 152), replayed with
  every sequence real: ms a replay and us a token, at B = 8, 16, 32, for the default tile and --tile.
Prints one JSON object per section.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.runner import PrefillBucket
from qasr.model import kernels
from qasr.model.gpu_timing import graphed_ms
from qasr.model.testmodel import make_test_model


DEFAULT_TILE = (kernels.PREFILL_TILE_ROWS, kernels.PREFILL_WARPS)
TILES = tuple(dict.fromkeys((DEFAULT_TILE, (32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8))))  # default 1st
TOKENS = 160


def attention_section(cfg, batches=(8, 32)) -> dict:
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for B in batches:
        k = torch.randn(B, kv_heads, 320, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(B * TOKENS, heads, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        slots = torch.arange(B, device="cuda")
        starts = torch.zeros(B, dtype=torch.long, device="cuda")
        lengths = torch.full((B,), 152, dtype=torch.long, device="cuda")
        real = (torch.arange(B * TOKENS, device="cuda") % TOKENS) < 152
        run = lambda rows, warps: kernels.prefill_attention(q, k, v, slots, starts, lengths, rows, warps)  # noqa: E731
        default = run(*TILES[0])
        out[B] = {}
        for rows, warps in TILES:
            out[B][f"{rows}x{warps}"] = {"us": round(graphed_ms(lambda: run(rows, warps)) * 1e3, 2),
                                         "equal_to_default": bool(torch.equal(run(rows, warps)[real], default[real]))}
    return out


def buckets_section(engine: Engine, tile: tuple[int, int], batches=(8, 16, 32)) -> dict:
    runner = engine.runner
    out = {}
    try:
        for rows, warps in (DEFAULT_TILE, tile):
            kernels.PREFILL_TILE_ROWS, kernels.PREFILL_WARPS = rows, warps  # read when the graph is captured
            for B in batches:
                bucket = PrefillBucket(runner, B, TOKENS)
                bucket.x.normal_()
                bucket.meta.copy_(torch.tensor([list(range(B)), [0] * B, [152] * B]))  # slots, starts, lengths
                ms = graphed_ms(bucket.forward, runs=15)
                out[f"{rows}x{warps} B={B}"] = {"ms": round(ms, 3), "us_per_token": round(ms * 1e3 / (B * 152), 3)}
    finally:
        kernels.PREFILL_TILE_ROWS, kernels.PREFILL_WARPS = DEFAULT_TILE
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.prefill_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("size", nargs="?", default="0.6B", choices=("0.6B", "1.7B"))
    p.add_argument("--sections", default="attention,buckets")
    p.add_argument("--tile", default="32x4", help="the tile the buckets section compares with the default "
                                                  "(default: %(default)s, the one before session 14)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    tile = tuple(int(x) for x in args.tile.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        d = make_test_model(f"{tmp}/m", size=args.size, dtype="bfloat16")
        opts = EngineOptions(num_slots=64, max_len=320, num_retained=0)
        engine = Engine.from_pretrained(str(d), device="cuda", dtype="bfloat16", options=opts)
    print(json.dumps({"size": args.size}), flush=True)
    if "attention" in sections:
        print(json.dumps({"prefill_attention_us": attention_section(engine.model.cfg.text)}), flush=True)
    if "buckets" in sections:
        print(json.dumps({"prefill_graph": buckets_section(engine, tile)}), flush=True)


if __name__ == "__main__":
    main()
