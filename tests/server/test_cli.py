"""qasr-server's command line, and the real SIGTERM path of a served process (with the fake engine)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from qasr.server import cli
from qasr.engine import engine_process as engine_module

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like, to_s16le
from live_server import free_port


def test_options_become_limits_and_defaults():
    args = cli.build_parser().parse_args([
        "--model", "some/model", "--port", "0", "--max-sessions", "3", "--max-message-bytes", "4096",
        "--idle-timeout-s", "5", "--partial-interval-ms", "700", "--vad-aggressiveness", "3",
        "--end-silence-ms", "800", "--max-segment-s", "20", "--drain-timeout-s", "2"])
    config = cli.build_config(args)
    assert (config.host, config.port) == ("127.0.0.1", 0)
    assert (config.limits.max_sessions, config.limits.max_message_bytes, config.limits.idle_timeout_s) == (3, 4096, 5)
    assert config.stream_limits.max_segment_s == 20 and config.limits.drain_timeout_s == 2
    assert (config.defaults.partial_interval_ms, config.defaults.vad.aggressiveness,
            config.defaults.vad.end_silence_ms, config.defaults.vad.max_segment_s) == (700, 3, 800, 20)


def engine_options(*flags):
    return cli.engine_options(cli.build_parser().parse_args(["--model", "m", "--device", "cpu", *flags]))


def test_live_serving_runs_ahead_only_when_asked():
    assert engine_options().decode_run_ahead is False  # not measured live on its own yet (engine/options.py)
    assert engine_options("--decode-run-ahead").decode_run_ahead is True


def test_the_kv_cache_is_int8_only_when_asked():
    assert engine_options().kv_int8 is False
    assert engine_options("--kv-int8").kv_int8 is True


def test_prefill_products_are_fp8_only_when_asked():
    assert engine_options().fp8_prefill is False
    assert engine_options("--fp8-prefill").fp8_prefill is True
    assert engine_options().fp8_encoder is False
    assert engine_options("--fp8-encoder").fp8_encoder is True
    assert engine_options().fp8_lm_head is False
    assert engine_options("--fp8-lm-head", "--fp8-prefill").fp8_lm_head is True


@pytest.mark.parametrize("argv", [
    [], ["--model", "m", "--max-sessions", "0"], ["--model", "m", "--partial-interval-ms", "10"],
    ["--model", "m", "--vad-aggressiveness", "5"], ["--model", "m", "--port", "70000"],
    ["--model", "m", "--dtype", "int8"], ["--model", "m", "--web-root", "/nonexistent"],
])
def test_bad_options_exit_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "qasr-server" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--decode-steps-ahead", "0"), ("--rollback-tokens", "-1"),
                                         ("--slots", "0"), ("--retained-slots", "-2"), ("--max-len", "10")])
def test_a_bad_engine_flag_is_named_in_the_usage_error(flag, value, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--model", "m", flag, value])
    assert caught.value.code == 2
    assert f"{flag} must be >=" in capsys.readouterr().err


def test_sigterm_finalises_open_streams_closes_1001_and_exits_0(monkeypatch):
    fake = FakeEngine(delay_s=0.01, ready=False)
    monkeypatch.setattr(engine_module.EngineProcess, "from_pretrained", lambda model, **kwargs: fake)
    port = free_port()
    args = cli.build_parser().parse_args(["--model", "fake", "--port", str(port)])

    async def client():
        uri = f"ws://127.0.0.1:{port}/v1/stream"
        for _ in range(500):  # until the server listens and the engine is ready
            try:
                websocket = await connect(uri)
            except (OSError, InvalidStatus):  # not listening yet, or 503 while the model loads and warms up
                await asyncio.sleep(0.01)
                continue
            await websocket.send(json.dumps({"type": "start", "partials": False}))
            first = json.loads(await websocket.recv())
            if first["type"] == "ready":
                break
            await websocket.wait_closed()
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0)])
        await websocket.send(to_s16le(audio))
        assert json.loads(await websocket.recv())["type"] == "speech_started"
        os.kill(os.getpid(), signal.SIGTERM)
        rest = [json.loads(message) async for message in websocket]
        return rest, websocket.close_code

    async def main():
        served = asyncio.ensure_future(cli.serve(args, cli.build_config(args)))
        rest, code = await client()
        return await asyncio.wait_for(served, 10), rest, code

    exit_code, rest, close_code = asyncio.run(asyncio.wait_for(main(), 30))
    assert exit_code == 0 and close_code == 1001 and fake.closed
    assert [event["type"] for event in rest] == ["error", "final", "summary"]


def test_a_model_that_cannot_load_exits_1(monkeypatch):
    def fail(model, **kwargs):
        raise FileNotFoundError(f"no checkpoint at {model}")

    monkeypatch.setattr(engine_module.EngineProcess, "from_pretrained", fail)
    args = cli.build_parser().parse_args(["--model", "missing", "--port", "0"])
    assert asyncio.run(asyncio.wait_for(cli.serve(args, cli.build_config(args)), 10)) == 1


QASR_SERVER = Path(sys.executable).with_name("qasr-server")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_busy_port_is_one_line_and_exit_1(log_format):
    if not QASR_SERVER.exists():
        pytest.skip(f"the qasr-server console script is not installed beside {sys.executable} (pip install -e .)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([str(QASR_SERVER), "--model", "never-loaded", "--device", "cpu", "--port", str(port),
                               "--log-format", log_format], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    expected = f"cannot listen on 127.0.0.1:{port}: the port is in use"
    if log_format == "json":
        entry = json.loads(line)
        assert entry["level"] == "error" and entry["message"].startswith(expected)
    else:
        assert "ERROR" in line and expected in line and "Traceback" not in line


def test_help_shows_defaults_only_where_they_say_something(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert caught.value.code == 0
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--log-format {text,json}" in text and "(default: 8765)" in text


def test_admission_control_is_on_by_default_for_gpu_engines_and_off_on_the_cpu_unless_asked():
    args = cli.build_parser().parse_args(["--model", "some/model", "--device", "cpu"])
    assert cli.build_config(args).admission.enabled is False and args.admission_target_ms == 0
    args = cli.build_parser().parse_args(["--model", "some/model", "--device", "cpu", "--admission-target-ms", "80"])
    assert cli.build_config(args).admission.enabled is True and args.admission_target_ms == 80
    assert cli.default_admission_target_ms(["cuda:0", "cuda:1"], "cuda:0") == 150
    assert cli.default_admission_target_ms([None], "cuda:0") == 150
    assert cli.default_admission_target_ms([None], "cpu") == 0
    assert cli.default_admission_target_ms(["cpu", "cpu"], "cuda:0") == 0
