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
    assert "linear N=151936 K=64 float32" in gemv.chosen_configs()
    gemv.forget_configs()
    assert gemv.chosen_configs() == {}
    with pytest.raises(ValueError, match="kind"):
        gemv.candidates("conv", 8, 8, x.device)


def test_split_for_stops_at_the_program_target_and_at_whole_blocks():
    assert gemv._split_for(1024, 2048, 64, 128, 264) == 16  # 16 column blocks x 16 = 256 programs
    assert gemv._split_for(4096, 1024, 64, 128, 264) == 4
    assert gemv._split_for(1024, 256, 64, 128, 264) == 2  # no split narrower than one block_k
    assert gemv._split_for(151936, 1024, 64, 128, 264) == 1


def test_the_tuner_settles_near_ties_on_the_fewest_splits_then_the_earliest_candidate():
    a, b, c = (gemv.GemvConfig(block_n=n, block_k=128) for n in (64, 32, 128))
    assert gemv.settle({a: 1.02, b: 1.0, c: 1.5}) == a  # within the margin: the candidate listed first
    assert gemv.settle({a: 1.10, b: 1.0, c: 1.01}) == b  # a is clearly slower; b and c tie, b is listed first
    assert gemv.settle({a: 2.0, b: 1.5, c: 1.0}) == c
    s16, s8, s4 = (gemv.GemvConfig(block_n=64, block_k=128, split=s) for s in (16, 8, 4))
    assert gemv.settle({s16: 1.0, s8: 1.02, s4: 1.2}) == s8  # s16 and s8 tie: the fewer splits
    assert gemv.settle({s16: 1.0, s8: 1.05, s4: 1.2}) == s16  # s8 is past the margin: the fastest
    assert gemv.settle({s16: 1.01, s8: 1.0, s4: 1.0}) == s4  # all three tie


def test_the_norms_after_the_split_products_take_the_wide_warps_only_in_the_decode_buckets():
    from qasr.model import kernels

    # the decode step's buckets (the rows gemv's split-K products run on): 16 warps at the real widths
    assert kernels.NORM_WIDE_ROWS == gemv.DEFAULT_MAX_ROWS
    assert {kernels.norm_warps(rows, block) for rows in (1, 16, 32) for block in (1024, 2048)} == {16}
    # a prefill's rows keep a warp per 256 columns (16 a row cost the H200 7% of offline throughput)
    assert kernels.norm_warps(33, 1024) == 4 and kernels.norm_warps(4096, 2048) == 8
    # never none, never past Triton's 16 on small or wide rows
    assert all(1 <= kernels.norm_warps(rows, 2 ** p) <= 16 for rows in (1, 64) for p in range(0, 15))


def test_a_launch_past_one_row_tile_keeps_at_most_three_stages():
    """4 stages paid on the H200 while the rows fit one tile and lost at two (session 19): the depth follows M."""
    deep, shallow = gemv.GemvConfig(64, 128), gemv.GemvConfig(64, 128, num_stages=2)
    assert [deep.stages(M) for M in (1, gemv.BLOCK_M, gemv.BLOCK_M + 1, 32)] == [4, 4, 3, 3]
    assert [shallow.stages(M) for M in (1, 32)] == [2, 2]  # a config asking for fewer keeps them
