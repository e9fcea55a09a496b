"""An admission's audio front end: 16 kHz clips -> audio embeddings, a stream's partial computing only what is new.

A clip of N samples has F = N // 160 mel frames; its chunks are 100 frames, its encoder windows 8 chunks. A partial of
a stream whose earlier partials kept K complete chunks (W of them as whole windows, the rest as conv tokens) computes:
- the mel of frames [100 K, F) only, from the samples those frames read (the chunk in progress and the new audio);
- the convolutions of the chunks from K on;
- the encoder over the window in progress (its kept chunks' tokens and the new ones) and any window the new audio
  completed;
and the engine's prefill starts after the retained KV of the prompt prefix and the W windows.
A clip without stream state (a final, a request without a stream id) is all new: computed whole.

The mel's floor (max - 8 over the whole clip) is kept exact: the maximum is that of the kept chunks and the new
frames; if it rose, kept chunks whose least raw value lies below the new floor changed, and everything from the first
of them on is dropped and computed again (StreamState.keep_chunks). So a partial's embeddings equal a fresh
computation of its audio (up to the float rounding of different batch shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qasr.model import audio as qaudio

from .runner import ModelRunner
from .stream_cache import StreamState


@dataclass
class AudioEmbedding:
    windows: list[torch.Tensor]  # [tokens, out] each, in order (the stream's kept windows, then the new ones as one
    # piece): what replaces the prompt's audio placeholders (the engine writes all clips' into their prompts at once:
    # a cat per clip was a launch each)
    kept_windows: int  # leading windows taken from the stream's cache (their KV may be reused too)

    @property
    def audio(self) -> torch.Tensor:
        """[num_audio_tokens, out]: the windows as one tensor."""
        return torch.cat(self.windows)


@dataclass
class _Clip:
    """One clip's work in an admission."""

    audio: np.ndarray
    state: StreamState | None
    first_frame: int = 0  # 100 * the kept chunks
    batch: torch.Tensor | None = None  # raw log10 mel frames [B, mels, frames] of the batch it was computed in
    row: int = 0  # this clip's row there: its frames from first_frame on
    lows: np.ndarray | None = None  # per computed chunk: least and greatest raw value
    highs: np.ndarray | None = None
    clip_max: float = -np.inf
    staged: object = None  # the samples its first mel reads, staged on the host (ModelRunner.stage_samples, shared
    # by the batch: set on the first clip of a prepared batch)
    finite: bool = True  # every sample of the clip is finite (checked by prepare, as its samples are staged)

    @property
    def num_new_frames(self) -> int:
        return qaudio.num_frames(self.audio.size) - self.first_frame


class AudioFrontEnd:
    def __init__(self, runner: ModelRunner, counters: dict[str, int]):
        self.runner = runner
        self.counters = counters  # the engine's: mel_frames, conv_chunks, encoded_windows, reused_windows, and
        counters.setdefault("floor_moves", 0)  # partials whose rising maximum dropped kept chunks
        counters.setdefault("encoder_tokens", 0)  # encoder positions of real audio, and those it computed
        counters.setdefault("encoder_computed_tokens", 0)  # (windows padded to whole windows and graph buckets)
        counters.setdefault("conv_computed_chunks", 0)  # batched conv chunks run, padded to graph buckets

    def embed(self, clips: list[np.ndarray], states: list[StreamState | None]) -> list[AudioEmbedding]:
        """Audio embeddings of each clip; states[i]: its stream's kept front-end work (updated here), None for none."""
        return self.run(self.prepare(clips, states))

    def prepare(self, clips: list[np.ndarray], states: list[StreamState | None]) -> list[_Clip]:
        """The host's part, before any device work (the engine does it while a decode step runs): what each clip
        keeps, where its new frames start, the samples they read staged for the device, and whether each clip's
        samples are all finite (a clip that is not must not run: its NaNs would reach the device)."""
        work = [_Clip(audio, state) for audio, state in zip(clips, states)]
        for clip in work:
            if clip.state is not None and not clip.state.continues(clip.audio):
                clip.state.restart_audio()  # not this stream's audio: nothing kept applies
            clip.first_frame = clip.state.num_chunks * qaudio.CHUNK_FRAMES if clip.state else 0
        if work:
            work[0].staged, finite = self.runner.stage_samples(clips, [clip.first_frame for clip in work])
            for clip, ok in zip(work, finite):
                clip.finite = ok
        return work

    def run(self, work: list[_Clip]) -> list[AudioEmbedding]:
        """The device's part: prepare's clips -> their audio embeddings (states updated)."""
        if work and all(clip.state is None for clip in work):  # finals, offline clips: no kept chunks to decide
            features = self._whole_clip_features(work)
        else:
            self._log_spectrogram(work, work[0].staged if work else None)
            redo = [clip for clip in work if self._floor_moved_into_kept_chunks(clip)]
            self.counters["floor_moves"] += len(redo)
            if redo:  # the clip's maximum rose and dropped kept chunks, whose frames are needed again
                for clip in redo:
                    clip.first_frame = clip.state.num_chunks * qaudio.CHUNK_FRAMES
                self._log_spectrogram(redo)
            features = self._floored(work)
        tokens = self._conv_tokens(work, features)
        encoded = self._encode(work, tokens)
        out = []
        for clip, clip_tokens, clip_encoded in zip(work, tokens, encoded):
            kept = clip.state.windows[:] if clip.state else []
            self.counters["reused_windows"] += len(kept)
            new = [clip_encoded] if clip_encoded is not None else []
            if clip.state is not None:  # its new windows apart, to keep the whole ones
                self._keep(clip, clip_tokens, [w for piece in new for w in piece.split(self.runner.window_tokens)])
            out.append(AudioEmbedding(kept + new, len(kept)))
        return out

    def _log_spectrogram(self, work: list[_Clip], staged=None) -> None:
        """Raw frames from each clip's first frame on, and their per-chunk extremes (one host read for the batch)."""
        log_spec = self.runner.log_spectrogram([clip.audio for clip in work], [clip.first_frame for clip in work],
                                               staged)
        counts = [clip.num_new_frames for clip in work]
        lows, highs = self.runner.chunk_extremes(log_spec, counts)
        for i, clip in enumerate(work):
            clip.batch, clip.row, clip.lows, clip.highs = log_spec, i, lows[i], highs[i]
            kept_high = max(clip.state.chunk_highs, default=-np.inf) if clip.state else -np.inf
            clip.clip_max = float(max(kept_high, highs[i].max(initial=-np.inf)))
        self.counters["mel_frames"] += sum(counts)

    def _whole_clip_features(self, work: list[_Clip]) -> list[torch.Tensor]:
        """_floored's features for clips without stream state, the host reading nothing: each clip's maximum stays
        on the device (the host read of the chunks' extremes waits for the mel, and with it for all the admission
        stream's work queued before; those extremes only matter to a stream's kept chunks)."""
        counts = [clip.num_new_frames for clip in work]
        log_spec = self.runner.log_spectrogram([clip.audio for clip in work], [0] * len(work), work[0].staged)
        floored = self.runner.floor_log_spectrogram(log_spec, self.runner.clip_maxima(log_spec, counts))
        self.counters["mel_frames"] += sum(counts)
        return [floored[i, :, :count] for i, count in enumerate(counts)]

    @staticmethod
    def _floor_moved_into_kept_chunks(clip: _Clip) -> bool:
        """Whether the clip's maximum rose so far that kept chunks changed; if so, drops them (and all after)."""
        state = clip.state
        if state is None or not state.num_chunks or clip.clip_max <= state.floor_max:
            return False
        floor = np.float32(clip.clip_max) - np.float32(qaudio.LOG_MEL_DYNAMIC_RANGE)  # as the device computes it
        below = np.flatnonzero(np.asarray(state.chunk_lows, dtype=np.float32) < floor)
        if not below.size:
            return False
        state.keep_chunks(int(below[0]))
        return True

    def _floored(self, work: list[_Clip]) -> list[torch.Tensor]:
        """Each clip's new frames as features [mels, frames], floored below its whole clip's maximum (one floor per
        batch of frames computed together)."""
        features = [None] * len(work)
        for batch in {id(clip.batch): clip.batch for clip in work}.values():
            rows = {clip.row: clip for clip in work if clip.batch is batch}
            floored = self.runner.floor_log_spectrogram(batch, [rows[r].clip_max if r in rows else 0.0
                                                                for r in range(batch.shape[0])])
            for i, clip in enumerate(work):
                if clip.batch is batch:
                    features[i] = floored[clip.row, :, : clip.num_new_frames]
        return features

    def _conv_tokens(self, work: list[_Clip], features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each clip's conv tokens from its first kept window on: the kept chunks' tokens, then the new chunks'."""
        todo = [i for i, clip in enumerate(work) if clip.num_new_frames or not (clip.state and clip.state.num_chunks)]
        run_before = self.runner.conv_chunks_run
        new = self.runner.embed_chunks([features[i] for i in todo], [work[i].first_frame > 0 for i in todo])
        self.counters["conv_chunks"] += sum(-(-work[i].num_new_frames // qaudio.CHUNK_FRAMES) for i in todo)
        # the batched chunks the convolutions ran, padded to a graph bucket (clips under a chunk run apart: uncounted)
        self.counters["conv_computed_chunks"] += self.runner.conv_chunks_run - run_before
        tokens = [None] * len(work)
        for i, t in zip(todo, new):
            tokens[i] = t
        out = []
        for clip, t in zip(work, tokens):
            kept = clip.state.chunk_tokens if clip.state is not None else None
            parts = [p for p in (kept, t) if p is not None and p.shape[0]]
            out.append(torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None)
        return out

    def _encode(self, work: list[_Clip], tokens: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The windows from each clip's first kept window on (all clips' in one call) -> per clip, their outputs one
        after the other [tokens, out] (None: no new windows)."""
        todo = [i for i, t in enumerate(tokens) if t is not None]
        run_before = self.runner.encoder_positions_run
        encoded = self.runner.encode([tokens[i] for i in todo]) if todo else []
        out: list[torch.Tensor | None] = [None] * len(work)
        for i, clip in zip(todo, encoded):
            out[i] = clip
        size = self.runner.window_tokens
        self.counters["encoded_windows"] += sum(-(-clip.shape[0] // size) for clip in encoded)
        # what the encoder computed against what was real: a partial's window in progress is mostly padding
        self.counters["encoder_tokens"] += sum(clip.shape[0] for clip in encoded)
        self.counters["encoder_computed_tokens"] += self.runner.encoder_positions_run - run_before
        return out

    @staticmethod
    def _keep(clip: _Clip, tokens: torch.Tensor | None, windows: list[torch.Tensor]) -> None:
        """Keep what the next partial of the stream can reuse: the chunks the audio completed, as windows where whole."""
        state = clip.state
        first_chunk = state.num_chunks
        complete = qaudio.num_settled_frames(clip.audio.size) // qaudio.CHUNK_FRAMES  # every frame settled
        state.chunk_lows += clip.lows[: complete - first_chunk].tolist()
        state.chunk_highs += clip.highs[: complete - first_chunk].tolist()
        state.floor_max = clip.clip_max
        first_window, whole = len(state.windows), complete // qaudio.WINDOW_CHUNKS
        state.windows += windows[: whole - first_window]
        start = (whole - first_window) * qaudio.WINDOW_TOKENS
        end = (complete - first_window * qaudio.WINDOW_CHUNKS) * qaudio.TOKENS_PER_CHUNK
        # a copy: tokens may be a view of the conv graph's output (overwritten by its next replay) or of the batch's
        state.chunk_tokens = tokens[start:end].clone() if tokens is not None and end > start else None
        state.saw(clip.audio)
