"""Would a persistent decode kernel pay (#16)? Its two costs, measured on the GPU before anyone writes one.

At one row the decode step is 227 kernels chained by programmatic dependent launch, each with a fixed cost of a few
us where its bytes need ~1 (docs/benchmarks.md). A persistent kernel (one launch; each program loops over a layer's
phases, the phases separated by grid-wide barriers) swaps those kernel boundaries for barriers. This probe measures,
at the decoder's product shapes, whether that swap wins, without touching the engine:

- `barrier`: a grid-wide barrier (every program arrives with an atomic, then spins until all have) against a kernel
  boundary (an empty kernel with PDL, in a CUDA graph), each repeated `--repeats` times over the same programs.
- `chain`: each layer's four products at one row (qkv, o_proj, gate_up, down; every product's input the one before's
  output, the weights streamed from memory) as one persistent kernel against one kernel a product (the same program
  body, PDL, in a CUDA graph), beside their weight bytes at the copy bandwidth.

Both variants run the same work items (BLOCK_N output columns, 1/SPLIT of the reduction, float32 atomics where split),
so the difference is the boundaries alone; each also runs with every program reading its first weight tile before it
waits (weights are no kernel's output). Session 26, an H100: the barrier 1.37 us against 0.64 for the boundary, the
persistent chain 28.3 us a layer against 18.6 (0.6B); the early tile 18.6 -> 16.4 here, but in the engine's step it
paid only beside 16-way splits that cost at 32 rows and was removed (session 27; docs/benchmarks.md). The products
are checked against float32 PyTorch. A program spins for at most MAX_SPINS polls (then raises a flag, reported as an
error) so that a grid whose programs are not all resident fails instead of hanging the GPU.

`python -m qasr.bench.persistent_probe [0.6B] [1.7B] [--programs-per-sm 1,2]`: one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from qasr.model import kernels
from qasr.model.gpu_timing import capture, graphed_ms, replay_ms
from qasr.model.testmodel import SHAPES

from .offline import copy_bandwidth  # the floors the offline bench reports use the same measure

triton, tl = kernels.triton, (kernels.tl if kernels.triton is not None else None)

BLOCK_N = 16  # output columns an item
BLOCK_K = 256  # the reduction's step
MAX_SPINS = 1 << 22  # a barrier's polls before giving up (~1 s): non-resident programs would otherwise hang


@dataclass(frozen=True)
class Product:
    name: str
    n: int  # outputs
    k: int  # inputs (the previous product's first k outputs)
    split: int  # items sharing one column block's reduction

    @property
    def items(self) -> int:
        return self.n // BLOCK_N * self.split


def layer_products(size: str, programs: int, block_k: int = BLOCK_K) -> list[Product]:
    """A decoder layer's four products at `size`'s shapes ("tiny" for the CPU test), each split (while its
    reduction divides into block_k steps) until it has about `programs` items."""
    s = SHAPES[size]
    shapes = [("qkv", (s.text_heads + 2 * s.text_kv_heads) * s.head_dim, s.text_hidden),
              ("o_proj", s.text_hidden, s.text_heads * s.head_dim),
              ("gate_up", 2 * s.text_intermediate, s.text_hidden),
              ("down", s.text_hidden, s.text_intermediate)]
    out = []
    for name, n, k in shapes:
        split = 1
        while n // BLOCK_N * split < programs and k % (2 * split * block_k) == 0:
            split *= 2
        out.append(Product(name, n, k, split))
    return out


if triton is not None:

    @triton.jit
    def _first_tile(W, item, limit, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # an item's first weight tile (zeros unless item < limit): weights are no kernel's output, so it may be read
        # before waiting for the inputs
        cols = (item // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = (item % SPLIT) * (K // SPLIT) + tl.arange(0, BLOCK_K)
        whole = tl.arange(0, BLOCK_K)[None, :] < BLOCK_K * (item < limit).to(tl.int32)  # all or none
        return tl.load(W + cols[:, None].to(tl.int64) * K + k[None, :], mask=whole & (cols[:, None] >= 0), other=0.0)

    @triton.jit
    def _item(W, X, Y, item, w_first, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, HAS_FIRST: tl.constexpr):
        # Y[cols] (+)= W[cols, this split's k] . X[this split's k], in float32 (atomics when split); with HAS_FIRST
        # the first weight tile is w_first, read already
        cols = (item // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_per: tl.constexpr = K // SPLIT
        k_start = (item % SPLIT) * k_per
        if HAS_FIRST:
            acc = tl.sum(w_first.to(tl.float32) * tl.load(X + k_start + tl.arange(0, BLOCK_K))[None, :], axis=1)
            begin: tl.constexpr = BLOCK_K
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
            begin: tl.constexpr = 0
        for k0 in range(begin, k_per, BLOCK_K):
            k = k_start + k0 + tl.arange(0, BLOCK_K)
            w = tl.load(W + cols[:, None].to(tl.int64) * K + k[None, :]).to(tl.float32)
            acc += tl.sum(w * tl.load(X + k)[None, :], axis=1)
        if SPLIT == 1:
            tl.store(Y + cols, acc)
        else:
            tl.atomic_add(Y + cols, acc, sem="relaxed")

    @triton.jit
    def _grid_barrier(COUNTER, ERROR, target, MAX_SPINS: tl.constexpr):
        # arrive (after this program's stores), then wait until `target` arrivals in all: the counter only grows, so
        # the i-th barrier of a launch waits for i * (arrivals a program makes) * programs
        tl.debug_barrier()
        tl.atomic_add(COUNTER, 1, sem="release", scope="gpu")
        spins = 0
        while (tl.load(COUNTER, volatile=True) < target) & (spins < MAX_SPINS):
            spins += 1
            if tl.load(ERROR, volatile=True) != 0:  # one barrier timed out already: the launch is void, end it
                spins = MAX_SPINS
        if spins >= MAX_SPINS:
            tl.store(ERROR, 1)
        tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _count_arrivals_kernel(COUNTER):
        tl.atomic_add(COUNTER, 1)  # how many increments one program's scalar atomic makes

    @triton.jit
    def _barriers_kernel(COUNTER, ERROR, REPEATS, ARRIVALS, MAX_SPINS: tl.constexpr):
        for i in range(REPEATS):
            _grid_barrier(COUNTER, ERROR, (i + 1) * ARRIVALS, MAX_SPINS)

    @triton.jit
    def _empty_kernel(PDL: tl.constexpr):
        kernels._await_inputs(PDL)

    @triton.jit
    def _product_kernel(W, X, Y, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
        item = tl.program_id(0)
        w_first = 0
        if EARLY:
            w_first = _first_tile(W, item, (N // BLOCK_N) * SPLIT, K, SPLIT, BLOCK_N, BLOCK_K)
        kernels._await_inputs(PDL)
        _item(W, X, Y, item, w_first, N, K, SPLIT, BLOCK_N, BLOCK_K, EARLY)

    @triton.jit
    def _phase(W, X, Y, w_first, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EARLY: tl.constexpr):
        # this program's items of a product: the first with its first tile read already (EARLY), the rest after
        ITEMS: tl.constexpr = (N // BLOCK_N) * SPLIT
        pid, programs = tl.program_id(0), tl.num_programs(0)
        if pid < ITEMS:
            _item(W, X, Y, pid, w_first, N, K, SPLIT, BLOCK_N, BLOCK_K, EARLY)
        for item in range(pid + programs, ITEMS, programs):
            _item(W, X, Y, item, 0, N, K, SPLIT, BLOCK_N, BLOCK_K, False)

    @triton.jit
    def _next_first_tile(W, exists, K: tl.constexpr, SPLIT: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EARLY: tl.constexpr):
        # with EARLY, this program's first tile of the next product (if it `exists`: 1 or 0), read before the barrier
        # in front of it
        if EARLY:
            return _first_tile(W, tl.program_id(0), exists * ((N // BLOCK_N) * SPLIT), K, SPLIT, BLOCK_N, BLOCK_K)
        else:
            return 0

    @triton.jit
    def _persistent_chain_kernel(W0, W1, W2, W3, Y, COUNTER, ERROR, LAYERS, ARRIVALS, STRIDE: tl.constexpr,
                                 N0: tl.constexpr, K0: tl.constexpr, S0: tl.constexpr,
                                 N1: tl.constexpr, K1: tl.constexpr, S1: tl.constexpr,
                                 N2: tl.constexpr, K2: tl.constexpr, S2: tl.constexpr,
                                 N3: tl.constexpr, K3: tl.constexpr, S3: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAX_SPINS: tl.constexpr,
                                 EARLY: tl.constexpr):
        # Y: [LAYERS + 1, STRIDE] float32, each layer's outputs at offsets 0, N0, N0+N1, N0+N1+N2 (layer 0's "down"
        # output is the input); a barrier after every product. EARLY: each program reads its first weight tile of
        # the next product before the barrier
        OFF1: tl.constexpr = N0
        OFF2: tl.constexpr = N0 + N1
        OFF3: tl.constexpr = N0 + N1 + N2
        barriers = 0
        w0 = _next_first_tile(W0, 1, K0, S0, N0, BLOCK_N, BLOCK_K, EARLY)
        for layer in range(LAYERS):
            before = Y + layer * STRIDE
            out = before + STRIDE
            _phase(W0 + layer * N0 * K0, before + OFF3, out, w0, N0, K0, S0, BLOCK_N, BLOCK_K, EARLY)
            w1 = _next_first_tile(W1 + layer * N1 * K1, 1, K1, S1, N1, BLOCK_N, BLOCK_K, EARLY)
            barriers += 1
            _grid_barrier(COUNTER, ERROR, barriers * ARRIVALS, MAX_SPINS)
            _phase(W1 + layer * N1 * K1, out, out + OFF1, w1, N1, K1, S1, BLOCK_N, BLOCK_K, EARLY)
            w2 = _next_first_tile(W2 + layer * N2 * K2, 1, K2, S2, N2, BLOCK_N, BLOCK_K, EARLY)
            barriers += 1
            _grid_barrier(COUNTER, ERROR, barriers * ARRIVALS, MAX_SPINS)
            _phase(W2 + layer * N2 * K2, out + OFF1, out + OFF2, w2, N2, K2, S2, BLOCK_N, BLOCK_K, EARLY)
            w3 = _next_first_tile(W3 + layer * N3 * K3, 1, K3, S3, N3, BLOCK_N, BLOCK_K, EARLY)
            barriers += 1
            _grid_barrier(COUNTER, ERROR, barriers * ARRIVALS, MAX_SPINS)
            _phase(W3 + layer * N3 * K3, out + OFF2, out + OFF3, w3, N3, K3, S3, BLOCK_N, BLOCK_K, EARLY)
            w0 = _next_first_tile(W0 + (layer + 1) * N0 * K0, (layer + 1 < LAYERS).to(tl.int32), K0, S0, N0, BLOCK_N, BLOCK_K,
                                  EARLY)
            barriers += 1
            _grid_barrier(COUNTER, ERROR, barriers * ARRIVALS, MAX_SPINS)


def arrivals_per_program(device: torch.device) -> int:
    """Increments one program's scalar atomic makes (1 where Triton gives it to one thread, as it should)."""
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    _count_arrivals_kernel[(1,)](counter)
    return int(counter.item())


class Chain:
    """`layers` layers of `products`, random bf16 weights ([layers, n, k] per product, scaled to keep the chain's
    values near 1) and the float32 activation buffer both variants write."""

    def __init__(self, products: list[Product], layers: int, device: torch.device, block_k: int = BLOCK_K,
                 seed: int = 0):
        assert all(p.k % (p.split * block_k) == 0 and p.n % BLOCK_N == 0 for p in products), products
        self.block_k = block_k
        gen = torch.Generator(device=device).manual_seed(seed)
        self.products, self.layers, self.device = products, layers, device
        self.weights = [(torch.randn(layers, p.n, p.k, generator=gen, device=device) / p.k ** 0.5).to(torch.bfloat16)
                        for p in products]
        self.offsets = [sum(p.n for p in products[:i]) for i in range(len(products))]
        self.stride = sum(p.n for p in products)
        self.y = torch.zeros(layers + 1, self.stride, dtype=torch.float32, device=device)
        self.x0 = torch.randn(products[-1].n, generator=gen, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)

    def bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def reset(self) -> None:
        """Zero the outputs (split items add into them) and the barrier's counter; the input back in place."""
        self.y.zero_()
        self.y[0, self.offsets[-1]:].copy_(self.x0)
        self.counter.zero_()

    def inputs_outputs(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.products[i]
        src_row, src_off = (layer, self.offsets[-1]) if i == 0 else (layer + 1, self.offsets[i - 1])
        x = self.y[src_row, src_off:src_off + p.k]
        return x, self.y[layer + 1, self.offsets[i]:self.offsets[i] + p.n]

    def reference(self) -> torch.Tensor:
        """The last layer's down output in float32 PyTorch."""
        x = self.x0
        for layer in range(self.layers):
            h = x
            for p, w in zip(self.products, self.weights):
                h = w[layer].float() @ h[:p.k]
            x = h
        return x

    def output(self) -> torch.Tensor:
        return self.y[self.layers, self.offsets[-1]:]

    def launch_separate(self, pdl: bool, early: bool = False) -> None:
        """One kernel a product, each over its items (early: each reads its first weight tile before the wait)."""
        for layer in range(self.layers):
            for i, (p, w) in enumerate(zip(self.products, self.weights)):
                x, y = self.inputs_outputs(layer, i)
                _product_kernel[(p.items,)](w[layer], x, y, p.n, p.k, p.split, BLOCK_N, self.block_k, PDL=pdl,
                                            EARLY=early, launch_pdl=pdl)

    def launch_persistent(self, programs: int, arrivals: int, early: bool = False) -> None:
        (a, b, c, d) = self.products
        _persistent_chain_kernel[(programs,)](
            *self.weights, self.y, self.counter, self.error, self.layers, arrivals * programs, self.stride,
            a.n, a.k, a.split, b.n, b.k, b.split, c.n, c.k, c.split, d.n, d.k, d.split, BLOCK_N, self.block_k, MAX_SPINS,
            EARLY=early)


def _agreement(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def probe_barrier(device: torch.device, programs: int, arrivals: int, repeats: int) -> dict:
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    barriers = capture(lambda: _barriers_kernel[(programs,)](counter, error, repeats, arrivals * programs, MAX_SPINS))
    barrier_ms = replay_ms(barriers, reset=counter.zero_)
    pdl = kernels.use_pdl(device)
    empty_ms = graphed_ms(lambda: [_empty_kernel[(programs,)](PDL=pdl, launch_pdl=pdl) for _ in range(repeats)])
    return {"section": "barrier", "programs": programs, "repeats": repeats, "pdl": pdl,
            "barrier_us": barrier_ms * 1e3 / repeats, "empty_kernel_us": empty_ms * 1e3 / repeats,
            "barrier_timeouts": int(error.item())}


def probe_chain(size: str, device: torch.device, programs: int, arrivals: int, layers: int, bandwidth: float) -> dict:
    chain = Chain(layer_products(size, programs), layers, device)
    expected = chain.reference()
    pdl = kernels.use_pdl(device)
    result = {"section": "chain", "size": size, "programs": programs, "layers": layers, "pdl": pdl,
              "products": [f"{p.name} {p.n}x{p.k} split {p.split} ({p.items} items)" for p in chain.products],
              "weight_MB": chain.bytes() / 1e6, "floor_us_a_layer": chain.bytes() / bandwidth * 1e6 / layers}
    for name, fn in (("separate", lambda: chain.launch_separate(pdl)),
                     ("separate_early", lambda: chain.launch_separate(pdl, early=True)),
                     ("persistent", lambda: chain.launch_persistent(programs, arrivals)),
                     ("persistent_early", lambda: chain.launch_persistent(programs, arrivals, early=True))):
        ms = graphed_ms(lambda: (chain.reset(), fn()))  # the outputs checked below: the last replay's
        result[f"{name}_us_a_layer"] = ms * 1e3 / layers
        result[f"{name}_max_rel_error"] = _agreement(chain.output(), expected)
    result["barrier_timeouts"] = int(chain.error.item())
    result["reset_us"] = graphed_ms(chain.reset) * 1e3 / layers  # in both variants' graphs: subtract it
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sizes", nargs="*", default=["0.6B"], choices=["0.6B", "1.7B"])
    ap.add_argument("--programs-per-sm", default="1,2", help="persistent grid sizes to try, in programs per SM")
    ap.add_argument("--repeats", type=int, default=112, help="barriers / empty kernels a graph (112: 28 layers x 4)")
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("persistent_probe needs a CUDA GPU")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    arrivals = arrivals_per_program(device)
    bandwidth = copy_bandwidth(device)
    print(json.dumps({"section": "device", "name": torch.cuda.get_device_name(device), "sms": sms,
                      "arrivals_per_program": arrivals, "copy_TBps": bandwidth / 1e12, "torch": torch.__version__,
                      "triton": triton.__version__}), flush=True)
    for per_sm in (int(v) for v in args.programs_per_sm.split(",")):
        print(json.dumps(probe_barrier(device, per_sm * sms, arrivals, args.repeats)), flush=True)
        for size in args.sizes:
            print(json.dumps(probe_chain(size, device, per_sm * sms, arrivals, args.layers, bandwidth)), flush=True)


if __name__ == "__main__":
    main()
