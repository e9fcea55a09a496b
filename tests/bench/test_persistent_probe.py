"""The persistent-kernel probe (bench/persistent_probe.py): its work split at the real shapes, and its two variants'
products on the CPU through Triton's interpreter (the timing and the multi-program barrier need a GPU)."""

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton")

from qasr.bench import persistent_probe  # noqa: E402

CHILD = """
import json, torch
from qasr.bench import persistent_probe as pp
device = torch.device("cpu")
chain = pp.Chain(pp.layer_products("tiny", programs=16, block_k=16), layers=2, device=device, block_k=16)
expected = chain.reference()
out = {"arrivals": pp.arrivals_per_program(device), "splits": [p.split for p in chain.products]}
for early in (False, True):
    chain.reset()
    chain.launch_separate(pdl=False, early=early)
    out[f"separate {early}"] = pp._agreement(chain.output(), expected)
    chain.reset()  # one program: the interpreter runs programs one after another, so more would wait forever
    chain.launch_persistent(programs=1, arrivals=out["arrivals"], early=early)
    out[f"persistent {early}"] = pp._agreement(chain.output(), expected)
    out[f"counter {early}"] = int(chain.counter.item())
out["timeouts"] = int(chain.error.item())
print(json.dumps(out))
"""


def test_each_product_is_split_until_the_grid_has_work_for_every_program():
    products = persistent_probe.layer_products("0.6B", programs=132)
    assert [(p.name, p.n, p.k) for p in products] == [("qkv", 4096, 1024), ("o_proj", 1024, 2048),
                                                       ("gate_up", 6144, 1024), ("down", 1024, 3072)]
    assert [p.split for p in products] == [1, 4, 1, 4]  # the two products of 1,024 outputs: 64 column blocks
    assert all(p.items >= 128 for p in products)


@pytest.mark.timeout(600)
def test_both_variants_compute_the_chain_of_products_in_the_interpreter():
    out = run_interpreted(CHILD)
    assert out["arrivals"] == 1
    assert max(out["splits"]) > 1  # the atomics' path runs too
    errors = {k: v for k, v in out.items() if k.startswith(("separate", "persistent"))}
    assert len(errors) == 4 and max(errors.values()) < 1e-5, errors
    assert out["counter False"] == out["counter True"] == 2 * 4  # one arrival a product a layer, the program's own
    assert out["timeouts"] == 0
