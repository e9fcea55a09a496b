"""Would a large decode batch run faster as parts on parallel CUDA streams (#16)? A probe, before the engine changes.

At 256 rows the decode step is the attention reading the KV cache at the memory bandwidth (over half the step) and
cuBLAS's small-M products with the norms between them, which use the GPU poorly (docs/benchmarks.md: ~1.3 ms of the
H200's 2.85 where their weights need ~0.3). Cut into parts on forked streams, one part's products could run beside
another part's attention (NanoFlow's nano-batches), at the price of reading every weight once a part.

This measures, without touching the engine, one decoder and one KV cache (random weights at the real shapes, every
row live at `--context` cached positions): the decode step (`TextDecoder.decode_greedy` on the fused layer ops) over
R rows captured in a CUDA graph (a) whole, (b) as P parts one after the other on one stream, (c) as P parts on P
forked streams; ms per replay, median. (c) runs the same kernels on the same inputs as (b), so its logits must equal
(b)'s bit for bit (a race between the streams would show there); the parts' tokens are compared with the whole's.

`python -m qasr.bench.overlap_probe [0.6B|1.7B] [--rows 128,256,512] [--parts 2,4]`: one JSON line per row count.

What it showed (session 30, H100, docs/benchmarks.md): the streams overlap, but a part costs too much of the whole
(256 rows: 3.50 ms whole, 3.84 in two parts on two streams, 4.67 on one); the engine's A/B agreed, and the step stays
whole.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile

import torch

from qasr.bench.cli import OFFLINE_MAX_LEN
from qasr.engine.runner import capture_graph, capture_stream
from qasr.model.checkpoint import load_model
from qasr.model.gpu_timing import replay_ms
from qasr.model.modeling import FusedLayerOps, KVCache
from qasr.model.testmodel import make_test_model



def cache_parts(cache: KVCache, parts: int) -> list[KVCache]:
    """`cache` cut into `parts` equal runs of slots: views sharing its memory (a decode over part p's rows writes and
    reads its slots, which are its rows' slots in the whole cache)."""
    n = cache.num_slots // parts
    if n * parts != cache.num_slots:
        raise ValueError(f"{cache.num_slots} slots do not split into {parts} equal parts")
    out = []
    for p in range(parts):
        view = copy.copy(cache)
        view.k = [t[p * n:(p + 1) * n] for t in cache.k]
        view.v = [t[p * n:(p + 1) * n] for t in cache.v]
        view.num_slots = n
        out.append(view)
    return out


def decode_in_parts(decoder, tokens: torch.Tensor, positions: torch.Tensor, parts: list[KVCache], ops,
                    streams: list[torch.cuda.Stream] | None = None) -> list[torch.Tensor]:
    """The logits of one decode step over R rows, computed a part at a time -> a [R / parts, V] tensor a part: part p
    (rows of parts[p]'s slots) on streams[p], forked from the current stream and joined back, or all on the current
    stream. Not concatenated: that copy would be a cost the whole step does not have."""
    n = parts[0].num_slots
    if streams is not None:
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
    logits = []
    for p, cache in enumerate(parts):
        rows = slice(p * n, (p + 1) * n)
        with torch.cuda.stream(streams[p]) if streams is not None else contextlib.nullcontext():
            logits.append(decoder.decode_greedy(tokens[rows], positions[rows], cache, ops)[0])
    if streams is not None:
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
    return logits


def probe(model, rows: int, parts_list: list[int], context: int, runs: int) -> dict:
    device = model.device
    cache = model.new_cache(rows, OFFLINE_MAX_LEN)
    ops = FusedLayerOps(model.decoder.rope_table(cache.length))
    gen = torch.Generator(device=device).manual_seed(5)
    for t in cache.tensors:
        t.normal_(generator=gen)
    tokens = torch.randint(0, model.cfg.text.vocab_size, (rows,), device=device, generator=gen)
    positions = torch.full((rows,), context, dtype=torch.long, device=device)
    decoder = model.decoder
    # a replay rewrites the same cache cells with the same values (same tokens, positions not advanced): no reset
    variants = {"whole": lambda: [decoder.decode_greedy(tokens, positions, cache, ops)[0]]}
    for P in parts_list:
        views = cache_parts(cache, P)
        streams = [torch.cuda.Stream(device) for _ in range(P)]
        variants[f"{P} parts, one stream"] = lambda v=views: decode_in_parts(decoder, tokens, positions, v, ops)
        variants[f"{P} parts, {P} streams"] = lambda v=views, s=streams: decode_in_parts(
            decoder, tokens, positions, v, ops, s)
    out = {"rows": rows, "context": context, "step_ms": {}, "tokens_agree_with_whole": {}, "streams_bit_identical": {}}
    logits, pool = {}, None
    with torch.inference_mode(), capture_stream() as stream:
        graphs = {}
        for name, fn in variants.items():
            graphs[name], logits[name] = capture_graph(fn, stream, pool, warmups=2)
            pool = graphs[name].pool() if pool is None else pool
    for name, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        logits[name] = torch.cat(logits[name])
    for name, graph in graphs.items():
        out["step_ms"][name] = round(replay_ms(graph, runs=runs), 4)
    whole = logits["whole"].argmax(-1)
    for P in parts_list:
        one, many = logits[f"{P} parts, one stream"], logits[f"{P} parts, {P} streams"]
        out["streams_bit_identical"][P] = bool(torch.equal(one, many))
        out["tokens_agree_with_whole"][P] = float((many.argmax(-1) == whole).float().mean())
    del graphs, logits, cache
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.overlap_probe")
    parser.add_argument("size", nargs="?", default="0.6B", choices=("0.6B", "1.7B"))
    parser.add_argument("--rows", default="128,256,512", help="decode rows, comma-separated (default: %(default)s)")
    parser.add_argument("--parts", default="2,4",
                        help="parts a step is cut into, comma-separated (default: %(default)s)")
    parser.add_argument("--context", type=int, default=200, help="cached positions a row (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=30, help="replays timed a variant (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_test_model(f"{tmp}/m", size=args.size, dtype="bfloat16"), device="cuda",
                           dtype="bfloat16")
    parts = [int(p) for p in args.parts.split(",")]
    for rows in (int(r) for r in args.rows.split(",")):
        print(json.dumps({"size": args.size, **probe(model, rows, parts, args.context, args.runs)}), flush=True)


if __name__ == "__main__":
    main()
