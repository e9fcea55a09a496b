"""Programmatic dependent launch ($QASR_PDL, model/kernels.py): when it is on and where it is off, and what the
compiled kernels do with it.

No GPU here, but Triton compiles for one: each kernel of kernels.py, gemv.py and kv_int8.py is compiled for sm_90
(Hopper) with its PDL flag on and off, and the PTX must wait for the previous kernel (griddepcontrol.wait) before its
first global load or store, allow the next one to launch, and carry neither instruction with the flag off. In Triton's interpreter (the
CPU tests) the switch on must change nothing: the flag stays off there and the engine's tokens are the same. The same
compiles check that the int8 KV readers' PTX converts no integer to a float.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qasr.model import gemv, kernels, kv_int8  # noqa: E402

# every kernel of the two modules, with a signature and constexprs at the 0.6B decoder's shapes (bf16, split-K inputs)
KERNELS = {
    "_rms_norm_kernel": (kernels, {"X": "*fp32", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "D": "i32", "eps": "fp32",
                                   "split_stride": "i32"},
                         {"SPLITS": 2, "HAS_RESIDUAL": True, "BLOCK": 1024}),
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
    "_silu_mul_kernel": (kernels, {"GU": "*bf16", "OUT": "*bf16", "I": "i32"}, {"BLOCK": 1024}),
    "_decode_begin_kernel": (kernels, {
        "TOKENS": "*i64", "POSITIONS": "*i64", "EMBED": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16",
        "ROPE_POS": "*i64", "SLOTS": "*i64", "WRITE_POS": "*i64", "D": "i32", "V": "i32", "scratch": "i32",
        "eps": "fp32"}, {"BLOCK": 1024}),
    "_advance_rows_kernel": (kernels, {  # the argmax of the lm_head's block maxima too
        "NXT": "*i32", "VALUES": "*fp32", "TOKENS": "*i64", "POSITIONS": "*i64", "COUNTS": "*i64", "BUDGETS": "*i64",
        "EOS": "*i64", "OUT": "*i64", "W": "i32", "stride_out": "i32"}, {"MAXIMA": True, "NUM_EOS": 2, "BLOCK": 1024}),
    "_gemv_kernel": (gemv, {"X": "*bf16", "W": "*bf16", "OUT": "*bf16", "MAX_V": "*fp32", "MAX_I": "*i32", "M": "i32",
                            "N": "i32", "K": "i32", "stride_xm": "i32"},  # the lm_head's, with its block maxima
                     {"K_SPLIT": 1024, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PRECISION": None,
                      "ARGMAX": True}),
    "_gate_up_silu_kernel": (gemv, {"X": "*bf16", "W": "*bf16", "OUT": "*bf16", "M": "i32", "I": "i32", "K": "i32",
                                    "stride_xm": "i32"},
                             {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "PRECISION": None}),
}
# kernels with a second case: the name above and the signature and constexprs that differ
VARIANTS = {"_qk_norm_rope_store_kernel (int8 cache)": ("_qk_norm_rope_store_kernel", {
    "K_CACHE": "*i32", "V_CACHE": "*i32", "K_SCALE": "*fp32", "V_SCALE": "*fp32"}, {"INT8": True})}
DEVICE_FUNCTIONS = {"_await_inputs", "_load_input", "_norm_store", "_norm_rope", "_first_max", "_block_argmax",
                    "_store_int8", "_quarters", "_exact_byte", "_scores", "_load_quarters", "_attend",
                    "_store_quarters", "_prefill_tile"}  # called from the kernels, not launched
MEMORY = re.compile(r"\b(ld|st|atom|red)\.global|\bcp\.async\b")


def launched_kernels() -> dict[str, triton.runtime.jit.JITFunction]:
    found = {}
    for module in (kernels, gemv, kv_int8):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name not in DEVICE_FUNCTIONS:
                found[name] = value
    return found


def compile_for_hopper(name: str, pdl: bool, num_stages: int = 3):
    name, signature_change, constexpr_change = VARIANTS.get(name, (name, {}, {}))
    module, signature, constexprs = KERNELS[name]
    signature, constexprs = signature | signature_change, constexprs | constexpr_change
    fn = getattr(module, name)
    constexprs = constexprs | {"PDL": pdl}
    src = ASTSource(fn=fn, signature=signature | {c: "constexpr" for c in constexprs}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"launch_pdl": pdl, "num_warps": 4, "num_stages": num_stages})


def test_every_launched_kernel_takes_the_pdl_flag_and_is_checked_here():
    found = launched_kernels()
    assert set(found) == set(KERNELS), "a kernel was added or renamed: give it a PDL flag and a case in KERNELS"
    for name, fn in found.items():
        assert "PDL" in fn.arg_names, name


def assert_waits_before_memory(compiled) -> None:
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.launch_pdl
    wait = ptx.find("griddepcontrol.wait")
    first_access = MEMORY.search(ptx)
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx
    assert first_access is not None and wait < first_access.start(), ptx[: first_access.start() + 200]


@pytest.mark.parametrize("name", sorted(KERNELS) + sorted(VARIANTS))
def test_with_pdl_each_program_waits_for_the_previous_kernel_before_touching_memory(name):
    assert_waits_before_memory(compile_for_hopper(name, True))
    off = compile_for_hopper(name, False)
    assert not off.metadata.launch_pdl and "griddepcontrol" not in off.asm["ptx"]


@pytest.mark.parametrize("name", ["_gemv_kernel", "_gate_up_silu_kernel"])
def test_the_gemv_kernels_wait_before_their_first_load_at_every_pipeline_depth_they_launch(name):
    """GemvConfig.stages: deeper at one row tile than past it; a deeper prologue's loads must still follow the wait."""
    depths = {gemv.GemvConfig(64, 128).stages(M) for M in (1, gemv.BLOCK_M + 1)}
    assert len(depths) == 2
    for depth in depths:
        assert_waits_before_memory(compile_for_hopper(name, True, num_stages=depth))


@pytest.mark.parametrize("name", ["_decode_attention_int8_kernel", "_prefill_attention_int8_kernel"])
def test_the_int8_readers_take_bytes_apart_without_int_to_float_conversions(name):
    """kv_int8._quarters builds each byte's value from float bits: a conversion from an integer (cvt.rn.*.s32, or
    .s8), quarter-rate on Hopper, one per byte read, was the decode reader's costliest instruction (session 32)."""
    ptx = compile_for_hopper(name, True).asm["ptx"]
    assert "mma" in ptx and not re.search(r"\bcvt\.rn\.(f32|bf16|f16)\.[su](8|16|32)\b", ptx)


def test_the_switch_is_on_by_default_and_never_on_off_a_gpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.PDL_ENV, raising=False)
    assert kernels.pdl_requested() and not kernels.use_pdl(cpu)
    assert kernels.pdl_options(cpu, 1) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv(kernels.PDL_ENV, "0")
    assert not kernels.pdl_requested()
    monkeypatch.setenv(kernels.PDL_ENV, "1")
    assert kernels.pdl_requested() and not kernels.use_pdl(cpu)
    assert kernels.pdl_options(cpu, 1) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(kernels, "use_pdl", lambda device: True)  # as on an H200 with QASR_PDL=1
    assert kernels.pdl_options(cpu, kernels.PDL_MAX_ROWS) == {"PDL": True, "launch_pdl": True}
    assert kernels.pdl_options(cpu, kernels.PDL_MAX_ROWS + 1) == {"PDL": False, "launch_pdl": False}  # cuBLAS's
    monkeypatch.setenv(kernels.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="QASR_PDL"):
        kernels.pdl_requested()


INTERPRETED = r"""
import json, os, sys
import numpy as np
from qasr.model import kernels
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest

flags = []
real = kernels.pdl_options
kernels.pdl_options = lambda *args: flags.append(real(*args)) or flags[-1]
rng = np.random.default_rng(3)
reqs = [DecodeRequest(audio=(0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32), max_new_tokens=5)
        for s in (0.6, 1.3)]
opts = dict(num_slots=2, max_len=128, num_retained=0)
fused = Engine.from_pretrained(sys.argv[1], device="cpu", options=EngineOptions(**opts, fused_kernels=True))
plain = Engine.from_pretrained(sys.argv[1], device="cpu", options=EngineOptions(**opts, fused_kernels=False))
tokens = {}
for pdl in ("1", "0"):
    os.environ["QASR_PDL"] = pdl
    tokens[pdl] = [r.token_ids for r in fused.transcribe(reqs)]
tokens["plain"] = [r.token_ids for r in plain.transcribe(reqs)]
print(json.dumps({"tokens": tokens, "launches": len(flags), "flags_on": sum(any(f.values()) for f in flags)}))
"""


def test_in_the_interpreter_pdl_on_gives_the_same_tokens_with_the_calls_elided(tiny_model_dir):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, str(tiny_model_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = result["tokens"]
    assert tokens["1"] == tokens["0"] == tokens["plain"] and all(len(t) == 5 for t in tokens["1"])
    assert result["launches"] > 0 and result["flags_on"] == 0


def test_kernel_check_counts_the_launches_pdl_can_chain():
    from qasr.bench import kernel_check

    triton_names = kernel_check.triton_kernel_names()
    assert set(KERNELS) <= triton_names
    step = ["index_select_kernel", "Memcpy DtoD", "_rms_norm_kernel", "_gemv_kernel", "_qk_norm_rope_store_kernel",
            "nvjet_gemm", "_rms_norm_kernel", "argmax_kernel", "_advance_rows_kernel"]
    kinds = kernel_check.launch_kinds(step * 2, triton_names, replays=2)
    assert (kinds["triton"], kinds["other"], kinds["copy"]) == (5, 3, 1)
    assert kinds["chain_breaks"] == 3  # after the copy, after the cuBLAS product, after the argmax
    assert kinds["other_names"] == {"index_select_kernel": 1, "nvjet_gemm": 1, "argmax_kernel": 1}
