"""Audio in, log-mel features out: loading, resampling, the Whisper-style log-mel and the frame/token arithmetic.

The constants below are the single source of truth for converting between samples, mel frames and audio
tokens; everything that turns a position into a timestamp should derive it from them.

The features match transformers' `WhisperFeatureExtractor._torch_extract_fbank_features` as Qwen3-ASR
configures it (128 Slaney mel bins over 0-8 kHz, n_fft 400, hop 160, no dither), with one deliberate
difference: the official extractor zero-pads a batch to its longest clip before the STFT and the max-8
clamp, so a clip's tail frames can depend on its batch mates. Here every clip is computed as if alone.
"""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import torch

from qasr.audio import SAMPLE_RATE, AudioError, quietest_point

# soundfile and soxr are imported where used: the feature path (log_mel on a GPU box) needs only numpy and torch

# ---------------------------------------------------------------------------------------------------------
# Constants: samples -> frames -> tokens
# ---------------------------------------------------------------------------------------------------------

N_FFT = 400  # samples per STFT window (25 ms)
HOP_LENGTH = 160  # samples between mel frames (10 ms)
N_MELS = 128  # mel bins per frame
N_FREQS = N_FFT // 2 + 1  # 201 one-sided STFT bins
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second

CHUNK_FRAMES = FRAMES_PER_SECOND  # 100 frames = 1 s: the encoder's conv stack runs on each chunk separately
CHUNK_SAMPLES = CHUNK_FRAMES * HOP_LENGTH  # 16000 samples per chunk


def _conv_stack_length(frames):
    """Tokens out of the encoder's three stride-2 convolutions (kernel 3, padding 1) for one chunk of <= 100 frames."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1  # 0 stays 0
    return frames


TOKENS_PER_CHUNK = _conv_stack_length(CHUNK_FRAMES)  # 13 audio tokens per full 1 s chunk (100 -> 50 -> 25 -> 13)
WINDOW_CHUNKS = 8  # chunks per block-diagonal attention window of the encoder
WINDOW_FRAMES = WINDOW_CHUNKS * CHUNK_FRAMES  # 800 frames = 8 s
WINDOW_SAMPLES = WINDOW_FRAMES * HOP_LENGTH  # 128000 samples per window
WINDOW_TOKENS = WINDOW_CHUNKS * TOKENS_PER_CHUNK  # 104 tokens per window

LOG_MEL_FLOOR = 1e-10  # mel power floor before log10
LOG_MEL_DYNAMIC_RANGE = 8.0  # log10 units kept below the clip's maximum (80 dB)

DEFAULT_MAX_SECONDS = 30.0  # longest piece split_long_audio hands to the model (~390 tokens)


def num_frames(num_samples):
    """Mel frames for `num_samples` samples at SAMPLE_RATE (int, numpy or torch): the STFT's last frame is dropped."""
    if isinstance(num_samples, (int, np.integer)) and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return num_samples // HOP_LENGTH


def num_audio_tokens(num_frames):
    """Audio tokens the encoder emits for `num_frames` mel frames (int, numpy or torch).

    Matches the official `_get_feat_extract_output_lengths`: 13 per full chunk plus the conv stack's output for
    the remainder.
    """
    if isinstance(num_frames, (int, np.integer)) and num_frames < 0:
        raise ValueError(f"num_frames must be >= 0, got {num_frames}")
    return TOKENS_PER_CHUNK * (num_frames // CHUNK_FRAMES) + _conv_stack_length(num_frames % CHUNK_FRAMES)


# ---------------------------------------------------------------------------------------------------------
# Loading and decoding
# ---------------------------------------------------------------------------------------------------------


AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]


def load_audio(source: AudioSource, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read an audio file (a path, its bytes or a binary file object) as float32 mono at `sample_rate`.

    Anything libsndfile reads works (wav, flac, ogg/vorbis, mp3, ...), at any rate; channels are averaged.
    Raises AudioError for a missing file, an unreadable format, empty audio or NaN/inf samples.
    """
    import soundfile

    _check_rate(sample_rate, "sample_rate")
    name, file = _open_source(source)
    try:
        data, file_rate = soundfile.read(file, dtype="float32", always_2d=True)  # [samples, channels]
    except (soundfile.SoundFileError, RuntimeError, TypeError) as error:
        raise AudioError(f"cannot decode audio from {name}: {error}; use a format libsndfile reads "
                         f"(wav, flac, ogg/vorbis, mp3, ...)") from error
    if data.size == 0:
        raise AudioError(f"{name} contains no audio samples")
    if not np.isfinite(data).all():
        raise AudioError(f"{name} contains NaN or infinite samples")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return resample(mono, file_rate, sample_rate)


def _open_source(source: AudioSource) -> tuple[str, object]:
    """(a name for error messages, something soundfile can read)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise AudioError(f"audio file not found: {path}")
        if path.is_dir():
            raise AudioError(f"expected an audio file, got a directory: {path}")
        return str(path), str(path)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise AudioError("audio bytes are empty")
        return "audio bytes", io.BytesIO(source)
    if hasattr(source, "read"):
        seekable = getattr(source, "seekable", None)
        if seekable is None or not seekable():  # libsndfile seeks while probing the format
            source = io.BytesIO(source.read())
        return getattr(source, "name", "audio stream"), source
    raise AudioError(f"cannot read audio from a {type(source).__name__}: pass a path, bytes or a binary file object")


def resample(audio: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample float audio ([samples] or [samples, channels]) with soxr's high-quality filter; float32 out.

    Output length is round(len * target_sr / orig_sr).
    """
    _check_rate(orig_sr, "orig_sr")
    _check_rate(target_sr, "target_sr")
    audio = np.asarray(audio, dtype=np.float32)
    if orig_sr == target_sr:
        return audio
    import soxr

    return soxr.resample(audio, orig_sr, target_sr, quality="HQ").astype(np.float32, copy=False)


def _check_rate(rate: int, what: str) -> None:
    if not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise ValueError(f"{what} must be a positive integer number of Hz, got {rate!r}")


# ---------------------------------------------------------------------------------------------------------
# Log-mel features
# ---------------------------------------------------------------------------------------------------------


def mel_filter_bank(num_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                    max_frequency: float = 8000.0) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular mel filters over 0..max_frequency: [n_fft // 2 + 1, num_mels]."""

    def hz_to_mel(hz):  # linear below 1 kHz, logarithmic above
        hz = np.asarray(hz, dtype=np.float64)
        return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-300) / 1000.0) * (27.0 / np.log(6.4)),
                        3.0 * hz / 200.0)

    def mel_to_hz(mel):
        return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)), 200.0 * mel / 3.0)

    band_edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(max_frequency), num_mels + 2))  # [num_mels + 2] Hz
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)  # [N_FREQS] Hz
    slopes = band_edges[None, :] - fft_freqs[:, None]  # [N_FREQS, num_mels + 2]
    widths = np.diff(band_edges)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    triangles = np.maximum(0.0, np.minimum(rising, falling))  # [N_FREQS, num_mels]
    return triangles * (2.0 / (band_edges[2:] - band_edges[:-2]))[None, :]  # equal area per filter


@functools.lru_cache(maxsize=None)
def _hann_window(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.hann_window(N_FFT, periodic=True, device=device, dtype=dtype)  # [N_FFT]


@functools.lru_cache(maxsize=None)
def _mel_filters(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # cast through float32 like the official extractor so both see the same weights
    filters = mel_filter_bank().astype(np.float32).T  # [N_MELS, N_FREQS]
    return torch.from_numpy(np.ascontiguousarray(filters)).to(device=device, dtype=dtype)


def _as_float32_tensor(audio, device: torch.device | None) -> torch.Tensor:
    if isinstance(audio, np.ndarray) and not audio.flags.writeable:
        audio = audio.copy()  # torch warns about sharing read-only numpy memory
    tensor = torch.as_tensor(audio)
    if tensor.dim() != 1:
        raise ValueError(f"expected 1-D mono audio, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"expected float audio samples in [-1, 1], got {tensor.dtype}: convert PCM with qasr.audio.decode_pcm")
    return tensor.to(device=device if device is not None else tensor.device, dtype=torch.float32)


def log_mel(audio: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Log-mel features of one clip at SAMPLE_RATE, on the audio's device: audio [N] -> [N_MELS, N // HOP_LENGTH]."""
    features, _ = log_mel_batch([audio])
    return features[0]  # a batch of one has no padding


def log_mel_batch(audios: list[torch.Tensor | np.ndarray],
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel features of several clips in one STFT and one matmul, each row equal to `log_mel` of that clip.

    audios: B clips [N_b] at SAMPLE_RATE (any float dtype; computed in float32).
    device: where to compute; defaults to the first clip's device.
    Returns (features [B, N_MELS, F_max] float32, zero past each clip's frames; num_frames [B] int64), F_b = N_b // 160.
    """
    lengths = [len(audio) if getattr(audio, "ndim", 1) == 1 else 0 for audio in audios]  # others fail as not 1-D
    log_spec, num_frames_out = log_spectrogram_batch(audios, lengths, [0] * len(audios), device)
    if log_spec.shape[-1] == 0:
        return log_spec, num_frames_out
    padding = torch.arange(log_spec.shape[-1], device=log_spec.device)[None, None, :] >= num_frames_out[:, None, None]
    clip_max = log_spec.masked_fill(padding, float("-inf")).amax(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    return floor_log_spectrogram(log_spec, clip_max).masked_fill(padding, 0.0), num_frames_out


def floor_log_spectrogram(log_spec: torch.Tensor, clip_max: torch.Tensor) -> torch.Tensor:
    """Whisper's normalisation of log10 mel power: values more than LOG_MEL_DYNAMIC_RANGE below the clip's maximum
    are raised to that floor, then (x + 4) / 4. clip_max broadcasts against log_spec (a [B, 1, 1] per clip)."""
    return (torch.maximum(log_spec, clip_max - LOG_MEL_DYNAMIC_RANGE) + 4.0) / 4.0


def num_settled_frames(num_samples: int) -> int:
    """Leading mel frames of a clip of `num_samples` that no audio appended to it can change.

    A frame is settled once its centred STFT window (N_FFT samples around frame * HOP_LENGTH) lies inside the clip:
    the last one or two frames read the reflect padding at the clip's end, which appended audio replaces. Frame 0's
    left padding mirrors samples 1..N_FFT // 2, so a clip of N_FFT // 2 samples or fewer has none settled.
    """
    if num_samples <= N_FFT // 2:
        return 0
    return min(num_frames(num_samples), (num_samples - N_FFT // 2) // HOP_LENGTH + 1)


def stft_start_sample(first_frame: int) -> int:
    """The first sample that frames from `first_frame` on read (their centred windows; the reflect padding aside)."""
    return max(0, first_frame * HOP_LENGTH - N_FFT // 2)


def log_spectrogram_batch(tails: list[torch.Tensor | np.ndarray], num_samples: list[int], first_frames: list[int],
                          device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log10 mel power (before the clip-wide floor) of frames first_frames[b] .. num_frames(num_samples[b]) of clips,
    so that a growing clip computes only its new frames (and the unsettled ones at its old end).

    tails[b]: clip b's samples from stft_start_sample(first_frames[b]) to its end, num_samples[b] samples in the
    whole clip. Frame values do not depend on the first frame asked for, nor on the batch mates (up to float
    rounding of the batched matmul).
    Returns (log_spec [B, N_MELS, n_max] float32, zero past each clip's n_b; n [B] int64, frames computed per clip).
    """
    if device is None:
        device = torch.as_tensor(tails[0]).device if len(tails) else torch.device("cpu")
    device = torch.device(device)
    clips = [_as_float32_tensor(tail, device) for tail in tails]
    starts = [stft_start_sample(first) for first in first_frames]
    for clip, first, start, total in zip(clips, first_frames, starts, num_samples):
        if not 0 <= first <= num_frames(total):
            raise ValueError(f"first frame {first} is outside a clip of {num_frames(total)} frames")
        if clip.shape[0] != total - start:
            raise ValueError(f"a tail from sample {start} of a {total}-sample clip has {total - start} samples, "
                             f"got {clip.shape[0]}")
    counts = [max(0, num_frames(total) - first) for total, first in zip(num_samples, first_frames)]
    batch, max_count = len(clips), max(counts, default=0)
    # everything per clip crosses to the device in one copy: [B, 5] = (samples of the whole clip, the tail's offset in
    # the concatenation less its start sample, frames to compute, first frame, the tail's start sample)
    offsets = np.cumsum([0] + [clip.shape[0] for clip in clips[:-1]])
    rows = [[total, offset - start, count, first, start]
            for total, offset, count, first, start in zip(num_samples, offsets, counts, first_frames, starts)]
    # pinned and asynchronous on CUDA: a pageable copy would make the host wait for the device (#17)
    per_clip = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda").reshape(batch, 5)
    per_clip = per_clip.to(device, non_blocking=True)
    num_frames_out = per_clip[:, 2]
    if max_count == 0:
        return torch.zeros(batch, N_MELS, 0, device=device), num_frames_out

    padded = _centre_padded_batch(clips, per_clip, max_count)  # [B, n_max * HOP + N_FFT]
    window = _hann_window(device, torch.float32)
    stft = torch.stft(padded, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
    power = stft[..., :max_count].abs() ** 2  # [B, N_FREQS, n_max]: the frame past each clip's end is dropped
    mel = _mel_filters(device, torch.float32) @ power  # [B, N_MELS, n_max]
    log_spec = torch.clamp(mel, min=LOG_MEL_FLOOR).log10()
    padding = torch.arange(max_count, device=device)[None, None, :] >= num_frames_out[:, None, None]  # [B, 1, n_max]
    return log_spec.masked_fill(padding, 0.0), num_frames_out


def _centre_padded_batch(clips: list[torch.Tensor], per_clip: torch.Tensor, max_frames: int) -> torch.Tensor:
    """Each clip's samples for its frames from its first frame on, reflect-padded by N_FFT // 2 at the clip's own
    ends, then zero-padded to a common length.

    clips: each clip's tail (from its start sample); per_clip: [B, 5] as log_spectrogram_batch builds it, on the clips'
    device. One gather from the concatenated tails, so the batch costs a handful of kernels however many clips it holds.
    Returns [B, max_frames * HOP_LENGTH + N_FFT]: the samples an uncentred STFT frames into max_frames + 1
    frames, exactly what torch.stft(center=True, pad_mode="reflect") frames for each whole clip alone from its first.
    """
    pad = N_FFT // 2
    width = max_frames * HOP_LENGTH + N_FFT
    flat = torch.cat(clips + [clips[0].new_zeros(1)])  # the last element is the zero used for padding
    zero_index = flat.shape[0] - 1
    length, base, has_frames = per_clip[:, 0:1], per_clip[:, 1:2], per_clip[:, 2:3] > 0  # [B, 1] each
    first, start = per_clip[:, 3:4], per_clip[:, 4:5]

    # [B, W] sample index in the clip's own time
    position = first * HOP_LENGTH + torch.arange(width, device=flat.device)[None, :] - pad
    # mirror without repeating the edge sample (torch's "reflect"), folded so clips shorter than the pad stay in
    # range; clips without frames (fewer than HOP_LENGTH samples) are never read
    period = torch.clamp(2 * (length - 1), min=1)
    folded = position.abs() % period
    mirrored = torch.where(folded >= length, period - folded, folded)  # [B, W]
    # samples before the tail are read only by columns past the clip's last frame: zeros there
    inside = (position < length + pad) & has_frames & (mirrored >= start)
    return flat[torch.where(inside, base + mirrored, zero_index)]


# ---------------------------------------------------------------------------------------------------------
# Splitting long recordings
# ---------------------------------------------------------------------------------------------------------


def split_long_audio(audio: np.ndarray, max_seconds: float = DEFAULT_MAX_SECONDS, search_seconds: float = 5.0,
                     sample_rate: int = SAMPLE_RATE, quiet_window_seconds: float = 0.025) -> list[tuple[int, int]]:
    """Cut a long clip into [start, end) sample ranges of at most `max_seconds` that cover it without gaps.

    Each cut lands at the quietest point of the last `search_seconds` before the limit: the middle of the longest
    stretch whose short-time energy (over `quiet_window_seconds`) is within 1% of the window's range above its
    minimum, so pauses are cut in their middle rather than at the edge of a word. An empty clip gives [].
    """
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"expected 1-D mono audio, got shape {audio.shape}")
    if max_seconds <= 0 or search_seconds < 0 or quiet_window_seconds <= 0:
        raise ValueError(f"need max_seconds > 0, search_seconds >= 0 and quiet_window_seconds > 0, got "
                         f"{max_seconds}, {search_seconds}, {quiet_window_seconds}")
    _check_rate(sample_rate, "sample_rate")
    max_samples = max(1, int(round(max_seconds * sample_rate)))
    search_samples = int(round(search_seconds * sample_rate))
    window = max(1, int(round(quiet_window_seconds * sample_rate)))

    ranges, start = [], 0
    while audio.shape[0] - start > max_samples:
        latest = start + max_samples
        earliest = max(start + 1, latest - search_samples)
        cut = quietest_point(audio, earliest, latest, window)
        ranges.append((start, cut))
        start = cut
    if audio.shape[0] > start:
        ranges.append((start, audio.shape[0]))
    return ranges
