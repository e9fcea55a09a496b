"""Run-ahead (EngineOptions.decode_run_ahead, offline work's default): the engine queues the next decode step before it
reads the last one, so the GPU is not idle while the host finishes rows and launches again. On the CPU a launch runs
its step whole, so queuing ahead means computing the next step before reading the last: the same order of device
effects as on a GPU, which is what these tests check. Rows the host stops (repetition, cancel) decode one more step,
unread; a slot freed so and taken by a new row must give that row only its own tokens."""

import asyncio

import numpy as np
import pytest
import torch

from qasr.engine import postprocess
from qasr.engine.request import DecodeRequest
from qasr.engine.sequence import Status

from test_admission_overlap import workload
from test_engine import assert_idle, make_engine, speech


@pytest.fixture(scope="module")
def ahead(tiny_model_dir):
    return make_engine(tiny_model_dir, admission_interval_ms=0, decode_run_ahead=True)


def test_offline_work_runs_ahead_and_live_serving_does_not_by_default(tiny_model_dir, ahead):
    from qasr.engine.transcribe import Transcriber

    assert make_engine(tiny_model_dir).run_ahead is False
    assert Transcriber.from_pretrained(str(tiny_model_dir), device="cpu", max_batch=2).engine.run_ahead is True
    assert ahead.run_ahead is True


def test_run_ahead_gives_the_tokens_of_reading_each_step_before_the_next(tiny_model_dir, ahead):
    """Finals arriving while others decode, a single-token one, a stream's partials and its final: token for token
    what the engine gives reading every step before launching the next."""
    one_at_a_time = workload(make_engine(tiny_model_dir, admission_interval_ms=0, decode_run_ahead=False))
    assert workload(ahead) == one_at_a_time and len(one_at_a_time) == 10


def test_the_next_step_is_launched_before_the_last_is_read_and_the_last_launch_is_read_by_the_next_step(ahead):
    events = []
    launch, read = ahead.runner.launch_decode, ahead.runner.read_decode
    ahead.runner.launch_decode = lambda *a, **k: events.append("launch") or launch(*a, **k)
    ahead.runner.read_decode = lambda: events.append("read") or read()
    try:
        seq = ahead.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=5), lambda r: None)
        ahead.step()  # admitted, its first step launched, nothing read
        assert events == ["launch"] and ahead.runner.launches_in_flight == 1 and seq.generated == []
        ahead.step()
        assert events == ["launch", "launch", "read"] and ahead.runner.launches_in_flight == 1
        assert len(seq.generated) == 2  # its first token (the prefill's) and the first step's
        ahead.run_until_done()
        # 4 steps make tokens 2-5; the 5th ends it on the device. The launch queued after it, with no row left, is
        # not waited for: the result is back, and run_until_done returns
        assert events == ["launch", "launch", "read"] + ["launch", "read"] * 3
        assert len(seq.generated) == 5 and seq.status is Status.FINISHED
        assert ahead.runner.launches_in_flight == 1 and not ahead.has_requests() and ahead.has_work()
        ahead.drain()  # reads it (before a bench drives the runner itself)
    finally:
        del ahead.runner.launch_decode, ahead.runner.read_decode
    assert events[-1] == "read" and ahead.runner.launches_in_flight == 0 and not ahead.has_work()
    assert_idle(ahead)


def test_a_launch_left_queued_by_one_call_changes_nothing_in_the_next(tiny_model_dir):
    """transcribe returns with the launch queued after its last rows unread; the next call reads it with its own
    first step and gets the tokens a fresh engine gives."""
    fresh = make_engine(tiny_model_dir, admission_interval_ms=0, decode_run_ahead=True)
    clips = [speech(1.3, seed=1), speech(2.2, seed=3)]
    expected = [alone(fresh, clip, 7) for clip in clips]
    engine = make_engine(tiny_model_dir, admission_interval_ms=0, decode_run_ahead=True)
    for clip, tokens in zip(clips * 2, expected * 2):
        assert alone(engine, clip, 7) == tokens
        assert engine.runner.launches_in_flight == 1 and not engine.has_requests()
    assert_idle(engine)


def alone(engine, clip, tokens):
    (result,) = engine.transcribe([DecodeRequest(audio=clip, max_new_tokens=tokens)])
    return result.token_ids


def stop(seq, how, monkeypatch) -> None:
    """Have the host stop `seq`'s row at its next step: cancelled, or the repetition guard firing on it alone."""
    if how == "cancelled":
        seq.cancelled = True
        return
    is_repeating = postprocess.is_repeating
    monkeypatch.setattr(postprocess, "is_repeating",
                        lambda generated, window: generated is seq.generated or is_repeating(generated, window))


def assert_stopped(result, how, alone_tokens) -> None:
    if how == "cancelled":
        assert isinstance(result, asyncio.CancelledError)
    else:
        assert result.finish_reason == "repetition" and result.token_ids == alone_tokens[: len(result.token_ids)]


@pytest.mark.parametrize("how", ["cancelled", "repetition"])
def test_a_slot_the_host_frees_while_its_row_is_queued_ahead_gives_the_next_row_only_its_own_tokens(tiny_model_dir,
                                                                                                     how, monkeypatch):
    """One slot: the host stops its row (a cancel, or the repetition guard) while the step after is already queued
    with that row in it; the next request takes the slot and must get exactly the tokens it gets alone."""
    engine = make_engine(tiny_model_dir, num_slots=1, admission_interval_ms=0, decode_run_ahead=True)
    first, second = speech(2.2, seed=3), speech(1.7, seed=5)
    first_alone, second_alone = alone(engine, first, 30), alone(engine, second, 9)
    results = {}
    seq = engine.add(DecodeRequest(audio=first, max_new_tokens=30), lambda r: results.__setitem__("first", r))
    for _ in range(4):
        engine.step()
    assert engine.runner.launches_in_flight == 1 and 0 < len(seq.generated) < 30
    stop(seq, how, monkeypatch)
    engine.add(DecodeRequest(audio=second, max_new_tokens=9), lambda r: results.__setitem__("second", r))
    engine.run_until_done()
    assert_stopped(results["first"], how, first_alone)
    assert results["second"].token_ids == second_alone and len(second_alone) == 9
    assert_idle(engine)


@pytest.mark.parametrize("how", ["cancelled", "repetition"])
def test_a_row_placed_while_the_slots_last_row_is_queued_ahead_gets_only_its_own_tokens(tiny_model_dir, how,
                                                                                        monkeypatch):
    """Two slots, one row decoding on: the other slot's row is stopped (a cancel, the repetition guard) while a launch
    with it is queued, and the next request is placed there by an admission overlapping the steps (before its rows
    start). Reading the queued launch must not hand the stopped row's token to the placed request."""
    engine = make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0, decode_run_ahead=True)
    engine.admit_during_step = True  # as on CUDA (an admission stream): placed between the launch and the read
    long, short, second = speech(3.1, seed=7), speech(1.3, seed=1), speech(1.7, seed=5)
    short_alone, second_alone = alone(engine, short, 40), alone(engine, second, 9)
    results = {}
    engine.add(DecodeRequest(audio=long, max_new_tokens=40), lambda r: results.__setitem__("long", r))
    engine.step()
    victim = engine.add(DecodeRequest(audio=short, max_new_tokens=40), lambda r: results.__setitem__("short", r))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 2 and len(victim.generated) > 1 and engine.runner.launches_in_flight == 1
    stop(victim, how, monkeypatch)
    placed = engine.add(DecodeRequest(audio=second, max_new_tokens=9), lambda r: results.__setitem__("second", r))
    while placed.slot < 0:  # an admission beside the steps places it in the freed slot, not started yet
        engine.step()
    assert placed.slot == victim.slot and placed.first_launch is None and engine.runner.launches_in_flight
    engine.run_until_done()
    assert_stopped(results["short"], how, short_alone)
    assert results["second"].token_ids == second_alone and len(second_alone) == 9
    assert_idle(engine)


def test_a_failed_engine_forgets_the_launch_it_had_queued(tiny_model_dir):
    engine = make_engine(tiny_model_dir, decode_run_ahead=True)
    got = []
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=20), got.append)
    engine.step()
    engine.step()
    assert engine.runner.launches_in_flight == 1
    engine.fail_all(RuntimeError("device lost"))
    assert engine.runner.launches_in_flight == 0 and not engine.has_work()
    assert len(got) == 1 and isinstance(got[0], RuntimeError)


def test_the_runner_reads_launches_in_order_and_holds_two_at_most(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    runner = engine.runner
    (one,) = engine.transcribe([DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=1)])
    runner.start_rows([0], [one.token_ids[0]], [40], [10])  # a row in slot 0 (its cache is the last request's)
    state = [t.clone() for t in (runner.tokens, runner.positions, runner.counts)]
    sequential = [runner.decode(1).clone() for _ in range(2)]
    for t, saved in zip((runner.tokens, runner.positions, runner.counts), state):
        t.copy_(saved)
    assert runner.launch_decode(1) == runner.launches - 1
    runner.launch_decode(1)
    with pytest.raises(RuntimeError, match="in flight"):
        runner.launch_decode(1)
    with pytest.raises(RuntimeError, match="in flight"):
        runner.decode(1)
    # each launch copies every slot's output (a contiguous copy: on CUDA a plain asynchronous memcpy), rows past
    # the ones asked for included
    last = runner._host_outputs[(runner.launches - 1) % len(runner._host_outputs)]
    assert torch.equal(last.out[0], runner.out) and runner.out.shape[1] == engine.options.num_slots > 1
    queued = [runner.read_decode()[0][0].clone() for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(queued, sequential))
    assert not torch.equal(queued[0][0], queued[1][0]) or queued[0][0, 0] == -1  # two steps, not one read twice
    with pytest.raises(RuntimeError, match="no decode step"):
        runner.read_decode()
    runner.stop_rows([0])
    assert np.all(runner.positions.numpy() == -1)
