"""The overlap probe (bench/overlap_probe.py): a decode step over a cache's slots cut into parts gives the whole
step's logits, on the CPU with the plain layer ops and with the fused kernels in Triton's interpreter (the streams and
the timing need a GPU)."""

import json
import os
import subprocess
import sys

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


# the fused kernels in a child process: Triton's interpreter must be chosen before the kernels are defined
CHILD = """
import json, sys, torch
from qasr.bench.overlap_probe import MAX_LEN, cache_parts, decode_in_parts
from qasr.model.checkpoint import load_model
from qasr.model.modeling import FusedLayerOps
model = load_model(sys.argv[1], device="cpu", dtype="float32")
rows = 4
gen = torch.Generator().manual_seed(3)
tokens = torch.randint(0, model.cfg.text.vocab_size, (rows,), generator=gen)
positions = torch.tensor([9, 9, -1, 9])
initial = [torch.randn(t.shape, generator=gen) for t in model.new_cache(rows, MAX_LEN).tensors]
logits, caches = [], []
for parts in (1, 2):
    cache = model.new_cache(rows, MAX_LEN)
    for t, values in zip(cache.tensors, initial):
        t.copy_(values)
    ops = FusedLayerOps(model.decoder.rope_table(cache.length))
    with torch.inference_mode():
        logits.append(torch.cat(decode_in_parts(model.decoder, tokens, positions, cache_parts(cache, parts), ops)))
    caches.append(cache)
print(json.dumps({"logits_max_abs": float((logits[0] - logits[1]).abs().max()),
                  "tokens_equal": bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))),
                  "cache_max_abs": max(float((a - b).abs().max()) for a, b in zip(caches[0].tensors, caches[1].tensors)),
                  "cache_written": not torch.equal(caches[0].k[0][0, :, 9], initial[0][0, :, 9])}))
"""


@pytest.mark.timeout(600)
def test_the_fused_kernels_decode_over_cache_parts_as_over_the_whole_cache(tiny_model_dir):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir)], env=env, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["logits_max_abs"] < 1e-5 and out["tokens_equal"], out
    assert out["cache_max_abs"] < 1e-5 and out["cache_written"], out
