"""profile_decode's step by place: a step's kernels told apart by their place in a layer."""

from types import SimpleNamespace

from qasr.bench.profile_decode import places


def event(name: str, start: float, us: float):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, elapsed_us=lambda: us))


def step_events(replays: int, layer: list[tuple[str, float]], layers: int = 3) -> list:
    """`replays` steps: begin, `layers` x `layer` (the first product 6 us slower in layer 1), lm_head, advance."""
    names = []
    for replay in range(replays):
        names.append(("begin", 2.0 + replay))
        for i in range(layers):
            names += [(name, us + (6.0 if (i, name, us) == (1, "gemv", 4.0) else 0.0)) for name, us in layer]
        names += [("lm_head", 10.0), ("advance", 1.0)]
    return [event(name, float(t), us) for t, (name, us) in enumerate(names)]


LAYER = [("norm", 1.0), ("gemv", 4.0), ("attention", 3.0), ("gemv", 2.0)]


def test_each_place_of_a_layer_is_averaged_over_the_layers_and_the_replays():
    events = step_events(2, LAYER)
    got = places(events, replays=2, layers=3)
    assert got["kernels_per_step"] == 15
    assert got["before"] == [("begin", 2.5)]
    assert got["layer"] == [("norm", 1.0), ("gemv", 6.0), ("attention", 3.0), ("gemv", 2.0)]
    assert got["after"] == [("lm_head", 10.0), ("advance", 1.0)]
    assert got["sum_us"] == 2.5 + 3 * 10.0 + 6.0 + 11.0


def test_a_step_that_does_not_split_into_layers_is_reported_by_count_only():
    assert places([event("k", 0.0, 1.0) for _ in range(7)], replays=1, layers=8) == {"kernels_per_step": 7,
                                                                                    "sum_us": 7.0}
    assert places([], replays=20, layers=28) == {"kernels_per_step": 0, "sum_us": 0.0}
    odd = step_events(1, LAYER)
    odd[5] = event("copy", odd[5].time_range.start, 1.0)  # layer 1 runs another kernel at place 0
    assert set(places(odd, replays=1, layers=3)) == {"kernels_per_step", "sum_us"}
