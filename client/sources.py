"""Audio sources for `stream_audio`: async iterables of float32 numpy chunks with `sample_rate` and `channels`.

- `file_source(path)`: a file (anything libsndfile reads) as mono chunks at the file's own rate, paced in real time
  (or `speed` times faster, or as fast as the server takes it); the server resamples.
- `microphone_source(device)`: a sounddevice (PortAudio) input stream; its callback thread hands blocks to the
  event loop through a bounded buffer that drops the oldest audio, never blocks the audio thread.

Any async iterable of chunks works as a source; these two are what qasr-mic uses.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from qasr.client.errors import AudioSourceError

log = logging.getLogger(__name__)


class FileSource:
    """A whole audio file, read once, handed out in `chunk_ms` pieces. See file_source()."""

    def __init__(self, path: str | os.PathLike, *, realtime: bool = True, speed: float = 1.0, chunk_ms: int = 100):
        import soundfile

        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if chunk_ms <= 0:
            raise ValueError(f"chunk_ms must be > 0, got {chunk_ms}")
        try:
            data, self.sample_rate = soundfile.read(os.fspath(path), dtype="float32", always_2d=True)
        except (OSError, RuntimeError, soundfile.SoundFileError) as error:
            raise AudioSourceError(f"cannot read audio from {path}: {error}") from None
        if data.size == 0:
            raise AudioSourceError(f"{path} contains no audio")
        self.samples = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]  # [n] mono
        self.channels = 1
        self.realtime = realtime
        self.speed = speed
        self.chunk_samples = max(1, self.sample_rate * chunk_ms // 1000)

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for offset in range(0, len(self.samples), self.chunk_samples):
            chunk = self.samples[offset:offset + self.chunk_samples]
            if self.realtime:  # a chunk exists once its last sample was "spoken", as from a microphone
                due = started + (offset + len(chunk)) / self.sample_rate / self.speed
                await asyncio.sleep(max(0.0, due - loop.time()))  # against the clock: no drift
            yield chunk


def file_source(path: str | os.PathLike, realtime: bool = True, speed: float = 1.0, chunk_ms: int = 100) -> FileSource:
    """Stream a file: in real time (`speed` 1), `speed` times faster, or (`realtime=False`) as fast as the server
    reads it. Raises AudioSourceError when the file cannot be read."""
    return FileSource(path, realtime=realtime, speed=speed, chunk_ms=chunk_ms)


@dataclass(frozen=True)
class InputDevice:
    index: int  # PortAudio device number (qasr-mic --device N)
    name: str
    channels: int  # max input channels
    default_sample_rate: float
    is_default: bool


def list_input_devices() -> list[InputDevice]:
    """The devices that can record. Raises AudioSourceError when PortAudio is missing."""
    sd = _sounddevice()
    try:
        devices = sd.query_devices()
        default_input = sd.default.device[0]
    except sd.PortAudioError as error:
        raise AudioSourceError(f"cannot list audio devices: {error}") from None
    return [InputDevice(index, device["name"], device["max_input_channels"], device["default_samplerate"],
                        index == default_input)
            for index, device in enumerate(devices) if device["max_input_channels"] > 0]


class MicrophoneSource:
    """Blocks from a sounddevice InputStream, opened when iteration starts and closed when it ends.

    The PortAudio callback runs on its own thread: it only copies the block and schedules it onto the event loop.
    If the consumer falls behind by more than `max_buffer_s`, the oldest blocks are dropped so memory stays bounded
    and the stream stays live; never silently: the first drop logs a warning (logger `qasr.client.sources`), the
    totals are in `dropped_blocks` and `dropped_s`, and `stream_audio` yields an `AudioDropped` event with the
    seconds lost so far after the next server event once the total grows.
    """

    def __init__(self, device: int | str | None = None, *, sample_rate: int | None = 16000, channels: int = 1,
                 chunk_ms: int = 100, max_buffer_s: float = 30.0):
        self._sd = _sounddevice()
        self.device = device
        self.device_info = self._input_device(device)
        self.sample_rate = self._pick_rate(sample_rate, channels)
        self.channels = channels
        self.blocksize = max(1, self.sample_rate * chunk_ms // 1000)
        self.max_blocks = max(1, int(max_buffer_s * 1000 // chunk_ms))
        self.dropped_blocks = 0
        self.dropped_s = 0.0  # audio dropped in all, in seconds (see the class docstring)
        self.overflows = 0  # PortAudio's own input overflows (the callback was late)
        self._stream = None
        self._capture_stopped = False
        self._wake: asyncio.Event | None = None

    async def stop_capture(self) -> None:
        """Stop recording: iteration then yields the blocks already captured and ends, so nothing recorded is lost
        (AudioStream.stop() calls this)."""
        if self._capture_stopped:
            return
        self._capture_stopped = True
        if self._stream is not None:  # PortAudio hands over the blocks it holds before stop() returns
            await asyncio.to_thread(self._stream.stop)
        if self._wake is not None:
            self._wake.set()

    def _input_device(self, device) -> dict:
        sd = self._sd
        try:
            return sd.query_devices(device, "input")
        except (ValueError, sd.PortAudioError) as error:
            if device is None:
                raise AudioSourceError(f"no microphone found ({error}): connect one, or pick one with --device "
                                       "(see --list-devices)") from None
            raise AudioSourceError(f"cannot use input device {device!r}: {error} (see --list-devices)") from None

    def _pick_rate(self, wanted: int | None, channels: int) -> int:
        """16 kHz if the device takes it (no resampling anywhere), else the device's own rate (the server
        resamples)."""
        sd = self._sd
        fallback = int(self.device_info["default_samplerate"])
        for rate in ([wanted] if wanted else []) + [fallback]:
            try:
                sd.check_input_settings(self.device, channels=channels, dtype="float32", samplerate=rate)
                return rate
            except (ValueError, sd.PortAudioError):
                continue
        raise AudioSourceError(f"input device {self.device_info['name']!r} cannot record {channels} channel(s) at "
                               f"{wanted or fallback} Hz or its default {fallback} Hz")

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        loop = asyncio.get_running_loop()
        blocks: collections.deque[np.ndarray] = collections.deque()
        arrived = self._wake = asyncio.Event()

        def push(block: np.ndarray) -> None:  # on the event loop
            if len(blocks) >= self.max_blocks:
                dropped = blocks.popleft()
                if self.dropped_blocks == 0:
                    log.warning("the stream is more than %g s behind the microphone (the server or the "
                                "network is too slow): dropping the oldest audio", self.max_blocks * len(dropped)
                                / self.sample_rate)
                self.dropped_blocks += 1
                self.dropped_s += len(dropped) / self.sample_rate
            blocks.append(block)
            arrived.set()

        def callback(indata, frames, time, status) -> None:  # on PortAudio's thread: copy and hand over
            if status.input_overflow:
                self.overflows += 1
            block = indata[:, 0].copy() if self.channels == 1 else indata.copy()
            try:
                loop.call_soon_threadsafe(push, block)
            except RuntimeError:  # the loop closed while the stream was stopping
                pass

        if self._capture_stopped:  # stopped before recording began: nothing to hand over
            return
        try:
            stream = self._sd.InputStream(device=self.device, channels=self.channels, samplerate=self.sample_rate,
                                          dtype="float32", blocksize=self.blocksize, callback=callback)
            stream.start()
        except self._sd.PortAudioError as error:
            raise AudioSourceError(f"cannot open input device {self.device_info['name']!r}: {error}") from None
        self._stream = stream
        try:
            while True:
                while not blocks:
                    if self._capture_stopped:
                        return
                    arrived.clear()
                    await arrived.wait()
                yield blocks.popleft()
        finally:
            stream.stop()
            stream.close()


def microphone_source(device: int | str | None = None, *, sample_rate: int | None = 16000, channels: int = 1,
                      chunk_ms: int = 100, max_buffer_s: float = 30.0) -> MicrophoneSource:
    """Record from `device` (a PortAudio index or a part of its name; None: the default input). Raises
    AudioSourceError when there is no PortAudio library, no input device, or the device cannot record."""
    return MicrophoneSource(device, sample_rate=sample_rate, channels=channels, chunk_ms=chunk_ms,
                            max_buffer_s=max_buffer_s)


def _sounddevice():
    try:
        import sounddevice
    except ImportError:
        raise AudioSourceError("the microphone needs the sounddevice package: pip install 'qasr[mic]'") from None
    except OSError as error:  # sounddevice is installed but the PortAudio C library is not
        raise AudioSourceError(f"cannot load PortAudio ({error}): install it (Debian/Ubuntu: apt-get install "
                               "libportaudio2; macOS: brew install portaudio)") from None
    return sounddevice
