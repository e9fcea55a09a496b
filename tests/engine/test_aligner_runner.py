"""Word times in the engine (qasr.engine.aligner_runner) on the CPU: a tiny ASR model and a tiny random aligner.

Finals that ask are aligned after their decode, many per aligner forward, one forward in flight at a time while
decoding goes on (a held event stands in for a slow GPU); finals that do not ask are handed out as before, never
waiting for the aligner; partials never get words."""

import asyncio
import weakref

import pytest
import torch

from qasr.engine import aligner_runner, streams
from qasr.engine.aligner_runner import FAILED_REASON, AlignerRunner
from qasr.engine.engine import Engine, EngineOptions
from qasr.engine.request import DecodeRequest, DecodeResult, EngineClosed, Priority
from qasr.engine.sequence import Sequence
from qasr.model.aligner import ForcedAligner
from qasr.model.aligner_words import split_words

from test_engine import SR, assert_idle, make_engine, speech


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_aligner_dir) -> Engine:
    return make_engine(tiny_model_dir, aligner=str(tiny_aligner_dir))


@pytest.fixture(scope="module")
def aligner(tiny_aligner_dir) -> ForcedAligner:
    return ForcedAligner.from_pretrained(tiny_aligner_dir)


def final(clip, *, words=True, language="English", budget=10) -> DecodeRequest:
    return DecodeRequest(audio=clip, language=language, max_new_tokens=budget, words=words)


def assert_word_times(words, clip):
    assert words, "expected word times"
    seconds = len(clip) / SR
    assert all(0 <= w.start <= w.end <= seconds for w in words)
    assert all(a.start <= b.start and a.end <= b.end for a, b in zip(words, words[1:]))  # monotonic


def test_a_final_that_asks_gets_the_aligners_word_times_for_its_text(engine, aligner):
    clips = [speech(s, seed=10 + i) for i, s in enumerate([1.2, 2.6, 4.1])]
    results = engine.transcribe([final(c) for c in clips])
    for clip, result in zip(clips, results):
        assert result.words_reason is None and result.timings["align_ms"] >= 0
        assert [w.word for w in result.words] == split_words(result.text, "English")
        assert_word_times(result.words, clip)
        expected = aligner.align([clip], [result.text], "English")[0].words
        seconds = len(clip) / SR
        assert [(w.start, w.end) for w in result.words] == [(min(w.start, seconds), min(w.end, seconds))
                                                            for w in expected]  # clamped to the clip
    assert_idle(engine)
    assert not len(engine.aligner)


def test_finals_without_words_are_unchanged_and_never_wait_for_the_aligner(tiny_model_dir, engine):
    clips = [speech(s, seed=20 + i) for i, s in enumerate([1.5, 2.2, 3.0, 0.8])]
    plain = make_engine(tiny_model_dir).transcribe([final(c, words=False) for c in clips])
    done = {}
    delivered_when_aligning = []
    launch = engine.aligner.launch

    def watched_launch():
        delivered_when_aligning.append(set(done))
        return launch()

    engine.aligner.launch = watched_launch
    batches = engine.aligner.num_batches
    try:
        for i, clip in enumerate(clips):  # the same budgets: all four stop in the same step
            engine.add(final(clip, words=i % 2 == 0), lambda r, i=i: done.__setitem__(i, r))
        engine.run_until_done()
    finally:
        engine.aligner.launch = launch
    assert engine.aligner.num_batches == batches + 1  # both finals with words in one forward
    assert delivered_when_aligning == [{1, 3}]  # those without words were out before the aligner ran
    for i, clip in enumerate(clips):
        assert done[i].token_ids == plain[i].token_ids  # aligning changes nothing of the decode
        if i % 2:
            assert done[i].words is None and done[i].words_reason is None and "align_ms" not in done[i].timings
        else:
            assert_word_times(done[i].words, clip)


class HeldEvent:
    """Stands in for the CUDA event of a batch in flight: its device work has not completed until `release()`."""

    def __init__(self):
        self.released = False

    def query(self) -> bool:
        return self.released

    def release(self) -> None:
        self.released = True


@pytest.fixture
def held(engine, monkeypatch) -> HeldEvent:
    """Every alignment the engine launches stays in flight until the test releases it (as a slow GPU would)."""
    event = HeldEvent()
    launch = engine.aligner._launch

    def held_launch(finals, inputs):
        flight = launch(finals, inputs)
        flight.done = event
        return flight

    monkeypatch.setattr(engine.aligner, "_launch", held_launch)
    return event


def step_until(engine, condition, limit=200):
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("the engine never got there")


def test_finals_without_words_decode_and_finish_while_an_alignment_is_in_flight(engine, held):
    done = {}
    engine.add(final(speech(1.0, seed=40), budget=2), lambda r: done.__setitem__("words", r))
    step_until(engine, lambda: engine.aligner.num_in_flight == 1)
    for i in range(3):  # arriving after the launch: admitted, decoded and finished beside the alignment
        engine.add(final(speech(1.2 + i, seed=41 + i), words=False, budget=6), lambda r, i=i: done.__setitem__(i, r))
    step_until(engine, lambda: {0, 1, 2} <= done.keys())
    assert "words" not in done and engine.aligner.num_in_flight == 1 and engine.has_work()
    assert all(done[i].text and done[i].words is None for i in range(3))
    held.release()
    step_until(engine, lambda: "words" in done)
    assert done["words"].words and done["words"].timings["align_ms"] > 0
    assert not engine.has_work() and engine.stats()["aligner"]["in_flight"] == 0
    assert_idle(engine)


def test_finals_stopping_during_an_alignment_wait_and_share_the_next_one(engine, held):
    done = {}
    batches = engine.aligner.num_batches
    engine.add(final(speech(1.0, seed=50), budget=2), lambda r: done.__setitem__(0, r))
    step_until(engine, lambda: engine.aligner.num_in_flight == 1)
    for i in (1, 2):
        engine.add(final(speech(1.0 + i, seed=50 + i), budget=3), lambda r, i=i: done.__setitem__(i, r))
    step_until(engine, lambda: len(engine.aligner) == 2)  # decoded, parked: one batch in flight at a time
    assert engine.aligner.num_batches == batches + 1 and engine.stats()["aligner"]["parked"] == 2
    held.release()
    engine.run_until_done()
    assert engine.aligner.num_batches == batches + 2  # the two parked ones in one forward
    assert all(done[i].words for i in range(3))


def test_a_final_cancelled_while_its_alignment_is_in_flight_is_dropped(engine, held):
    outcomes = []
    seq = engine.add(final(speech(1.0, seed=60), budget=2), outcomes.append)
    step_until(engine, lambda: engine.aligner.num_in_flight == 1)
    seq.cancelled = True
    held.release()
    engine.run_until_done()
    assert len(outcomes) == 1 and isinstance(outcomes[0], asyncio.CancelledError)


def test_stopping_the_engine_fails_finals_in_flight_and_parked(engine, held):
    outcomes = []
    engine.add(final(speech(1.0, seed=70), budget=2), outcomes.append)
    step_until(engine, lambda: engine.aligner.num_in_flight == 1)
    engine.add(final(speech(1.5, seed=71), budget=2), outcomes.append)
    step_until(engine, lambda: len(engine.aligner) == 1)
    engine.fail_all(EngineClosed("closed"))
    assert len(outcomes) == 2 and all(isinstance(o, EngineClosed) for o in outcomes)
    assert not engine.has_work()


def test_a_language_the_aligner_does_not_support_gives_a_reason_not_an_error(engine):
    result = engine.transcribe([final(speech(1.5, seed=30), language="Arabic")])[0]
    assert result.text and result.words == ()
    assert "does not support Arabic" in result.words_reason


def test_partials_and_engines_without_an_aligner_refuse_words(tiny_model_dir, engine):
    clip = speech(1.0, seed=31)
    partial = DecodeRequest(audio=clip, priority=Priority.PARTIAL, stream_id="s/0", words=True)
    with pytest.raises(ValueError, match="finals only"):
        engine.transcribe([partial])
    with pytest.raises(ValueError, match="aligner"):
        make_engine(tiny_model_dir).transcribe([final(clip)])


def test_a_failing_aligner_still_delivers_the_final_with_a_reason(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device error")

    monkeypatch.setattr(engine.aligner.aligner, "forward", broken)
    result = engine.transcribe([final(speech(1.0, seed=32))])[0]
    assert result.text and result.words == () and result.words_reason == FAILED_REASON
    assert not engine.has_work()


def test_a_device_error_surfacing_when_polled_still_delivers_the_final_with_a_reason(engine, monkeypatch):
    class FailingEvent:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    launch = engine.aligner._launch

    def failing_launch(finals, inputs):
        flight = launch(finals, inputs)
        flight.done = FailingEvent()
        return flight

    monkeypatch.setattr(engine.aligner, "_launch", failing_launch)
    result = engine.transcribe([final(speech(1.0, seed=36))])[0]
    assert result.text and result.words == () and result.words_reason == FAILED_REASON


def test_a_final_cancelled_while_waiting_for_its_words_is_dropped(engine, monkeypatch):
    outcomes = []
    park = engine.aligner.park

    def park_then_cancel(seq, result):  # the client goes away between the decode and the alignment
        park(seq, result)
        seq.cancelled = True

    monkeypatch.setattr(engine.aligner, "park", park_then_cancel)
    rows = engine.aligner.num_rows
    engine.add(final(speech(1.0, seed=33), budget=3), outcomes.append)
    engine.run_until_done()
    assert len(outcomes) == 1 and isinstance(outcomes[0], asyncio.CancelledError)
    assert engine.aligner.num_rows == rows and not len(engine.aligner)  # not aligned


def test_stats_count_aligner_batches(engine):
    before = engine.stats()["aligner"]
    engine.transcribe([final(speech(1.0, seed=34)), final(speech(1.3, seed=35))])
    after = engine.stats()["aligner"]
    assert after["parked"] == 0 and after["in_flight"] == 0 and after["rows"] == before["rows"] + 2
    assert after["batches"] > before["batches"] and after["graphed"] == 0  # the CPU runs the forward eagerly
    assert after["launch_seconds"] > before["launch_seconds"] and engine.stats()["seconds"]["align"] > 0


def test_aligner_options_are_validated():
    with pytest.raises(ValueError):
        EngineOptions(aligner_max_batch=0)


def parked_final(runner: AlignerRunner, clip, outcomes: list, text="the call was about a refund") -> None:
    """A decoded final with words as the engine parks it (its decode skipped: the text is given)."""
    seq = Sequence(final(clip), outcomes.append)
    runner.park(seq, DecodeResult(text=text, language="English", raw_text=text, token_ids=(), finish_reason="stop",
                                  num_audio_tokens=0))


def test_one_batch_of_at_most_max_batch_finals_is_in_flight_and_the_next_launch_waits_for_it(aligner, monkeypatch):
    runner = AlignerRunner(aligner, max_batch=2)
    events = []
    launch = runner._launch

    def held_launch(finals, inputs):
        flight = launch(finals, inputs)
        flight.done = HeldEvent()
        events.append(flight.done)
        return flight

    monkeypatch.setattr(runner, "_launch", held_launch)
    outcomes = []
    for i in range(5):
        parked_final(runner, speech(1.0 + 0.2 * i, seed=80 + i), outcomes)
    assert runner.launch() == 0 and runner.num_in_flight == 2 and len(runner) == 3  # the oldest two
    assert not runner.can_launch() and runner.launch() == 0  # nothing more while one is in flight
    assert runner.num_batches == 1 and runner.num_in_flight == 2 and runner.poll() == 0 and not outcomes
    events[0].release()
    assert runner.poll() == 2 and len(outcomes) == 2 and runner.num_in_flight == 0
    assert runner.can_launch() and runner.launch() == 0 and runner.num_in_flight == 2 and len(runner) == 1
    events[1].release()
    runner.poll()
    runner.launch()
    assert runner.num_in_flight == 1 and not len(runner)
    events[2].release()
    assert runner.poll() == 1 and not runner.has_work()
    assert runner.num_batches == 3 and len(outcomes) == 5 and all(outcome.words for outcome in outcomes)


def test_without_cuda_there_are_no_streams_and_the_aligner_runs_on_the_cpu(aligner):
    assert streams.decode_stream("cpu") is None and streams.aligner_stream(torch.device("cpu")) is None
    assert AlignerRunner(aligner).stream is None
    with torch.cuda.stream(None):  # how the engine enters a stream that is None: a no-op without CUDA
        assert torch.ones(2).sum().item() == 2
    assert EngineOptions().stream_priorities is True


class FakeStream:
    """Records how a stream was made, as torch.cuda.Stream would be called on a GPU."""

    made: list["FakeStream"] = []

    def __init__(self, device=None, priority=0):
        self.device, self.priority, self.waited_for = device, priority, []
        FakeStream.made.append(self)

    def wait_stream(self, other):
        self.waited_for.append(other)


def test_decoding_asks_for_the_highest_priority_and_the_aligner_for_the_lowest(monkeypatch):
    """The CUDA path's logic on the CPU, torch.cuda.Stream faked: lower numbers are higher priorities, PyTorch
    clamps them into its range (0 down to -3), and the decode stream starts after the thread's queued work."""
    FakeStream.made = []
    current = object()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    decode = streams.decode_stream("cuda:0")
    side = streams.aligner_stream(torch.device("cuda", 0))
    assert [stream.device for stream in FakeStream.made] == [torch.device("cuda", 0)] * 2
    assert decode.priority <= -3 and side.priority == 0 == streams.ALIGNER_PRIORITY  # CUDA's lowest is its default
    assert decode.waited_for == [current] and side.waited_for == []


def test_an_engine_method_on_its_own_stream_runs_with_that_stream_current(monkeypatch):
    """streams.on_own_stream (how the engine's step enters its decode stream): the method runs inside
    torch.cuda.stream(self.stream), or inside the no-op context for None (no attribute: None too)."""
    entered = []

    class Recorder:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            entered.append(("in", self.stream))

        def __exit__(self, *exc):
            entered.append(("out", self.stream))

    class Stepper:
        def __init__(self, stream):
            self.stream = stream

        @streams.on_own_stream
        def step(self, value):
            entered.append(("ran", value))
            return value * 2

    class Bare:
        @streams.on_own_stream
        def step(self):
            return "ran"

    assert Stepper(None).step(2) == 4 and Bare().step() == "ran"  # the real no-op context on a CPU
    monkeypatch.setattr(torch.cuda, "stream", Recorder)
    marker = object()
    assert Stepper(marker).step(3) == 6
    assert entered == [("ran", 2), ("in", marker), ("ran", 3), ("out", marker)]


class Clock:
    """Stands in for the runner's time module: perf_counter() reads `now`, which the test moves."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_a_launch_is_due_at_min_batch_finals_or_once_the_oldest_has_waited_max_wait(aligner, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(aligner_runner, "time", clock)
    runner = AlignerRunner(aligner, max_batch=4, min_batch=3, max_wait_ms=50)
    outcomes = []
    parked_final(runner, speech(1.0, seed=90), outcomes)
    clock.now += 0.020
    parked_final(runner, speech(1.1, seed=91), outcomes)
    assert len(runner) == 2 and not runner.can_launch()  # two of three, the oldest 20 ms old
    assert runner.can_launch(idle=True)  # nothing decodes: a launch delays nobody, so it goes at once
    clock.now += 0.029
    assert not runner.can_launch()  # 49 ms
    clock.now += 0.002
    assert runner.can_launch()  # the oldest has waited 51 ms
    clock.now -= 0.030
    parked_final(runner, speech(1.2, seed=92), outcomes)
    assert runner.can_launch()  # three parked: a full enough batch at once
    assert runner.launch() == 0 and runner.num_in_flight == 3
    parked_final(runner, speech(1.3, seed=93), outcomes)
    clock.now += 1.0
    assert not runner.can_launch() and not runner.can_launch(idle=True)  # one batch in flight at a time
    assert runner.poll() == 3 and runner.can_launch()  # the CPU ran it in launch(); the fourth has waited 1 s
    runner.launch()
    assert runner.poll() == 1 and len(outcomes) == 4 and all(outcome.words for outcome in outcomes)


def test_min_batch_is_capped_at_max_batch_and_the_defaults_launch_at_once(aligner):
    outcomes = []
    capped = AlignerRunner(aligner, max_batch=2, min_batch=8, max_wait_ms=1e9)
    parked_final(capped, speech(1.0, seed=94), outcomes)
    assert not capped.can_launch()
    parked_final(capped, speech(1.0, seed=95), outcomes)
    assert capped.can_launch()  # two: as full as a batch gets
    eager = AlignerRunner(aligner, max_batch=8)
    parked_final(eager, speech(1.0, seed=96), outcomes)
    assert eager.can_launch()
    with pytest.raises(ValueError):
        AlignerRunner(aligner, min_batch=0)
    with pytest.raises(ValueError):
        AlignerRunner(aligner, max_wait_ms=-1)
    for options in (dict(aligner_min_batch=0), dict(aligner_max_wait_ms=-1.0)):
        with pytest.raises(ValueError):
            EngineOptions(**options)


def test_a_final_that_cannot_be_aligned_is_finished_when_parked_and_counts_toward_no_batch(aligner):
    outcomes = []
    runner = AlignerRunner(aligner, max_batch=8, min_batch=2, max_wait_ms=1e9)
    seq = Sequence(final(speech(1.0, seed=97), language="Arabic"), outcomes.append)
    runner.park(seq, DecodeResult(text="marhaba", language="Arabic", raw_text="marhaba", token_ids=(),
                                  finish_reason="stop", num_audio_tokens=0))
    assert len(outcomes) == 1 and "does not support Arabic" in outcomes[0].words_reason and not len(runner)
    parked_final(runner, speech(1.0, seed=98), outcomes, text="...")  # no words in it
    assert outcomes[1].words == () and "no words" in outcomes[1].words_reason
    assert not runner.has_work() and runner.park_seconds > 0 and runner.num_batches == 0


def test_while_rows_decode_a_final_with_words_waits_for_a_fuller_batch_and_goes_once_decoding_stops(tiny_model_dir,
                                                                                                    tiny_aligner_dir):
    engine = make_engine(tiny_model_dir, aligner=str(tiny_aligner_dir), aligner_min_batch=2,
                         aligner_max_wait_ms=1e9)
    done = {}
    engine.add(final(speech(1.0, seed=99), budget=2), lambda r: done.__setitem__("words", r))
    engine.add(final(speech(2.0, seed=100), words=False, budget=12), lambda r: done.__setitem__("plain", r))
    step_until(engine, lambda: len(engine.aligner) == 1)
    assert engine.scheduler.running and engine.aligner.num_batches == 0  # one of two, decoding goes on: not due
    step_until(engine, lambda: "plain" in done)
    engine.run_until_done()  # nothing decodes any more: it launches at once, not after the wait
    assert engine.aligner.num_batches == 1 and done["words"].words and done["plain"].words is None


class SyncWatch(torch.overrides.TorchFunctionMode):
    """Records the calls that would make the host wait for the device on CUDA, telling host tensors (made here from
    host data with no device named: Python values, numpy arrays, empty buffers; and their views) from device ones
    (everything else, and what a copy to a device gives, even on the CPU where that is the same tensor):
    - a read of a device tensor's values (item, tolist, numpy, cpu, bool/int/float, nonzero);
    - a host tensor copied to a device without non_blocking=True (a pageable or blocking copy);
    - a tensor made from Python values straight on a device (torch.tensor(list, device=...))."""

    READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
    FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "from_numpy"}
    VIEWS = {"reshape", "view", "split", "__getitem__", "flatten"}

    def __init__(self):
        super().__init__()
        self.calls = []
        self.host: dict[int, weakref.ref] = {}  # id -> the host tensor (ids are reused once it is gone)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if name in self.READS and not on_host:
            self.calls.append(name)
        to_device = name in ("to", "copy_") and (
            "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:]) or name == "copy_")
        if to_device and self.is_host(args[-1] if name == "copy_" else args[0]) and not kwargs.get("non_blocking"):
            self.calls.append(f"{name} (blocking, from the host)")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.calls.append(f"{name}(device=...)")
        out = func(*args, **kwargs)
        made = out if isinstance(out, (tuple, list)) else [out]
        for t in made:
            if not isinstance(t, torch.Tensor):
                continue
            if to_device:
                self.host.pop(id(t), None)
            elif (name in self.FACTORIES and kwargs.get("device") is None and not tensors) or (
                    name in self.VIEWS and on_host):
                self.host[id(t)] = weakref.ref(t)
        return out


def test_launch_makes_no_read_or_copy_that_would_block_the_engine_thread(aligner, monkeypatch):
    """The eager path on the CPU runs the whole forward in launch(); on CUDA the same calls are only queued, so a
    value read back or a blocking copy here would stall the engine thread until the aligner's stream got there."""
    runner = AlignerRunner(aligner, max_batch=4)
    outcomes = []
    parked_final(runner, speech(1.0, seed=109), outcomes)
    runner.run()  # the first launch in a process makes the mel's constants on the device, once
    for i in range(3):
        parked_final(runner, speech(1.0 + 0.7 * i, seed=110 + i), outcomes, text="one two three four five")
    watch = SyncWatch()
    with watch:
        runner.launch()
    assert runner.num_in_flight == 3 and watch.calls == []
    assert runner.poll() == 3 and all(outcome.words for outcome in outcomes)


def test_the_sync_watch_sees_a_blocking_copy_and_a_read(aligner):
    """The watch above can fail: what launch() used to do (a pageable copy of the mel's per-clip table) and a
    value read back are caught; the asynchronous copy of a host tensor and reading a host tensor are not."""
    watch = SyncWatch()
    with watch:
        table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64).reshape(4)
        table.numpy()
        on_device = table.to(aligner.device, non_blocking=True)
        torch.tensor([5, 6]).to(aligner.device)
        on_device.sum().item()
    assert watch.calls == ["to (blocking, from the host)", "item"]
