"""`python -m qasr.bench.conv_front_end [0.6B|1.7B]`: the encoder's conv front end as the engine replays it (a CUDA
graph per chunk-count bucket), its first convolution on PyTorch against conv_kernels.conv1_gelu (GPU only).

Variants, each captured in a graph per bucket and replayed (median of --replays, CUDA events):
- pytorch: the three convolutions, bias adds and GELUs as PyTorch runs them (NCHW);
- channels_last: the same with every convolution's weight channels-last (cuDNN then runs channels-last throughout);
- fused: conv_kernels.conv1_gelu, the next two convolutions channels-last (the engine's path with the fused kernels).
Prints JSON: ms a replay, the largest difference from pytorch's tokens, and the kernels one replay runs (GPU us each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

import torch

from qasr.engine.runner import capture_graph, capture_stream
from qasr.model.config import AudioEncoderConfig
from qasr.model.conv_kernels import conv1_gelu
from qasr.model.gpu_timing import graphed_ms, replay_ms
from qasr.model.modeling import AudioEncoder

from .offline import profiled

D_MODEL = {"0.6B": 896, "1.7B": 1024}


def kernels_of_replay(graph: torch.cuda.CUDAGraph) -> dict[str, dict]:
    """The kernels one replay runs -> {name: {"count", "us"}} (their GPU time summed), the longest first."""
    count, us = Counter(), Counter()
    for e in profiled(graph.replay, replays=1).events():
        if e.device_type.name == "CUDA":
            count[e.name] += 1
            us[e.name] += e.time_range.elapsed_us()
    return {name: {"count": count[name], "us": total} for name, total in us.most_common()}


def set_layout(encoder: AudioEncoder, convs: tuple[str, ...], layout: torch.memory_format) -> None:
    for name in convs:
        conv = getattr(encoder, name)
        conv.weight.data = conv.weight.data.contiguous(memory_format=layout)


def front_end(size: str, chunks: int) -> tuple[AudioEncoder, torch.Tensor]:
    """The conv front end of `size`'s encoder (no transformer layers), random bf16 weights on the GPU, and `chunks`
    random mel chunks."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(AudioEncoderConfig(), d_model=D_MODEL[size], encoder_layers=0)
    encoder = AudioEncoder(cfg).to("cuda", torch.bfloat16)
    return encoder, torch.randn(chunks, cfg.num_mel_bins, cfg.chunk_frames, device="cuda", dtype=torch.bfloat16)


@torch.inference_mode()
def run(size: str, buckets: list[int], replays: int) -> dict:
    encoder, chunks = front_end(size, max(buckets))
    variants = {
        "pytorch": ((), lambda x: encoder.embed_chunks(x)),
        "channels_last": (("conv2d1", "conv2d2", "conv2d3"), lambda x: encoder.embed_chunks(x)),
        "fused": (("conv2d2", "conv2d3"), lambda x: encoder.embed_chunks(x, first_conv=conv1_gelu)),
    }
    out: dict = {"size": size, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "buckets": {}}
    for n in buckets:
        x = chunks[:n].contiguous()
        rows, reference = {}, None
        for name, (channels_last, fn) in variants.items():
            set_layout(encoder, ("conv2d1", "conv2d2", "conv2d3"), torch.contiguous_format)
            set_layout(encoder, channels_last, torch.channels_last)
            with capture_stream() as stream:
                graph, y = capture_graph(lambda: fn(x), stream, None, warmups=2)
            graph.replay()  # capturing records the kernels without running them: the output is set by a replay
            torch.cuda.synchronize()
            y = y.float().clone()
            reference = y if reference is None else reference
            rows[name] = {"ms": replay_ms(graph, lambda: None, replays),
                          "max_abs_diff": (y - reference).abs().max().item(), "kernels": kernels_of_replay(graph)}
        out["buckets"][n] = rows
    return out


CONV1_TILES = ((64, 64, 4), (64, 32, 4), (128, 32, 4), (128, 32, 8), (32, 32, 2), (256, 32, 8), (128, 64, 8))  # the
# default (conv_kernels' BLOCK_POSITIONS x BLOCK_CHANNELS x NUM_WARPS) among them


@torch.inference_mode()
def conv1_tiles(size: str, chunks: int, replays: int) -> dict:
    """conv1_gelu alone over `chunks` chunks at each tile of CONV1_TILES: ms a call in a graph, and whether the
    output equals the default tile's bit for bit."""
    encoder, x = front_end(size, chunks)
    conv = encoder.conv2d1
    default = conv1_gelu(x, conv)
    return {"x".join(map(str, tile)): {"ms": graphed_ms(lambda: conv1_gelu(x, conv, tile), replays),
                                       "equal_to_default": bool(torch.equal(conv1_gelu(x, conv, tile), default))}
            for tile in CONV1_TILES}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qasr.bench.conv_front_end", description=__doc__.split("\n\n")[0])
    p.add_argument("size", nargs="?", default="0.6B", choices=sorted(D_MODEL))
    p.add_argument("--buckets", type=int, nargs="+", default=[8, 24, 64], help="chunks a replay (default: %(default)s)")
    p.add_argument("--replays", type=int, default=50, help="timed replays per variant (default: %(default)s)")
    p.add_argument("--conv1-tiles", action="store_true",
                   help="instead: the fused first convolution alone at the largest bucket, per tile (positions x "
                        "channels x warps)")
    args = p.parse_args(argv)
    if args.conv1_tiles:
        print(json.dumps({"conv1_tiles": conv1_tiles(args.size, max(args.buckets), args.replays)}, indent=1))
        return
    print(json.dumps(run(args.size, args.buckets, args.replays), indent=1))


if __name__ == "__main__":
    main()
