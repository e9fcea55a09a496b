"""Decode steps read and launched between the pieces of an admission's host work (`Engine._decode_meanwhile`): on
CUDA an admission at 1,000 streams takes several steps' time, and the GPU should not idle meanwhile. On the CPU a
step is done when launched, so with admissions during the step (as on CUDA) every piece boundary reads one: the
bookkeeping is tested here (same tokens, slots freed meanwhile, a failing step), the GPU run of the stream bench
measures the gain."""

import pytest

from qasr.engine.request import DecodeRequest

from test_admission_overlap import workload
from test_engine import assert_idle, make_engine, speech


def during_step_engine(tiny_model_dir, **kw):
    engine = make_engine(tiny_model_dir, admission_interval_ms=0, **kw)
    engine.admit_during_step = True  # as on CUDA with the admission stream
    return engine


def test_steps_read_during_admissions_give_the_same_tokens(tiny_model_dir):
    at_once = workload(make_engine(tiny_model_dir, admission_interval_ms=0))
    engine = during_step_engine(tiny_model_dir)
    assert workload(engine) == at_once
    assert engine.counters["steps_during_admission"] > 0
    assert_idle(engine)


def test_a_step_not_done_is_not_read_during_an_admission(tiny_model_dir):
    at_once = workload(make_engine(tiny_model_dir, admission_interval_ms=0))
    engine = during_step_engine(tiny_model_dir)
    engine.runner.step_done = lambda: False  # the GPU still busy with it
    assert workload(engine) == at_once
    assert engine.counters["steps_during_admission"] == 0


def test_a_slot_freed_by_a_step_read_during_the_admission_is_the_one_it_places(tiny_model_dir):
    alone = make_engine(tiny_model_dir).transcribe([DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6)])[0]
    engine = during_step_engine(tiny_model_dir)
    results = {}
    a = engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=3), lambda r: results.__setitem__("a", r))
    engine.step()  # admitted whole, its first step: one token left
    assert len(a.generated) == 2
    b = engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6), lambda r: results.__setitem__("b", r))
    engine.step()  # "a"'s step launched; read while "b" is prepared: "a" ends and frees slot 0, which "b" takes
    assert "a" in results and engine.counters["steps_during_admission"] >= 1 and b.slot == 0
    engine.run_until_done()
    assert len(results["a"].token_ids) == 3 and results["b"].token_ids == alone.token_ids
    assert_idle(engine)


def test_a_step_failing_during_an_admission_fails_the_engine_not_just_the_admission(tiny_model_dir):
    engine = during_step_engine(tiny_model_dir)
    results = {}
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=30), lambda r: results.__setitem__("a", r))
    engine.step()
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6), lambda r: results.__setitem__("b", r))

    def lost():
        raise RuntimeError("device lost")

    engine.runner.read_decode = lost
    with pytest.raises(RuntimeError, match="device lost"):  # the step's own error, as from a step read after
        engine.step()
    assert "b" not in results  # not failed as a bad admission: the engine's loop fails everything it holds
    engine.fail_all(RuntimeError("device lost"))
    assert isinstance(results["a"], RuntimeError) and isinstance(results["b"], RuntimeError)
    assert not engine.has_work()
