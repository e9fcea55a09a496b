"""The engine in its own process (`EngineProcess`): the same results as the engine in this process, errors and
cancellation across the pipe, a crashed engine process is restarted (failing only what it held) until its restart
budget is spent, close and load failures, and the real `qasr-server` command serving a stream through it."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.engine_process import EngineProcess
from qasr.engine.request import DecodeRequest, EngineClosed, EngineCrashed, Priority

from fakes import speech_like, to_s16le
from live_server import free_port
from test_engine import speech

OPTIONS = EngineOptions(num_slots=4, max_len=256, num_retained=2)
LONG = 900  # tokens: a request that decodes for a while (EOS ignored), to cancel or to be caught by a crash


def start(model_dir, options: EngineOptions = OPTIONS, **restarts) -> EngineProcess:
    return EngineProcess(str(model_dir), device="cpu", dtype="float32", options=options, **restarts)


async def decoding(model_dir, **restarts) -> tuple[EngineProcess, asyncio.Task]:
    """A started engine process that is busy decoding one LONG request."""
    engine = start(model_dir, EngineOptions(num_slots=4, max_len=1024, num_retained=0, ignore_eos=True), **restarts)
    await engine.start()
    task = asyncio.create_task(engine.transcribe(DecodeRequest(audio=speech(2.0, seed=1), max_new_tokens=LONG)))
    await until(lambda: engine.stats().get("running") == 1)
    return engine, task


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def requests() -> list[DecodeRequest]:
    finals = [DecodeRequest(audio=speech(0.6 + 0.7 * i, seed=i), max_new_tokens=6) for i in range(5)]
    partials = [DecodeRequest(audio=speech(1.5, seed=9)[: n], priority=Priority.PARTIAL, stream_id="s1",
                              max_new_tokens=4) for n in (12000, 24000)]  # the second continues the first
    return finals + partials


def test_results_equal_the_engine_in_this_process_and_errors_cross_the_pipe(tiny_model_dir, requests):
    expected = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32", options=OPTIONS)
    expected = [expected.transcribe([r])[0] for r in requests]

    async def main():
        engine = start(tiny_model_dir)
        await engine.start()
        assert engine.ready and engine.model_name == Path(tiny_model_dir).name
        try:
            together = await asyncio.gather(*(engine.transcribe(r) for r in requests[:5]))
            in_turn = [await engine.transcribe(r) for r in requests[5:]]  # the second partial reuses the first's
            with pytest.raises(ValueError, match="audio too short"):
                await engine.transcribe(DecodeRequest(audio=np.zeros(10, np.float32)))
            await engine.check_context("Names: Qasr.", language="english", max_audio_seconds=2.0)  # fits
            with pytest.raises(ValueError, match="context too long"):  # asked of the engine process
                await engine.check_context("word " * 300, language=None, max_audio_seconds=2.0)
            with pytest.raises(ValueError, match="Klingon") as refused:
                await engine.check_context("", language="Klingon", max_audio_seconds=2.0)
            assert type(refused.value) is ValueError  # not the model's subclass: the server imports no model code
            await until(lambda: engine.stats().get("streams_cached") == 1)
            engine.release_stream("s1")
            await until(lambda: engine.stats().get("streams_cached") == 0)
            stats = engine.stats()
        finally:
            await engine.close()
        return together + in_turn, stats

    results, stats = asyncio.run(main())
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    assert stats["counters"]["reused_windows"] == 0 and stats["counters"]["encoded_windows"] >= 7
    assert stats["steps"] > 0 and stats["process_cpu_seconds"] > 0 and stats["running"] == 0


def test_a_cancelled_request_frees_its_slot_and_close_fails_what_is_left(tiny_model_dir):
    async def main():
        engine, long = await decoding(tiny_model_dir)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        await until(lambda: engine.stats().get("running") == 0)
        assert engine.stats()["counters"]["decode_rows"] < LONG - 1  # dropped before its budget ran out
        left = asyncio.create_task(engine.transcribe(DecodeRequest(audio=speech(2.0, seed=2), max_new_tokens=LONG)))
        await until(lambda: engine.stats().get("running") == 1)
        await engine.close()
        with pytest.raises(EngineClosed):
            await left
        with pytest.raises(EngineClosed):
            await engine.transcribe(DecodeRequest(audio=speech(1.0, seed=3)))
        return engine

    engine = asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.pid is not None and engine._link.process.exitcode == 0 and not engine.ready and engine.error is None


def test_a_killed_engine_process_is_restarted_failing_only_what_it_held(tiny_model_dir):
    async def main():
        engine, held = await decoding(tiny_model_dir)
        first_pid = engine.pid
        engine.release_stream("never-seen")  # harmless, before and after the restart
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(EngineCrashed, match="died under this request"):
            await asyncio.wait_for(held, 10)
        assert not isinstance(held.exception(), EngineClosed)  # a stream survives this one
        assert not engine.ready and engine.error is None  # restarting: /readyz 503, /healthz 200
        # sent while it restarts: these wait for the new process instead of failing
        waiting = asyncio.create_task(engine.transcribe(DecodeRequest(audio=speech(1.0, seed=3), max_new_tokens=4)))
        checked = asyncio.create_task(engine.check_context("Names: Qasr.", language=None, max_audio_seconds=2.0))
        result = await asyncio.wait_for(waiting, 60)
        await asyncio.wait_for(checked, 10)
        engine.release_stream("never-seen")
        assert len(result.token_ids) == 4 and engine.ready and engine.error is None
        assert engine.pid not in (None, first_pid) and engine.stats()["restarts"] == 1
        await until(lambda: "steps" in engine.stats())  # the new process reports its stats
        await engine.close()
        assert not engine.ready and engine.error is None

    asyncio.run(asyncio.wait_for(main(), 120))


def test_past_its_restart_budget_the_engine_fails_and_says_so(tiny_model_dir):
    async def main():
        engine, held = await decoding(tiny_model_dir, max_restarts=0)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineCrashed, match="exit code -9"):
            await asyncio.wait_for(held, 10)
        await until(lambda: engine.error is not None)
        assert not engine.ready and isinstance(engine.error, EngineClosed)
        assert "restart budget (0 in 300 s) is spent" in str(engine.error)
        with pytest.raises(EngineClosed):
            await engine.transcribe(DecodeRequest(audio=speech(1.0, seed=3)))
        with pytest.raises(EngineClosed):
            await engine.check_context("", language=None, max_audio_seconds=2.0)
        assert engine.stats()["restarts"] == 0
        await engine.close()  # still closes cleanly

    asyncio.run(asyncio.wait_for(main(), 60))


def test_requests_waiting_for_a_restart_get_engine_closed_once_it_cannot_load(tiny_model_dir, tmp_path):
    """The replacement loads the checkpoint again: one that broke meanwhile leaves the engine failed."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)

    async def main():
        engine = start(model)
        await engine.start()
        (model / "model.safetensors").write_bytes(b"not a safetensors file")
        os.kill(engine.pid, signal.SIGKILL)
        await until(lambda: not engine.ready)
        with pytest.raises(EngineClosed, match="could not be restarted"):  # waits for the replacement, in vain
            await asyncio.wait_for(engine.transcribe(DecodeRequest(audio=speech(1.0, seed=3))), 60)
        assert isinstance(engine.error, EngineClosed)
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_a_checkpoint_that_cannot_load_raises_with_the_reason(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # the tokenizer loads, the weights do not
    with pytest.raises(RuntimeError, match="the engine process could not load .*broken: .*Error"):
        EngineProcess(str(broken), device="cpu", options=OPTIONS)


def test_the_server_side_of_the_engine_process_imports_no_torch_or_tokenizer():
    code = ("import sys, qasr.engine.engine_process; "
            "print(sorted(m for m in ('torch', 'tokenizers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_engine_process_logs_in_the_format_it_is_given(tmp_path):
    """Its logs share the server's stderr: with `--log-format json` every line the engine process writes is JSON."""
    code = ("import functools, sys; from qasr.engine.engine_process import EngineProcess; "
            "from qasr.server import logs; "
            "setup = functools.partial(logs.configure, 'info', 'json'); "
            f"EngineProcess({str(tmp_path / 'missing')!r}, device='cpu', log_setup=setup)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "could not load" in done.stderr  # the RuntimeError, in this process
    lines = [line for line in done.stderr.splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    loaded = [e for e in entries if e["logger"] == "qasr.engine.engine_process" and "cannot load" in e["message"]]
    assert len(loaded) == 1 and loaded[0]["level"] == "error" and "Traceback" in loaded[0]["error"]


def test_qasr_server_serves_through_its_engine_process_and_sigterm_stops_both(tiny_model_dir):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "qasr.server.cli", "--model", str(tiny_model_dir), "--device", "cpu", "--port",
         str(port), "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    async def client():
        uri = f"ws://127.0.0.1:{port}/v1/stream"
        for _ in range(600):  # until the server listens and the engine process is ready
            try:
                websocket = await connect(uri)
            except (OSError, InvalidStatus):  # not listening yet, or 503 while the model loads and warms up
                await asyncio.sleep(0.1)
                continue
            try:
                await websocket.send(json.dumps({"type": "start", "partials": False}))
                if json.loads(await websocket.recv())["type"] == "ready":
                    break
            except ConnectionClosed:  # 1013: the model is still loading
                pass
            await asyncio.sleep(0.1)
        audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 1.0), ("speech", 0.8)])
        await websocket.send(to_s16le(audio))
        await websocket.send(json.dumps({"type": "end"}))
        return [json.loads(message) async for message in websocket], websocket.close_code

    try:
        events, close_code = asyncio.run(asyncio.wait_for(client(), 120))
        engine_pids = [pid for children in Path(f"/proc/{server.pid}/task").glob("*/children")
                       for pid in children.read_text().split()]
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(30)
    finally:
        server.kill()
        output = server.communicate()[0].decode()
    kinds = [event["type"] for event in events]
    assert close_code == 1000 and kinds.count("final") == 2 and kinds[-1] == "summary", (kinds, output)
    assert exit_code == 0, output
    assert len(engine_pids) >= 1  # the engine (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in engine_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(pid) for pid in engine_pids)


def running(pid: str) -> bool:
    """Alive and not a zombie (an exited child no one reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_an_engine_process_for_one_gpu_sees_only_that_gpu(monkeypatch):
    from qasr.engine.engine_process import only_this_gpu

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert only_this_gpu("cuda:1") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the operator's own choice: cuda:1 is the second of those
    assert only_this_gpu("cuda:1") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(ValueError, match="only 2 GPUs are visible"):
        only_this_gpu("cuda:2")
    for other in (None, "cpu", "cuda"):  # no index: the process keeps what it was given
        assert only_this_gpu(other) == other
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
