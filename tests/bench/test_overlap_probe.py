"""The overlap probe (bench/overlap_probe.py): a decode step over a cache's slots cut into parts gives the whole
step's logits, on the CPU with the plain layer ops (the streams and the timing need a GPU)."""

import pytest
import torch

from qasr.bench.overlap_probe import MAX_LEN, cache_parts, decode_in_parts
from qasr.model.checkpoint import load_model
from qasr.model.modeling import PlainLayerOps


def test_a_step_over_the_cache_in_parts_gives_the_whole_steps_logits_and_writes_the_same_cells(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    rows, context = 8, 11
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.cfg.text.vocab_size, (rows,), generator=gen)
    positions = torch.full((rows,), context, dtype=torch.long)
    positions[5] = -1  # an idle row in the second part
    fill = torch.Generator().manual_seed(4)
    initial = [torch.randn(t.shape, generator=fill) for t in model.new_cache(rows, MAX_LEN).tensors]
    caches = []
    for _ in range(2):
        cache = model.new_cache(rows, MAX_LEN)
        for t, values in zip(cache.tensors, initial):
            t.copy_(values)
        caches.append(cache)
    whole_cache, parted_cache = caches
    with torch.inference_mode():
        whole = model.decoder.decode_greedy(tokens, positions, whole_cache, PlainLayerOps())[0]
        parts = decode_in_parts(model.decoder, tokens, positions, cache_parts(parted_cache, 2), PlainLayerOps())
    assert [p.shape[0] for p in parts] == [4, 4]
    # float32 products over 4 rows and over 8 may round differently on the CPU: close, and the same tokens
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat(parts).argmax(-1), whole.argmax(-1))
    # each part wrote its own rows' slots at `context`, as the whole step did, and nothing else
    live = positions >= 0
    assert not torch.allclose(whole_cache.k[0][live, :, context], initial[0][live, :, context])
    for a, b in zip(whole_cache.tensors, parted_cache.tensors):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

def test_parts_must_split_the_slots_evenly(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="equal parts"):
        cache_parts(model.new_cache(6, MAX_LEN), 4)
