"""What the engine keeps between requests of one stream, so partials do not cost time quadratic in segment length.

The audio front end (engine/audio_frontend.py) keeps what the new audio cannot change: the conv tokens of complete
1 s chunks (their mel frames settled: their STFT windows lie inside the audio), and the encoder outputs of whole 8 s
windows (fixed, aligned at the segment start, attending only inside themselves). The decoder KV of the prompt prefix
plus those windows' audio tokens does not change either (causal attention): it is kept in a retained slot and copied
into the next partial's slot, which then prefills only what is new. And the last partial's answer tokens: the next
partial starts from them, minus the last few (the least settled), as the official streaming does with text.

The mel's "max - 8" floor is taken over the whole clip, so a louder sound arriving later can change the features of
kept chunks that held values below the new floor: each kept chunk's least raw value says whether it did, and
everything from the first such chunk on is dropped and computed again. So a partial's audio embeddings equal a fresh
computation of the same audio. Finals are still decoded from scratch (their batched matmuls differ from the pieces'
by float rounding), so a final equals the offline transcription of the segment exactly.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from qasr.model import audio as qaudio

FINGERPRINT_SAMPLES = 32  # samples compared at each end of the audio seen


@dataclass
class StreamState:
    # the audio front end: chunks [0, 8 * len(windows)) are kept as windows, [8 * len(windows), num_chunks) as tokens
    windows: list[torch.Tensor] = field(default_factory=list)  # encoder outputs [window_tokens, D] of whole windows
    chunk_tokens: torch.Tensor | None = None  # conv tokens [13 per chunk, D] of complete chunks past the windows
    chunk_lows: list[float] = field(default_factory=list)  # per complete chunk: its least raw log10 mel value
    chunk_highs: list[float] = field(default_factory=list)  # ... and its greatest
    floor_max: float = -math.inf  # the clip maximum the kept chunks and windows were floored with
    num_samples: int = 0  # samples of the audio seen (the last partial's)
    fingerprint: np.ndarray | None = None  # its first and last samples: audio that does not match starts over
    # the decoder
    retained_slot: int = -1  # KV slot holding prefix_ids + the audio of `kv_windows` windows
    prefix_ids: tuple[int, ...] = ()
    kv_windows: int = 0
    answer_ids: tuple[int, ...] = ()  # the last partial's answer (its given prefix + what it generated): the next
    # partial's given prefix, rolled back

    @property
    def num_chunks(self) -> int:
        """Complete chunks kept (as windows or tokens): a partial computes mel frames and convs from here on."""
        return len(self.chunk_lows)

    def continues(self, audio: np.ndarray) -> bool:
        """Whether `audio` extends the audio seen (same first and last samples where it was seen)."""
        return self.num_samples == 0 or (audio.size >= self.num_samples
                                         and np.array_equal(_fingerprint(audio, self.num_samples), self.fingerprint))

    def saw(self, audio: np.ndarray) -> None:
        self.num_samples, self.fingerprint = audio.size, _fingerprint(audio, audio.size)

    def keep_chunks(self, count: int) -> None:
        """Forget every kept chunk from `count` on: its features changed (the floor rose) or the audio did. A window
        with a chunk gone goes whole (its chunks' tokens were not kept), and so does the KV of its audio."""
        windows = min(len(self.windows), count // qaudio.WINDOW_CHUNKS)
        if windows < len(self.windows):
            count, self.chunk_tokens = windows * qaudio.WINDOW_CHUNKS, None
            del self.windows[windows:]
        elif self.chunk_tokens is not None:
            self.chunk_tokens = self.chunk_tokens[: (count - windows * qaudio.WINDOW_CHUNKS) * qaudio.TOKENS_PER_CHUNK]
        del self.chunk_lows[count:], self.chunk_highs[count:]
        self.kv_windows = min(self.kv_windows, windows)

    def restart_audio(self) -> None:
        """The audio does not continue what was seen: keep nothing of it (the retained slot and answer stay)."""
        self.keep_chunks(0)
        self.chunk_tokens, self.floor_max, self.num_samples, self.fingerprint = None, -math.inf, 0, None


def _fingerprint(audio: np.ndarray, length: int) -> np.ndarray:
    """The first and last FINGERPRINT_SAMPLES of audio[:length]."""
    return np.concatenate([audio[:FINGERPRINT_SAMPLES], audio[max(0, length - FINGERPRINT_SAMPLES) : length]])


class StreamCache:
    def __init__(self, retained_slots: range, max_streams: int = 4096):
        self._free = list(reversed(retained_slots))
        self._streams: collections.OrderedDict[str, StreamState] = collections.OrderedDict()  # LRU order
        self.max_streams = max_streams  # a bound even if a caller never releases its streams

    def get(self, stream_id: str) -> StreamState:
        state = self._streams.get(stream_id)
        if state is None:
            if len(self._streams) >= self.max_streams:
                self.release(next(iter(self._streams)))  # the least recently used
            state = self._streams[stream_id] = StreamState()
        self._streams.move_to_end(stream_id)
        return state

    def peek(self, stream_id: str) -> StreamState | None:
        return self._streams.get(stream_id)

    def retained_slot(self, stream_id: str, busy: set[str]) -> int:
        """A retained KV slot for this stream: its own, a free one, or the least recently used other stream's."""
        state = self.get(stream_id)
        if state.retained_slot >= 0:
            return state.retained_slot
        if not self._free:
            for other_id, other in self._streams.items():
                if other.retained_slot >= 0 and other_id != stream_id and other_id not in busy:
                    self._free.append(other.retained_slot)
                    other.retained_slot, other.kv_windows = -1, 0
                    break
        if not self._free:
            return -1
        state.retained_slot = self._free.pop()
        return state.retained_slot

    def release(self, stream_id: str) -> None:
        state = self._streams.pop(stream_id, None)
        if state is not None and state.retained_slot >= 0:
            self._free.append(state.retained_slot)

    def __len__(self) -> int:
        return len(self._streams)
