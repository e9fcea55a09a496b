"""The host-side layout of one aligner forward: where every clip's mel chunks, encoder windows and prompt row go.

Built in numpy before anything touches the device, so that a batch crosses to the device in one copy and its shapes
can be padded up to a CUDA-graph bucket (qasr.engine.aligner_graphs) without changing any row's result:
- Chunks: a clip's mel is cut into 100-frame chunks; clip b owns `8 x windows_b` consecutive chunk slots (8 chunks of
  13 tokens fill one 104-token encoder window), its own chunks first, then empty slots. Empty and padding slots
  read a zero chunk and their tokens are past their window's length, so no real token ever attends to them.
- Windows: the encoder's attention windows, clip after clip; a padding window has length 1 (no empty softmax).
- Rows: `<|audio_start|>`, the clip's audio tokens, `<|audio_end|>`, the words with their timestamp slots, then
  `<|endoftext|>` padding; `audio_index` says which encoder output (flat window x 104 + token) fills each audio
  position. A padding row has length 1. The decoder masks by `lengths`, so a row's real positions never see padding.
- A clip shorter than one chunk is convolved as if unpadded (the official does so): `chunk_valid` frames of it are
  real and the convolutions' outputs past them are zeroed. A longer clip's last chunk is zero-padded, as the
  official pads it, so its slots have `chunk_valid` = a whole chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .audio import num_frames
from .config import AudioEncoderConfig

# what crosses to the device
ARRAYS = ("chunk_source", "chunk_valid", "window_lengths", "ids", "audio_index", "lengths")


@dataclass(frozen=True)
class AlignerBatch:
    """One forward's integer inputs (numpy int64) and what the host needs to read its result."""

    chunk_source: np.ndarray  # [8W] (8 chunks a window) index into the clips' chunks [clips x max_chunks] + 1 zero
    chunk_valid: np.ndarray  # [8W] mel frames the convolutions treat as real (100, fewer in a clip under one chunk)
    window_lengths: np.ndarray  # [W] real tokens per encoder window (1 for a padding window)
    ids: np.ndarray  # [B, T] prompt ids, right-padded
    audio_index: np.ndarray  # [B, T] encoder output (flat) for an audio position, 0 elsewhere
    lengths: np.ndarray  # [B] real positions per row (1 for a padding row)
    num_clips: int  # real rows (the first ones)
    max_chunks: int  # chunks per clip in the features layout chunk_source indexes
    slots: tuple[np.ndarray, ...]  # per real row: the positions of its timestamp slots, in order

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, tokens, windows): what a graph bucket must hold."""
        return self.ids.shape[0], self.ids.shape[1], self.window_lengths.shape[0]

    def padded(self, rows: int, tokens: int, windows: int, pad_id: int) -> "AlignerBatch":
        """The same batch in a larger shape: padding rows, positions, windows and chunk slots that change no real
        row's result (the CPU tests compare both)."""
        B, T, W = self.shape
        if rows < B or tokens < T or windows < W:
            raise ValueError(f"cannot pad a batch of shape {(B, T, W)} down to {(rows, tokens, windows)}")
        zero_chunk = self.num_clips * self.max_chunks
        ids = np.full((rows, tokens), pad_id, dtype=np.int64)
        ids[:B, :T] = self.ids
        audio_index = np.zeros((rows, tokens), dtype=np.int64)
        audio_index[:B, :T] = self.audio_index
        return replace(
            self,
            chunk_source=_pad(self.chunk_source, self.chunks_per_window * windows, zero_chunk),
            chunk_valid=_pad(self.chunk_valid, self.chunks_per_window * windows, 1),
            window_lengths=_pad(self.window_lengths, windows, 1),
            ids=ids,
            audio_index=audio_index,
            lengths=_pad(self.lengths, rows, 1),
        )

    @property
    def chunks_per_window(self) -> int:
        return self.chunk_source.shape[0] // self.window_lengths.shape[0]

    def read_classes(self, classes: np.ndarray) -> list[list[int]]:
        """classes [>= B, >= T] (argmax at every position) -> per real row, its timestamp slots' classes."""
        return [classes[b, positions].tolist() for b, positions in enumerate(self.slots)]


def _pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, dtype=np.int64)
    out[: values.shape[0]] = values
    return out


def plan_batch(num_samples: list[int], text_ids: list[tuple[int, ...]], cfg: AudioEncoderConfig, *,
               audio_start_id: int, audio_pad_id: int, audio_end_id: int, pad_id: int,
               timestamp_id: int) -> AlignerBatch:
    """The exact (unpadded) layout of clips of `num_samples` samples with the ids that follow their audio."""
    if len(num_samples) != len(text_ids) or not num_samples:
        raise ValueError(f"need one text per clip and at least one clip, got {len(num_samples)} and {len(text_ids)}")
    size, window, per_chunk = cfg.chunk_frames, cfg.window_tokens, cfg.tokens_per_chunk  # 100 frames, 104, 13
    per_window = window // per_chunk  # 8 chunks
    if per_window * per_chunk != window:
        raise ValueError(f"an encoder window of {window} tokens is not whole chunks of {per_chunk}")
    frames = [int(num_frames(n)) for n in num_samples]
    tokens = [cfg.num_tokens(f) for f in frames]
    chunks = [-(-f // size) for f in frames]
    windows = [-(-t // window) for t in tokens]
    max_chunks, num_clips = max(chunks), len(num_samples)
    lengths = [n + 2 + len(text) for n, text in zip(tokens, text_ids)]
    ids = np.full((num_clips, max(lengths)), pad_id, dtype=np.int64)
    index = np.zeros_like(ids)
    chunk_source = np.full(per_window * sum(windows), num_clips * max_chunks, dtype=np.int64)  # the zero chunk
    chunk_valid = np.empty_like(chunk_source)
    window_lengths, slots = [], []
    first_window = 0
    for b, (f, n_tokens, n_chunks, n_windows, text) in enumerate(zip(frames, tokens, chunks, windows, text_ids)):
        first_slot = per_window * first_window
        chunk_source[first_slot : first_slot + n_chunks] = np.arange(b * max_chunks, b * max_chunks + n_chunks)
        chunk_valid[first_slot : first_slot + per_window * n_windows] = min(f, size)
        window_lengths += [min(window, n_tokens - w * window) for w in range(n_windows)]
        ids[b, 0], ids[b, 1 : 1 + n_tokens], ids[b, 1 + n_tokens] = audio_start_id, audio_pad_id, audio_end_id
        text = np.asarray(text, dtype=np.int64)
        ids[b, 2 + n_tokens : lengths[b]] = text
        index[b, 1 : 1 + n_tokens] = np.arange(first_window * window, first_window * window + n_tokens)
        slots.append(2 + n_tokens + np.flatnonzero(text == timestamp_id))
        first_window += n_windows
    return AlignerBatch(
        chunk_source=chunk_source,
        chunk_valid=chunk_valid,
        window_lengths=np.asarray(window_lengths, dtype=np.int64),
        ids=ids,
        audio_index=index,
        lengths=np.asarray(lengths, dtype=np.int64),
        num_clips=num_clips,
        max_chunks=max_chunks,
        slots=tuple(slots),
    )
