"""Programmatic dependent launch ($QASR_PDL, model/kernels.py): when it is on and where it is off, and what the
compiled kernels do with it.

No GPU here, but Triton compiles for one: each kernel of kernels.py, gemv.py and kv_int8.py is compiled for sm_90
(Hopper, bench/hopper_build.py) with its PDL flag on and off, and the PTX must wait for the previous kernel
(griddepcontrol.wait) before its first global load or store, allow the next one to launch, and carry neither
instruction with the flag off. In Triton's interpreter (the CPU tests) the switch on must change nothing: the flag
stays off there and the engine's tokens are the same. The same builds check that the int8 KV readers convert no
integer to a float and that the int8 prefill attention's default tile spills no registers.
"""

import json
import re

import pytest
import torch
from interpreted import run_interpreted

pytest.importorskip("triton")

from qasr.bench import hopper_build  # noqa: E402
from qasr.bench.hopper_build import KERNELS, VARIANTS, build_report, compile_for_hopper, launched_kernels  # noqa: E402
from qasr.model import gemv, kernels, kv_int8  # noqa: E402

MEMORY = re.compile(r"\b(ld|st|atom|red)\.global|\bcp\.async\b")


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
    .s8), by the CUDA guide a quarter of integer logic's rate, one per byte read, was the most frequent costly
    instruction in the decode reader's SASS (session 32)."""
    ptx = compile_for_hopper(name, True).asm["ptx"]
    assert "mma" in ptx and not re.search(r"\bcvt\.rn\.(f32|bf16|f16)\.[su](8|16|32)\b", ptx)


def test_the_int8_prefill_attention_converts_no_bytes_and_spills_no_registers_at_one_stage(capsys):
    """Its SASS (nvdisasm, through bench/hopper_build.py's command). kv_int8.PREFILL_TILE keeps Triton's three stages,
    where it spills (faster on an H100 all the same: session 35); at one stage it does not. At the 0.6B heads a
    program's tile is 64 rows of 2 heads."""
    rows, warps, stages = kv_int8.PREFILL_TILE
    hopper_build.main(["_prefill_attention_int8_kernel", "--stages", str(stages), "--warps", str(warps),
                       "--set", f"BLOCK_M={rows // 2}"])
    report = json.loads(capsys.readouterr().out)
    assert report["instructions"] > 1000 and report["opcodes"]["HGMMA"] > 0  # a real build, on the tensor cores
    assert report["conversions"].get("I2F", 0) == 0
    assert build_report("_prefill_attention_int8_kernel", 1, warps, {"BLOCK_M": rows // 2})["spill_stores"] == 0


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
    result = run_interpreted(INTERPRETED, str(tiny_model_dir), timeout=600)
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
