"""An admission's device work on a stream of its own (CUDA): its rows join decoding only once that work is done
(`Engine._start_admitted`), while the rows already decoding go on stepping; with nothing else decoding they start at
once, the decode stream waiting for the admission's event on the device. The CPU has no second stream, so a
stand-in for the admission's CUDA event that is not ready for a number of polls takes its place (and stand-ins for
the streams where an engine is made to have them): the bookkeeping (when rows start, cancellation and failure
meanwhile, the same tokens) is tested here; the GPU run of the stream bench exercises the streams themselves."""

import asyncio

import pytest
import torch

from qasr.engine.request import DecodeRequest

from test_admission_overlap import workload
from test_engine import assert_idle, make_engine, speech


class SlowEvent:
    """A CUDA event's query/synchronize whose work is done after `polls` queries (or when waited for)."""

    def __init__(self, polls: int):
        self.polls = polls
        self.waited = False  # was it waited for before its work was done?

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0 or self.waited

    def synchronize(self) -> None:
        self.waited = self.waited or self.polls >= 0  # a wait that blocked: the work was not done yet


def slow_admissions(engine, polls: int) -> list[SlowEvent]:
    """Every admission of `engine` from now on is done after `polls` polls -> the events, as they are made."""
    events: list[SlowEvent] = []
    engine._record_done = lambda: events.append(SlowEvent(polls)) or events[-1]
    return events


@pytest.fixture
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, admission_interval_ms=0)


def decoding_and_one_admitted(engine, results: dict):
    """Row "a" decoding, then "b" admitted while it does (its device work in flight) -> the two sequences."""
    a = engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=30), lambda r: results.__setitem__("a", r))
    engine.step()  # nothing decoding: admitted whole (waited for), then decoded
    b = engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6), lambda r: results.__setitem__("b", r))
    engine.step()  # "a" decodes while "b"'s admission is prepared, then "b"'s device work is queued
    assert engine._admitted and engine._admitted[0].seqs == [b]
    return a, b


def test_rows_start_decoding_only_once_their_admissions_device_work_is_done(engine):
    events = slow_admissions(engine, polls=3)
    results = {}
    a, b = decoding_and_one_admitted(engine, results)
    assert events[0].waited  # "a" was admitted with nothing else decoding: the engine waited for it
    for _ in range(3):  # "b"'s work is not done: "a" keeps decoding, "b" does not
        before = len(a.generated)
        engine.step()
        assert len(a.generated) == before + 1 and b.generated == []
    engine.run_until_done()
    assert not events[1].waited  # started when it was ready, never waited for
    assert len(results["b"].token_ids) == 6 and len(results["a"].token_ids) == 30
    assert_idle(engine)


@pytest.mark.parametrize("during_step", [False, True])
def test_slow_admissions_give_the_same_tokens(tiny_model_dir, during_step):
    """during_step: the admission's device work queued while the decode step runs (as on CUDA with the admission
    stream), rows placed in slots the step in flight does not have."""
    at_once = workload(make_engine(tiny_model_dir, admission_interval_ms=0))
    engine = make_engine(tiny_model_dir, admission_interval_ms=0)
    engine.admit_during_step = during_step
    events = slow_admissions(engine, polls=2)
    assert workload(engine) == at_once and len(events) >= 5


def test_a_row_cancelled_before_its_admission_is_done_never_decodes(engine):
    slow_admissions(engine, polls=3)
    results = {}
    a, b = decoding_and_one_admitted(engine, results)
    b.cancelled = True
    engine.step()  # dropped: its slot freed while its device work is still in flight
    assert isinstance(results["b"], asyncio.CancelledError)
    engine.run_until_done()  # "b"'s admission becomes ready: started, then idled at once
    assert b.generated == [] and len(results["a"].token_ids) == 30
    assert_idle(engine)


def test_a_failing_engine_fails_the_rows_whose_admission_is_in_flight(engine):
    slow_admissions(engine, polls=10)
    results = {}
    decoding_and_one_admitted(engine, results)
    engine.fail_all(RuntimeError("device lost"))
    assert isinstance(results["a"], RuntimeError) and isinstance(results["b"], RuntimeError)
    assert not engine._admitted and not engine.has_work()


class StandInStream:
    """A CUDA stream's waits, recorded (off CUDA torch.cuda.stream() of any stream is a no-op context)."""

    def __init__(self):
        self.waited_events = []

    def wait_event(self, event) -> None:
        self.waited_events.append(event)

    def wait_stream(self, stream) -> None:
        pass


def with_stand_in_streams(engine, monkeypatch) -> StandInStream:
    """`engine` as on CUDA with an admission stream, its streams stand-ins -> the decode stream (the thread's
    current stream), whose device waits it records."""
    decode = StandInStream()
    engine.admission_stream = StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: decode)
    return decode


def tokens_alone(tiny_model_dir, request: DecodeRequest) -> list[int]:
    return make_engine(tiny_model_dir, admission_interval_ms=0).transcribe([request])[0].token_ids


def test_rows_start_on_a_device_wait_only_with_an_admission_stream_and_nothing_else_decoding(engine):
    slow_admissions(engine, polls=10)
    assert not engine._starts_on_device_wait()  # the CPU: no admission stream, the host waits
    engine.admission_stream = StandInStream()
    assert engine._starts_on_device_wait()  # nothing decoding
    engine.admission_stream = None
    results = {}
    a, b = decoding_and_one_admitted(engine, results)
    engine.admission_stream = StandInStream()
    assert not engine._starts_on_device_wait()  # "a" decodes beside "b"'s admission in flight
    a.cancelled = True
    engine._drop_cancelled()
    assert engine._starts_on_device_wait()  # only "b"'s rows would decode
    engine.admission_stream = None
    assert not engine._starts_on_device_wait()


def test_without_an_admission_stream_the_host_waits_and_asks_for_no_cuda_stream(engine, monkeypatch):
    """The CPU (and CUDA without stream priorities) keeps the host's wait: no CUDA stream to wait on."""
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device))
    events = slow_admissions(engine, polls=10)
    results = {}
    a, b = decoding_and_one_admitted(engine, results)
    assert events[0].waited  # "a" alone: the host waited for its admission
    a.cancelled = True
    engine.step()  # "b"'s rows are the only ones left: still a host wait
    assert events[1].waited and not engine._admitted and b.first_launch is not None
    engine.run_until_done()
    assert asked == [] and len(results["b"].token_ids) == 6
    assert_idle(engine)


def test_a_lone_admission_starts_at_once_the_decode_stream_waiting_for_it_on_the_device(
        engine, tiny_model_dir, monkeypatch):
    """With an admission stream and nothing else decoding, the rows start in the step that admits them, its first
    decode launched behind the admission's event on the device (a host wait left the GPU idle through the launches
    after it); the tokens are those of the host's wait."""
    request = DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=12)
    expected = tokens_alone(tiny_model_dir, request)
    decode = with_stand_in_streams(engine, monkeypatch)
    events = slow_admissions(engine, polls=10)
    results = []
    a = engine.add(request, results.append)
    engine.step()
    assert decode.waited_events == events and not events[0].waited  # on the device, not the host
    assert not engine._admitted and a.first_launch == 0 and a.t_decode > 0 and a.generated
    engine.run_until_done()
    assert results[0].token_ids == expected
    assert_idle(engine)


@pytest.mark.parametrize("cancel_b", [False, True])
def test_rows_left_alone_with_their_admission_in_flight_start_on_a_device_wait(
        engine, tiny_model_dir, monkeypatch, cancel_b):
    """"b" admitted while "a" decodes, then "a" (and "b") cancelled before "b"'s work is done: "b"'s rows are started
    at once behind its event on the device; cancelled, it is idled at once and never decodes."""
    expected = tokens_alone(tiny_model_dir, DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6))
    events = slow_admissions(engine, polls=10)
    results = {}
    a, b = decoding_and_one_admitted(engine, results)  # on the CPU's path: "a" alone was waited for by the host
    decode = with_stand_in_streams(engine, monkeypatch)
    engine.step()  # "a" decodes: "b" waits for its work, neither the host nor the decode stream waiting
    assert decode.waited_events == [] and engine._admitted and not events[1].waited
    a.cancelled, b.cancelled = True, cancel_b
    engine.step()
    assert decode.waited_events == [events[1]] and not events[1].waited and not engine._admitted
    engine.run_until_done()
    assert isinstance(results["a"], asyncio.CancelledError)
    if cancel_b:
        assert isinstance(results["b"], asyncio.CancelledError) and b.generated == []
    else:
        assert results["b"].token_ids == expected
    assert_idle(engine)
