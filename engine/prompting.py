"""Before a request runs: is it valid, what is its prompt, how many tokens may it generate, does a context fit."""

from __future__ import annotations

import math

import numpy as np

from qasr.model import audio as qaudio
from qasr.model.prompt import Prompt, PromptTemplates, build_prompt
from qasr.model.tokenizer import Tokenizer

from .options import EngineOptions
from .request import DecodeRequest

PROMPT_TEXT_TOKENS = 32  # the chat template around the audio, roughly: what admission budgets per prompt


def validate(request: DecodeRequest, options: EngineOptions) -> None:
    """ValueError unless the request's audio is something the engine can decode. Whether its samples are finite is
    checked later, when its admission copies them (AudioFrontEnd.prepare): a pass over every sample, here it held
    the device idle at the start of an offline batch."""
    audio = request.audio
    if not isinstance(audio, np.ndarray) or audio.ndim != 1:
        raise ValueError("request audio must be a 1-D float32 numpy array of 16 kHz samples")
    if audio.size < qaudio.HOP_LENGTH:
        raise ValueError(f"audio too short: {audio.size} samples (at least {qaudio.HOP_LENGTH}, 10 ms)")
    if audio.size > options.max_audio_seconds * qaudio.SAMPLE_RATE:
        raise ValueError(f"audio too long: {audio.size / qaudio.SAMPLE_RATE:.1f} s "
                         f"(the engine takes at most {options.max_audio_seconds:g} s per request)")


def default_budget(options: EngineOptions, seconds: float) -> int:
    """New tokens a request of this much audio may generate unless it asks for fewer: only a runaway guard."""
    return options.base_tokens + math.ceil(options.tokens_per_second * seconds)


def prefill_cost(request: DecodeRequest) -> int:
    """Prompt tokens the request will prefill, about (before its prompt is built)."""
    return int(qaudio.num_audio_tokens(qaudio.num_frames(request.audio.size))) + PROMPT_TEXT_TOKENS


def prepare_prompt(templates: PromptTemplates, options: EngineOptions, request: DecodeRequest, num_audio_tokens: int,
                   answer_ids: tuple[int, ...] = ()) -> tuple[Prompt, int]:
    """The request's prompt (built from the engine's cached templates) and token budget; ValueError if it cannot fit
    a slot.

    answer_ids: a partial's given prefix (the previous hypothesis). When a model runs on (a hallucination loop) it
    can outgrow what the audio could hold, so a prefix longer than the audio's token budget, or one that would not
    fit the slot, is dropped and the partial decodes from the audio alone.
    """
    seconds = request.audio.size / qaudio.SAMPLE_RATE
    budget = default_budget(options, seconds)
    prompt = templates.build(context=request.context, language=request.language, num_audio_tokens=num_audio_tokens,
                             answer_ids=answer_ids)
    if answer_ids and (prompt.num_tokens >= options.max_len or len(answer_ids) > budget):
        prompt = templates.build(context=request.context, language=request.language,
                                 num_audio_tokens=num_audio_tokens)
    room = options.max_len - prompt.num_tokens
    if room < 1:
        raise ValueError(f"the prompt ({prompt.num_tokens} tokens for {seconds:.1f} s of audio and the context) does "
                         f"not fit the engine's max_len {options.max_len}")
    return prompt, max(1, min(room, request.max_new_tokens or budget))


def check_context(tokenizer: Tokenizer, options: EngineOptions, context: str, *, language: str | None = None,
                  max_audio_seconds: float) -> None:
    """ValueError unless a request with this context and up to `max_audio_seconds` of audio fits a slot with its full
    default token budget (the server checks a stream's context once, at `start`)."""
    tokens = int(qaudio.num_audio_tokens(qaudio.num_frames(int(max_audio_seconds * qaudio.SAMPLE_RATE))))
    prompt = build_prompt(tokenizer, context=context, language=language, num_audio_tokens=tokens)
    budget = default_budget(options, max_audio_seconds)
    if prompt.num_tokens + budget > options.max_len:
        bare = build_prompt(tokenizer, language=language, num_audio_tokens=tokens).num_tokens
        room = max(0, options.max_len - bare - budget)
        raise ValueError(
            f"context too long: {prompt.num_tokens - bare} tokens, but with segments up to "
            f"{max_audio_seconds:g} s this server has room for {room} (shorten the context or the maximum "
            f"segment, or start the server with a larger --max-len)")
