"""profile_decode's step by place: a step's kernels told apart by their place in a layer."""

from types import SimpleNamespace

from qasr.bench.profile_decode import places


def event(name: str, start: float, us: float):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, elapsed_us=lambda: us))


def test_each_place_of_a_layer_is_averaged_over_the_layers_and_the_replays():
    layer = [("norm", 1.0), ("gemv", 4.0), ("attention", 3.0), ("gemv", 2.0)]
    events, t = [], 0.0
    for replay in range(2):
        events.append(event("begin", t, 2.0 + replay))
        for i in range(3):  # three layers, the first product slower in layer 1
            for name, us in layer:
                events.append(event(name, t, us + (6.0 if (i, name, us) == (1, "gemv", 4.0) else 0.0)))
        events += [event("lm_head", t, 10.0), event("advance", t, 1.0)]
    got = places(events, replays=2, layers=3)
    assert got["kernels_per_step"] == 15
    assert got["before"] == [("begin", 2.5)]
    assert got["layer"] == [("norm", 1.0), ("gemv", 6.0), ("attention", 3.0), ("gemv", 2.0)]
    assert got["after"] == [("lm_head", 10.0), ("advance", 1.0)]
    assert got["sum_us"] == 2.5 + 3 * 10.0 + 6.0 + 11.0


def test_a_step_that_does_not_split_into_layers_is_reported_by_count_only():
    events = [event("k", 0.0, 1.0) for _ in range(7)]
    assert places(events, replays=1, layers=8) == {"kernels_per_step": 7, "sum_us": 7.0}
