"""The overlap probe (bench/overlap_probe.py): a decode step over a cache's slots cut into parts gives the whole
step's logits, on the CPU with the plain layer ops and with the fused kernels in Triton's interpreter (the streams and
the timing need a GPU)."""

import os

import pytest
import torch
from interpreted import run_interpreted

from qasr.bench.cli import OFFLINE_MAX_LEN
from qasr.bench.overlap_probe import cache_parts, decode_in_parts
from qasr.model.checkpoint import load_model
from qasr.model.modeling import PlainLayerOps

CONTEXT = 9  # the live rows' position


def whole_and_parts(model, make_ops, rows: int, parts: int) -> dict:
    """One decode step over `rows` rows (row 2 idle), whole and in `parts` parts, each on its own copy of one random
    cache -> both steps' logits and caches, and the cache before them."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.cfg.text.vocab_size, (rows,), generator=gen)
    positions = torch.full((rows,), CONTEXT, dtype=torch.long)
    positions[2] = -1
    initial = [torch.randn(t.shape, generator=gen) for t in model.new_cache(rows, OFFLINE_MAX_LEN).tensors]
    out = {"initial": initial, "live": positions >= 0}
    for name, n in (("whole", 1), ("parts", parts)):
        cache = model.new_cache(rows, OFFLINE_MAX_LEN)
        for t, values in zip(cache.tensors, initial):
            t.copy_(values)
        with torch.inference_mode():
            logits = decode_in_parts(model.decoder, tokens, positions, cache_parts(cache, n), make_ops(cache))
        out[name] = torch.cat(logits), cache
        out[f"{name} rows a part"] = [part.shape[0] for part in logits]
    return out


def test_a_step_over_the_cache_in_parts_gives_the_whole_steps_logits_and_writes_the_same_cells(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    out = whole_and_parts(model, lambda cache: PlainLayerOps(), rows=8, parts=2)
    (whole, whole_cache), (parts, parted_cache) = out["whole"], out["parts"]
    assert out["parts rows a part"] == [4, 4]
    # float32 products over 4 rows and over 8 may round differently on the CPU: close, and the same tokens
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(parts.argmax(-1), whole.argmax(-1))
    # each part wrote its own rows' slots at CONTEXT, as the whole step did, and nothing else
    live = out["live"]
    assert not torch.allclose(whole_cache.k[0][live, :, CONTEXT], out["initial"][0][live, :, CONTEXT])
    for a, b in zip(whole_cache.tensors, parted_cache.tensors):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_parts_must_split_the_slots_evenly(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="equal parts"):
        cache_parts(model.new_cache(6, OFFLINE_MAX_LEN), 4)


# the fused kernels in a child process: Triton's interpreter must be chosen before the kernels are defined
CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from test_overlap_probe import CONTEXT, whole_and_parts
from qasr.model.checkpoint import load_model
from qasr.model.modeling import FusedLayerOps
model = load_model(sys.argv[1], device="cpu", dtype="float32")
out = whole_and_parts(model, lambda cache: FusedLayerOps(model.decoder.rope_table(cache.length)), rows=4, parts=2)
(whole, whole_cache), (parts, parted_cache) = out["whole"], out["parts"]
print(json.dumps({"logits_max_abs": float((whole - parts).abs().max()),
                  "tokens_equal": bool(torch.equal(whole.argmax(-1), parts.argmax(-1))),
                  "cache_max_abs": max(float((a - b).abs().max())
                                       for a, b in zip(whole_cache.tensors, parted_cache.tensors)),
                  "cache_written": not torch.equal(whole_cache.k[0][0, :, CONTEXT], out["initial"][0][0, :, CONTEXT])}))
"""


@pytest.mark.timeout(600)
def test_the_fused_kernels_decode_over_cache_parts_as_over_the_whole_cache(tiny_model_dir):
    pytest.importorskip("triton")
    out = run_interpreted(CHILD, str(tiny_model_dir), os.path.dirname(__file__))
    assert out["logits_max_abs"] < 1e-5 and out["tokens_equal"], out
    assert out["cache_max_abs"] < 1e-5 and out["cache_written"], out
