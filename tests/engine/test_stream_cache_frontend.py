"""The incremental audio front end: a stream's partial computes only what is new, and still equals a fresh encode.

Driven through `Engine.frontend` on the tiny random model (CPU, fp32). A growing clip is embedded with the stream's
state after each append, and compared with the model's own offline encoder (`AudioEncoder.forward` over `log_mel`) of
the same audio: equal to ~1e-5 (the pieces are batched differently, so float rounding may differ). The engine's
counters say what each partial computed: mel frames, conv chunks, encoder windows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qasr.bench.synthetic import speech_like
from qasr.engine import runner as runner_module
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, Priority
from qasr.engine.stream_cache import StreamState
from qasr.model import audio as qaudio

SR = qaudio.SAMPLE_RATE
ATOL = 1e-5  # fp32 on the CPU (the embeddings are O(1)): a few ulp apart at most. Mostly equal, but a clean clone
# on a 2-core machine once gave 1.19e-6 at one element of 6,656 (8.0 s: a window boundary)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    options = EngineOptions(num_slots=4, max_len=2048, num_retained=4)
    return Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32", options=options)


@torch.inference_mode()
def offline_embedding(engine: Engine, clip: np.ndarray) -> torch.Tensor:
    return engine.model.encoder([qaudio.log_mel(clip)])[0]


def embed(engine: Engine, clip: np.ndarray, state: StreamState | None):
    """-> (the clip's audio embedding, the windows it kept, what it computed: counter deltas)."""
    before = dict(engine.counters)
    with torch.inference_mode():
        out = engine.frontend.embed([clip], [state])[0]
    return out.audio, out.kept_windows, {key: engine.counters[key] - before[key] for key in before}


def grow(engine: Engine, audio: np.ndarray, ends: list[int], state: StreamState | None = None) -> list[dict]:
    """Embed audio[:end] for each end with one stream state, checking each against the offline encoder."""
    state = StreamState() if state is None else state
    rows = []
    for end in ends:
        clip = audio[:end]
        got, kept, work = embed(engine, clip, state)
        expected = offline_embedding(engine, clip)
        assert got.shape == expected.shape == (qaudio.num_audio_tokens(qaudio.num_frames(end)), expected.shape[1])
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=lambda m: f"at {end / SR:.3f} s: {m}")
        rows.append(dict(end=end, kept=kept, **work))
    return rows


def loud_start_speech(seconds: float, seed: int) -> np.ndarray:
    """Speech-like audio whose loudest stretch is at 0.5-1.0 s: the clip maximum, so the floor, never moves later."""
    audio = speech_like(seconds, seed)
    audio[SR // 2 : SR] *= 3.0
    return audio


# (first end, step, last end) in seconds: appends of 0.1 s to 10 s, crossing window boundaries (8 s, 16 s)
GROWTH = {"0.1 s over 8 s": (7.5, 0.1, 8.6), "0.37 s": (0.37, 0.37, 9.0), "1 s": (1.0, 1.0, 18.0),
          "3.3 s": (3.3, 3.3, 18.0), "10 s": (1.0, 10.0, 21.0)}


@pytest.mark.parametrize("growth", GROWTH)
def test_growing_clip_equals_the_offline_encoder_and_computes_only_what_is_new(engine, growth):
    first, step, last = GROWTH[growth]
    audio = loud_start_speech(last + 0.5, seed=int(step * 10))
    ends = [int(round(t * SR)) for t in np.arange(first, last + 1e-9, step)]
    rows = grow(engine, audio, ends)
    previous = 0
    for row in rows:
        new_frames = qaudio.num_frames(row["end"]) - qaudio.num_frames(previous)
        # the chunk in progress (< 100 settled frames + the 1-2 unsettled ones) plus the new audio's frames
        assert row["mel_frames"] <= qaudio.CHUNK_FRAMES + new_frames + 2, row
        assert row["conv_chunks"] <= 2 + new_frames // qaudio.CHUNK_FRAMES, row
        assert row["encoded_windows"] <= 2 + new_frames // qaudio.WINDOW_FRAMES, row  # + the one in progress
        whole_before = qaudio.num_settled_frames(previous) // qaudio.WINDOW_FRAMES
        assert row["kept"] == row["reused_windows"] == whole_before, row
        previous = row["end"]


def test_a_clip_without_state_is_computed_whole(engine):
    audio = speech_like(17.0, seed=3)
    got, kept, work = embed(engine, audio, None)
    torch.testing.assert_close(got, offline_embedding(engine, audio), rtol=0, atol=ATOL)
    frames = qaudio.num_frames(audio.size)
    assert (kept, work["mel_frames"], work["conv_chunks"], work["encoded_windows"]) == (
        0, frames, -(-frames // qaudio.CHUNK_FRAMES), -(-frames // qaudio.WINDOW_FRAMES))


def test_the_encoder_counts_its_real_positions_and_those_it_computed(engine, monkeypatch):
    audio = speech_like(17.0, seed=3)  # windows of 8, 8 and 1 s: three, so one run at the whole window's length
    _, _, work = embed(engine, audio, None)
    runner, T, D = engine.runner, engine.runner.window_tokens, engine.model.encoder.cfg.d_model
    real = qaudio.num_audio_tokens(qaudio.num_frames(audio.size))
    last = real - 2 * T
    assert work["encoder_tokens"] == real and last < runner.encoder_lengths[0] < T
    assert work["encoder_computed_tokens"] == 3 * T
    monkeypatch.setattr(runner_module, "ENCODER_MERGED_WINDOWS", 2)  # a call of three: the last at its length bucket
    _, _, work = embed(engine, audio, None)
    assert work["encoder_computed_tokens"] == 2 * T + runner.encoder_lengths[0]
    # without graphs (the CPU) the conv runs the clip's chunks as they are: 17 s, 1,700 frames, 17 chunks
    assert work["conv_computed_chunks"] == work["conv_chunks"] == -(-qaudio.num_frames(audio.size) // qaudio.CHUNK_FRAMES)
    # CUDA's graph buckets pad the window count of each length's group: stand-ins for graphs of 1, 2 and 4 windows
    monkeypatch.setattr(runner_module, "ENCODER_BUCKETS", (1, 2, 4))
    replay = type("Graph", (), {"replay": lambda self: None})()
    out = engine.model.encoder.cfg.output_dim
    monkeypatch.setattr(runner, "encoder_graphs", {(n, b): (replay, torch.zeros(b, n, out))
                                                   for n in runner.encoder_lengths for b in (1, 2, 4)})
    monkeypatch.setattr(runner, "_enc_windows", {n: torch.zeros(4, n, D) for n in runner.encoder_lengths},
                        raising=False)
    monkeypatch.setattr(runner, "_enc_lengths", {n: torch.ones(4, dtype=torch.long) for n in runner.encoder_lengths},
                        raising=False)
    short, middle = runner.encoder_lengths[:2]
    computed = []
    for sizes in ([T], [T] * 3, [T] * 5, [T] * 7, [1, short, T, middle, 2]):
        before = runner.encoder_positions_run
        runner.encode_windows(torch.zeros(len(sizes), T, D), torch.tensor(sizes), sizes)
        computed.append(runner.encoder_positions_run - before)
    # 5 and 7 whole windows: replays of 4 and 1, of 4 and 4; the mixed call (past the merge's limit, 2 here): three
    # short ones in the 4-window graph
    assert computed == [T, 4 * T, 5 * T, 8 * T, 4 * short + middle + T]


def test_the_same_audio_again_computes_only_the_unsettled_end(engine):
    audio = loud_start_speech(9.0, seed=4)
    state = StreamState()
    rows = grow(engine, audio, [audio.size, audio.size])
    assert rows[1]["mel_frames"] <= qaudio.CHUNK_FRAMES and rows[1]["kept"] == 1 and rows[1]["encoded_windows"] == 1
    # at a window boundary with every frame settled, nothing is left to compute: all of it comes from the cache
    end = qaudio.WINDOW_SAMPLES + 40  # 800 frames, all settled (the last one's window ends at sample 128040)
    assert qaudio.num_settled_frames(end) == qaudio.num_frames(end) == qaudio.WINDOW_FRAMES
    rows = grow(engine, audio, [end, end], state)
    assert (rows[1]["mel_frames"], rows[1]["conv_chunks"], rows[1]["encoded_windows"], rows[1]["kept"]) == (0, 0, 0, 1)


def test_a_louder_sound_later_moves_the_floor_and_what_it_changed_is_computed_again(engine):
    audio = loud_start_speech(20.0, seed=5)
    audio[: SR // 4] = 0  # digital silence at the start: floored at any maximum
    audio[12 * SR : 13 * SR] *= 20  # louder than anything before: the clip maximum rises by ~2.6 (log10)
    assert qaudio.log_mel(audio[: 12 * SR]).max() < qaudio.log_mel(audio).max() - 0.2  # features: log10 / 4
    ends = [s * SR for s in range(1, 21)]
    rows = grow(engine, audio, ends)
    at = {row["end"] // SR: row for row in rows}
    assert at[12]["kept"] == 1  # before the loud second: the first window is kept
    assert [row["end"] // SR for row in rows if row["floor_moves"]] == [13]
    assert at[13]["kept"] == 0 and at[13]["mel_frames"] >= 13 * qaudio.FRAMES_PER_SECOND - 2  # all of it again
    assert at[14]["kept"] == 1 and at[14]["mel_frames"] <= qaudio.CHUNK_FRAMES + qaudio.FRAMES_PER_SECOND + 2


def test_a_rise_of_the_maximum_that_floors_no_kept_chunk_keeps_them(engine):
    # white noise: every mel bin within ~5.3 (log10) of the loudest, so a louder burst floors nothing that was kept
    audio = (0.1 * np.random.default_rng(6).standard_normal(16 * SR)).astype(np.float32)
    audio[12 * SR : 13 * SR] *= 3
    assert qaudio.log_mel(audio[: 12 * SR]).max() < qaudio.log_mel(audio).max() - 0.1  # features: log10 / 4
    rows = grow(engine, audio, [s * SR for s in range(11, 15)])
    assert [row["kept"] for row in rows] == [0, 1, 1, 1]
    assert not any(row["floor_moves"] for row in rows)
    assert all(row["mel_frames"] <= qaudio.CHUNK_FRAMES + qaudio.FRAMES_PER_SECOND + 2 for row in rows[1:])


def test_audio_that_does_not_continue_the_stream_starts_it_over(engine):
    first, other = speech_like(18.0, seed=7), speech_like(18.0, seed=8)
    state = StreamState()
    grow(engine, first, [10 * SR, 17 * SR], state)
    assert len(state.windows) == 2
    rows = grow(engine, other, [17 * SR + 100], state)  # longer, but other audio: nothing of `first` enters
    assert rows[0]["kept"] == 0 and rows[0]["mel_frames"] == qaudio.num_frames(17 * SR + 100)
    rows = grow(engine, other, [16 * SR], state)  # shorter than what was seen: starts over too
    assert rows[0]["kept"] == 0


def test_streams_in_one_batch_stay_apart(engine):
    clips = [speech_like(14.0, seed=9), speech_like(14.0, seed=10) * 3, speech_like(5.0, seed=11)]
    clips[1][: SR // 2] = 0
    states = [StreamState(), StreamState(), None]
    for seconds in (3, 9, 11, 14):
        batch = [clip[: min(seconds * SR, clip.size)] for clip in clips]
        with torch.inference_mode():
            out = engine.frontend.embed(batch, states)
        for clip, got in zip(batch, out):
            torch.testing.assert_close(got.audio, offline_embedding(engine, clip), rtol=0, atol=ATOL)


def test_partials_decode_the_same_tokens_as_fresh_ones_when_the_floor_moves(engine):
    """The retained KV of windows the floor changed is not reused: every partial equals one decoded from scratch."""
    audio = loud_start_speech(17.0, seed=12)
    audio[: SR // 4] = 0
    audio[12 * SR : 13 * SR] *= 20
    for seconds in range(9, 17):
        request = dict(audio=audio[: seconds * SR], priority=Priority.PARTIAL, max_new_tokens=4)
        copied = engine.counters["reused_tokens"]
        reused = engine.transcribe([DecodeRequest(stream_id="floor", **request)])[0]
        copied = engine.counters["reused_tokens"] - copied
        # the retained KV holds window 1 from 10 s on; at 13 s the floor moved into it: none of it may be copied
        assert (copied == 0) == (seconds in (9, 13)), (seconds, copied)
        engine.streams.get("fresh").answer_ids = ()
        fresh = engine.transcribe([DecodeRequest(stream_id="fresh", **request)])[0]
        engine.release_stream("fresh")
        engine.step()
        engine.streams.get("floor").answer_ids = ()  # both from the same (empty) given prefix
        assert reused.token_ids == fresh.token_ids, seconds
    engine.release_stream("floor")
    engine.step()
    assert engine.streams.peek("floor") is None  # released: its windows, chunks and KV slot with it


def test_clips_without_stream_state_get_the_host_paths_features_bit_for_bit_without_a_host_read(engine):
    """Finals and offline clips keep their maxima on the device (AudioFrontEnd._whole_clip_features): the same
    features as the path that reads the chunks' extremes to the host (which partials still take), and no read."""
    seconds = (0.3, 2.0, 10.9, 0.0125, 4.37)  # under a chunk, whole chunks, #16's clip, two frames, a ragged end
    clips = [speech_like(s, seed=60 + i) for i, s in enumerate(seconds)]
    clips.append((speech_like(1.5, seed=70) * 1e-5).astype(np.float32))  # a whisper: every raw value below 0, so a
    # maximum taken over the zeros past its end (the batch's padding) would be wrong
    frontend = engine.frontend
    with torch.inference_mode():
        work = frontend.prepare(clips, [None] * len(clips))
        reads = engine.runner.host_reads
        on_device = frontend._whole_clip_features(work)
        assert engine.runner.host_reads == reads
        frontend._log_spectrogram(work, work[0].staged)  # the partials' path: extremes read, maxima on the host
        assert engine.runner.host_reads == reads + 1
        on_host = frontend._floored(work)
    assert work[-1].clip_max < 0
    for clip, a, b in zip(clips, on_device, on_host):
        assert a.shape == b.shape == (qaudio.N_MELS, qaudio.num_frames(clip.size))
        assert torch.equal(a, b)
        torch.testing.assert_close(a, qaudio.log_mel(clip), atol=ATOL, rtol=0)  # the clip's features, alone
