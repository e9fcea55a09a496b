"""A decode step cut into parts of rows (runner.DECODE_PARTS_ENV, #16): on a GPU the parts run on forked CUDA streams,
one part's products beside another's attention; on the CPU one after another. Either way each part decodes its rows
over its own slots of the one KV cache, so a step in parts must give the whole step's tokens, state and cache."""

import pytest
import torch

from qasr.engine.runner import DECODE_PART_MIN_ROWS, DECODE_PARTS_ENV, ModelRunner
from qasr.model.checkpoint import load_model
from qasr.model.modeling import KVCache

SLOTS = 4 * DECODE_PART_MIN_ROWS


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def make_runner(model, monkeypatch, parts: int | None) -> ModelRunner:
    if parts is None:
        monkeypatch.delenv(DECODE_PARTS_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_PARTS_ENV, str(parts))
    runner = ModelRunner(model, num_slots=SLOTS, max_len=64, cuda_graphs=False, fused_kernels=False, eos_ids=(5,))
    g = torch.Generator().manual_seed(11)
    for t in runner.cache.tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    runner.tokens.copy_(torch.randint(0, model.cfg.text.vocab_size, (SLOTS,), generator=g))
    runner.positions.copy_(torch.randint(-1, 40, (SLOTS,), generator=g))  # -1: idle rows
    runner.counts.copy_(torch.randint(0, 4, (SLOTS,), generator=g))
    runner.budgets.copy_(torch.randint(3, 12, (SLOTS,), generator=g))  # some rows finish on theirs
    return runner


def decoded(runner: ModelRunner, rows: int, steps: int) -> list[torch.Tensor]:
    outs = [runner.decode(rows).clone() for _ in range(steps)]
    return outs + [runner.tokens, runner.positions, runner.counts, *runner.cache.tensors]


def test_the_step_is_cut_only_where_every_part_keeps_its_minimum_rows(model, monkeypatch):
    assert make_runner(model, monkeypatch, None).decode_parts == 1
    runner = make_runner(model, monkeypatch, 2)
    assert [runner.parts_for(B) for B in (1, 32, 64, 128, 256)] == [1, 1, 1, 2, 2]
    runner = make_runner(model, monkeypatch, 4)
    assert [runner.parts_for(B) for B in (128, 256)] == [1, 4]
    monkeypatch.setenv(DECODE_PARTS_ENV, "0")
    with pytest.raises(ValueError, match=DECODE_PARTS_ENV):
        ModelRunner(model, num_slots=8, max_len=64, cuda_graphs=False)


@pytest.mark.parametrize("parts, rows", [(2, 2 * DECODE_PART_MIN_ROWS), (2, SLOTS), (4, SLOTS), (4, SLOTS - 9)])
def test_a_step_in_parts_gives_the_whole_steps_tokens_state_and_cache(model, monkeypatch, parts, rows):
    whole = decoded(make_runner(model, monkeypatch, None), rows, steps=3)
    runner = make_runner(model, monkeypatch, parts)
    calls = []
    decode_greedy = runner.model.decoder.decode_greedy
    monkeypatch.setattr(runner.model.decoder, "decode_greedy",
                        lambda tokens, *a: calls.append(len(tokens)) or decode_greedy(tokens, *a))
    in_parts = decoded(runner, rows, steps=3)
    bucket = runner.bucket_for(rows)
    assert calls == [bucket // parts] * parts * 3  # it did run in parts, each over its share of the bucket
    assert all(torch.equal(a, b) for a, b in zip(whole, in_parts))
    tokens = torch.stack(whole[:3])[:, 0]
    assert (tokens >= 0).any() and (tokens == -1).any() and len(set(tokens[tokens >= 0].tolist())) > 10


def test_a_part_over_the_wrong_slots_is_seen(model, monkeypatch):
    # the comparison above can fail: parts decoding over each other's slots give other tokens
    whole = decoded(make_runner(model, monkeypatch, None), SLOTS, steps=1)
    runner = make_runner(model, monkeypatch, 2)
    cache = runner.cache
    monkeypatch.setattr(cache, "slot_range", lambda start, stop: KVCache.slot_range(
        cache, stop % SLOTS, stop % SLOTS + stop - start))
    shifted = decoded(runner, SLOTS, steps=1)
    assert not torch.equal(whole[0], shifted[0])
