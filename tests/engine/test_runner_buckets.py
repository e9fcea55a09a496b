"""The runner's padding of admissions on the CPU: the prefill's (sequences, length) buckets and the encoder's
(window length, windows) buckets, which are the shapes its CUDA graphs are captured at.

What a bucket pads must not change what the real positions compute: a window run at its length bucket gives the
outputs of the whole window, whatever lies in its padding. The graphed path is driven with stand-in graphs that run
what capture would have recorded (the eager encoder on the static buffers)."""

import pytest
import torch

from qasr.engine import runner as runner_module
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.runner import bucket_of, encoder_replays, prefill_graphed, prefill_length_buckets, prefill_replays


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> runner_module.ModelRunner:
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32",
                                    options=EngineOptions(num_slots=4, max_len=256, num_retained=2))
    return engine.runner


def test_prefill_lengths_are_fine_where_prompts_are_and_coarser_beyond():
    assert prefill_length_buckets(640) == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                           320, 384, 448, 512, 576, 640)
    assert prefill_length_buckets(100)[-1] == 112 and prefill_length_buckets(300)[-1] == 320  # past max_len
    # the graphs captured: 100 at the benches' --max-len 640, 124 at the default 1024 (1-8 sequences at every length,
    # 16 up to 512 tokens, 32 up to 256: at most 8,192 padded tokens a graph)
    for max_len, graphs in ((640, 100), (1024, 124)):
        shapes = [(b, t) for b in runner_module.PREFILL_BATCH_BUCKETS for t in prefill_length_buckets(max_len)
                  if prefill_graphed(b, t)]
        assert len(shapes) == graphs and max(b * t for b, t in shapes) == runner_module.PREFILL_GRAPH_TOKENS
    with pytest.raises(ValueError, match="before max_len"):
        prefill_length_buckets(300, steps=((128, 16), (256, 32)))


def test_a_prefill_is_padded_sorted_by_length_in_groups_of_the_largest_batch_bucket():
    lengths = [100, 25, 47, 30, 200, 26, 51, 33, 64, 90]  # ten sequences: groups of 8 and 2
    batch, ladder = (1, 2, 4, 8), prefill_length_buckets(640)
    replays = prefill_replays(lengths, batch, ladder)
    assert [(chunk, b, t) for chunk, b, t in replays] == [
        ([1, 5, 3, 7, 2, 6, 8, 9], 8, 96),  # 25..90 -> 96 (with a step of 64: 128)
        ([0, 4], 2, 224)]  # 100 and 200 -> 224
    assert sum(b * t for _, b, t in replays) == 8 * 96 + 2 * 224
    assert prefill_replays([17], batch, ladder) == [([0], 1, 32)] and prefill_replays([16], batch, ladder)[0][2] == 16
    assert [b for _, b, _ in prefill_replays([5] * 3, batch, ladder)] == [4]  # 3 sequences and a padding row


def test_a_prefill_groups_as_many_sequences_as_a_graph_of_their_length_holds():
    batch, ladder = (1, 2, 4, 8, 16, 32), prefill_length_buckets(1024)
    assert [(len(c), b, t) for c, b, t in prefill_replays([150] * 40, batch, ladder)] == [(32, 32, 160), (8, 8, 160)]
    # 32 x 320 tokens is past the cap, 16 x 320 within it; 8 sequences of 1,000 tokens are the most a graph holds
    assert [(len(c), b, t) for c, b, t in prefill_replays([300] * 40, batch, ladder)] == [
        (16, 16, 320), (16, 16, 320), (8, 8, 320)]
    assert [b for _, b, _ in prefill_replays([1000] * 9, batch, ladder)] == [8, 1]
    # sorted: the short ones fill a 32-graph, the long ones go on in smaller groups
    replays = prefill_replays([900] * 3 + [40] * 33, batch, ladder)
    assert [(len(c), b, t) for c, b, t in replays] == [(32, 32, 48), (4, 4, 960)]
    assert all(prefill_graphed(b, t) for _, b, t in replays)
    assert prefill_graphed(1, 100_000) and not prefill_graphed(2, 4097)


def test_prefill_batches_stop_at_the_first_that_holds_every_slot(tiny_model_dir):
    for slots, batches in ((4, (1, 2, 4)), (6, (1, 2, 4, 8)), (64, runner_module.PREFILL_BATCH_BUCKETS)):
        engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32",
                                        options=EngineOptions(num_slots=slots, max_len=128, num_retained=0))
        assert engine.runner.prefill_batches == batches


def test_prefill_batches_can_be_narrowed_for_a_comparison(monkeypatch):
    monkeypatch.setenv(runner_module.PREFILL_BATCHES_ENV, "8,1,4,2")
    assert runner_module.prefill_batch_buckets() == (1, 2, 4, 8)
    for bad in ("2,4", "1,x", "0,1"):
        monkeypatch.setenv(runner_module.PREFILL_BATCHES_ENV, bad)
        with pytest.raises(ValueError, match=runner_module.PREFILL_BATCHES_ENV):
            runner_module.prefill_batch_buckets()
    monkeypatch.delenv(runner_module.PREFILL_BATCHES_ENV)
    assert runner_module.prefill_batch_buckets() == runner_module.PREFILL_BATCH_BUCKETS


def test_the_runner_picks_the_prefill_bucket_of_the_ladder(runner):
    try:
        runner.fused_kernels = True  # build_prefill_buckets asks for them; capture=False runs nothing
        runner.build_prefill_buckets(capture=False)
        assert sorted({t for _, t in runner.prefill_buckets}) == list(prefill_length_buckets(256))
        # every replay an admission makes has its bucket: up to max_len tokens, any number of sequences
        for lengths in ([30, 100, 64], [16], [5] * 9, [256, 1, 129], [20] * 40, [250] * 40):
            for _, b, t in prefill_replays(lengths, runner.prefill_batches, runner.prefill_lengths):
                assert (b, t) in runner.prefill_buckets, (lengths, b, t)
    finally:
        runner.fused_kernels, runner.prefill_buckets = False, {}


def test_encoder_windows_are_grouped_by_length_bucket_and_each_group_padded_to_a_window_bucket():
    lengths, windows = (32, 56, 104), (1, 2, 3, 4, 6, 8)
    sizes = [14, 104, 27, 40, 53, 104, 79, 13, 32, 33]
    assert encoder_replays(sizes, lengths, windows) == [
        (32, [0, 2, 7, 8], 4), (56, [3, 4, 9], 3), (104, [1, 5, 6], 3)]
    assert encoder_replays(sizes, lengths, None) == [  # eagerly: no window padding
        (32, [0, 2, 7, 8], 4), (56, [3, 4, 9], 3), (104, [1, 5, 6], 3)]
    assert encoder_replays([104] * 9 + [5], lengths, windows) == [
        (32, [9], 1), (104, [0, 1, 2, 3, 4, 5, 6, 7], 8), (104, [8], 1)]  # past the largest: several replays
    assert encoder_replays([104] * 5, (104,), windows) == [(104, [0, 1, 2, 3, 4], 6)]
    assert bucket_of(57, lengths) == 104 and bucket_of(56, lengths) == 56


def test_a_call_of_at_most_the_merged_windows_is_one_run_at_the_longest_bucket_any_needs():
    lengths, windows = (32, 56, 104), (1, 2, 3, 4, 6, 8)
    assert encoder_replays([104, 39], lengths, windows, merged_windows=4) == [(104, [0, 1], 2)]  # a 10.9 s clip
    assert encoder_replays([104, 39], lengths, None, merged_windows=4) == [(104, [0, 1], 2)]
    assert encoder_replays([104, 39], lengths, windows) == [(56, [1], 1), (104, [0], 1)]  # no merging: two runs
    assert encoder_replays([14, 40, 27], lengths, windows, merged_windows=4) == [(56, [0, 1, 2], 3)]
    assert encoder_replays([5, 30, 33, 10], lengths, windows, merged_windows=4) == [(56, [0, 1, 2, 3], 4)]
    assert encoder_replays([7], lengths, windows, merged_windows=4) == [(32, [0], 1)]
    # more windows than that: grouped by length bucket, as without merging
    assert encoder_replays([5, 30, 33, 10, 1], lengths, windows, merged_windows=4) == [
        (32, [0, 1, 3, 4], 4), (56, [2], 1)]
    assert encoder_replays([14, 40, 27], lengths, windows, merged_windows=2) == [(32, [0, 2], 2), (56, [1], 1)]
    sizes = [14, 104, 27, 40, 53, 104, 79, 13, 32, 33]
    assert encoder_replays(sizes, lengths, windows, merged_windows=4) == encoder_replays(sizes, lengths, windows)
    assert encoder_replays([], lengths, windows, merged_windows=4) == []


def test_the_runners_encoder_lengths_end_with_its_window(runner):
    assert runner.encoder_lengths == runner_module.ENCODER_LENGTH_BUCKETS == (32, 56, runner.window_tokens)


def random_windows(runner, sizes, seed=0):
    """Packed windows [W, window, D] whose positions past each window's size are random garbage (not zeros)."""
    cfg = runner.model.encoder.cfg
    torch.manual_seed(seed)
    return torch.randn(len(sizes), cfg.window_tokens, cfg.d_model), torch.tensor(sizes)


@torch.inference_mode()
def test_a_windows_output_does_not_depend_on_its_padding(runner):
    """A window run at its length bucket gives what it gives run whole, whatever its padding holds: its real
    positions never read the others (keys masked; positions were added per chunk, before the encoder)."""
    sizes = [14, 27, 104, 40, 53, 1, 79, 56]
    windows, lengths = random_windows(runner, sizes)
    encoder = runner.model.encoder
    whole = encoder.encode_windows(windows, lengths)  # every window at 104 positions
    before = runner.encoder_positions_run
    bucketed = runner.encode_windows(windows, lengths, sizes)
    assert runner.encoder_positions_run - before == sum(bucket_of(n, runner.encoder_lengths) for n in sizes) < 8 * 104
    other = windows.clone()
    for w, n in enumerate(sizes):
        other[w, n:] = torch.randn(other.shape[1] - n, other.shape[2]) * 100  # different padding
    again = runner.encode_windows(other, lengths, sizes)
    for w, n in enumerate(sizes):
        torch.testing.assert_close(bucketed[w, :n], whole[w, :n], rtol=0, atol=1e-5)
        assert torch.equal(bucketed[w, :n], again[w, :n])
    # without the host's sizes, every window runs whole
    before = runner.encoder_positions_run
    assert torch.equal(runner.encode_windows(windows, lengths), whole)
    assert runner.encoder_positions_run - before == 8 * 104


@torch.inference_mode()
def test_each_clips_encoder_output_is_one_view_of_its_windows_in_order(runner):
    """encode -> per clip its windows' outputs one after the other, as a view of the packed output (every window of a
    clip but its last is whole), equal to the windows cut out one by one."""
    D = runner.model.encoder.cfg.d_model
    size = runner.window_tokens
    clips = [torch.randn(n, D) for n in (size, 2 * size, 2 * size + 37, 5, size + 1)]
    encoder = runner.model.encoder
    windows, lengths, owners = encoder.pack_windows(clips)
    expected = encoder.unpack_windows(encoder.encode_windows(windows, lengths), lengths, owners, len(clips))
    got = runner.encode(clips)
    assert [t.shape[0] for t in got] == [c.shape[0] for c in clips]
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # views of one output
    for t, e in zip(got, expected):
        torch.testing.assert_close(t, e, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_a_call_of_few_windows_runs_once_and_gives_each_window_its_own_outputs(runner, monkeypatch):
    """Clips of at most ENCODER_MERGED_WINDOWS windows in all run in one run at the longest length bucket any of
    them needs (a 10.9 s clip's windows of 104 and 39 positions: one run, not two); each clip's outputs are those of
    one run per length bucket and of every window run whole, up to the rounding of other shapes."""
    encoder = runner.model.encoder
    T, D = runner.window_tokens, encoder.cfg.d_model
    plain_encode_windows = type(encoder).encode_windows
    runs = []  # (windows, length) of each of the encoder's runs

    def counted(self, windows, lengths, *args, **kwargs):
        runs.append(tuple(windows.shape[:2]))
        return plain_encode_windows(self, windows, lengths, *args, **kwargs)

    monkeypatch.setattr(type(encoder), "encode_windows", counted)
    assert runner_module.ENCODER_MERGED_WINDOWS == 4
    cases = [  # clips' conv tokens -> the runs merged, and one per length bucket
        ((T + 39,), [(2, T)], [(1, 56), (1, T)]),
        ((14, 40, 27), [(3, 56)], [(2, 32), (1, 56)]),
        ((5, T + 20), [(3, T)], [(2, 32), (1, T)]),
        ((14, 40, 27, T + 9), [(3, 32), (1, 56), (1, T)], [(3, 32), (1, 56), (1, T)]),  # 5 windows: not merged
    ]
    torch.manual_seed(3)
    for sizes, merged_runs, bucket_runs in cases:
        clips = [torch.randn(n, D) for n in sizes]
        windows, lengths, owners = encoder.pack_windows(clips)
        whole = encoder.unpack_windows(plain_encode_windows(encoder, windows, lengths), lengths, owners, len(clips))
        got = {}
        for merged in (4, 0):
            monkeypatch.setattr(runner_module, "ENCODER_MERGED_WINDOWS", merged)
            runs.clear()
            before = runner.encoder_positions_run
            got[merged] = runner.encode(clips)
            assert runs == (merged_runs if merged else bucket_runs), (sizes, merged)
            assert runner.encoder_positions_run - before == sum(w * n for w, n in runs)
        for one_run, per_bucket, reference in zip(got[4], got[0], whole):
            torch.testing.assert_close(one_run, per_bucket, rtol=0, atol=1e-5)
            torch.testing.assert_close(one_run, reference, rtol=0, atol=1e-5)


def stand_in_encoder_graphs(runner, monkeypatch) -> list[tuple[int, int]]:
    """The runner's encoder graphs (of 1, 2 and 4 windows at each length) replaced by stand-ins that run what
    capture would have recorded, the encoder on the static buffers' first W windows -> their replays, as they come."""
    encoder = runner.model.encoder
    cfg = encoder.cfg
    monkeypatch.setattr(runner_module, "ENCODER_BUCKETS", (1, 2, 4))
    monkeypatch.setattr(runner, "_enc_windows", {n: torch.full((4, n, cfg.d_model), 7.0)
                                                 for n in runner.encoder_lengths}, raising=False)
    monkeypatch.setattr(runner, "_enc_lengths", {n: torch.ones(4, dtype=torch.long) for n in runner.encoder_lengths},
                        raising=False)
    replays = []

    class StandInGraph:  # replays what capture recorded: the encoder on the static buffers' first W windows
        def __init__(self, n, W):
            self.n, self.W, self.out = n, W, torch.zeros(W, n, cfg.output_dim)

        def replay(self):
            replays.append((self.n, self.W))
            static = runner._enc_windows[self.n][: self.W]
            self.out.copy_(encoder.encode_windows(static, runner._enc_lengths[self.n][: self.W]))

    graphs = {(n, W): StandInGraph(n, W) for n in runner.encoder_lengths for W in (1, 2, 4)}
    monkeypatch.setattr(runner, "encoder_graphs", {key: (g, g.out) for key, g in graphs.items()})
    return replays


@torch.inference_mode()
def test_graphed_encoder_runs_each_length_group_through_its_graphs(runner, monkeypatch):
    encoder = runner.model.encoder
    replays = stand_in_encoder_graphs(runner, monkeypatch)
    sizes = [104] * 6 + [9, 40, 20]
    windows, lengths = random_windows(runner, sizes, seed=1)
    got = runner.encode_windows(windows, lengths, sizes)
    expected = encoder.encode_windows(windows, lengths)
    # the short group (9, 20) in the 2-window graph at 32, 40 alone at 56, the whole ones in graphs of 4 and 2
    assert replays == [(32, 2), (56, 1), (104, 4), (104, 2)]
    assert got.shape == expected.shape
    for w, n in enumerate(sizes):
        torch.testing.assert_close(got[w, :n], expected[w, :n], rtol=0, atol=1e-5)
    assert runner._enc_lengths[104][:2].tolist() == [104, 104] and runner._enc_lengths[56][1:].tolist() == [1, 1, 1]


@torch.inference_mode()
def test_graphed_encoder_runs_a_call_of_few_windows_in_one_replay(runner, monkeypatch):
    """A 10.9 s clip's windows (104 and 39 positions) and three short ones: one replay each, at the longest length
    bucket the call needs, each window's real outputs those of its whole window whatever its padding holds."""
    encoder = runner.model.encoder
    replays = stand_in_encoder_graphs(runner, monkeypatch)
    for sizes, expected_replays in (([104, 39], [(104, 2)]), ([14, 40, 27], [(56, 4)])):
        replays.clear()
        windows, lengths = random_windows(runner, sizes, seed=2)
        got = runner.encode_windows(windows, lengths, sizes)
        expected = encoder.encode_windows(windows, lengths)
        assert replays == expected_replays
        for w, n in enumerate(sizes):
            torch.testing.assert_close(got[w, :n], expected[w, :n], rtol=0, atol=1e-5)


@torch.inference_mode()
def test_graphed_conv_front_end_pads_the_chunk_count_to_a_bucket(runner, monkeypatch):
    """Full chunks of all clips run through the conv graph of their count's bucket, in pieces of the largest; a clip
    shorter than one chunk still runs apart, unpadded (as the official encoder convolves it)."""
    encoder = runner.model.encoder
    cfg = encoder.cfg
    monkeypatch.setattr(runner_module, "CONV_BUCKETS", (1, 2, 4))
    monkeypatch.setattr(runner, "_conv_chunks", torch.full((4, cfg.num_mel_bins, cfg.chunk_frames), 3.0),
                        raising=False)
    replays = []

    class StandInGraph:  # replays what capture recorded: the conv front end on the static buffer's first n chunks
        def __init__(self, n):
            self.n = n
            self.out = torch.zeros(n, cfg.tokens_per_chunk, cfg.d_model)

        def replay(self):
            replays.append(self.n)
            self.out.copy_(encoder.embed_chunks(runner._conv_chunks[: self.n]))

    graphs = {n: StandInGraph(n) for n in (1, 2, 4)}
    monkeypatch.setattr(runner, "conv_graphs", {n: (g, g.out) for n, g in graphs.items()})
    torch.manual_seed(5)
    frames = [250, 60, 100, 120]  # chunks 3, short, 1, 2: six in the batch
    mels = [torch.randn(cfg.num_mel_bins, f) for f in frames]
    for continued in ([False] * 4, [False, True, False, False]):  # a continued short tail is padded like a chunk
        replays.clear()
        before = runner.conv_chunks_run
        got = runner.embed_chunks(mels, continued)
        expected = encoder.embed_clips(mels, continued)
        chunks = 6 + continued[1]
        assert replays == ([4, 2] if chunks == 6 else [4, 4])  # 6: 4 + 2; 7: 4 + 3 padded to 4
        assert runner.conv_chunks_run - before == (6 if chunks == 6 else 8)
        for g, e, f in zip(got, expected, frames):
            assert g.shape == e.shape == (cfg.num_tokens(f), cfg.d_model)
            torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
    # without graphs (the CPU) the batch runs as it is
    monkeypatch.setattr(runner, "conv_graphs", {})
    before = runner.conv_chunks_run
    runner.embed_chunks(mels, [False] * 4)
    assert runner.conv_chunks_run - before == 6
