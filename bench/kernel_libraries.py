"""The field's kernel libraries beside qasr's own kernels, where one covers a piece of the decoder (#16: measure
before adopting).

Liger Kernel (`pip install liger-kernel`: Triton kernels, torch and triton its only needs) implements the two pieces
of a decoder layer that are neither products nor attention: the residual add + RMSNorm (Qwen3's casting, "llama")
and SiLU(gate) * up over one fused gate|up row. Each is compared with the PyTorch reference, as qasr's kernels.rms_norm
and kernels.silu_mul are, and timed beside them per call in one CUDA graph, over enough copies of its inputs that each
call reads them from memory as a layer of a step does. Rows: decode buckets and prefill sizes.

Not measured here: FlashInfer (its wheel is 101 MB and unpacks to 716 MB with eleven more packages, past what a device
call carries; its kernels are compiled on first use by nvcc) and sgl-kernel (wheels built against one torch version,
not the device image's). Their decode attention is what they would replace, and qasr's already reads the KV cache at
the bandwidth from 32 rows (docs/benchmarks.md).

`python -m qasr.bench.kernel_libraries [0.6B|1.7B]` on a CUDA machine with liger-kernel installed; one JSON line per
case.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from qasr.model import kernels
from qasr.model.gpu_timing import per_call_ms
from qasr.model.modeling import RMSNorm
from qasr.model.testmodel import SHAPES

ROWS = (1, 32, 256, 4096, 32768)
COPY_BYTES = 256 << 20  # inputs a timing cycles through: past any GPU's L2, so each call reads from memory
EPS = 1e-6


def reference_add_rms_norm(x, residual, weight):
    norm = RMSNorm(weight.numel(), EPS).to(weight.device, weight.dtype)  # the model's own, Qwen3's casting
    norm.weight.data = weight
    return norm(residual + x)


def reference_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.float()).to(gate_up.dtype) * up


def qasr_add_rms_norm(x, residual, weight):
    return kernels.rms_norm(x, weight, EPS, residual)  # residual += x in place, as the layer does


def liger_add_rms_norm(x, residual, weight):
    from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
    return fused_add_rms_norm_forward(x, residual, weight, EPS, 0.0, "llama")[0]


def qasr_silu_mul(gate_up):
    return kernels.silu_mul(gate_up)


def liger_silu_mul(gate_up):
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_forward
    return swiglu_fused_gate_up_forward(gate_up)[1]


# case -> (reference, {library: kernel}, inputs(rows, hidden, intermediate, device, dtype) -> tuple of tensors)
CASES = {
    "add_rms_norm": (reference_add_rms_norm, {"qasr": qasr_add_rms_norm, "liger": liger_add_rms_norm},
                     lambda n, d, i, dev, dt: (torch.randn(n, d, device=dev, dtype=dt),
                                               torch.randn(n, d, device=dev, dtype=dt),
                                               torch.randn(d, device=dev, dtype=dt))),
    "silu_mul": (reference_silu_mul, {"qasr": qasr_silu_mul, "liger": liger_silu_mul},
                 lambda n, d, i, dev, dt: (4 * torch.randn(n, 2 * i, device=dev, dtype=dt),)),
}


def agreement(case: str, library: str, rows: int, hidden: int, intermediate: int, device,
              dtype=torch.bfloat16) -> dict:
    """The library's kernel against the PyTorch reference on one set of inputs: the fraction of identical elements
    and the largest difference (bf16 rounding of a float32 sum may differ in the last place)."""
    reference, kernels_by_library, inputs = CASES[case]
    torch.manual_seed(rows)
    args = inputs(rows, hidden, intermediate, device, dtype)
    expected = reference(*args).float()
    got = kernels_by_library[library](*[a.clone() for a in args]).float()
    return {"identical": float((got == expected).float().mean()), "max_abs": float((got - expected).abs().max()),
            "max_ref": float(expected.abs().max())}


def time_us(case: str, library: str, rows: int, hidden: int, intermediate: int, device) -> float:
    """GPU time of one call (per_call_ms), cycling through copies of the inputs worth COPY_BYTES."""
    _, kernels_by_library, inputs = CASES[case]
    one = inputs(rows, hidden, intermediate, device, torch.bfloat16)
    copies = max(2, min(64, COPY_BYTES // sum(a.numel() * a.element_size() for a in one)))
    sets = [one] + [tuple(a.clone() for a in one) for _ in range(copies - 1)]
    kernel = kernels_by_library[library]
    return per_call_ms([lambda s=s: kernel(*s) for s in sets], runs=20) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.kernel_libraries")
    parser.add_argument("size", nargs="?", default="0.6B", choices=("0.6B", "1.7B"))
    parser.add_argument("--libraries", default="liger", help="comma-separated, beside qasr's kernels")
    args = parser.parse_args(argv)
    libraries = ["qasr", *args.libraries.split(",")]
    unknown = set(libraries) - {lib for _, by_library, _ in CASES.values() for lib in by_library}
    if unknown:
        parser.error(f"no kernels for {sorted(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_libraries times kernels in CUDA graphs: it needs a CUDA device")
    shapes, device = SHAPES[args.size], torch.device("cuda")
    for case in CASES:
        for rows in ROWS:
            line = {"case": case, "size": args.size, "rows": rows}
            for library in libraries:
                try:
                    line[library] = agreement(case, library, rows, shapes.text_hidden, shapes.text_intermediate,
                                              device) | {"us": round(time_us(case, library, rows, shapes.text_hidden,
                                                                              shapes.text_intermediate, device), 2)}
                except ImportError as e:
                    line[library] = {"error": f"not installed: {e.name}"}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
