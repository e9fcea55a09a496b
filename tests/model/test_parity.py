"""qasr against the OFFICIAL Qwen3-ASR implementation (qwen-asr 0.0.6 on transformers 4.57), fp32 on the CPU.

Both load the same tiny random checkpoint (conftest's tiny_model_dir, original layout; qasr also its "-hf" twin).
Compared: mel features, encoder output, prompt ids and logits at every prompt position, greedy tokens for clips
from 0.3 s to 40 s (across the 1 s conv-chunk and 8 s attention-window boundaries) with and without a forced
language and context; then the engine against itself (batched == one at a time) and the loader's and engine's
errors on bad checkpoints and bad audio.

The official encoder's windows. qwen-asr 0.0.6 (transformers backend) calls its encoder layers without an attention
mask, so without flash-attention-2 (on the CPU: sdpa or eager) every token attends over the WHOLE clip, while its
FA2 path, its vLLM backend and transformers 5's port attend within 8 s windows (cu_seqlens), which is the model's
design and what qasr implements. `official_encoder_windows` hands each official encoder layer the block-diagonal mask
its own `_prepare_attention_mask(hidden, cu_seqlens)` builds; `test_unpatched_official_encoder_*` show that this
changes nothing for clips of one window (<= 8 s) and only the cross-window attention beyond.
"""

from __future__ import annotations

import contextlib
import functools
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the official implementation runs on transformers 4.57 (test extra)")
import official  # noqa: E402  (tests/official.py; conftest puts tests/ on sys.path)
from fakes import speech_clip  # noqa: E402

try:
    official.import_official()
except ImportError as error:  # pragma: no cover - depends on the environment
    pytest.skip(f"the official qwen-asr package is not importable: {error}", allow_module_level=True)

from qasr.model import audio as qaudio  # noqa: E402
from qasr.model.checkpoint import CheckpointError, load_model, resolve_model_dir  # noqa: E402
from qasr.model.modeling import PlainLayerOps  # noqa: E402
from qasr.model.prompt import build_prompt  # noqa: E402
from qasr.model.tokenizer import OFFICIAL_EOS_IDS, Tokenizer  # noqa: E402
from qasr.engine.engine import Engine, EngineOptions  # noqa: E402
from qasr.engine.request import DecodeRequest  # noqa: E402

SR = qaudio.SAMPLE_RATE
MAX_NEW_TOKENS = 24

# Seconds: under one conv chunk (0.3, 0.5, 0.99), at and just past chunk edges (1.0, 1.01, 15.99, 16.0), at and past the
# 8 s window edge (7.9, 8.0, 8.1) and its multiples (16.0, 24.0), several windows and a ragged last one (9.5 ... 40.0).
DURATIONS = (0.3, 0.5, 0.99, 1.0, 1.01, 1.5, 2.5, 3.7, 5.0, 7.9, 8.0, 8.1, 9.5, 12.0, 15.99, 16.0, 16.3, 20.4,
             24.0, 30.0, 33.3, 40.0)  # fmt: skip
# (language, context): automatic language without context, then forced language and/or context
PLAIN = (None, "")
PROMPT_VARIANTS = (("English", ""), (None, "Meeting notes: Qwen, qasr, Hangzhou."),
                   ("Chinese", "会议记录：语音识别"))
# clips for the feature and encoder comparisons: one window or less (the unpatched official agrees) and several
SINGLE_WINDOW = (0.3, 0.99, 1.0, 1.01, 5.0, 8.0)
MULTI_WINDOW = (8.1, 16.3, 33.3, 40.0)
MEL_DURATIONS = (0.3, 0.99, 1.01, 7.9, 8.1, 16.3, 40.0)  # test_audio.py covers the extractor's arithmetic further
# prompt-logit cases (the logits are [T, 151936]: a few clips, each prompt variant once)
LOGIT_CASES = ((0.99, *PLAIN), (1.01, "English", ""), (8.1, None, "Meeting notes: Qwen, qasr, Hangzhou."),
               (16.3, "Chinese", "会议记录：语音识别"), (8.0, *PLAIN))

# Tolerances (fp32): features in absolute log-mel units, the rest relative to the reference's largest magnitude.
MEL_ATOL = 1e-4
REL_TOL = 1e-4


def clip_for(seconds: float) -> np.ndarray:
    """The test clip of this duration (a fresh copy: callers may edit it)."""
    return _clip(seconds).copy()


@functools.lru_cache(maxsize=None)
def _clip(seconds: float) -> np.ndarray:
    return speech_clip(seconds, seed=int(round(seconds * 100)))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference| (in float32: the logits are large, and 1e-7 of slack is plenty)."""
    ours, reference = ours.float(), reference.float()
    return float((ours - reference).abs().max() / reference.abs().max())


# ---------------------------------------------------------------------------------------------------------------
# The official encoder's own window mask


def _window_mask_hook(tower, layer, args, kwargs):
    """forward_pre_hook of an official encoder layer: add the block-diagonal mask of its cu_seqlens windows."""
    hidden = args[0]  # [tokens, d_model]: the whole clip, windows back to back
    cu_seqlens = args[1] if len(args) > 1 else kwargs["cu_seqlens"]  # window boundaries
    kwargs = {**kwargs, "attention_mask": tower._prepare_attention_mask(hidden, cu_seqlens)}
    return args, kwargs


@contextlib.contextmanager
def official_encoder_windows(model):
    """Within this block the official encoder attends only within its 8 s windows, as its FA2 path does.

    Without flash-attention-2, qwen-asr 0.0.6 passes no mask to its encoder layers (see the module docstring);
    this gives each layer the mask the official `_prepare_attention_mask(hidden, cu_seqlens)` builds from the
    encoder's own cu_seqlens, so nothing of qasr's enters the reference.
    """
    tower = model.thinker.audio_tower
    handles = [layer.register_forward_pre_hook(functools.partial(_window_mask_hook, tower), with_kwargs=True)
               for layer in tower.layers]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------------------------
# Shared models (module scope: loading is the slow part)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """(official model, official processor) on the original-layout checkpoint."""
    return official.load_official(tiny_model_dir)


@pytest.fixture(scope="module")
def ours(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_pretrained(tiny_model_dir)


def make_engine(model_dir, num_slots: int) -> Engine:
    options = EngineOptions(num_slots=num_slots, num_retained=0, cuda_graphs=False)
    return Engine.from_pretrained(str(model_dir), device="cpu", dtype="float32", options=options)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_model_dir_hf):
    """Eager CPU engines with 8 slots, one per checkpoint layout (same seed, so the same weights)."""
    return {"original": make_engine(tiny_model_dir, 8), "hf": make_engine(tiny_model_dir_hf, 8)}


@pytest.fixture(scope="module")
def measured():
    """Worst errors seen, printed at the end of the module (run with -s to see them)."""
    numbers: dict[str, float] = {}
    yield numbers
    print("\nparity numbers:", ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in sorted(numbers.items())))


def note_max(measured: dict, key: str, value: float) -> None:
    measured[key] = max(measured.get(key, 0.0), value)


# ---------------------------------------------------------------------------------------------------------------
# Weights, features, encoder, prompt logits


def test_every_layout_loads_the_same_weights(ours, tiny_model_dir_hf, tiny_model_dir_sharded):
    """The "-hf" layout and a 3-shard copy of the same seed fill every parameter with the same values."""
    expected = dict(ours.named_parameters())
    for model_dir in (tiny_model_dir_hf, tiny_model_dir_sharded):
        other = dict(load_model(model_dir, device="cpu", dtype=torch.float32).named_parameters())
        assert other.keys() == expected.keys()
        for name, param in other.items():
            assert torch.equal(param, expected[name]), f"{model_dir.name}: {name}"


def test_log_mel_matches_official_processor(reference, measured):
    _, processor = reference
    for seconds in MEL_DURATIONS:
        wav = clip_for(seconds)
        expected, frames = official.official_features(processor, wav)
        got = qaudio.log_mel(wav)
        assert got.shape == expected.shape == (qaudio.N_MELS, frames), seconds
        error = float((got - expected.float()).abs().max())
        note_max(measured, "mel_max_abs", error)
        assert error < MEL_ATOL, f"{seconds} s: mel max abs diff {error:.3g}"


def official_encoder(model, features: torch.Tensor) -> torch.Tensor:
    """The official audio tower on one clip's features [128, F] -> [tokens, hidden]."""
    tower = model.thinker.audio_tower
    with torch.no_grad():
        return tower(features, feature_lens=torch.tensor([features.shape[1]])).last_hidden_state


def test_encoder_matches_official(reference, ours, measured):
    model, processor = reference
    for seconds in SINGLE_WINDOW + MULTI_WINDOW:
        features, frames = official.official_features(processor, clip_for(seconds))
        with official_encoder_windows(model):
            expected = official_encoder(model, features)
        got = ours.encoder([features.float()])[0]
        assert got.shape == expected.shape == (qaudio.num_audio_tokens(frames), ours.cfg.text.hidden_size)
        error = relative_error(got, expected)
        note_max(measured, "encoder_rel", error)
        note_max(measured, "encoder_max_abs", float((got - expected).abs().max()))
        assert error < REL_TOL, f"{seconds} s: encoder relative error {error:.3g}"


def test_unpatched_official_encoder_agrees_within_one_window(reference):
    """Up to 8 s a clip is one window: the official CPU path's missing mask changes nothing, nor does our patch."""
    model, processor = reference
    for seconds in SINGLE_WINDOW:
        features, _ = official.official_features(processor, clip_for(seconds))
        plain = official_encoder(model, features)
        with official_encoder_windows(model):
            windowed = official_encoder(model, features)
        assert relative_error(windowed, plain) < 1e-6, seconds


def test_unpatched_official_encoder_attends_across_windows(reference, ours):
    """Past 8 s the unpatched official CPU path mixes windows; the windowed one is what qasr (and FA2) computes.
    If a later qwen-asr masks its windows on the CPU too, this fails and the patch can go."""
    model, processor = reference
    features, _ = official.official_features(processor, clip_for(16.3))
    plain = official_encoder(model, features)
    got = ours.encoder([features.float()])[0]
    assert relative_error(got, plain) > 100 * REL_TOL
    first_window = qaudio.WINDOW_TOKENS
    assert relative_error(got[:first_window], plain[:first_window]) > 100 * REL_TOL  # even window 1 saw the rest


def official_prompt_logits(model, processor, wav: np.ndarray, context: str, language: str | None):
    """(input ids [T], logits [T, V]) of the official thinker over the whole prompt with audio."""
    text = official.official_text_prompt(processor, context, language)
    inputs = processor(text=[text], audio=[wav], return_tensors="pt", padding=True)
    with torch.no_grad(), official_encoder_windows(model):
        out = model.thinker(**inputs)
    return inputs["input_ids"][0], out.logits[0]


def our_prompt_logits(model, tokenizer, wav: np.ndarray, context: str, language: str | None):
    """(input ids [T], logits [T, V]) from qasr's pieces: log_mel -> encoder -> embed_prompt -> prefill -> logits."""
    audio = model.encoder([qaudio.log_mel(wav)])[0]
    prompt = build_prompt(tokenizer, context=context, language=language, num_audio_tokens=audio.shape[0])
    ids = torch.tensor(prompt.input_ids)
    embeds = model.embed_prompt(ids, audio, prompt.audio_offset)  # [T, D]
    T = embeds.shape[0]
    cache = model.new_cache(1, T + 1)
    one = lambda value: torch.tensor([value])  # noqa: E731
    with torch.no_grad():
        hidden = model.decoder.prefill(embeds[None], one(0), one(0), one(T), cache, PlainLayerOps())
        return ids, model.decoder.lm_head(hidden)[0]


@pytest.mark.parametrize("seconds, language, context", LOGIT_CASES)
def test_prompt_logits_match_official(reference, ours, tokenizer, measured, seconds, language, context):
    model, processor = reference
    wav = clip_for(seconds)
    expected_ids, expected = official_prompt_logits(model, processor, wav, context, language)
    got_ids, got = our_prompt_logits(ours, tokenizer, wav, context, language)
    assert got_ids.tolist() == expected_ids.tolist(), "prompt ids differ"
    assert got.shape == expected.shape
    error = relative_error(got, expected)
    note_max(measured, "logits_rel", error)
    note_max(measured, "logits_max_abs", float((got - expected).abs().max()))
    note_max(measured, "logits_scale", float(expected.abs().max()))
    assert error < REL_TOL, f"prompt logits relative error {error:.3g}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------------------------------------------------
# Greedy tokens through the engine


def greedy_cases() -> list[tuple[float, str | None, str]]:
    """(seconds, language, context) for every duration, the prompt variants taking turns along the durations so
    that each variant meets short clips, window edges and long clips."""
    variants = (PLAIN,) + PROMPT_VARIANTS
    return [(seconds, *variants[i % len(variants)]) for i, seconds in enumerate(DURATIONS)]


def request_for(case, max_new_tokens: int = MAX_NEW_TOKENS) -> DecodeRequest:
    seconds, language, context = case
    return DecodeRequest(audio=clip_for(seconds), context=context, language=language, max_new_tokens=max_new_tokens)


@pytest.fixture(scope="module")
def official_tokens(reference):
    """Official greedy ids per case, one clip at a time (windowed encoder), EOS stripped; and whether EOS came."""
    model, processor = reference
    tokens = {}
    with official_encoder_windows(model):
        for case in greedy_cases():
            seconds, language, context = case
            ids = official.official_generate(model, processor, clip_for(seconds), context=context,
                                             language=language, max_new_tokens=MAX_NEW_TOKENS)
            ended = bool(ids) and ids[-1] in OFFICIAL_EOS_IDS
            tokens[case] = (tuple(ids[:-1] if ended else ids), ended)
    return tokens


@pytest.fixture(scope="module")
def engine_results(engines):
    """Per layout: the engine's results for every case, all submitted together (8 decoded at a time)."""
    cases = greedy_cases()
    return {layout: dict(zip(cases, engine.transcribe([request_for(c) for c in cases])))
            for layout, engine in engines.items()}


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_engine_greedy_tokens_match_official(official_tokens, engine_results, measured, layout):
    mismatches = []
    compared = 0
    for case, (expected, ended) in official_tokens.items():
        result = engine_results[layout][case]
        compared += len(expected)
        if result.token_ids != expected or (result.finish_reason == "eos") != ended:
            first = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b),
                         min(len(result.token_ids), len(expected)))
            mismatches.append(f"{case}: first difference at token {first} "
                              f"(ours {result.token_ids[first:first + 3]}, official {expected[first:first + 3]})")
    measured[f"greedy_{layout}"] = f"{len(official_tokens)} clips/{compared} tokens"
    assert len(official_tokens) >= 20 and not mismatches, "\n".join(mismatches)


def test_batched_engine_equals_one_at_a_time(tiny_model_dir, engine_results):
    """num_slots 8 (eight sequences per decode step) gives exactly the tokens of num_slots 1."""
    single = make_engine(tiny_model_dir, 1)
    cases = greedy_cases()
    results = single.transcribe([request_for(c) for c in cases])
    for case, alone in zip(cases, results):
        batched = engine_results["original"][case]
        assert alone.token_ids == batched.token_ids, case
        assert (alone.text, alone.language, alone.finish_reason) == (batched.text, batched.language,
                                                                      batched.finish_reason), case


# ---------------------------------------------------------------------------------------------------------------
# Bad checkpoints


def edited_checkpoint(src, dst, edit):
    """A copy of checkpoint `src` at `dst` whose model.safetensors tensors went through `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(dict(tensors)), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def without(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", without("thinker.audio_tower.ln_post.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*encoder\.ln_post\.weight"):
        load_model(path)


def test_missing_fused_shard_is_named(tiny_model_dir, tmp_path):
    k_proj = "thinker.model.layers.1.self_attn.k_proj.weight"
    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", without(k_proj))
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.1\.self_attn\.qkv_proj\.weight\[shard 1\]"):
        load_model(path)


def test_wrong_shape_tensor_is_named(tiny_model_dir, tmp_path):
    def shrink(tensors):
        tensors["thinker.model.norm.weight"] = tensors["thinker.model.norm.weight"][:-1].clone()
        return tensors

    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", shrink)
    with pytest.raises(CheckpointError, match=r"wrong shape.*thinker\.model\.norm\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tiny_model_dir, tmp_path):
    def add(tensors):
        tensors["thinker.audio_tower.extra_adapter.weight"] = torch.zeros(3)
        return tensors

    path = edited_checkpoint(tiny_model_dir, tmp_path / "ckpt", add)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*thinker\.audio_tower\.extra_adapter\.weight"):
        load_model(path)


def test_missing_config_json(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "ckpt")


def test_hf_id_offline_says_how_to_get_the_model(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    # the constants are read at import time: set both the environment and the module's copies
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    with pytest.raises(CheckpointError) as error:
        resolve_model_dir("Qwen/Qwen3-ASR-0.6B")
    message = str(error.value)
    assert "Qwen/Qwen3-ASR-0.6B" in message and "hf download" in message and "--local-dir" in message


# ---------------------------------------------------------------------------------------------------------------
# Bad audio through the engine


def test_silence_only_audio_gives_a_result(engines):
    for samples in (np.zeros(2 * SR, dtype=np.float32), np.zeros(SR // 4, dtype=np.float32)):
        (result,) = engines["original"].transcribe([DecodeRequest(audio=samples, max_new_tokens=8)])
        assert result.finish_reason in ("eos", "length") and isinstance(result.text, str)


def test_nan_audio_is_refused_clearly(engines):
    samples = clip_for(1.0)
    samples[100] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        engines["original"].transcribe([DecodeRequest(audio=samples)])
    # the engine is still usable afterwards
    (result,) = engines["original"].transcribe([DecodeRequest(audio=clip_for(1.0), max_new_tokens=4)])
    assert len(result.token_ids) <= 4


def test_empty_audio_file_is_an_audio_error(tmp_path):
    import soundfile

    empty_wav = tmp_path / "empty.wav"
    soundfile.write(str(empty_wav), np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(qaudio.AudioError, match="no audio samples"):
        qaudio.load_audio(empty_wav)
    zero_bytes = tmp_path / "zero.wav"
    zero_bytes.write_bytes(b"")
    with pytest.raises(qaudio.AudioError, match="zero.wav"):
        qaudio.load_audio(zero_bytes)
