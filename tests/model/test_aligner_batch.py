"""qasr.model.aligner_batch: the host-side layout of an aligner forward, and the chunk-laid-out encoder that reads it
(qasr.model.aligner's `encode_chunks`), on the CPU with a tiny random aligner.

The layout is what a CUDA-graph bucket is padded from, so it is checked position by position; the encoder over it
must give each clip what the plain encoder gives that clip alone (the official's, tests/model/test_aligner.py)."""

import numpy as np
import pytest
import torch

from qasr.model.aligner import ForcedAligner
from qasr.model.aligner_batch import plan_batch
from qasr.model.audio import log_mel

from fakes import speech_clip

SR = 16000
START, PAD, END, EOT, TS = 1, 2, 3, 0, 9  # stand-in ids: the layout only places them


@pytest.fixture(scope="module")
def aligner(tiny_aligner_dir) -> ForcedAligner:
    return ForcedAligner.from_pretrained(tiny_aligner_dir)


def plan(aligner, seconds, texts):
    return plan_batch([int(s * SR) for s in seconds], texts, aligner.config.model.audio, audio_start_id=START,
                      audio_pad_id=PAD, audio_end_id=END, pad_id=EOT, timestamp_id=TS)


def test_chunks_windows_and_rows_are_laid_out_clip_by_clip(aligner):
    # 0.5 s: 50 frames, one short chunk (7 tokens); 8.5 s: 850 frames, 9 chunks, 104 + 7 tokens, 2 windows
    batch = plan(aligner, [0.5, 8.5], [(40, TS, TS), (41, 42, TS, TS, 43, TS, TS)])
    assert batch.shape == (2, 2 + 111 + 7, 3) and batch.max_chunks == 9 and batch.num_clips == 2
    zero = 2 * 9
    assert batch.chunk_source.tolist() == [0] + [zero] * 7 + [9 + j for j in range(9)] + [zero] * 7
    assert batch.chunk_valid.tolist() == [50] * 8 + [100] * 16  # a short clip's convs see its 50 frames only
    assert batch.window_lengths.tolist() == [7, 104, 7]
    assert batch.lengths.tolist() == [2 + 7 + 3, 2 + 111 + 7]
    assert batch.ids[0].tolist() == [START, *[PAD] * 7, END, 40, TS, TS] + [EOT] * (batch.shape[1] - 12)
    assert batch.ids[1].tolist() == [START, *[PAD] * 111, END, 41, 42, TS, TS, 43, TS, TS]
    # each audio position reads its token of the flat encoder output: clip 0 from window 0, clip 1 from window 1
    assert batch.audio_index[0, 1:8].tolist() == list(range(7)) and not batch.audio_index[0, 8:].any()
    assert batch.audio_index[1, 1:112].tolist() == list(range(104, 104 + 111))
    assert [s.tolist() for s in batch.slots] == [[10, 11], [115, 116, 118, 119]]
    assert batch.read_classes(np.arange(2 * 120).reshape(2, 120)) == [[10, 11], [120 + 115, 120 + 116, 120 + 118,
                                                                                120 + 119]]


def test_padding_adds_rows_positions_windows_and_zero_chunks_only(aligner):
    batch = plan(aligner, [1.5, 0.3], [(40, TS, TS), (41, TS, TS)])
    padded = batch.padded(4, 64, 5, pad_id=EOT)
    B, T, W = batch.shape
    assert padded.shape == (4, 64, 5)
    assert (padded.ids[:B, :T] == batch.ids).all()
    assert (padded.ids[:, T:] == EOT).all() and (padded.ids[B:] == EOT).all()
    assert (padded.audio_index[:B, :T] == batch.audio_index).all() and not padded.audio_index[B:].any()
    assert padded.lengths.tolist() == batch.lengths.tolist() + [1, 1]
    assert padded.window_lengths.tolist() == batch.window_lengths.tolist() + [1] * (5 - W)
    assert padded.chunk_source.tolist() == batch.chunk_source.tolist() + [2 * batch.max_chunks] * 8 * (5 - W)
    assert [s.tolist() for s in padded.slots] == [s.tolist() for s in batch.slots]
    with pytest.raises(ValueError, match="cannot pad"):
        batch.padded(1, 64, 5, pad_id=EOT)


def test_bad_plans_are_refused(aligner):
    with pytest.raises(ValueError, match="one text per clip"):
        plan(aligner, [1.0], [(40,), (41,)])
    with pytest.raises(ValueError, match="at least one clip"):
        plan(aligner, [], [])


@pytest.mark.parametrize("seconds", [[0.3], [0.93], [1.0], [2.47], [8.0], [8.3], [0.6, 12.7, 1.0, 16.5]])
def test_the_chunk_laid_out_encoder_gives_each_clip_what_the_plain_encoder_gives_it_alone(aligner, seconds):
    clips = [speech_clip(s, seed=i) for i, s in enumerate(seconds)]
    inputs = [aligner.prepare("a few words", "English") for _ in clips]
    batch = aligner.plan(clips, inputs)
    arrays = aligner.upload(batch)
    with torch.inference_mode():
        chunks = aligner.chunks(aligner.upload_clips(clips), batch, arrays["chunk_source"])
        audio = aligner.network.encode_chunks(chunks, arrays["chunk_valid"], arrays["window_lengths"])
        for b, clip in enumerate(clips):
            alone = aligner.network.encoder([log_mel(clip)])[0]  # short clips unpadded, as the official
            at = batch.audio_index[b][batch.ids[b] == aligner.tokenizer.audio_pad_id]
            torch.testing.assert_close(audio[torch.from_numpy(at)], alone, rtol=1e-5, atol=1e-5)
