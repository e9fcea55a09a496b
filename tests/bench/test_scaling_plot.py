"""`qasr-bench stream --plot PNG --from JSON...`: the scaling curve of earlier runs."""

import json

import pytest

from qasr.bench import stream
from qasr.bench.scaling import refused, series


def run_result(clients: int, label: str | None, p95: float, *, refused_codes=(), finals=10, segments=10) -> dict:
    sessions = [{"close_code": 1000, "error": None} for _ in range(clients - len(refused_codes))]
    sessions += [{"close_code": code, "error": None if code else "server rejected WebSocket connection: HTTP 503"}
                 for code in refused_codes]
    return {
        "config": {"protocol": "native", "clients": clients, "label": label},
        "summary": {"final_latency_ms": {"n": finals, "p50": p95 / 2, "p95": p95, "p99": p95 * 1.5}},
        "totals": {"finals": finals, "segments": segments, "missing_finals": segments - finals},
        "sessions": sessions,
    }


def test_runs_group_into_lines_by_label_sorted_by_clients_with_refusals_counted():
    runs = [run_result(1000, "1 GPU", 240.0, refused_codes=(1013, None)), run_result(600, "1 GPU", 150.0),
            run_result(2000, "2 GPUs", 230.0), run_result(100, None, 50.0)]
    lines = series(runs)
    assert list(lines) == ["1 GPU", "2 GPUs", "native"]
    assert [p["clients"] for p in lines["1 GPU"]] == [600, 1000]
    assert lines["1 GPU"][1]["refused"] == 2 and lines["1 GPU"][0]["refused"] == 0
    assert lines["1 GPU"][1]["latency"] == {"p50": 120.0, "p95": 240.0, "p99": 360.0}


def test_a_refusal_is_a_1013_close_or_an_http_503_not_any_failure():
    assert refused({"close_code": 1013, "error": None})
    assert refused({"close_code": None, "error": "server rejected WebSocket connection: HTTP 503"})
    assert not refused({"close_code": 1011, "error": "internal error"})
    assert not refused({"close_code": 1000, "error": None})


def test_the_cli_draws_the_curve_from_saved_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    paths = []
    for i, run in enumerate([run_result(600, "1 GPU", 150.0), run_result(1000, "1 GPU", 400.0, refused_codes=(1013,)),
                             run_result(2000, "2 GPUs", 240.0)]):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run))
        paths.append(str(path))
    png = tmp_path / "scaling.png"
    lines = stream.main(["--plot", str(png), "--from", *paths])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(lines) == ["1 GPU", "2 GPUs"]
    out = capsys.readouterr().out
    assert "1 GPU" in out and "2 GPUs" in out and "wrote" in out


def test_from_without_plot_or_with_a_file_that_is_not_a_run_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit):
        stream.main(["--from", str(bad)])
    with pytest.raises(SystemExit, match="not a `qasr-bench stream --out` result"):
        stream.main(["--plot", str(tmp_path / "x.png"), "--from", str(bad)])
