"""After each step: which sequences stop (EOS, token budget, a runaway repetition) and what they said."""

from __future__ import annotations

import time

from qasr.model.prompt import parse_output
from qasr.model.tokenizer import Tokenizer

from .request import DecodeResult
from .sequence import Sequence

MAX_PATTERN_TOKENS = 8  # the longest pattern the repetition guard looks for


def stop_reason(seq: Sequence, token: int, eos_ids: tuple[int, ...], device_finished: bool = False) -> str | None:
    """Record one generated token (EOS is not recorded) -> why the sequence stops, or None while it runs on."""
    if token in eos_ids:
        return "eos"
    seq.generated.append(token)
    if device_finished or len(seq.generated) >= seq.budget:
        return "length"
    return None


def is_repeating(tokens: list[int], window: int) -> bool:
    """Token-level runaway guard: the last `window` tokens are one pattern of <= 8 tokens repeated (0: off)."""
    if not window or len(tokens) < window:
        return False
    if window > MAX_PATTERN_TOKENS and tokens[-1] not in tokens[-1 - MAX_PATTERN_TOKENS:-1]:
        return False  # a pattern of p tokens repeats the newest one p back: most rows fail this at once
    tail = tokens[-window:]
    # compare from the newest token back: a sequence that is not looping fails at once (this runs per row per step)
    return any(all(tail[i] == tail[i - p] for i in range(window - 1, p - 1, -1))
               for p in range(1, MAX_PATTERN_TOKENS + 1))


def results_of(finished: list[tuple[Sequence, str]], tokenizer: Tokenizer) -> list[DecodeResult]:
    """Each finished (sequence, reason)'s result: its answer (a given prefix + what it generated) read as language
    and text, all answers decoded in one batch."""
    raws = tokenizer.decode_batch([answer_ids(seq) for seq, _ in finished])
    return [_result(seq, raw, reason) for (seq, reason), raw in zip(finished, raws)]


def _result(seq: Sequence, raw: str, reason: str) -> DecodeResult:
    language, text = parse_output(raw, seq.prompt.language)
    seq.timings["decode_ms"] = (time.perf_counter() - seq.t_decode) * 1e3
    return DecodeResult(text=text, language=language, raw_text=raw, token_ids=tuple(seq.generated),
                        finish_reason=reason, num_audio_tokens=seq.prompt.num_audio_tokens, timings=dict(seq.timings))


def answer_ids(seq: Sequence) -> tuple[int, ...]:
    return (*seq.prompt.answer_ids, *seq.generated)
