"""gemv.py's choices, without running a kernel: the row threshold, the split arithmetic, the configs per shape.
(The kernels themselves run through Triton's interpreter in kernel_cases.py.)"""

import pytest
import torch

pytest.importorskip("triton")

from qasr.model import gemv  # noqa: E402


def test_max_rows_reads_the_environment(monkeypatch):
    monkeypatch.delenv(gemv.MAX_ROWS_ENV, raising=False)
    assert gemv.max_rows() == gemv.DEFAULT_MAX_ROWS
    monkeypatch.setenv(gemv.MAX_ROWS_ENV, "0")
    assert gemv.max_rows() == 0
    monkeypatch.setenv(gemv.MAX_ROWS_ENV, "-1")
    with pytest.raises(ValueError, match="QASR_DECODE_GEMV"):
        gemv.max_rows()


@pytest.mark.parametrize("K,block_k,split,per_split,splits", [
    (3072, 128, 16, 256, 12),  # the 0.6B down_proj: 192 rounds up to whole blocks, so 12 partial sums, not 16
    (2048, 128, 16, 128, 16),
    (1024, 128, 1, 1024, 1),
    (200, 64, 3, 128, 2),
])
def test_a_split_covers_the_reduction_in_whole_blocks(K, block_k, split, per_split, splits):
    config = gemv.GemvConfig(64, block_k, split)
    assert (config.k_per_split(K), config.splits(K)) == (per_split, splits)
    assert (config.splits(K) - 1) * per_split < K <= config.splits(K) * per_split


def test_the_cpu_takes_one_config_sized_to_the_shape_and_keeps_it():
    gemv.forget_configs()
    x = torch.zeros(2, 64)
    (only,) = gemv.candidates("linear", 151936, 64, x.device)
    assert (only.block_n, only.block_k, only.splits(64)) == (4096, 64, 1)  # few interpreted programs
    assert gemv.config_for("linear", 151936, 64, x) is gemv.config_for("linear", 151936, 64, x)
    assert "linear N=151936 K=64 float32 rows 1-32" in gemv.chosen_configs()
    gemv.forget_configs()
    assert gemv.chosen_configs() == {}
    with pytest.raises(ValueError, match="kind"):
        gemv.candidates("conv", 8, 8, x.device)


def test_split_for_stops_at_the_program_target_and_at_whole_blocks():
    assert gemv._split_for(1024, 2048, 64, 128, 264) == 16  # 16 column blocks x 16 = 256 programs
    assert gemv._split_for(4096, 1024, 64, 128, 264) == 4
    assert gemv._split_for(1024, 256, 64, 128, 264) == 2  # no split narrower than one block_k
    assert gemv._split_for(151936, 1024, 64, 128, 264) == 1


def test_row_classes_are_fixed_per_decode_bucket():
    assert [gemv.row_class(n) for n in (1, 16, 32, 33, 64, 65, 128, 129, 256, 512, 1024)] == \
        [32, 32, 32, 64, 64, 128, 128, 256, 256, 256, 256]


# the 0.6B decoder's products: qkv, o_proj, down (products), gate_up (its I), the lm_head
SHAPES_06B = [("products", 4096, 1024), ("products", 1024, 2048), ("products", 1024, 3072),
              ("gate_up_silu", 3072, 1024), ("linear", 151936, 1024)]


@pytest.fixture()
def h200(monkeypatch):
    """candidates() as on an H200 (132 SMs), on a machine without one."""
    monkeypatch.setattr(gemv, "_sm_count", lambda device: 132)
    return torch.device("cuda")


def test_up_to_32_rows_the_configs_are_session_5s(h200):
    # rows <= 32 keep the configs measured before the larger classes came: 16-row tiles, weights first, and the
    # same candidates (block_n, block_k, split) in the same order as then (the first is the untuned heuristic one)
    expected = {
        ("products", 4096, 1024): [(64, 4), (64, 1), (32, 2), (32, 1), (128, 8), (128, 2)],
        ("products", 1024, 2048): [(64, 16), (64, 4), (32, 8), (32, 2), (128, 16), (128, 4)],
        ("products", 1024, 3072): [(64, 16), (64, 4), (32, 8), (32, 2), (128, 16), (128, 4)],
        ("gate_up_silu", 3072, 1024): [(32, 1), (16, 1), (64, 1)],
        ("linear", 151936, 1024): [(64, 1), (128, 1), (32, 1)],
    }
    for (kind, N, K), widths in expected.items():
        for rows in (1, 8, 32):
            got = gemv.candidates(kind, N, K, h200, rows)
            assert [(c.block_n, c.split) for c in got] == widths, (kind, N, K)
            assert all((c.block_m, c.swap, c.block_k, c.num_warps, c.num_stages) == (16, True, 128, 4, 3) for c in got)


@pytest.mark.parametrize("kind,N,K", SHAPES_06B)
@pytest.mark.parametrize("rows", [64, 128, 256])
def test_the_larger_classes_try_a_few_tiles_that_fit_and_fill_the_gpu(h200, kind, N, K, rows):
    options = gemv.candidates(kind, N, K, h200, rows)
    assert options == gemv.candidates(kind, N, K, h200, rows - 1 if rows > 64 else 33)  # one config set per class
    assert 3 <= len(options) <= 5 and len(set(options)) == len(options)  # each is compiled and timed at first use
    assert {c.swap for c in options} == {True, False}  # both orientations
    for c in options:
        assert c.block_m in (32, 64, 128) and c.block_m <= rows and c.block_n in (32, 64, 128)
        assert c.split == 1 or kind == "products"
        assert (c.splits(K) - 1) * c.k_per_split(K) < K <= c.splits(K) * c.k_per_split(K)
        weight_tiles = 2 if kind == "gate_up_silu" else 1
        shared = (c.block_m + weight_tiles * c.block_n) * c.block_k * 2 * c.num_stages  # bf16 bytes
        assert shared <= 160 * 1024, c  # the H200 has 227 KB a block: room for Triton's own buffers
    first = options[0]  # the heuristic one (untuned): the SMs busy, or no whole block_k left to split further
    programs = -(-rows // first.block_m) * -(-N // first.block_n) * first.splits(K)
    assert programs >= 100 or first.k_per_split(K) < 2 * first.block_k, first


def test_configs_are_kept_per_row_class():
    gemv.forget_configs()
    small, large = torch.zeros(32, 64), torch.zeros(33, 64)
    a, b = gemv.config_for("products", 96, 64, small), gemv.config_for("products", 96, 64, large)
    assert (a.block_m, a.swap) == (16, True) and (b.block_m, b.swap) == (64, False)
    assert gemv.config_for("products", 96, 64, torch.zeros(1, 64)) is a
    assert gemv.config_for("products", 96, 64, torch.zeros(64, 64)) is b
    assert set(gemv.chosen_configs()) == {"products N=96 K=64 float32 rows 1-32", "products N=96 K=64 float32 rows 33-64"}
    gemv.forget_configs()
