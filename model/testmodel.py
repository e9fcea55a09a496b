"""Random-weight Qwen3-ASR checkpoints with a working tokenizer, for tests and benchmarks.

No real weights can be downloaded where qasr is tested, so `make_test_model` writes a complete checkpoint in either
official layout (original `thinker.*` or transformers-native "-hf") that the official toolkit loads as it would the
real one: config.json, generation_config.json, preprocessor_config.json, the tokenizer files, the chat template and
safetensors (sharded with an index if asked). Shapes are the real ones ("0.6B", "1.7B") or a tiny model with the real
vocabulary, mel bins, windows and token ids.

The tokenizer keeps the real vocabulary size (151936 embedding rows) and the real added-token ids, but its BPE is a
small one trained here on a built-in text, padded with filler tokens up to the real size so every id decodes to text.

Weights are drawn per tensor from a generator seeded by (seed, tensor name): the same seed gives the same values in
every layout, dtype cast aside, and in any number of shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from .config import ALIGNER_LANGUAGES
from .prompt import SUPPORTED_LANGUAGES
from .tokenizer import QWEN2_PRETOKENIZE_REGEX

if TYPE_CHECKING:  # torch is imported where weights are made, so `qasr-make-test-model --help` is instant
    import torch

VOCAB_SIZE = 151936  # embedding rows of every Qwen3-ASR size
NUM_BPE_TOKENS = 151643  # entries of vocab.json; added tokens start here
TRANSFORMERS_VERSION = "4.57.1"  # written into config.json; see checkpoint_config
SIZES = ("tiny", "0.6B", "1.7B")
LAYOUTS = ("original", "hf")
DTYPES = ("float32", "bfloat16")  # names of torch dtypes the weights can be saved in


@dataclass(frozen=True)
class Shapes:
    """The widths that differ between sizes; everything else is shared."""

    audio_d_model: int
    audio_layers: int
    audio_heads: int
    audio_ffn: int
    downsample_hidden_size: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    tie_word_embeddings: bool  # the default for the size


SHAPES = {
    "tiny": Shapes(32, 2, 2, 64, 8, 64, 2, 4, 2, 16, 128, (4, 2, 2), tie_word_embeddings=False),
    "0.6B": Shapes(896, 18, 14, 3584, 480, 1024, 28, 16, 8, 128, 3072, (24, 20, 20), tie_word_embeddings=True),
    "1.7B": Shapes(1024, 24, 16, 4096, 480, 2048, 28, 16, 8, 128, 6144, (24, 20, 20), tie_word_embeddings=True),
}
NUM_MEL_BINS = 128

# Added tokens, id -> (content, special). The ids the ASR prompt uses are the real ones; the others are Qwen3's added
# tokens (or plausible stand-ins) so that every id between lines up.
_RESERVED = {i: (f"<|reserved_special_token_{n}|>", True) for n, i in enumerate([151675, *range(151677, 151704)])}
ADDED_TOKENS: dict[int, tuple[str, bool]] = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
    151669: ("<|audio_start|>", True),
    151670: ("<|audio_end|>", True),
    151671: ("<tts_pad>", True),
    151672: ("<tts_text_bos>", True),
    151673: ("<tts_text_eod>", True),
    151674: ("<tts_text_bos_single>", True),
    151676: ("<|audio_pad|>", True),
    151704: ("<asr_text>", False),  # not special: decoded text keeps it
    **_RESERVED,
}
AUDIO_TOKEN_ID, AUDIO_START_TOKEN_ID, AUDIO_END_TOKEN_ID = 151676, 151669, 151670
ENDOFTEXT_ID, IM_END_ID = 151643, 151645

# The official processor renders this template; it yields
# <|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n
# and, with add_generation_prompt, <|im_start|>assistant\n.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'audio' or 'audio' in part or 'audio_url' in part %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Text the test BPE is trained on: the words of the prompt and the language names, plus a little of several scripts.
TRAINING_TEXT = "\n".join(
    [
        "system", "user", "assistant",  # as they follow <|im_start|>
        "system user assistant language None " + " ".join(SUPPORTED_LANGUAGES),
        *(f"language {name}" for name in SUPPORTED_LANGUAGES),
        "The quick brown fox jumps over the lazy dog while the radio plays in the kitchen.",
        "Please call me back tomorrow morning at nine thirty, or send a short message instead.",
        "We measured the latency of every request and wrote the numbers into a small table.",
        "Speech recognition turns spoken words into written text, one sentence after another.",
        "It's a test, isn't it? They'll see, we've seen, you're right, I'm here, she'd know.",
        "Numbers like 12, 345, 6789 and 3.14 appear in the transcripts, as do dates: 2024-05-17.",
        "Hello, how are you today? Fine, thanks. And you? The weather is nice; let's go outside!",
        "The meeting starts at ten. Bring the report, the slides and the budget for next year.",
        "今天天气很好，我们去公园散步吧。语音识别把说的话变成文字。",
        "请在明天上午九点以前把报告发给我，谢谢。",
        "Guten Morgen, wie geht es Ihnen? Ich möchte einen Tisch für zwei Personen reservieren.",
        "Bonjour, je voudrais un café et un croissant, s'il vous plaît. Merci beaucoup!",
        "Hola, ¿cómo estás? Mañana vamos a la playa con mis amigos.",
        "Olá, tudo bem? Eu gostaria de saber o horário do próximo ônibus.",
        "こんにちは、今日はいい天気ですね。音声認識のテストです。",
        "안녕하세요, 만나서 반갑습니다. 오늘 회의는 세 시에 시작합니다.",
        "Привет, как дела? Сегодня мы проверяем распознавание речи.",
        "مرحبا، كيف حالك؟ هذا اختبار للتعرف على الكلام.",
        "नमस्ते, आप कैसे हैं? यह वाक् पहचान का परीक्षण है।",
        "สวัสดีครับ วันนี้อากาศดีมาก",
        "Xin chào, hôm nay trời đẹp quá.",
    ]
)

README = """# Random-weight Qwen3-ASR test checkpoint

**The weights in this folder are random.** Any transcript it produces is meaningless. It exists so that qasr and
the official `qwen-asr` toolkit can be tested and benchmarked against each other where real weights are not available.

- size: {size}, layout: {layout}, dtype: {dtype}, seed: {seed}, shards: {num_shards},
  tie_word_embeddings: {tie}
- tokenizer: the real vocabulary size and added-token ids, but a small BPE trained on a few sentences and padded with
  filler tokens; encoding ordinary text gives short, valid ids, not the ids the real model would see.

Made by `qasr-make-test-model` (qasr.model.testmodel).
"""


def make_test_model(
    out_dir: str | Path,
    *,
    layout: str = "original",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """Write a complete random-weight checkpoint into `out_dir` (created if needed) and return its path.

    layout: "original" (thinker.*, nested thinker_config) or "hf" (model.audio_tower.*, model.language_model.*).
    size: "tiny" (fast CPU tests), "0.6B" or "1.7B" (real shapes).
    tie_word_embeddings: share lm_head with the token embedding (no lm_head tensor is saved); None takes the
        size's default (untied for tiny, tied like the real 0.6B/1.7B).
    """
    _check_choices(layout=layout, size=size, dtype=dtype)
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    shapes = SHAPES[size]
    tie = shapes.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)
    specs = tensor_specs(shapes, tie_word_embeddings=tie)
    if num_shards > len(specs):
        raise ValueError(f"num_shards {num_shards} is more than the {len(specs)} tensors of the model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()  # weights of a checkpoint written here before would mix with these

    _write_json(out / "config.json", checkpoint_config(size, layout=layout, dtype=dtype, tie_word_embeddings=tie))
    _write_json(out / "generation_config.json", _generation_config())
    _write_json(out / "preprocessor_config.json", _preprocessor_config(layout))
    write_tokenizer_files(out)
    _write_weights(out, specs, layout=layout, seed=seed, dtype=dtype, num_shards=num_shards)
    (out / "README.md").write_text(
        README.format(size=size, layout=layout, dtype=dtype, seed=seed, num_shards=num_shards, tie=tie),
        encoding="utf-8",
    )
    return out


def _check_choices(*, layout: str, size: str, dtype: str) -> None:
    for what, value, choices in (("layout", layout, LAYOUTS), ("size", size, SIZES), ("dtype", dtype, tuple(DTYPES))):
        if value not in choices:
            raise ValueError(f"{what} must be one of {choices}, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Weights


@dataclass(frozen=True)
class TensorSpec:
    name: str  # original-layout name
    shape: tuple[int, ...]
    kind: str  # how it is initialised: "linear", "bias", "norm_weight", "norm_bias", "embedding", "lm_head"
    fan_in: int = 1


def tensor_specs(shapes: Shapes, *, tie_word_embeddings: bool) -> list[TensorSpec]:
    """Every tensor of the model, in original-layout names and a stable order."""
    specs: list[TensorSpec] = []

    def linear(name: str, out_features: int, in_features: int, bias: bool = True) -> None:
        specs.append(TensorSpec(f"{name}.weight", (out_features, in_features), "linear", in_features))
        if bias:
            specs.append(TensorSpec(f"{name}.bias", (out_features,), "bias"))

    def layer_norm(name: str, width: int) -> None:
        specs.append(TensorSpec(f"{name}.weight", (width,), "norm_weight"))
        specs.append(TensorSpec(f"{name}.bias", (width,), "norm_bias"))

    def rms_norm(name: str, width: int) -> None:
        specs.append(TensorSpec(f"{name}.weight", (width,), "norm_weight"))

    a, d, dh = "thinker.audio_tower", shapes.audio_d_model, shapes.downsample_hidden_size
    for i, in_channels in enumerate((1, dh, dh), start=1):
        specs.append(TensorSpec(f"{a}.conv2d{i}.weight", (dh, in_channels, 3, 3), "linear", in_channels * 9))
        specs.append(TensorSpec(f"{a}.conv2d{i}.bias", (dh,), "bias"))
    mel_after_convs = NUM_MEL_BINS
    for _ in range(3):
        mel_after_convs = (mel_after_convs + 1) // 2
    linear(f"{a}.conv_out", d, dh * mel_after_convs, bias=False)
    for n in range(shapes.audio_layers):
        layer = f"{a}.layers.{n}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{layer}.self_attn.{proj}", d, d)
        layer_norm(f"{layer}.self_attn_layer_norm", d)
        linear(f"{layer}.fc1", shapes.audio_ffn, d)
        linear(f"{layer}.fc2", d, shapes.audio_ffn)
        layer_norm(f"{layer}.final_layer_norm", d)
    layer_norm(f"{a}.ln_post", d)
    linear(f"{a}.proj1", d, d)
    linear(f"{a}.proj2", shapes.text_hidden, d)

    t, h, hd = "thinker.model", shapes.text_hidden, shapes.head_dim
    specs.append(TensorSpec(f"{t}.embed_tokens.weight", (VOCAB_SIZE, h), "embedding", h))
    for n in range(shapes.text_layers):
        layer = f"{t}.layers.{n}"
        linear(f"{layer}.self_attn.q_proj", shapes.text_heads * hd, h, bias=False)
        linear(f"{layer}.self_attn.k_proj", shapes.text_kv_heads * hd, h, bias=False)
        linear(f"{layer}.self_attn.v_proj", shapes.text_kv_heads * hd, h, bias=False)
        linear(f"{layer}.self_attn.o_proj", h, shapes.text_heads * hd, bias=False)
        rms_norm(f"{layer}.self_attn.q_norm", hd)
        rms_norm(f"{layer}.self_attn.k_norm", hd)
        linear(f"{layer}.mlp.gate_proj", shapes.text_intermediate, h, bias=False)
        linear(f"{layer}.mlp.up_proj", shapes.text_intermediate, h, bias=False)
        linear(f"{layer}.mlp.down_proj", h, shapes.text_intermediate, bias=False)
        rms_norm(f"{layer}.input_layernorm", h)
        rms_norm(f"{layer}.post_attention_layernorm", h)
    rms_norm(f"{t}.norm", h)
    if not tie_word_embeddings:
        specs.append(TensorSpec("thinker.lm_head.weight", (VOCAB_SIZE, h), "lm_head", h))
    return specs


HF_PREFIXES = (  # original-layout prefix -> transformers-native ("-hf") prefix, first match wins
    ("thinker.audio_tower.proj1.", "model.multi_modal_projector.linear_1."),
    ("thinker.audio_tower.proj2.", "model.multi_modal_projector.linear_2."),
    ("thinker.audio_tower.", "model.audio_tower."),
    ("thinker.model.", "model.language_model."),
    ("thinker.lm_head.", "lm_head."),
)


def hf_name(original_name: str, prefixes: tuple[tuple[str, str], ...] = HF_PREFIXES) -> str:
    """The transformers-native ("-hf") name of an original-layout tensor."""
    for old, new in prefixes:
        if original_name.startswith(old):
            return new + original_name[len(old) :]
    raise ValueError(f"no -hf name for {original_name!r}")


# Initialisation. Linear layers keep activations near unit scale (std 1/sqrt(fan_in)); norms get weights away from 1
# and biases away from 0, so a loader that skips one is caught; the token embedding has unit-scale rows. The lm_head
# is 32x the unit scale: logits have std ~32 and peak near 150 with the top-1 typically ~5 logits (3 %) above the
# runner-up, so greedy decoding is sharp yet still follows the audio; the top two come within 1e-4 (relative) of each
# other in about 1 step of 200, still ~100x the fp32 rounding differences between implementations. Rows past the
# tokenizer's ids are zero, so greedy decoding never picks an id that decodes to nothing.
LM_HEAD_GAIN = 32.0


def init_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 values of one tensor: a function of (seed, name) only."""
    import torch

    digest = hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == "linear":
        return values.mul_(spec.fan_in**-0.5)
    if spec.kind in ("bias", "norm_bias"):
        return values.mul_(0.1)
    if spec.kind == "norm_weight":
        return values.mul_(0.1).add_(1.0)
    if spec.kind in ("embedding", "lm_head"):
        if spec.kind == "lm_head":
            values.mul_(LM_HEAD_GAIN * spec.fan_in**-0.5)
        values[len(ADDED_TOKENS) + NUM_BPE_TOKENS :] = 0.0
        return values
    if spec.kind == "aligner_embedding":  # the aligner's tokenizer has one more added token: <timestamp>
        values[TIMESTAMP_TOKEN_ID + 1 :] = 0.0
        values[TIMESTAMP_TOKEN_ID] *= TIMESTAMP_EMBED_SCALE
        return values
    if spec.kind == "classifier":  # the aligner's timestamp head: as sharp as the lm_head (see LM_HEAD_GAIN)
        return values.mul_(LM_HEAD_GAIN * spec.fan_in**-0.5)
    if spec.kind == "aligner_q_norm":  # see ALIGNER_QUERY_GAIN
        return values.mul_(0.1).add_(1.0).mul_(ALIGNER_QUERY_GAIN)
    raise ValueError(f"unknown tensor kind {spec.kind!r}")


def _write_weights(
    out: Path, specs: list[TensorSpec], *, layout: str, seed: int, dtype: str, num_shards: int,
    name_of=None,
) -> None:
    """Save the tensors as `dtype`, `num_shards` files of about equal size; only one shard's tensors are in memory at
    a time.

    name_of(original name) -> saved name; default: the ASR model's names in `layout`.
    """
    name_of = name_of or (hf_name if layout == "hf" else (lambda name: name))
    import torch
    from safetensors.torch import save_file

    shards = _split_evenly(specs, num_shards)
    files = (
        ["model.safetensors"]
        if num_shards == 1
        else [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
    )
    weight_map, total_size = {}, 0
    for file_name, shard in zip(files, shards):
        tensors = {}
        for spec in shard:
            name = name_of(spec.name)
            tensors[name] = init_tensor(spec, seed).to(getattr(torch, dtype))
            total_size += tensors[name].nbytes
            weight_map[name] = file_name
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
    if num_shards > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)


def _split_evenly(specs: list[TensorSpec], num_shards: int) -> list[list[TensorSpec]]:
    """Cut the tensor list into `num_shards` consecutive, non-empty runs of about equal element counts."""
    sizes = [math.prod(spec.shape) for spec in specs]
    total = sum(sizes)
    shards, start, done = [], 0, 0
    for k in range(num_shards - 1):
        # Take one tensor, then more while their midpoints fall in this shard's share, leaving one per later shard.
        end, done = start + 1, done + sizes[start]
        share_end = total * (k + 1) / num_shards
        while end < len(specs) - (num_shards - 1 - k) and done + sizes[end] / 2 <= share_end:
            done += sizes[end]
            end += 1
        shards.append(specs[start:end])
        start = end
    shards.append(specs[start:])
    return shards


# ----------------------------------------------------------------------------------------------------------------
# Configs


def _audio_config(shapes: Shapes) -> dict:
    return {
        "num_mel_bins": NUM_MEL_BINS,
        "encoder_layers": shapes.audio_layers,
        "encoder_attention_heads": shapes.audio_heads,
        "encoder_ffn_dim": shapes.audio_ffn,
        "d_model": shapes.audio_d_model,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_function": "gelu",
        "activation_dropout": 0.0,
        "scale_embedding": False,
        "initializer_range": 0.02,
        "max_source_positions": 1500,
        "n_window": 50,
        "output_dim": shapes.text_hidden,
        "n_window_infer": 800,
        "conv_chunksize": 500,
        "downsample_hidden_size": shapes.downsample_hidden_size,
    }


def _text_config(shapes: Shapes, *, tie: bool) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shapes.text_hidden,
        "intermediate_size": shapes.text_intermediate,
        "num_hidden_layers": shapes.text_layers,
        "num_attention_heads": shapes.text_heads,
        "num_key_value_heads": shapes.text_kv_heads,
        "head_dim": shapes.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "rope_theta": 1000000.0,
        # The official rotary code reads rope_scaling["mrope_section"]; positions are equal on all three axes.
        "rope_scaling": {"rope_type": "default", "mrope_section": list(shapes.mrope_section), "interleaved": True},
        "attention_bias": False,
        "attention_dropout": 0.0,
        # The official model ties lm_head to embed_tokens on this key (text_config), not on the outer ones.
        "tie_word_embeddings": tie,
    }


def checkpoint_config(
    size: str = "tiny", *, layout: str = "original", dtype: str = "float32", tie_word_embeddings: bool | None = None
) -> dict:
    """The config.json make_test_model writes (arguments as there).

    `transformers_version` matters: transformers 4.57.3-4.57.x, loading a local tokenizer with fix_mistral_regex=True
    (as qwen-asr does), swaps the Qwen2 pre-tokenizer regex for Mistral's unless config.json names a version <= 4.57.2
    or >= 5. We write 4.57.1 so the official processor tokenizes with the Qwen2 regex the vocabulary was made for.
    """
    _check_choices(layout=layout, size=size, dtype=dtype)
    shapes = SHAPES[size]
    tie = shapes.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)
    audio, text = _audio_config(shapes), _text_config(shapes, tie=tie)
    if layout == "original":
        return {
            "architectures": ["Qwen3ASRForConditionalGeneration"],
            "model_type": "qwen3_asr",
            "support_languages": list(SUPPORTED_LANGUAGES),
            "thinker_config": {
                "model_type": "qwen3_asr_thinker",
                "audio_config": {"model_type": "qwen3_asr_audio_encoder", **audio},
                "text_config": {"model_type": "qwen3_asr_text", **text},
                "audio_token_id": AUDIO_TOKEN_ID,
                "audio_start_token_id": AUDIO_START_TOKEN_ID,
                "audio_end_token_id": AUDIO_END_TOKEN_ID,
                "initializer_range": 0.02,
                "dtype": dtype,
                "tie_word_embeddings": tie,
            },
            "dtype": dtype,
            "tie_word_embeddings": tie,
            "transformers_version": TRANSFORMERS_VERSION,
        }
    text_hf = {k: v for k, v in text.items() if k not in ("rope_theta", "rope_scaling")}
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "audio_config": {"model_type": "qwen3_asr_encoder", **audio},
        "text_config": {
            "model_type": "qwen3",
            **text_hf,
            # transformers 5 spelling of the rotary settings
            "rope_parameters": {"rope_type": "default", "rope_theta": text["rope_theta"]},
        },
        "audio_token_id": AUDIO_TOKEN_ID,
        "pad_token_id": IM_END_ID,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "support_languages": list(SUPPORTED_LANGUAGES),
        "dtype": dtype,
        "tie_word_embeddings": tie,
        "transformers_version": "5.0.0",
    }


def _generation_config() -> dict:
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": False,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def _preprocessor_config(layout: str) -> dict:
    config = {
        "chunk_length": 30,
        "dither": 0.0,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": NUM_MEL_BINS,
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "Qwen3ASRProcessor",
        "return_attention_mask": True,
        "sampling_rate": 16000,
    }
    if layout == "hf":
        config.update(feature_extractor_type="Qwen3ASRFeatureExtractor", n_window=50)
    return config


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def write_tokenizer_files(out: str | Path) -> None:
    """vocab.json, merges.txt, tokenizer_config.json and chat_template.json of the test tokenizer."""
    out = Path(out)
    vocab, merges = _padded_vocab_and_merges()
    _write_json(out / "vocab.json", vocab, indent=None)
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges), encoding="utf-8"
    )
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def _tokenizer_config() -> dict:
    added = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token_id, (content, special) in sorted(ADDED_TOKENS.items())
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
        ],  # fmt: skip
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3ASRProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(text: str) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE trained on TRAINING_TEXT with the Qwen2 pre-tokenizer (deterministic)."""
    bpe = tokenizers.Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = BpeTrainer(
        vocab_size=2000,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _padded_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The trained BPE plus filler tokens up to the real vocab.json size (151643 entries)."""
    vocab, merges = _train_bpe()
    for filler in _filler_tokens():
        if len(vocab) == NUM_BPE_TOKENS:
            break
        if filler not in vocab:
            vocab[filler] = len(vocab)
    if sorted(vocab.values()) != list(range(NUM_BPE_TOKENS)):
        raise RuntimeError("test vocabulary ids are not 0..151642")
    return vocab, merges


def _filler_tokens():
    """Tokens that decode to readable text: every CJK ideograph, then ' ' + 3 or 4 lowercase letters."""
    for code_point in range(0x4E00, 0xA000):
        yield _byte_level(chr(code_point))
    space = _bytes_to_unicode()[ord(" ")]
    for length in (3, 4):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield space + "".join(letters)


# ----------------------------------------------------------------------------------------------------------------
# Forced aligner (Qwen3-ForcedAligner-0.6B): the same network with a timestamp-class head; see qasr.model.aligner


ALIGNER_SIZES = ("tiny", "0.6B")
# The real aligner pairs the 1.7B's audio encoder (d_model 1024, 24 layers) with the 0.6B's text decoder.
ALIGNER_SHAPES = {
    "tiny": SHAPES["tiny"],
    "0.6B": dataclasses.replace(
        SHAPES["0.6B"], audio_d_model=1024, audio_layers=24, audio_heads=16, audio_ffn=4096, tie_word_embeddings=False
    ),
}
TIMESTAMP_TOKEN_ID = 151705  # <timestamp>, the added token after <asr_text>
CLASSIFY_NUM = 5000  # timestamp classes
TIMESTAMP_SEGMENT_TIME = 80  # ms per class
# Every timestamp slot holds the same token; at unit scale its embedding would dominate the slot's hidden state and
# a random aligner would give (nearly) one class everywhere. Small, the slots' classes follow the audio and the
# words around them, so they vary and the monotonic repair has work to do.
TIMESTAMP_EMBED_SCALE = 0.01
# Random attention at unit scale is nearly uniform: every slot would average the same hundreds of audio tokens and
# get the same class. Larger decoder query norms sharpen it, so a slot's class depends on the tokens near it.
ALIGNER_QUERY_GAIN = 4.0

ALIGNER_README = """# Random-weight Qwen3-ForcedAligner test checkpoint

**The weights in this folder are random.** The word times it produces are meaningless. It exists so that qasr's
aligner and the official `qwen-asr` toolkit can be tested and benchmarked against each other.

- size: {size}, layout: {layout}, dtype: {dtype}, seed: {seed}, shards: {num_shards}
- {classify_num} timestamp classes of {segment} ms; `<timestamp>` is token {timestamp_id}
- tokenizer: the test ASR tokenizer plus `<timestamp>` (a small BPE, not the real vocabulary's ids for text)

Made by `qasr-make-test-model --aligner` (qasr.model.testmodel).
"""


def make_test_aligner(
    out_dir: str | Path,
    *,
    layout: str = "original",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
) -> Path:
    """Write a complete random-weight forced-aligner checkpoint into `out_dir` and return its path.

    layout "original": what Qwen/Qwen3-ForcedAligner-0.6B ships (thinker.*, thinker_config.classify_num, the
    classifier saved as thinker.lm_head). layout "hf": what transformers' conversion script writes for
    Qwen3-ForcedAligner-0.6B-hf (model.audio_tower.* with proj1/proj2 inside, no encoder k_proj biases,
    model.language_model.*, classifier.weight, a flat config with num_timestamp_bins).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if size not in ALIGNER_SIZES:
        raise ValueError(f"aligner size must be one of {ALIGNER_SIZES}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    specs = aligner_tensor_specs(ALIGNER_SHAPES[size], layout=layout)
    if not 1 <= num_shards <= len(specs):
        raise ValueError(f"num_shards must be between 1 and {len(specs)}, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()

    _write_json(out / "config.json", aligner_config(size, layout=layout, dtype=dtype))
    _write_json(out / "preprocessor_config.json", _preprocessor_config(layout))
    write_tokenizer_files(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["added_tokens_decoder"][str(TIMESTAMP_TOKEN_ID)] = {
        "content": "<timestamp>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": False,
    }  # fmt: skip
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    name_of = aligner_hf_name if layout == "hf" else (lambda name: name)
    _write_weights(out, specs, layout=layout, seed=seed, dtype=dtype, num_shards=num_shards,
                   name_of=name_of)
    (out / "README.md").write_text(
        ALIGNER_README.format(size=size, layout=layout, dtype=dtype, seed=seed, num_shards=num_shards,
                              classify_num=CLASSIFY_NUM, segment=TIMESTAMP_SEGMENT_TIME,
                              timestamp_id=TIMESTAMP_TOKEN_ID),
        encoding="utf-8",
    )
    return out


def aligner_tensor_specs(shapes: Shapes, *, layout: str = "original") -> list[TensorSpec]:
    """The aligner's tensors in original-layout names: the ASR network without lm_head, plus the timestamp head.

    The "-hf" conversion drops the encoder's k_proj biases (softmax cancels them), so that layout has none.
    """
    specs = []
    for spec in tensor_specs(shapes, tie_word_embeddings=True):
        if layout == "hf" and spec.name.startswith("thinker.audio_tower.") and spec.name.endswith("k_proj.bias"):
            continue
        if spec.kind == "embedding":
            spec = dataclasses.replace(spec, kind="aligner_embedding")
        elif spec.name.startswith("thinker.model.") and spec.name.endswith("self_attn.q_norm.weight"):
            spec = dataclasses.replace(spec, kind="aligner_q_norm")
        specs.append(spec)
    specs.append(TensorSpec("thinker.lm_head.weight", (CLASSIFY_NUM, shapes.text_hidden), "classifier",
                            shapes.text_hidden))
    return specs


ALIGNER_HF_PREFIXES = (  # the aligner's "-hf" layout has no projector block and calls its head `classifier`
    ("thinker.audio_tower.", "model.audio_tower."),
    ("thinker.model.", "model.language_model."),
    ("thinker.lm_head.", "classifier."),
)


def aligner_hf_name(original_name: str) -> str:
    """The transformers-native ("-hf") name of an original-layout aligner tensor."""
    return hf_name(original_name, ALIGNER_HF_PREFIXES)


def aligner_config(size: str = "tiny", *, layout: str = "original", dtype: str = "float32") -> dict:
    """The config.json make_test_aligner writes.

    The official code tells the aligner from the ASR model by `"forced_aligner" in thinker_config.model_type` (its
    lm_head then has `classify_num` rows) and reads `timestamp_token_id` and `timestamp_segment_time` from the
    top level. The text decoder is untied: the head is not the embedding.
    """
    shapes = ALIGNER_SHAPES[size]
    audio, text = _audio_config(shapes), _text_config(shapes, tie=False)
    if layout == "original":
        return {
            "architectures": ["Qwen3ASRForConditionalGeneration"],
            "model_type": "qwen3_asr",
            "support_languages": list(ALIGNER_LANGUAGES),
            "timestamp_token_id": TIMESTAMP_TOKEN_ID,
            "timestamp_segment_time": TIMESTAMP_SEGMENT_TIME,
            "thinker_config": {
                "model_type": "qwen3_forced_aligner",
                "classify_num": CLASSIFY_NUM,
                "audio_config": {"model_type": "qwen3_asr_audio_encoder", **audio},
                "text_config": {"model_type": "qwen3_asr_text", **text},
                "audio_token_id": AUDIO_TOKEN_ID,
                "audio_start_token_id": AUDIO_START_TOKEN_ID,
                "audio_end_token_id": AUDIO_END_TOKEN_ID,
                "initializer_range": 0.02,
                "dtype": dtype,
                "tie_word_embeddings": False,
            },
            "dtype": dtype,
            "tie_word_embeddings": False,
            "transformers_version": TRANSFORMERS_VERSION,
        }
    if layout != "hf":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    text_hf = {k: v for k, v in text.items() if k not in ("rope_theta", "rope_scaling")}
    return {
        "architectures": ["Qwen3ASRForForcedAlignment"],
        "model_type": "qwen3_forced_aligner",
        "audio_config": {"model_type": "qwen3_asr_audio_encoder", **audio},
        "text_config": {
            "model_type": "qwen3",
            **text_hf,
            "rope_parameters": {"rope_type": "default", "rope_theta": text["rope_theta"]},
        },
        "audio_token_id": AUDIO_TOKEN_ID,
        "num_timestamp_bins": CLASSIFY_NUM,
        "timestamp_token_id": TIMESTAMP_TOKEN_ID,
        "timestamp_segment_time": TIMESTAMP_SEGMENT_TIME,
        "pad_token_id": IM_END_ID,
        "dtype": dtype,
        "tie_word_embeddings": False,
        "transformers_version": "5.0.0",
    }


# ----------------------------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict, indent: int | None = 2) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


ALIGNER_HELP = f"write a Qwen3-ForcedAligner-shaped checkpoint instead (sizes: {', '.join(ALIGNER_SIZES)})"


def _aligner_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """main() for --aligner: the same options, minus --tie-word-embeddings (the timestamp head is never tied)."""
    if args.tie_word_embeddings is not None:
        parser.error("--tie-word-embeddings does not apply to --aligner (its timestamp head is never tied)")
    try:
        path = make_test_aligner(args.out_dir, layout=args.layout, size=args.size, seed=args.seed, dtype=args.dtype,
                                 num_shards=args.shards)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        print(f"qasr-make-test-model: error: cannot write {args.out_dir}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a random-weight {args.size} aligner checkpoint ({args.layout} layout) to {path}", file=sys.stderr)
    return 0


def _out_dir_problem(out_dir: Path, *, force: bool) -> str | None:
    """Why main() will not write to `out_dir` (None: it may): a file is never replaced, and a folder that holds
    something only with --force (a mistyped path must not fill someone's folder with weights)."""
    if out_dir.exists() and not out_dir.is_dir():
        return f"{out_dir} is a file: name a new or empty folder"
    if out_dir.is_dir() and not force and any(out_dir.iterdir()):
        return f"{out_dir} is not empty: name a new or empty folder, or pass --force to write into it"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qasr-make-test-model",
        description="Write a random-weight Qwen3-ASR checkpoint (meaningless transcripts) for tests and benchmarks.",
        epilog="Then serve it: qasr-server --model OUT_DIR --device cpu",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new or empty folder to write (created)")
    parser.add_argument("--force", action="store_true",
                        help="write into OUT_DIR although it is not empty (files of the same names are replaced)")
    parser.add_argument("--layout", choices=LAYOUTS, default="original",
                        help="tensor names and config layout: the original Qwen release's or transformers' -hf "
                             "(default: %(default)s)")
    parser.add_argument("--size", choices=SIZES, default="tiny",
                        help="tiny for CPU tests and demos, or the real model's shapes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="each tensor is drawn from (SEED, its name): the same seed writes the same weights "
                             "in any layout or shard count (default: %(default)s)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of the saved weights (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=1,
                        help="number of safetensors files, with an index when > 1 (default: %(default)s)")
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share lm_head with the embedding (default: untied for tiny, tied for 0.6B/1.7B)",
    )
    parser.add_argument("--aligner", action="store_true", help=ALIGNER_HELP)
    args = parser.parse_args(argv)
    if problem := _out_dir_problem(args.out_dir, force=args.force):
        parser.error(problem)
    if args.aligner:
        return _aligner_main(parser, args)
    try:
        path = make_test_model(
            args.out_dir,
            layout=args.layout,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            num_shards=args.shards,
            tie_word_embeddings=args.tie_word_embeddings,
        )
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:  # no permission, a full disk, a file where a parent folder should be
        print(f"qasr-make-test-model: error: cannot write {args.out_dir}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a random-weight {args.size} checkpoint ({args.layout} layout) to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
