"""Partials of a growing segment reuse the stream's whole encoder windows and retained decoder KV.

One stream grows to 20 s (two and a half 8 s encoder windows) with a partial every second (audio[:1 s], audio[:2 s],
...), driven straight into the synchronous `Engine` on the tiny random model (CPU, fp32). `engine.counters` says what
each request prefilled and encoded. Checked: (a) the work per partial stays bounded (prompt + less than one window +
one new second) instead of growing with the segment, (b) the final of the whole segment equals a fresh offline decode
and reads nothing cached, (c) every partial's tokens equal a decode of the same request without reuse: the loudest
mel frame lies in the first window, so the mel's max-8 floor never moves and the kept windows are exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from qasr.bench.synthetic import speech_like
from qasr.model import audio as qaudio
from qasr.model.prompt import build_prompt
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority

SR = qaudio.SAMPLE_RATE
SEGMENT_S = 20  # windows are kept from 10 and 18 s on; each second costs a fresh decode of the whole prefix
STREAM_ID = "session/0"
MAX_NEW_TOKENS = 6  # the random model rarely says EOS: a few tokens are enough to compare decodes
FINAL_TOKENS = 24


def loud_start_speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Speech-like audio whose loudest stretch is at 0.5-1.0 s, inside the first 8 s window."""
    audio = speech_like(seconds, seed)
    audio[SR // 2 : SR] *= 3.0
    return audio


def decode_counting(engine: Engine, request: DecodeRequest):
    """Run one request; -> (result, counter deltas it caused)."""
    before = dict(engine.counters)
    result = engine.transcribe([request])[0]
    return result, {key: engine.counters[key] - before[key] for key in before}


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    # max_len 2048: each text prefix is the previous partial's output, which the random model makes long
    options = EngineOptions(num_slots=4, max_len=2048, num_retained=4)
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32", options=options)


@pytest.fixture(scope="module")
def growing_stream(engine):
    """The 20 partials with reuse, each beside the same request decoded on a stream of its own that was given the
    same previous answer (so the same rolled-back prefix) but has nothing cached (so no reuse)."""
    audio = loud_start_speech(SEGMENT_S)
    runs = []
    for seconds in range(1, SEGMENT_S + 1):
        previous = engine.streams.get(STREAM_ID).answer_ids
        prefix = previous[: max(0, len(previous) - engine.options.rollback_tokens)]
        request = dict(audio=audio[: seconds * SR], priority=Priority.PARTIAL, max_new_tokens=MAX_NEW_TOKENS)
        reused, work = decode_counting(engine, DecodeRequest(stream_id=STREAM_ID, **request))
        engine.streams.get("fresh").answer_ids = previous
        fresh, fresh_work = decode_counting(engine, DecodeRequest(stream_id="fresh", **request))
        engine.release_stream("fresh")
        engine.step()  # applies the release
        runs.append((seconds, prefix, reused, work, fresh, fresh_work))
    return audio, runs


def test_the_loudest_mel_frame_of_every_partial_is_in_the_first_window():
    """The premise of exact reuse: the max-8 floor is the same for every prefix of the segment."""
    audio = loud_start_speech(SEGMENT_S)
    for seconds in range(1, SEGMENT_S + 1):
        mel = qaudio.log_mel(audio[: seconds * SR])  # [mels, frames]
        assert int(mel.amax(dim=0).argmax()) < qaudio.WINDOW_FRAMES


def test_partials_prefill_a_bounded_number_of_tokens_however_long_the_segment(engine, growing_stream):
    _, runs = growing_stream
    tokenizer = engine.tokenizer
    prefix_ids = build_prompt(tokenizer, num_audio_tokens=0).prefix_ids  # system turn up to <|audio_start|>
    audio_prefilled, audio_fresh = [], []
    for seconds, prefix, reused, work, fresh, fresh_work in runs:
        # the prompt around the audio: chat template + the given prefix (which grows with the text, as it must)
        assert reused.raw_text == tokenizer.decode(prefix + reused.token_ids)  # the prefix was used, not dropped
        around = build_prompt(tokenizer, num_audio_tokens=0, answer_ids=prefix).num_tokens
        assert work["prefill_tokens"] + work["reused_tokens"] == fresh_work["prefill_tokens"] == \
            around + reused.num_audio_tokens  # the same prompt, split between copied and prefilled positions
        # the windows wholly inside the previous partial's audio are kept, and the KV of prompt prefix + them copied
        kept = ((seconds - 1) * qaudio.FRAMES_PER_SECOND - 2) // qaudio.WINDOW_FRAMES if seconds > 1 else 0
        assert work["reused_windows"] == kept, seconds
        assert work["reused_tokens"] == (len(prefix_ids) + kept * qaudio.WINDOW_TOKENS if kept else 0), seconds
        assert work["encoded_windows"] <= 2, seconds  # the window in progress (+ the one this second completed)
        assert fresh_work["reused_tokens"] == 0 and fresh_work["reused_windows"] == 0
        assert fresh_work["encoded_windows"] == -(-reused.num_audio_tokens // qaudio.WINDOW_TOKENS)
        audio_prefilled.append(reused.num_audio_tokens - kept * qaudio.WINDOW_TOKENS)
        audio_fresh.append(reused.num_audio_tokens)
    # with reuse a partial prefills at most one window + the new second of audio; without, the whole segment so far
    assert max(audio_prefilled) <= qaudio.WINDOW_TOKENS + qaudio.TOKENS_PER_CHUNK
    assert audio_fresh[-1] == qaudio.num_audio_tokens(SEGMENT_S * qaudio.FRAMES_PER_SECOND) > 3 * audio_prefilled[-1]
    assert 2 * sum(audio_prefilled) < sum(audio_fresh)
    windows_with_reuse = sum(run[3]["encoded_windows"] for run in runs)
    windows_without = sum(run[5]["encoded_windows"] for run in runs)
    # one window per partial, two at 9 and 17 s (the window just completed is encoded once more, then kept); without
    # reuse the count grows with the square of the segment's length (20 s: 36 windows)
    assert windows_with_reuse == SEGMENT_S + 2 and 3 * windows_with_reuse < 2 * windows_without


def test_partials_with_reuse_decode_the_same_tokens_as_without(growing_stream):
    _, runs = growing_stream
    for seconds, prefix, reused, _, fresh, _ in runs:
        assert reused.token_ids == fresh.token_ids, f"partial at {seconds} s (prefix {prefix!r})"
        assert (reused.text, reused.language, reused.raw_text) == (fresh.text, fresh.language, fresh.raw_text)
        assert reused.num_audio_tokens == qaudio.num_audio_tokens(qaudio.num_frames(seconds * SR))


def test_the_final_reads_nothing_cached_and_equals_a_fresh_offline_decode(engine, tiny_model_dir, growing_stream):
    audio, _ = growing_stream
    request = dict(audio=audio, max_new_tokens=FINAL_TOKENS)
    final, work = decode_counting(engine, DecodeRequest(priority=Priority.FINAL, stream_id=STREAM_ID, **request))
    assert work["reused_tokens"] == 0 and work["reused_windows"] == 0
    fresh_engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32",
                                          options=engine.options)
    offline = fresh_engine.transcribe([DecodeRequest(**request)])[0]
    assert final.token_ids == offline.token_ids
    assert (final.text, final.language) == (offline.text, offline.language)
    engine.release_stream(STREAM_ID)
    engine.step()  # applies the release
    assert engine.stats()["streams_cached"] == 0
