"""Test support: run the OFFICIAL Qwen3-ASR implementation (qwen-asr 0.0.6 on transformers 4.57.x) as a reference.

Parity tests import this module (`import official`; conftest.py puts tests/ on sys.path) and compare qasr against it:

    model, processor = official.load_official(model_dir)
    features, num_frames = official.official_features(processor, wav)
    ids = official.official_generate(model, processor, wav, context="", language=None, max_new_tokens=32)
    prompt = official.official_prompt_ids(processor, len(wav), context="", language="English")

Importing `qwen_asr` pulls packages that are neither installed nor needed here (librosa, nagisa, gradio, ...); they
get empty stand-in modules, only where missing, after transformers is imported (so its feature probes saw the truth).
The prompt and generation paths follow Qwen3ASRModel._infer_asr_transformers for one clip, line for line.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

# Imported at module level by qwen_asr (or its CLI/demo modules) but not used on the transformers inference path.
STANDIN_MODULES = ("librosa", "soundfile", "nagisa", "soynlp", "qwen_omni_utils", "sox", "gradio", "flask", "pytz")


def _standin(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"empty stand-in for {name!r}, which qwen_asr imports but qasr's tests never use")
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, origin="qasr-test-standin")

    def __getattr__(attr: str):
        raise AttributeError(f"{name}.{attr}: {name} is not installed; tests/official.py only stands in for it")

    module.__getattr__ = __getattr__
    return module


def import_official() -> types.ModuleType:
    """Import qwen_asr (registering Qwen3-ASR with transformers' Auto classes) and return the package. Idempotent."""
    if "qwen_asr.inference.qwen3_asr" in sys.modules:
        return sys.modules["qwen_asr"]
    import transformers  # noqa: F401  (first: its availability probes must see the real environment)

    for name in STANDIN_MODULES:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = _standin(name)
    import qwen_asr
    import qwen_asr.inference.qwen3_asr  # noqa: F401  (AutoConfig/AutoModel/AutoProcessor.register)

    return qwen_asr


def load_official(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """(model, processor) of the checkpoint as Qwen3ASRModel.from_pretrained loads them, on the CPU, in eval mode."""
    import_official()
    from transformers import AutoModel, AutoProcessor

    model = AutoModel.from_pretrained(str(model_dir), dtype=dtype).eval()
    processor = AutoProcessor.from_pretrained(str(model_dir), fix_mistral_regex=True)
    return model, processor


def official_text_prompt(processor, context: str = "", language: str | None = None) -> str:
    """The prompt string before audio expansion (Qwen3ASRModel._build_text_prompt, language checked like transcribe)."""
    qwen_asr = import_official()
    from qwen_asr.inference.utils import normalize_language_name, validate_language

    forced = None
    if language is not None and str(language).strip():
        forced = normalize_language_name(str(language))
        validate_language(forced)
    wrapper = qwen_asr.Qwen3ASRModel(backend="transformers", model=torch.nn.Identity(), processor=processor)
    return wrapper._build_text_prompt(context=context, force_language=forced)


def _processor_inputs(processor, text: str, wav_16k: np.ndarray):
    wav = np.asarray(wav_16k, dtype=np.float32)
    return processor(text=[text], audio=[wav], return_tensors="pt", padding=True)


def official_features(processor, wav_16k: np.ndarray) -> tuple[torch.Tensor, int]:
    """(log-mel features [128, F], F) the official processor feeds the model for one 16 kHz clip."""
    inputs = _processor_inputs(processor, official_text_prompt(processor), wav_16k)
    num_frames = int(inputs["feature_attention_mask"][0].sum())
    return inputs["input_features"][0, :, :num_frames], num_frames


def official_prompt_ids(
    processor, num_samples: int, context: str = "", language: str | None = None, text_prefix: str = ""
) -> list[int]:
    """The input ids the official path builds for a clip of `num_samples` samples (audio pads expanded).

    text_prefix is appended to the prompt string as the official streaming does with its rolled-back partial.
    """
    text = official_text_prompt(processor, context, language) + text_prefix
    inputs = _processor_inputs(processor, text, np.zeros(num_samples, dtype=np.float32))
    return inputs["input_ids"][0].tolist()


@torch.no_grad()
def official_generate(
    model,
    processor,
    wav_16k: np.ndarray,
    *,
    context: str = "",
    language: str | None = None,
    max_new_tokens: int = 32,
    text_prefix: str = "",
) -> list[int]:
    """Greedy new token ids for one clip (EOS included if it came), exactly as _infer_asr_transformers runs it.

    wav_16k: mono float32 at 16 kHz in [-1, 1] (transcribe() would only rescale louder input).
    """
    text = official_text_prompt(processor, context, language) + text_prefix
    inputs = _processor_inputs(processor, text, wav_16k)
    inputs = inputs.to(model.device).to(model.dtype)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens)
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist()


def official_decode(processor, ids: list[int]) -> str:
    """Text of generated ids as the official path decodes them (special tokens skipped, no space clean-up)."""
    return processor.batch_decode([ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)[0]
