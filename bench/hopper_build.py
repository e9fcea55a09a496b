"""`python -m qasr.bench.hopper_build KERNEL [--stages N] [--warps N] [--set NAME=VALUE ...]`: one of the project's
Triton kernels compiled for sm_90 (Hopper) on this machine, no GPU needed, and what its machine code holds: instructions
by opcode (SASS, from the `nvdisasm` that ships with Triton), shared memory, register spills, conversions.

Session 32 found the int8 KV readers' cost this way (an int-to-float conversion per byte read, `I2F`, 256 a key block
per thread: docs/benchmarks.md), and tests/model/test_kernels_pdl.py compiles every kernel here to check its PDL wait
and the int8 readers' PTX. KERNELS holds each launched kernel's signature and constexprs at the 0.6B decoder's shapes;
--set overrides a constexpr (BLOCK_M=32: the int8 prefill attention at its default 64-row tile).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qasr.model import gemv, kernels, kv_int8

# every launched kernel of kernels.py, gemv.py and kv_int8.py, with a signature and constexprs at the 0.6B decoder's
# shapes (bf16, split-K inputs)
KERNELS = {
    "_rms_norm_kernel": (kernels, {"X": "*fp32", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "S": "*bf16", "D": "i32",
                                   "eps": "fp32", "split_stride": "i32"},
                         {"SPLITS": 2, "HAS_RESIDUAL": True, "FP8": False, "BLOCK": 1024}),
    "_qk_norm_rope_store_kernel": (kernels, {
        "QKV": "*fp32", "Q": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16", "K_SCALE": "*bf16", "V_SCALE": "*bf16",
        "QW": "*bf16", "KW": "*bf16", "COS": "*bf16", "SIN": "*bf16", "ROPE_POS": "*i64", "SLOT": "*i64",
        "WRITE_POS": "*i64", "stride_qkv": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_cl": "i32",
        "stride_ss": "i32", "stride_sh": "i32", "eps": "fp32", "split_stride": "i32"},
        {"H": 16, "KVH": 8, "HD": 128, "HEADS": 8, "SPLITS": 2, "INT8": False}),
    "_decode_attention_kernel": (kernels, {
        "Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "POS": "*i64", "stride_cs": "i32", "stride_ch": "i32",
        "stride_cl": "i32", "scale": "fp32"}, {"H": 16, "G": 2, "G_BLOCK": 16, "HD": 128, "BLOCK_N": 64}),
    "_prefill_attention_kernel": (kernels, {
        "Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "SLOTS": "*i64", "STARTS": "*i64",
        "LENGTHS": "*i64", "T": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_cl": "i32", "scale": "fp32"},
        {"H": 16, "G": 2, "G_BLOCK": 2, "HD": 128, "BLOCK_M": 16, "BLOCK_N": 64}),
    "_decode_attention_int8_kernel": (kv_int8, {
        "Q": "*bf16", "K": "*i32", "V": "*i32", "KS": "*fp32", "VS": "*fp32", "OUT": "*bf16", "POS": "*i64",
        "stride_cs": "i32", "stride_ch": "i32", "stride_cl": "i32", "stride_ss": "i32", "stride_sh": "i32",
        "scale": "fp32"}, {"H": 16, "G": 2, "G_BLOCK": 16, "HD": 128, "BLOCK_N": 128}),
    "_prefill_attention_int8_kernel": (kv_int8, {
        "Q": "*bf16", "K": "*i32", "V": "*i32", "KS": "*fp32", "VS": "*fp32", "OUT": "*bf16", "SLOTS": "*i64",
        "STARTS": "*i64", "LENGTHS": "*i64", "T": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_cl": "i32",
        "stride_ss": "i32", "stride_sh": "i32", "scale": "fp32"},
        {"H": 16, "G": 2, "G_BLOCK": 2, "HD": 128, "BLOCK_M": 16, "BLOCK_N": 64}),
    "_silu_mul_kernel": (kernels, {"GU": "*bf16", "OUT": "*bf16", "S": "*bf16", "I": "i32"},
                         {"BLOCK": 1024, "FP8": False}),
    "_decode_begin_kernel": (kernels, {
        "TOKENS": "*i64", "POSITIONS": "*i64", "EMBED": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16",
        "ROPE_POS": "*i64", "SLOTS": "*i64", "WRITE_POS": "*i64", "D": "i32", "V": "i32", "scratch": "i32",
        "eps": "fp32"}, {"BLOCK": 1024}),
    "_advance_rows_kernel": (kernels, {  # the argmax of the lm_head's block maxima too
        "NXT": "*i32", "VALUES": "*fp32", "TOKENS": "*i64", "POSITIONS": "*i64", "COUNTS": "*i64", "BUDGETS": "*i64",
        "EOS": "*i64", "OUT": "*i64", "W": "i32", "stride_out": "i32"}, {"MAXIMA": True, "NUM_EOS": 2, "BLOCK": 1024}),
    "_gemv_kernel": (gemv, {"X": "*bf16", "W": "*bf16", "SCALE": "*fp32", "OUT": "*bf16", "MAX_V": "*fp32",
                            "MAX_I": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32"},  # the lm_head's
                     {"K_SPLIT": 1024, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PRECISION": None,
                      "ARGMAX": True, "SCALED": False}),  # with its block maxima
    "_gate_up_silu_kernel": (gemv, {"X": "*bf16", "W": "*bf16", "OUT": "*bf16", "M": "i32", "I": "i32", "K": "i32",
                                    "stride_xm": "i32"},
                             {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "PRECISION": None}),
    # the audio encoder's (FP8 encoder products), at the 0.6B encoder's widths: 896, and 3,584 for the GELU
    "_layer_norm_kernel": (kernels, {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "S": "*bf16", "D": "i32",
                                     "eps": "fp32"}, {"FP8": False, "BLOCK": 1024}),
    "_gelu_kernel": (kernels, {"X": "*bf16", "Y": "*bf16", "S": "*bf16", "D": "i32"}, {"FP8": False, "BLOCK": 4096}),
}
# kernels with a second case: the name above and the signature and constexprs that differ
VARIANTS = {"_qk_norm_rope_store_kernel (int8 cache)": ("_qk_norm_rope_store_kernel", {
    "K_CACHE": "*i32", "V_CACHE": "*i32", "K_SCALE": "*fp32", "V_SCALE": "*fp32"}, {"INT8": True}),
    "_rms_norm_kernel (fp8 output)": ("_rms_norm_kernel", {"X": "*bf16", "Y": "*fp8e4nv", "S": "*fp32"},
                                      {"SPLITS": 0, "FP8": True}),
    "_silu_mul_kernel (fp8 output)": ("_silu_mul_kernel", {"OUT": "*fp8e4nv", "S": "*fp32"},
                                      {"BLOCK": 4096, "FP8": True}),
    "_layer_norm_kernel (fp8 output)": ("_layer_norm_kernel", {"Y": "*fp8e4nv", "S": "*fp32"}, {"FP8": True}),
    "_gelu_kernel (fp8 output)": ("_gelu_kernel", {"Y": "*fp8e4nv", "S": "*fp32"}, {"FP8": True}),
    "_gemv_kernel (fp8 weight)": ("_gemv_kernel", {"W": "*fp8e4nv"}, {"SCALED": True})}
DEVICE_FUNCTIONS = {"_await_inputs", "_load_input", "_round_to_e4m3", "_store_e4m3", "_norm_store", "_norm_rope",
                    "_first_max", "_block_argmax", "_store_int8", "_quarters", "_exact_byte", "_scores",
                    "_load_quarters", "_attend", "_store_quarters", "_prefill_tile"}  # called, not launched
CONVERSIONS = ("I2F", "F2I", "F2F", "I2I")  # SASS conversion opcodes (a conversion unit's, not the ALU's, rate)
SASS_LINE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def launched_kernels() -> dict[str, triton.runtime.jit.JITFunction]:
    """The Triton kernels the three modules launch (every JIT function that is not a DEVICE_FUNCTIONS helper)."""
    found = {}
    for module in (kernels, gemv, kv_int8):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name not in DEVICE_FUNCTIONS:
                found[name] = value
    return found


def compile_for_hopper(name: str, pdl: bool, num_stages: int = 3, num_warps: int = 4, constexprs: dict | None = None):
    """A kernel of KERNELS (or VARIANTS) compiled for sm_90: `.asm["ptx"]`, `.asm["cubin"]`, `.metadata`; constexprs
    override the table's."""
    name, signature_change, constexpr_change = VARIANTS.get(name, (name, {}, {}))
    module, signature, table_constexprs = KERNELS[name]
    signature = signature | signature_change
    constexprs = table_constexprs | constexpr_change | (constexprs or {}) | {"PDL": pdl}
    fn = getattr(module, name)
    src = ASTSource(fn=fn, signature=signature | {c: "constexpr" for c in constexprs}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"launch_pdl": pdl, "num_warps": num_warps, "num_stages": num_stages})


def sass_opcodes(compiled) -> collections.Counter:
    """Instructions of a compiled kernel's SASS by opcode (modifiers dropped: I2F.BF16.S8 counts as I2F)."""
    nvdisasm = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1) for m in map(SASS_LINE.search, sass.splitlines()) if m)


def build_report(name: str, stages: int = 3, warps: int = 4, constexprs: dict | None = None) -> dict:
    compiled = compile_for_hopper(name, True, stages, warps, constexprs)
    ops = sass_opcodes(compiled)
    return {"kernel": name, "stages": stages, "warps": warps, "constexprs": constexprs or {},
            "instructions": sum(ops.values()), "shared_bytes": compiled.metadata.shared,
            "spill_stores": ops["STL"], "conversions": {op: ops[op] for op in CONVERSIONS if ops[op]},
            "opcodes": dict(ops.most_common())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.hopper_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=sorted(KERNELS) + sorted(VARIANTS))
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a constexpr (an integer)")
    args = parser.parse_args(argv)
    constexprs = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            constexprs[key] = int(value)
        except ValueError:
            parser.error(f"--set takes NAME=INTEGER, got {item!r}")
    print(json.dumps(build_report(args.kernel, args.stages, args.warps, constexprs)))


if __name__ == "__main__":
    main()
