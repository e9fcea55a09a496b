"""Model configuration, read from a checkpoint's `config.json` in either official layout.

The original layout nests everything under `thinker_config` (`audio_config`, `text_config`); the transformers-native
"-hf" layout has `audio_config` and `text_config` at the top. Both describe the same two networks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


def conv_output_length(frames: int) -> int:
    """Tokens one encoder chunk of `frames` mel frames yields after three stride-2 convolutions (0 -> 0)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    d_model: int = 896
    encoder_layers: int = 18
    encoder_attention_heads: int = 14
    encoder_ffn_dim: int = 3584
    output_dim: int = 1024  # = the decoder's hidden size
    downsample_hidden_size: int = 480
    n_window: int = 50  # half a chunk: chunks are 2 * n_window mel frames (1 s)
    n_window_infer: int = 800  # mel frames per attention window (8 s)
    max_source_positions: int = 1500

    @property
    def chunk_frames(self) -> int:  # mel frames per conv chunk
        return 2 * self.n_window

    @property
    def tokens_per_chunk(self) -> int:  # 13 for 100-frame chunks
        return conv_output_length(self.chunk_frames)

    @property
    def window_tokens(self) -> int:  # 104: tokens per block-diagonal attention window
        return self.tokens_per_chunk * (self.n_window_infer // self.chunk_frames)

    @property
    def conv_out_features(self) -> int:  # channels x mel bins left after three stride-2 convs
        return self.downsample_hidden_size * conv_output_length(self.num_mel_bins)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def num_tokens(self, num_frames: int) -> int:
        """Audio tokens for `num_frames` mel frames: 13 per full chunk plus the conv length of the rest."""
        full, rest = divmod(num_frames, self.chunk_frames)
        return full * self.tokens_per_chunk + conv_output_length(rest)


@dataclass(frozen=True)
class TextDecoderConfig:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class ModelConfig:
    audio: AudioEncoderConfig
    text: TextDecoderConfig
    audio_token_id: int = 151676
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    layout: str = "original"  # "original" (thinker.*) or "hf" (model.audio_tower.*, model.language_model.*)
    support_languages: tuple[str, ...] = ()

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        if "thinker_config" in cfg:
            layout, inner = "original", cfg["thinker_config"]
        elif "audio_config" in cfg and "text_config" in cfg:
            layout, inner = "hf", cfg
        else:
            raise ValueError(
                "config.json is not a Qwen3-ASR config: expected `thinker_config` (original layout) "
                "or `audio_config` + `text_config` (transformers-native layout)"
            )
        audio = _pick(AudioEncoderConfig, inner.get("audio_config") or {})
        text_cfg = dict(inner.get("text_config") or {})
        # transformers 5 moved rope_theta into rope_parameters
        rope = text_cfg.get("rope_parameters") or {}
        if "rope_theta" not in text_cfg and "rope_theta" in rope:
            text_cfg["rope_theta"] = rope["rope_theta"]
        if layout == "hf" and "tie_word_embeddings" not in text_cfg:
            text_cfg["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
        text = _pick(TextDecoderConfig, text_cfg)
        if audio.output_dim != text.hidden_size:
            raise ValueError(f"audio output_dim {audio.output_dim} != text hidden_size {text.hidden_size}")
        return cls(
            audio=audio,
            text=text,
            audio_token_id=inner.get("audio_token_id", 151676),
            audio_start_token_id=inner.get("audio_start_token_id", 151669),
            audio_end_token_id=inner.get("audio_end_token_id", 151670),
            layout=layout,
            support_languages=tuple(cfg.get("support_languages") or ()),
        )


def _pick(cls, values: dict):
    """Build a config dataclass from the keys it knows; the checkpoint's others are informational."""
    names = cls.__dataclass_fields__.keys()
    return cls(**{k: v for k, v in values.items() if k in names})


# The languages Qwen3-ForcedAligner-0.6B aligns (its model card and config.json's support_languages, in that order);
# the "-hf" config does not carry the list, so this is the default.
ALIGNER_LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean", "Portuguese", "Russian",
    "Spanish",
)  # fmt: skip


@dataclass(frozen=True)
class AlignerConfig:
    """A Qwen3-ForcedAligner checkpoint: the ASR network's shapes plus a timestamp-class head.

    Original layout: `thinker_config.classify_num` (and `thinker_config.model_type` "qwen3_forced_aligner"), with
    `timestamp_token_id`, `timestamp_segment_time` and `support_languages` at the top. "-hf" layout:
    `num_timestamp_bins`, `timestamp_token_id` and `timestamp_segment_time` at the top.
    """

    model: ModelConfig  # encoder and decoder shapes; the decoder has no vocabulary head (tie_word_embeddings False)
    classify_num: int  # timestamp classes (5000)
    timestamp_token_id: int  # <timestamp> (151705)
    timestamp_segment_ms: float  # ms per class (80)
    languages: tuple[str, ...] = ALIGNER_LANGUAGES

    @classmethod
    def from_file(cls, path: str | Path) -> "AlignerConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict) -> "AlignerConfig":
        model = ModelConfig.from_dict(cfg)
        if model.layout == "original":
            classify_num, where = cfg["thinker_config"].get("classify_num"), "thinker_config.classify_num"
        else:
            classify_num, where = cfg.get("num_timestamp_bins"), "num_timestamp_bins"
        if classify_num is None:
            raise ValueError(
                f"config.json has no {where}: not a Qwen3-ForcedAligner checkpoint (an ASR model's config?)"
            )
        missing = [key for key in ("timestamp_token_id", "timestamp_segment_time") if cfg.get(key) is None]
        if missing:
            raise ValueError(f"the forced aligner's config.json lacks {' and '.join(missing)}")
        segment_ms = float(cfg["timestamp_segment_time"])
        if int(classify_num) < 1 or segment_ms <= 0:
            raise ValueError(f"bad timestamp head: {classify_num} classes of {segment_ms} ms")
        text = dataclasses.replace(model.text, tie_word_embeddings=False)
        return cls(
            model=dataclasses.replace(model, text=text),
            classify_num=int(classify_num),
            timestamp_token_id=int(cfg["timestamp_token_id"]),
            timestamp_segment_ms=segment_ms,
            languages=model.support_languages or ALIGNER_LANGUAGES,
        )

    @property
    def max_seconds(self) -> float:
        """The longest clip whose times the classes can express (400 s for 5000 classes of 80 ms)."""
        return self.classify_num * self.timestamp_segment_ms / 1000.0
