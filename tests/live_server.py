"""A qasr server for end-to-end client tests: in the test's own event loop (`serving`), or on a thread of its own
(`ThreadedServer`) so that blocking clients (qasr-mic's asyncio.run, a subprocess, a browser) can talk to it.

Speech for the tests: `spoken_wav` writes espeak-ng utterances separated by pauses, with the true position of
each utterance (or skips when espeak-ng is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from qasr.server.app import QasrServer, ServerConfig
from qasr.server.auth import Authenticator, KeyStore
from qasr.server.limits import ServerLimits
from qasr.server.security import SecuritySettings
from qasr.streaming.settings import StreamLimits, StreamSettings

REPO = Path(__file__).resolve().parents[1]
WEB_ROOT = REPO / "web"


def real_engine(model_dir: Path):
    """The eager CPU engine on a (tiny) checkpoint."""
    from qasr.engine.engine import AsyncEngine

    return AsyncEngine.from_pretrained(str(model_dir), device="cpu", dtype="float32")


def requiring_key(key: str) -> SecuritySettings:
    """Security for a server whose streams need `key` (as $QASR_API_KEYS would give it); tokens from its
    POST /v1/tokens are signed with a secret of its own."""
    return SecuritySettings(auth=Authenticator(KeyStore.load(None, key), required=True))


def free_port() -> int:
    """A TCP port nothing listens on now (for a server started as a process of its own)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def is_ready(port: int) -> bool:
    """Whether a qasr-server on `port` answers /readyz with 200 (listening, model loaded and warmed up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def server_process(*args: str, ready_timeout: float = 240):
    """`qasr-server --port P ARGS` as a process of its own, once /readyz says ready -> its port P. A server that
    exits or is not ready in time fails the test with what it printed; on leaving it gets stop_process. Its output
    goes to a file, not a pipe nobody reads (a full pipe would block a long-lived server's logging)."""
    port = free_port()
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen([sys.executable, "-m", "qasr.server.cli", "--port", str(port), *args],
                                  stdout=output, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout
            while not is_ready(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    server.wait()
                    output.seek(0)
                    pytest.fail(f"qasr-server {' '.join(args)} did not become ready:\n" + output.read().decode())
                time.sleep(0.5)
            yield port
        finally:
            stop_process(server)


def stream_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/stream"


@contextlib.asynccontextmanager
async def serving(engine, *, port: int = 0, web_root: Path | None = None, start_engine: bool = True,
                  security: SecuritySettings = SecuritySettings(), **limits):
    """A started server in the running loop (and its engine, unless the test decides when it is ready); stopped
    (the SIGTERM path) on exit. `security`: e.g. `requiring_key(KEY)` for a server that needs an API key."""
    config = ServerConfig(port=port, limits=ServerLimits(**limits), web_root=web_root, ping_interval_s=None,
                          security=security)
    server = QasrServer(engine, config)
    await server.start()
    if start_engine:
        await engine.start()
    try:
        yield server
    finally:
        await server.stop()


def abort_connections(server: QasrServer) -> None:
    """Drop every open stream's TCP connection without a close frame, as if the server process died."""
    for connection in list(server.connections):
        connection.websocket.transport.abort()


class ThreadedServer:
    """A QasrServer on its own thread and event loop. `engine_factory` runs on that loop."""

    def __init__(self, engine_factory: Callable[[], object], *, port: int = 0, web_root: Path | None = None,
                 defaults: StreamSettings = StreamSettings(), security: SecuritySettings = SecuritySettings(),
                 stream_limits: StreamLimits = StreamLimits(), **limits):
        self.engine_factory = engine_factory
        self.port = port
        self.web_root = web_root
        self.defaults = defaults
        self.stream_limits = stream_limits  # e.g. StreamLimits(word_times=True): the engine can time words
        self.security = security
        self.limits = limits
        self.server: QasrServer | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="qasr-test-server", daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        self.call(self._start(), timeout=60)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def _start(self) -> None:
        engine = self.engine_factory()
        config = ServerConfig(port=self.port, limits=ServerLimits(**self.limits), defaults=self.defaults,
                              stream_limits=self.stream_limits, web_root=self.web_root, ping_interval_s=None,
                              security=self.security)
        self.server = QasrServer(engine, config)
        await self.server.start()
        await engine.start()
        self.port = self.server.port

    @property
    def url(self) -> str:
        return stream_url(self.port)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def num_connections(self) -> int:
        return len(self.server.connections) if self.server is not None else 0

    def audio_seconds_received(self) -> float:
        """Audio the server has taken in from all streams so far (its qasr_audio_seconds_total)."""
        if self.server is None:
            return 0.0
        return self.server.metrics.registry.get_sample_value("qasr_audio_seconds_total") or 0.0

    def stop(self) -> None:
        """The SIGTERM path: open streams get their finals, then close 1001."""
        if self.server is not None:
            self.call(self.server.stop())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def spoken_wav(path: Path, sentences: list[str], *, lead_s: float = 0.5, pause_s: float = 1.0,
               tail_s: float = 1.0, sample_rate: int = 16000) -> list[tuple[float, float]]:
    """espeak-ng speaks each sentence; they are joined with `pause_s` of quiet room noise into a 16-bit WAV.
    Returns the true (start, end) seconds of each utterance."""
    import soundfile
    import soxr

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    rng = np.random.default_rng(0)
    pieces, truth, position = [np.zeros(int(lead_s * sample_rate), np.float32)], [], lead_s
    for index, sentence in enumerate(sentences):
        raw = subprocess.run([espeak, "--stdout", sentence], check=True, capture_output=True).stdout
        speech, rate = soundfile.read(io.BytesIO(raw), dtype="float32")
        speech = soxr.resample(speech, rate, sample_rate).astype(np.float32)
        speech = _trim_silence(speech)
        truth.append((position, position + len(speech) / sample_rate))
        pause = pause_s if index < len(sentences) - 1 else tail_s
        pieces += [speech, np.zeros(int(pause * sample_rate), np.float32)]
        position += len(speech) / sample_rate + pause
    audio = np.concatenate(pieces)
    audio += rng.normal(0.0, 3e-4, len(audio)).astype(np.float32)  # a real room is never digital zero
    soundfile.write(str(path), audio, sample_rate, subtype="PCM_16")
    return truth


def _trim_silence(speech: np.ndarray, threshold: float = 1e-3) -> np.ndarray:
    voiced = np.flatnonzero(np.abs(speech) > threshold)
    return speech[voiced[0]:voiced[-1] + 1] if len(voiced) else speech
