"""host_speed: the figures that let a GPU run be read beside the speed of the host that made it."""

import json

import pytest

pytest.importorskip("torch")

from qasr.bench.host_speed import main, measure  # noqa: E402


def test_measure_times_python_dispatch_and_launch_on_the_cpu():
    import torch

    r = measure(torch.device("cpu"), calls=200)
    assert r["device"] == "cpu" and r["cpu_threads"] >= 1
    for key in ("python_loop_ms", "dispatch_us", "launch_us"):
        assert 0 < r[key] < 10_000, (key, r[key])  # measured, and not absurd on any host


def test_main_prints_one_line_or_json(capsys):
    main(["--device", "cpu"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("host speed: python loop ") and "\n" not in line
    main(["--device", "cpu", "--json"])
    assert set(json.loads(capsys.readouterr().out)) >= {"python_loop_ms", "dispatch_us", "launch_us"}
