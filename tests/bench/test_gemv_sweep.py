"""The GEMV sweep's grid (bench/gemv_sweep.py; the timing needs a GPU)."""

import pytest

pytest.importorskip("triton")

from qasr.bench import gemv_sweep  # noqa: E402


def test_the_products_are_the_decode_steps_at_the_models_shapes():
    assert gemv_sweep.products("0.6B") == {"qkv": ("products", 4096, 1024), "o_proj": ("products", 1024, 2048),
                                           "gate_up_silu": ("gate_up_silu", 3072, 1024),
                                           "down": ("products", 1024, 3072)}
    assert gemv_sweep.products("1.7B")["gate_up_silu"] == ("gate_up_silu", 6144, 2048)


def test_the_grid_keeps_whole_reduction_blocks_and_never_splits_gate_up():
    configs = gemv_sweep.grid("products", 1024, 3072, programs=264)
    assert len(configs) == len(set(configs)) > 36
    assert all(3072 // c.split >= c.block_k for c in configs)
    # the rule's 16 and its half; not twice it (96 of reduction, less than a block)
    assert {c.split for c in configs if (c.block_n, c.block_k) == (64, 128)} == {8, 16}
    assert {c.num_warps for c in configs} == {4, 8} and {c.num_stages for c in configs} == {2, 3, 4}
    assert {c.split for c in gemv_sweep.grid("gate_up_silu", 3072, 1024, programs=264)} == {1}
