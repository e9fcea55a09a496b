"""Qwen3-ForcedAligner: word times for a known transcript of a clip, from one non-autoregressive forward pass.

Facts checked against the official code (qwen-asr 0.0.6: inference/qwen3_forced_aligner.py,
core/transformers_backend/modeling_qwen3_asr.py) and transformers' conversion script for the "-hf" checkpoint:
- The network is Qwen3-ASR's (`Qwen3ASRForConditionalGeneration`: audio encoder + Qwen3 decoder). When
  `thinker_config.model_type` contains "forced_aligner" the thinker's lm_head is `Linear(hidden, classify_num,
  bias=False)`: a head over timestamp classes, not the vocabulary. Qwen3-ForcedAligner-0.6B: classify_num 5000
  (`thinker_config.classify_num`), `timestamp_segment_time` 80 ms per class and `timestamp_token_id` 151705
  (`<timestamp>`, an added token) at the top of config.json, the 1.7B's audio encoder (d_model 1024, 24 layers)
  with the 0.6B's decoder. The "-hf" checkpoint: `num_timestamp_bins`, `timestamp_token_id` and
  `timestamp_segment_time` at the top, `classifier.weight` for the head, `model.audio_tower.*` (proj1/proj2 inside)
  without the encoder's k_proj biases, `model.language_model.*`. The tests' random checkpoints have both layouts.
- Input (no chat template, no system or user turn): `<|audio_start|>` + N x `<|audio_pad|>` + `<|audio_end|>` then
  each word followed by `<timestamp><timestamp>` (its start and end slots). The string is tokenized whole, but the
  added tokens split it, so each word is tokenized on its own. Audio embeddings replace the `<|audio_pad|>`s.
- One ordinary causal forward (positions 0..T-1, nothing cached, nothing generated); the class of a slot is the
  argmax of the head at its position; times are class x 80 ms from the start of the clip; the sequence is made
  monotonic by `fix_timestamp` and read two per word (qasr.model.aligner_repair), in seconds rounded to the ms.
- Words: split per language (qasr.model.aligner_words); punctuation is never a unit.
- `Qwen3ForcedAligner.align` batches by padding: the text on the left, the audio on the right before the STFT, so a
  clip's last feature frames depend on its batch mates. Here every clip's features and rows are its own: a row
  equals the official result for that pair alone, whatever else is in the batch.
- The official takes any language (every one but Japanese and Korean goes the whitespace way) and
  `transcribe(return_time_stamps=True)` aligns pieces of at most 180 s. Here a language outside the checkpoint's
  `support_languages` (the 11 of the model card) gives no words and a reason, and a clip longer than the classes can
  express (5000 x 80 ms = 400 s) is refused.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qasr.audio import SAMPLE_RATE

from .aligner_batch import ARRAYS, AlignerBatch, plan_batch
from .aligner_repair import WordTime, word_times
from .aligner_words import SplitterUnavailable, japanese_available, split_words
from .audio import log_mel_batch
from .checkpoint import CheckpointError, checkpoint_files, load_weights, parse_dtype, resolve_device, resolve_model_dir
from .config import AlignerConfig, ModelConfig
from .modeling import AudioEncoder, TextDecoder, rope_inv_freq, sinusoids
from .tokenizer import TIMESTAMP, Tokenizer

WORD_CACHE_SIZE = 1 << 16  # distinct words whose tokens ForcedAligner.prepare keeps

# (checkpoint prefix, our prefix) per layout: the ASR model's, with the timestamp head as `classifier`
ALIGNER_PREFIXES = {
    "original": [
        ("thinker.audio_tower.", "encoder."),
        ("thinker.model.", "decoder."),
        ("thinker.lm_head.", "classifier."),
    ],
    "hf": [
        ("model.audio_tower.", "encoder."),
        ("model.multi_modal_projector.linear_1.", "encoder.proj1."),  # the projector's name in the ASR -hf layout
        ("model.multi_modal_projector.linear_2.", "encoder.proj2."),
        ("model.language_model.", "decoder."),
        ("classifier.", "classifier."),
    ],
}


class AlignerNetwork(nn.Module):
    """Qwen3-ASR's encoder and decoder without the vocabulary head, plus the timestamp-class head."""

    def __init__(self, cfg: ModelConfig, classify_num: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = AudioEncoder(cfg.audio)
        self.decoder = TextDecoder(cfg.text)
        self.decoder.lm_head = None  # the aligner never scores the vocabulary
        self.classifier = nn.Linear(cfg.text.hidden_size, classify_num, bias=False)

    def hidden(self, embeds: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The causal decoder over right-padded rows, no cache. embeds [B, T, D], lengths [B] -> final-normed [B, T, D].

        Row b attends to its own first lengths[b] positions only, so its real positions do not depend on the
        padding or on the other rows; padded positions give garbage that nobody reads.
        """
        B, T, _ = embeds.shape
        dec = self.decoder
        t = torch.arange(T, device=embeds.device)
        mask = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None])  # [B, T, T]
        cos, sin = dec.rope(t.expand(B, T), embeds.dtype)
        bias = dec.layers[0].self_attn.attention_bias(mask, embeds.dtype)
        x = embeds
        for layer in dec.layers:
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
            x = x + attn.o_proj(attn.attend(q, k, v, bias))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return dec.norm(x)

    def encode_chunks(self, chunks: torch.Tensor, valid: torch.Tensor, window_lengths: torch.Tensor) -> torch.Tensor:
        """The audio encoder over chunks laid out window by window (qasr.model.aligner_batch) -> [W x 104, out].

        chunks: [8W, mels, 100] (a clip's windows' chunks, zero chunks after its last); valid: [8W] mel frames each
        convolution treats as real (its outputs past them are zeroed, as if the chunk were unpadded); window_lengths:
        [W] real tokens per window. Fixed shapes for given W, so a CUDA graph can replay it.
        """
        enc = self.encoder
        x = chunks.unsqueeze(1)
        for conv in (enc.conv2d1, enc.conv2d2, enc.conv2d3):
            x = F.gelu(conv(x))
            valid = (valid - 1) // 2 + 1  # the conv's output length, as for an unpadded input
            x = x * (torch.arange(x.shape[-1], device=x.device)[None, :] < valid[:, None]).to(x.dtype)[:, None, None]
        n, c, f, t = x.shape
        x = enc.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, c * f)) + enc.positions[:t].to(x.dtype)  # [8W, 13, D]
        W = window_lengths.shape[0]
        windows = enc.encode_windows(x.reshape(W, -1, x.shape[-1]), window_lengths)  # [W, 104, out]
        return windows.reshape(W * windows.shape[1], -1)

    def timestamp_logits(self, ids: torch.Tensor, audio_index: torch.Tensor, lengths: torch.Tensor,
                         audio: torch.Tensor, audio_pad_id: int) -> torch.Tensor:
        """ids, audio_index [B, T], lengths [B], audio [tokens, D] (encode_chunks) -> the head's logits [B, T, C].

        Each <|audio_pad|> position takes its encoder output; fixed shapes for given (B, T), so it can be graphed.
        """
        embeds = self.decoder.embed_tokens(ids)
        embeds = torch.where((ids == audio_pad_id)[..., None], audio[audio_index].to(embeds.dtype), embeds)
        return self.classifier(self.hidden(embeds, lengths))


def load_aligner_network(
    model_dir: str | os.PathLike, cfg: AlignerConfig, *, device: torch.device, dtype: torch.dtype
) -> AlignerNetwork:
    """The network of a resolved checkpoint directory, weights straight to `device` in `dtype`."""
    with torch.device("meta"):
        network = AlignerNetwork(cfg.model, cfg.classify_num).to(dtype)
    network.to_empty(device=device)
    # non-persistent buffers were built on meta: compute them for real, in float32 as the official does
    network.encoder.positions = sinusoids(cfg.model.audio.tokens_per_chunk, cfg.model.audio.d_model).to(device)
    network.decoder.inv_freq = rope_inv_freq(cfg.model.text).to(device)
    load_weights(network, checkpoint_files(model_dir), cfg.model.layout, ALIGNER_PREFIXES[cfg.model.layout])
    return network.eval().requires_grad_(False)


@dataclass(frozen=True)
class AlignerInput:
    """One transcript made ready for the aligner."""

    words: tuple[str, ...]  # the units to time, in order (empty when `reason` is set)
    text_ids: tuple[int, ...]  # what follows <|audio_end|>: each word's tokens, then two <timestamp> slots
    reason: str | None = None  # why there is nothing to align (unsupported language, no words)


@dataclass(frozen=True)
class Alignment:
    """The word times of one clip (seconds from its start), or no words and the reason why."""

    words: tuple[WordTime, ...]
    reason: str | None = None


class ForcedAligner:
    """Loads a Qwen3-ForcedAligner checkpoint and aligns batches of (clip, transcript, language)."""

    def __init__(self, network: AlignerNetwork, tokenizer: Tokenizer, config: AlignerConfig):
        self.network = network
        self.tokenizer = tokenizer
        self.config = config
        self._languages = {name.lower(): name for name in config.languages}
        # a word's tokens, remembered: the engine prepares every final's words on its thread, and speech repeats words
        self._word_ids = functools.lru_cache(maxsize=WORD_CACHE_SIZE)(lambda word: tuple(tokenizer.encode(word)))

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        revision: str | None = None,
    ) -> "ForcedAligner":
        """A local checkpoint directory (either layout) or a Hugging Face id, e.g. Qwen/Qwen3-ForcedAligner-0.6B."""
        model_dir = resolve_model_dir(name_or_path, revision=revision)
        device = resolve_device(device)
        try:
            config = AlignerConfig.from_file(model_dir / "config.json")
        except ValueError as e:
            raise CheckpointError(f"{model_dir}: {e}") from e
        tokenizer = Tokenizer.from_pretrained(model_dir)
        if tokenizer.token_id(TIMESTAMP) != config.timestamp_token_id:
            raise CheckpointError(
                f"{model_dir}: the tokenizer's {TIMESTAMP} is id {tokenizer.token_id(TIMESTAMP)} but config.json "
                f"says timestamp_token_id {config.timestamp_token_id}"
            )
        network = load_aligner_network(model_dir, config, device=device, dtype=parse_dtype(dtype, device))
        return cls(network, tokenizer, config)

    @property
    def device(self) -> torch.device:
        return self.network.classifier.weight.device

    def prepare(self, text: str, language: str | None) -> AlignerInput:
        """Split `text` into the aligner's units for `language` and tokenize them; a reason instead if it cannot."""
        if language is None or not str(language).strip():
            return AlignerInput((), (), "no language: the aligner splits words per language")
        canonical = self._languages.get(str(language).strip().lower())
        if canonical is None:
            return AlignerInput(
                (), (), f"the aligner does not support {language}; it supports {', '.join(self.config.languages)}"
            )
        try:
            words = split_words(text, canonical)
        except SplitterUnavailable as e:
            return AlignerInput((), (), str(e))
        if not words:
            return AlignerInput((), (), "the text has no words to align")
        slots = (self.config.timestamp_token_id,) * 2
        text_ids = [token for word in words for token in self._word_ids(word) + slots]
        return AlignerInput(tuple(words), tuple(text_ids))

    def can_split(self, language: str) -> bool:
        """Whether words of `language` can be split here (supported, and nagisa installed for Japanese)."""
        canonical = self._languages.get(language.strip().lower())
        return canonical is not None and (canonical != "Japanese" or japanese_available())

    @torch.inference_mode()
    def align(
        self,
        audios: Sequence[np.ndarray | torch.Tensor],
        texts: Sequence[str],
        languages: Sequence[str | None] | str | None,
    ) -> list[Alignment]:
        """Word times for each (clip, transcript, language); one forward for all the clips that have words.

        audios: mono float clips at 16 kHz in [-1, 1]; languages: one per clip, or one for all.
        """
        if languages is None or isinstance(languages, str):
            languages = [languages] * len(audios)
        if not len(audios) == len(texts) == len(languages):
            raise ValueError(f"batch sizes differ: {len(audios)} clips, {len(texts)} texts, {len(languages)} languages")
        inputs = [self.prepare(text, language) for text, language in zip(texts, languages)]
        todo = [i for i, item in enumerate(inputs) if item.reason is None]
        results = [Alignment((), item.reason) for item in inputs]
        if todo:
            classes = self.timestamp_classes([audios[i] for i in todo], [inputs[i] for i in todo])
            for i, row in zip(todo, classes):
                results[i] = Alignment(tuple(word_times(inputs[i].words, row, self.config.timestamp_segment_ms)))
        return results

    @torch.inference_mode()
    def timestamp_classes(
        self, audios: Sequence[np.ndarray | torch.Tensor], inputs: Sequence[AlignerInput]
    ) -> list[list[int]]:
        """The argmax class of every timestamp slot, per row (2 per word); one device-to-host copy."""
        if not inputs:
            return []
        batch = self.plan(audios, inputs)
        return batch.read_classes(self.forward(batch, self.upload_clips(audios)).argmax(dim=-1).cpu().numpy())

    @torch.inference_mode()
    def slot_logits(self, audios: Sequence[np.ndarray | torch.Tensor], inputs: Sequence[AlignerInput]) -> torch.Tensor:
        """The head's logits at every timestamp slot, rows one after another -> [sum of 2 x words, C]."""
        if not inputs:
            return torch.zeros(0, self.config.classify_num, device=self.device)
        batch = self.plan(audios, inputs)
        logits = self.forward(batch, self.upload_clips(audios))
        return torch.cat([logits[b, torch.from_numpy(positions).to(self.device)]
                          for b, positions in enumerate(batch.slots)])

    def plan(self, audios: Sequence[np.ndarray | torch.Tensor], inputs: Sequence[AlignerInput]) -> AlignerBatch:
        """The host-side layout of aligning `audios` with `inputs` (checked: mono clips of an alignable length)."""
        if len(audios) != len(inputs):
            raise ValueError(f"{len(audios)} clips but {len(inputs)} inputs")
        if any(item.reason is not None for item in inputs):
            raise ValueError("an input with a reason has nothing to align")
        tok = self.tokenizer
        return plan_batch([self._check_clip(audio).shape[0] for audio in audios], [item.text_ids for item in inputs],
                          self.config.model.audio, audio_start_id=tok.audio_start_id, audio_pad_id=tok.audio_pad_id,
                          audio_end_id=tok.audio_end_id, pad_id=tok.endoftext_id,
                          timestamp_id=self.config.timestamp_token_id)

    def upload_clips(self, audios: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """The clips on the device as float32, in one copy (asynchronous from pinned memory on CUDA)."""
        flat = self._to_device(self._staged([np.asarray(a) for a in audios], torch.float32))
        return list(torch.split(flat, [int(a.shape[0]) for a in audios]))

    def upload(self, batch: AlignerBatch) -> dict[str, torch.Tensor]:
        """The batch's integer arrays on the device, in one copy -> {name: tensor} (names: aligner_batch.ARRAYS)."""
        flat = self._to_device(self._staged([getattr(batch, name) for name in ARRAYS], torch.int64))
        sizes = [getattr(batch, name).size for name in ARRAYS]
        return {name: part.view(getattr(batch, name).shape) for name, part in zip(ARRAYS, torch.split(flat, sizes))}

    def _staged(self, parts: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        """`parts` one after another in one host tensor of `dtype`, pinned on CUDA: written there in one pass (no
        pageable concatenation copied again into pinned memory), ready for an asynchronous copy."""
        host = torch.empty(sum(part.size for part in parts), dtype=dtype, pin_memory=self.device.type == "cuda")
        if parts:
            np.concatenate([part.reshape(-1) for part in parts], out=host.numpy(), casting="same_kind")
        return host

    def chunks(self, clips: list[torch.Tensor], batch: AlignerBatch, chunk_source: torch.Tensor) -> torch.Tensor:
        """Log-mel of the clips on the device, cut into the batch's chunk slots -> [8W, mels, 100], model dtype."""
        features, _ = log_mel_batch(clips, device=self.device)  # [B, mels, F], zero past each clip's frames
        B, mels, frames = features.shape
        size = self.config.model.audio.chunk_frames
        features = F.pad(features, (0, batch.max_chunks * size - frames))
        chunks = features.view(B, mels, batch.max_chunks, size).transpose(1, 2).reshape(-1, mels, size)
        chunks = torch.cat([chunks, chunks.new_zeros(1, mels, size)])  # the zero chunk empty slots read
        return chunks[chunk_source].to(self.network.classifier.weight.dtype)

    @torch.inference_mode()
    def forward(self, batch: AlignerBatch, clips: list[torch.Tensor]) -> torch.Tensor:
        """The whole forward, eagerly, at the batch's own shape: -> the head's logits at every position [B, T, C].

        mel per clip -> chunks -> encoder windows of all clips together -> each row's prompt with its audio in place
        -> the causal decoder over the right-padded rows -> the head."""
        arrays = self.upload(batch)
        audio = self.network.encode_chunks(self.chunks(clips, batch, arrays["chunk_source"]), arrays["chunk_valid"],
                                           arrays["window_lengths"])
        return self.network.timestamp_logits(arrays["ids"], arrays["audio_index"], arrays["lengths"], audio,
                                             self.tokenizer.audio_pad_id)

    def prompt_ids(self, item: AlignerInput, num_audio_tokens: int) -> list[int]:
        """The aligner's whole input for one clip: <|audio_start|>, the audio placeholders, <|audio_end|>, the words."""
        tok = self.tokenizer
        return [tok.audio_start_id, *[tok.audio_pad_id] * num_audio_tokens, tok.audio_end_id, *item.text_ids]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A `_staged` tensor on the device; on CUDA the copy is queued on the current stream and the host goes on
        (the caching host allocator keeps the pinned block until the copy is done)."""
        return host.to(self.device, non_blocking=True)

    def _check_clip(self, audio: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        if audio.ndim != 1:
            raise ValueError(f"expected a mono clip (1-D samples at {SAMPLE_RATE} Hz), got shape {tuple(audio.shape)}")
        seconds = audio.shape[0] / SAMPLE_RATE
        if audio.shape[0] < SAMPLE_RATE // 100:
            raise ValueError(f"cannot align a clip of {audio.shape[0]} samples (under one 10 ms feature frame)")
        if seconds > self.config.max_seconds:
            raise ValueError(
                f"cannot align a clip of {seconds:.1f} s: the aligner's classes reach {self.config.max_seconds:.0f} s"
            )
        return audio
