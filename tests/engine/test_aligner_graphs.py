"""qasr.engine.aligner_graphs on the CPU: the buckets' static buffers and padding, run eagerly (a CUDA graph replays
exactly these buffers; it cannot be captured here). Padded to a bucket, every real row's result equals the unpadded
forward's, and the engine's words through the bucket path equal its words through the eager path."""

import numpy as np
import pytest
import torch

from qasr.engine.aligner_graphs import AlignerGraphs
from qasr.engine.request import DecodeRequest
from qasr.model.aligner import ForcedAligner

from fakes import speech_clip
from test_engine import make_engine, speech

TEXTS = ["Please call me back tomorrow morning.", "Yes.", "We measured the latency of every request today.",
         "Hello, world!"]


@pytest.fixture(scope="module")
def aligner(tiny_aligner_dir) -> ForcedAligner:
    return ForcedAligner.from_pretrained(tiny_aligner_dir)


@pytest.fixture(scope="module")
def graphs(aligner) -> AlignerGraphs:
    return AlignerGraphs(aligner, max_rows=4, capture=False, token_buckets=(64, 128, 256))


def batch_of(aligner, seconds):
    clips = [speech_clip(s, seed=i) for i, s in enumerate(seconds)]
    inputs = [aligner.prepare(TEXTS[i % len(TEXTS)], "English") for i in range(len(clips))]
    return clips, inputs, aligner.plan(clips, inputs)


def test_buckets_come_from_the_rows_and_the_longest_segment(graphs):
    assert graphs.row_buckets == (1, 2, 4) and graphs.token_buckets == (64, 128, 256)
    assert graphs.window_buckets == (1, 2, 4, 8, 16)  # 4 rows x 4 windows of a 30 s segment
    assert graphs.num_graphs == 0 and graphs.capture_seconds == 0  # not captured on the CPU
    with pytest.raises(ValueError, match="max_rows"):
        AlignerGraphs(graphs.aligner, max_rows=0, capture=False)


def test_a_batch_gets_the_smallest_bucket_that_holds_it_or_none(aligner, graphs):
    _, _, batch = batch_of(aligner, [1.0, 2.0, 3.0])
    rows, tokens, windows = batch.shape
    assert (rows, windows) == (3, 3) and tokens <= 128
    assert graphs.shape_for(batch) == (4, 64 if tokens <= 64 else 128, 4)
    _, _, long = batch_of(aligner, [19.0])  # 247 audio tokens + the words: past 256 positions
    assert long.shape[1] > 256 and graphs.shape_for(long) is None
    _, _, many = batch_of(aligner, [0.5] * 5)  # more rows than the largest bucket
    assert graphs.shape_for(many) is None
    _, _, wide = batch_of(aligner, [16.5] * 4)  # 3 windows each
    narrow = AlignerGraphs(aligner, max_rows=4, capture=False, token_buckets=(1024,), max_windows=8)
    assert wide.shape[2] == 12 and narrow.window_buckets == (1, 2, 4, 8) and narrow.shape_for(wide) is None
    with pytest.raises(ValueError, match="no aligner bucket"):
        graphs.run(batch, aligner.upload_clips([speech_clip(1.0, seed=0)] * 3))


@pytest.mark.parametrize("seconds", [[0.4], [1.0, 2.0, 3.0], [0.93, 8.3], [5.2, 0.3, 9.9, 2.2]])
def test_padding_to_a_bucket_changes_no_row(aligner, graphs, seconds):
    clips, inputs, batch = batch_of(aligner, seconds)
    padded = batch.padded(*graphs.shape_for(batch), pad_id=aligner.tokenizer.endoftext_id)
    with torch.inference_mode():
        exact = aligner.forward(batch, aligner.upload_clips(clips))
        wide = aligner.forward(padded, aligner.upload_clips(clips))
        classes = graphs.run(padded, aligner.upload_clips(clips)).numpy()
    B, T, _ = batch.shape
    real = torch.arange(T)[None, :] < torch.from_numpy(batch.lengths)[:, None]  # [B, T]
    torch.testing.assert_close(wide[:B, :T][real], exact[real], rtol=1e-4, atol=1e-4)  # as batch mates may move it
    assert (classes[:B, :T][real.numpy()] == exact.argmax(-1)[real].numpy()).all()
    assert padded.read_classes(classes) == aligner.timestamp_classes(clips, inputs)


def test_the_buffers_are_reused_run_after_run(aligner, graphs):
    """A smaller batch after a larger one in the same bucket reads none of the larger one's leftovers."""
    big_clips, big_inputs, big = batch_of(aligner, [9.9, 5.2, 7.7, 3.3])
    small_clips, small_inputs, small = batch_of(aligner, [1.1])
    for clips, inputs, batch in [(big_clips, big_inputs, big), (small_clips, small_inputs, small)]:
        padded = batch.padded(*graphs.shape_for(batch), pad_id=aligner.tokenizer.endoftext_id)
        with torch.inference_mode():
            classes = graphs.run(padded, aligner.upload_clips(clips)).numpy()
        assert padded.read_classes(classes) == aligner.timestamp_classes(clips, inputs)


def test_the_engines_bucket_path_gives_the_eager_paths_words(tiny_model_dir, tiny_aligner_dir):
    clips = [speech(s, seed=80 + i) for i, s in enumerate([1.3, 0.7, 4.4, 2.9, 25.0])]
    requests = lambda: [DecodeRequest(audio=c, language="English", max_new_tokens=8, words=True)  # noqa: E731
                        for c in clips]
    eager = make_engine(tiny_model_dir, aligner=str(tiny_aligner_dir), max_len=512, aligner_max_batch=4)
    bucketed = make_engine(tiny_model_dir, aligner=str(tiny_aligner_dir), max_len=512, aligner_max_batch=4)
    bucketed.aligner.graphs = AlignerGraphs(bucketed.aligner.aligner, max_rows=4, capture=False,
                                            token_buckets=(64, 128, 256))
    expected = eager.transcribe(requests())
    got = bucketed.transcribe(requests())
    assert [r.words for r in got] == [r.words for r in expected] and all(r.words for r in got)
    stats = bucketed.stats()["aligner"]
    assert stats["graphed"] >= 1 and stats["graphed"] < stats["batches"]  # the 25 s clip's batch runs eagerly
    assert np.isfinite(stats["launch_seconds"])
