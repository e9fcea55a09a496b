"""Audio sources: files as chunks (paced or not), and the microphone through the real sounddevice/PortAudio on a
PulseAudio null sink: qasr-mic records its monitor while paplay plays speech-like bursts into it. The PulseAudio
test skips, saying why, where pulseaudio/paplay/PortAudio are not installed or the daemon cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from qasr.client import AudioSourceError, file_source

# tests/ is on sys.path (tests/conftest.py)
from fakes import FakeEngine, speech_like
from live_server import ThreadedServer, stop_process, wait_until


async def chunks_of(source) -> list[np.ndarray]:
    return [chunk async for chunk in source]


def test_a_file_is_handed_out_in_chunks_at_its_own_rate_as_mono(tmp_path):
    rng = np.random.default_rng(0)
    stereo = rng.uniform(-0.5, 0.5, (44100, 2)).astype(np.float32)
    soundfile.write(str(tmp_path / "stereo.wav"), stereo, 44100, subtype="FLOAT")
    source = file_source(tmp_path / "stereo.wav", realtime=False, chunk_ms=100)
    assert (source.sample_rate, source.channels, source.duration_s) == (44100, 1, 1.0)
    chunks = asyncio.run(chunks_of(source))
    assert [len(chunk) for chunk in chunks] == [4410] * 10
    assert np.allclose(np.concatenate(chunks), stereo.mean(axis=1), atol=1e-6)


def test_a_realtime_file_is_paced_against_the_clock(tmp_path):
    soundfile.write(str(tmp_path / "a.wav"), np.zeros(8000, np.float32), 16000)  # 0.5 s

    async def timed(speed):
        loop = asyncio.get_running_loop()
        started = loop.time()
        await chunks_of(file_source(tmp_path / "a.wav", speed=speed))
        return loop.time() - started

    assert asyncio.run(timed(1.0)) >= 0.5  # a chunk is handed out once it would have been spoken
    assert asyncio.run(timed(10.0)) >= 0.05


def test_file_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(AudioSourceError, match="cannot read audio"):
        file_source(tmp_path / "missing.wav")
    (tmp_path / "text.wav").write_text("not audio")
    with pytest.raises(AudioSourceError, match="cannot read audio"):
        file_source(tmp_path / "text.wav")
    with pytest.raises(ValueError, match="speed"):
        file_source(tmp_path / "text.wav", speed=0)


# -- a real microphone: PulseAudio's null sink monitor -----------------------------------------------------------


@pytest.fixture
def pulseaudio(tmp_path_factory):
    """A private PulseAudio daemon with a null sink whose monitor is the default source; yields the environment
    that points clients at it."""
    for tool in ("pulseaudio", "paplay", "pactl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian: apt-get install pulseaudio pulseaudio-utils "
                        "libportaudio2)")
    runtime = tmp_path_factory.mktemp("pulse")
    socket_path = runtime / "native"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PULSE_SERVER": f"unix:{socket_path}",
           "HOME": str(runtime)}
    daemon = subprocess.Popen(
        ["pulseaudio", "--daemonize=no", "-n", "--exit-idle-time=-1", "--use-pid-file=no", "--log-target=stderr",
         f"--load=module-native-protocol-unix auth-anonymous=1 socket={socket_path}",
         "--load=module-null-sink sink_name=virtual_speaker rate=16000 channels=1",
         "--load=module-always-sink"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"PulseAudio cannot run here: {daemon.communicate(timeout=5)[1][-500:]!r}")
            time.sleep(0.1)
        subprocess.run(["pactl", "set-default-source", "virtual_speaker.monitor"], env=env, check=True)
        probe = subprocess.run([sys.executable, "-c", "import sounddevice as sd; sd.query_devices(None, 'input')"],
                               env=env, capture_output=True, text=True)
        if probe.returncode != 0:
            why = (probe.stderr.strip().splitlines() or ["no reason given"])[-1]
            pytest.skip(f"PortAudio sees no input through PulseAudio: {why}")
        yield env
    finally:
        stop_process(daemon, timeout=5)


def test_qasr_mic_transcribes_what_the_virtual_microphone_hears(pulseaudio, tmp_path):
    bursts = [("silence", 0.5), ("speech", 1.2), ("silence", 1.0), ("speech", 0.8), ("silence", 1.0)]
    audio, _ = speech_like(bursts)
    soundfile.write(str(tmp_path / "bursts.wav"), audio, 16000, subtype="PCM_16")
    qasr_mic = Path(sys.executable).with_name("qasr-mic")
    with ThreadedServer(lambda: FakeEngine(delay_s=0.005)) as server:
        mic = subprocess.Popen([str(qasr_mic), "--url", server.url, "--no-partials"], env=pulseaudio,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Play only once the microphone's audio reaches the server: qasr-mic opens the input after it connects,
            # and on a loaded host PortAudio's stream can start after a burst began (a CI run lost the first one).
            wait_until(lambda: server.audio_seconds_received() >= 0.2 or mic.poll() is not None, timeout=30)
            assert mic.poll() is None, mic.communicate()[1]
            subprocess.run(["paplay", "--device=virtual_speaker", str(tmp_path / "bursts.wav")], env=pulseaudio,
                           check=True, timeout=20)
            finals = lambda: sum(call.request.priority.name == "FINAL" for call in server.server.engine.calls)  # noqa: E731
            with contextlib.suppress(AssertionError):  # too few finals: the assertions below show what qasr-mic said
                wait_until(lambda: finals() >= 2 or mic.poll() is not None, timeout=30)
            mic.send_signal(signal.SIGINT)
            stdout, stderr = mic.communicate(timeout=20)
        finally:
            mic.kill()
    assert mic.returncode == 0, stderr
    finals = [line for line in stdout.splitlines() if line.startswith("[")]
    assert len(finals) == 2, (stdout, stderr)
    for line, seconds in zip(finals, [1.2, 0.8]):  # the fake engine's text is the length of what it heard
        heard = float(line.split("] ")[1].rstrip("s"))
        assert heard == pytest.approx(seconds + 0.3, abs=0.25)  # + the 300 ms pre-roll
    assert "listening; Ctrl-C to stop" in stderr and "Traceback" not in stderr
