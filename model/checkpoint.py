"""Find a checkpoint (local directory or Hugging Face id) and load its weights into `Qwen3ASR`.

Both official layouts are read: the original (`thinker.*`) and the transformers-native "-hf" one. Every tensor in the
files must land in a parameter and every parameter must be filled: anything else is an error that names the tensors.
Weights go straight to the target device and dtype one tensor at a time (the model is built on the meta device), so
host memory never holds a second full copy.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .config import ModelConfig
from .modeling import Qwen3ASR, rope_inv_freq, sinusoids


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete, or does not fit the model."""


# (checkpoint prefix, our prefix), per layout; the first match wins
_PREFIXES = {
    "original": [("thinker.audio_tower.", "encoder."), ("thinker.model.", "decoder."), ("thinker.lm_head.", "decoder.lm_head.")],
    "hf": [
        ("model.audio_tower.", "encoder."),
        ("model.multi_modal_projector.linear_1.", "encoder.proj1."),
        ("model.multi_modal_projector.linear_2.", "encoder.proj2."),
        ("model.language_model.", "decoder."),
        ("lm_head.", "decoder.lm_head."),
    ],
}

# separate checkpoint projections that we keep fused: (checkpoint name part, fused name part, shard index)
_FUSED = [
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", 1),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", 2),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' (or None) = bf16 on a GPU, fp32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) = the GPU when there is one."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available (torch.cuda.is_available() is False)")
    return device


def resolve_model_dir(name_or_path: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a Hugging Face id downloaded (or found in the local HF cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json: not a Qwen3-ASR checkpoint directory")
        return path
    name = str(name_or_path)
    if path.exists() or not re.fullmatch(r"[\w.\-]+/[\w.\-]+", name):
        raise CheckpointError(
            f"model {name!r} is neither a checkpoint directory nor a Hugging Face id like 'Qwen/Qwen3-ASR-0.6B'"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except Exception as e:  # network down, HF_HUB_OFFLINE, unknown repo: all end the same way for the user
        raise CheckpointError(
            f"could not get {name!r} from Hugging Face ({type(e).__name__}: {e}). On a machine with network run "
            f"`hf download {name} --local-dir DIR` (the command line of huggingface_hub), copy DIR here and pass "
            f"its path instead; or make a random test model with `qasr-make-test-model DIR`."
        ) from e


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"the checkpoint index names shard files that are missing: {', '.join(missing)}")
    return files


def target_name(
    name: str, layout: str, prefixes: list[tuple[str, str]] | None = None
) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (our parameter name, shard index of a fused parameter or None); None if foreign.

    prefixes: (checkpoint prefix, our prefix) pairs, the first match wins; default: the ASR model's for `layout`.
    """
    for theirs, ours in prefixes or _PREFIXES[layout]:
        if name.startswith(theirs):
            name = ours + name[len(theirs) :]
            break
    else:
        return None
    for part, fused, shard in _FUSED:
        if name.startswith("decoder.") and part in name:
            return name.replace(part, fused), shard
    return name, None


def load_model(
    model_dir: str | os.PathLike,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
) -> Qwen3ASR:
    model_dir = resolve_model_dir(model_dir)
    device = resolve_device(device)
    dtype = parse_dtype(dtype, device)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    with torch.device("meta"):
        model = Qwen3ASR(cfg).to(dtype)
    model.to_empty(device=device)
    _reinit_buffers(model, device)
    load_weights(model, checkpoint_files(model_dir), cfg.layout)
    return model.eval().requires_grad_(False)


def _reinit_buffers(model: Qwen3ASR, device: torch.device) -> None:
    """Non-persistent buffers were built on meta: compute them again for real (kept in float32)."""
    a, t = model.cfg.audio, model.cfg.text
    model.encoder.positions = sinusoids(a.tokens_per_chunk, a.d_model).to(device)
    model.decoder.inv_freq = rope_inv_freq(t).to(device)


def load_weights(
    model: Qwen3ASR, files: list[Path], layout: str, prefixes: list[tuple[str, str]] | None = None
) -> None:
    """Fill `model` (anything with .cfg, .encoder and .decoder named as Qwen3ASR's) from the safetensors files.

    prefixes: see `target_name` (the forced aligner passes its own: its head is not the decoder's lm_head).
    """
    from safetensors import safe_open

    params = dict(model.named_parameters())
    fused_sizes = _fused_shard_sizes(model)
    filled: set[tuple[str, int | None]] = set()
    unknown, bad_shape = [], []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = target_name(name, layout, prefixes)
                if target is None or target[0] not in params:
                    unknown.append(name)
                    continue
                pname, shard = target
                param = params[pname]
                dest = param.data if shard is None else _shard_view(param.data, fused_sizes[pname], shard)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    bad_shape.append(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}")
                    continue
                dest.copy_(tensor)
                filled.add(target)
    problems = []
    # Tied (text_config.tie_word_embeddings, as the official model reads it): lm_head is the embedding. A saved
    # lm_head that differs would be discarded by the official loader; we refuse it rather than guess.
    dec = model.decoder
    if model.cfg.text.tie_word_embeddings and ("decoder.embed_tokens.weight", None) in filled:
        if ("decoder.lm_head.weight", None) in filled and not torch.equal(dec.lm_head.weight, dec.embed_tokens.weight):
            problems.append("config ties lm_head to embed_tokens but the checkpoint's lm_head differs from it")
        dec.lm_head.weight = dec.embed_tokens.weight
        filled.add(("decoder.lm_head.weight", None))
    if layout == "hf":
        _zero_dropped_key_biases(params, filled)
    expected = {(p, s) for p in params for s in (range(len(fused_sizes[p])) if p in fused_sizes else [None])}
    missing = sorted(f"{p}" + (f"[shard {s}]" if s is not None else "") for p, s in expected - filled)
    if unknown:
        problems.append(f"{len(unknown)} unexpected tensor(s): {', '.join(sorted(unknown)[:20])}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} tensor(s) with the wrong shape: {'; '.join(bad_shape[:20])}")
    if missing:
        problems.append(f"{len(missing)} missing tensor(s) (our names): {', '.join(missing[:20])}")
    if problems:
        raise CheckpointError(f"checkpoint does not fit the {layout}-layout model config: " + " | ".join(problems))


def _zero_dropped_key_biases(params: dict[str, torch.nn.Parameter], filled: set) -> None:
    """transformers' "-hf" conversion drops the audio encoder's k_proj biases: a key bias adds one constant to all of
    a query's scores, which softmax cancels. Missing ones are zeros - the same function - and count as filled."""
    for name, param in params.items():
        if name.startswith("encoder.") and name.endswith(".self_attn.k_proj.bias") and (name, None) not in filled:
            param.data.zero_()
            filled.add((name, None))


def _fused_shard_sizes(model: Qwen3ASR) -> dict[str, list[int]]:
    t = model.cfg.text
    sizes = {}
    for i in range(t.num_hidden_layers):
        q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        sizes[f"decoder.layers.{i}.self_attn.qkv_proj.weight"] = [q, kv, kv]
        sizes[f"decoder.layers.{i}.mlp.gate_up_proj.weight"] = [t.intermediate_size, t.intermediate_size]
    return sizes


def _shard_view(tensor: torch.Tensor, sizes: list[int], shard: int) -> torch.Tensor:
    start = sum(sizes[:shard])
    return tensor.narrow(0, start, sizes[shard])
