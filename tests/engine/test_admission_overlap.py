"""An admission overlapped with a decode step (Engine.step): the step is launched, the admission's host work (prompts,
the audio front end's staging) runs while it decodes, the step is read, then the admission's device work is queued;
the first tokens of a prefill stay on the device until the next step's read. The host waits (counted, not timed)
once per step and once per admission's mel where a partial needs its extremes, not once more per prefill; and the results are those of admitting
first and decoding after (the order before the overlap), token for token, including rows that end at their first
token."""

import numpy as np
import pytest
import torch

from qasr.engine.request import DecodeRequest, Priority

from test_engine import assert_idle, make_engine, speech


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, admission_interval_ms=0)


def test_the_admissions_host_work_runs_between_the_decode_steps_launch_and_its_read(engine):
    events = []

    def spy(obj, name):
        method = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: events.append(name) or method(*a, **k))

    for name in ("launch_decode", "read_decode", "stage_samples", "log_spectrogram", "prefill"):
        spy(engine.runner, name)
    spy(engine.prompts, "build")
    try:
        engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=12), lambda r: None)
        engine.step()  # nothing decoding: admitted whole, then its first step
        assert events == ["build", "stage_samples", "log_spectrogram", "prefill", "launch_decode", "read_decode"]
        events.clear()
        engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=4), lambda r: None)
        engine.step()  # decoding: the admission overlaps the step
        assert events == ["launch_decode", "build", "stage_samples", "read_decode", "log_spectrogram", "prefill"]
        engine.run_until_done()
    finally:
        for name in ("launch_decode", "read_decode", "stage_samples", "log_spectrogram", "prefill"):
            delattr(engine.runner, name)
        del engine.prompts.build
    assert_idle(engine)


def test_the_host_waits_once_per_step_and_for_a_partials_mel_never_for_a_final_or_the_prefill(engine):
    """A stream's partial needs its chunks' extremes on the host (whether its kept chunks changed); finals and offline
    clips keep their maxima on the device (AudioFrontEnd._whole_clip_features), so their admission reads nothing."""
    def reads_of(step):
        before = engine.runner.host_reads
        step()
        return engine.runner.host_reads - before

    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=12), lambda r: None)
    engine.add(DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=12), lambda r: None)
    assert reads_of(engine.step) == 1  # admitting two finals while idle: the step alone (the first tokens with it)
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=4), lambda r: None)
    assert reads_of(engine.step) == 1  # admitting a final while decoding: the step
    engine.add(DecodeRequest(audio=speech(1.6, seed=4), priority=Priority.PARTIAL, stream_id="w", max_new_tokens=4),
               lambda r: None)
    assert reads_of(engine.step) == 2  # a partial: the step and its mel's extremes
    assert reads_of(engine.step) == 1  # the admitted rows' first tokens came with the step's read
    engine.run_until_done()
    engine.release_stream("w")
    engine.step()
    assert_idle(engine)


def workload(engine) -> dict:
    """Finals arriving while others decode (one of a single token), and a stream's partials, each asked once the one
    before it answered (as a session does), then its final -> each request's tokens and finish reason."""
    long_audio = speech(3.1, seed=7)
    results: dict = {}

    def add(key, request):
        engine.add(request, lambda r, key=key: results.__setitem__(key, r))

    arrivals = {0: [("a", DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=14))],
                2: [("b", DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=1))],
                3: [("c", DecodeRequest(audio=speech(1.7, seed=5), max_new_tokens=9)),
                    ("d", DecodeRequest(audio=speech(0.4, seed=6), max_new_tokens=5))],
                9: [("e", DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=7))]}
    partials = [int(s * 16000) for s in (1.0, 1.6, 2.2, 2.8)]
    asked = 0
    for step in range(400):
        for key, request in arrivals.get(step, []):
            add(key, request)
        if asked < len(partials) and (asked == 0 or f"p{asked - 1}" in results) and step >= 1:
            add(f"p{asked}", DecodeRequest(audio=long_audio[: partials[asked]], priority=Priority.PARTIAL,
                                          stream_id="s", max_new_tokens=8))
            asked += 1
        elif asked == len(partials) and f"p{asked - 1}" in results and "final" not in results:
            add("final", DecodeRequest(audio=long_audio, stream_id="s", max_new_tokens=10))
            asked += 1
        engine.step()
        if len(results) == 5 + len(partials) + 1 and not engine.has_work():
            break
    engine.release_stream("s")
    engine.step()
    assert_idle(engine)
    return {key: (r.token_ids, r.finish_reason) for key, r in results.items()}


def test_overlapped_admissions_give_the_same_tokens_as_admitting_first(engine):
    engine.overlap_admissions = False
    try:
        before = workload(engine)
    finally:
        del engine.overlap_admissions
    overlapped = workload(engine)
    assert overlapped == before and len(before) == 10
    assert before["b"] == (before["b"][0], "length") and len(before["b"][0]) == 1
    alone = engine.transcribe([DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=14)])[0]
    assert overlapped["a"][0] == alone.token_ids


def test_a_row_that_ends_at_its_first_token_is_left_idle_and_finished_with_the_next_read(tiny_model_dir):
    engine = make_engine(tiny_model_dir, admission_interval_ms=0)
    clip = speech(1.3, seed=1)
    first = engine.transcribe([DecodeRequest(audio=clip, max_new_tokens=1)])[0].token_ids[0]
    other = speech(2.2, seed=3)
    engine.eos_ids, engine.runner.eos = (first,), torch.tensor([first])  # this clip's first token ends it now

    def run(overlap):
        engine.overlap_admissions = overlap
        results = {}
        engine.add(DecodeRequest(audio=other, max_new_tokens=10), lambda r: results.__setitem__("other", r))
        engine.step()
        engine.add(DecodeRequest(audio=clip, max_new_tokens=10), lambda r: results.__setitem__("eos", r))
        engine.run_until_done()
        assert_idle(engine)
        return {key: (r.token_ids, r.finish_reason) for key, r in results.items()}

    assert run(True) == run(False)
    assert run(True)["eos"] == ((), "eos")
    assert np.all(engine.runner.positions.numpy() == -1)


def test_requests_taken_for_an_admission_are_failed_with_the_rest_if_the_step_fails(tiny_model_dir):
    engine = make_engine(tiny_model_dir, admission_interval_ms=0)
    results = {}
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=12), lambda r: results.__setitem__("a", r))
    engine.step()
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=4), lambda r: results.__setitem__("b", r))

    def broken():
        raise RuntimeError("device lost")

    engine.runner.read_decode = broken
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # "b" was scheduled (out of the queue) while the step ran, not admitted yet
    assert len(engine.scheduler) == 0 and "b" not in results
    engine.fail_all(RuntimeError("engine failed"))  # what AsyncEngine does when its loop raises
    assert isinstance(results["a"], RuntimeError) and isinstance(results["b"], RuntimeError)


def test_steps_queued_beside_an_admission_give_the_tokens_of_one_step_at_a_time(tiny_model_dir, monkeypatch):
    """Several decode steps launched at once beside an admission's host work (each feeding on the one before on the
    device) are read in order: rows that end in an early one are finished there and their later outputs ignored; the
    tokens are those of one step at a time."""
    single = workload(make_engine(tiny_model_dir, admission_interval_ms=0, decode_steps_ahead=1))
    engine = make_engine(tiny_model_dir, admission_interval_ms=0)
    launched, read, ended = [], [0], []  # steps of each launch; outputs read of the last; (output, of steps) at an end
    launch, postprocess, complete_all = engine.runner.launch_decode, engine._postprocess, engine._complete_all

    def counting_launch(rows, read_tokens=False, steps=1):
        launched.append(steps)
        read[0] = 0
        return launch(rows, read_tokens, steps)

    def counting_postprocess(out, launch):
        read[0] += 1
        return postprocess(out, launch)

    def counting_complete_all(finished):
        ended.extend((read[0], launched[-1]) for _ in finished)
        return complete_all(finished)

    monkeypatch.setattr(engine.runner, "launch_decode", counting_launch)
    monkeypatch.setattr(engine, "_postprocess", counting_postprocess)
    monkeypatch.setattr(engine, "_complete_all", counting_complete_all)
    monkeypatch.setattr(engine, "_steps_beside_admission", lambda: 3)
    steps_before, launches_before = engine.steps, engine.counters["decode_launches"]
    assert workload(engine) == single and len(single) == 10
    assert launched.count(3) >= 5 and set(launched) == {1, 3}  # several admissions came while rows decoded
    assert engine.steps - steps_before == sum(launched)
    assert engine.counters["decode_launches"] - launches_before == len(launched)
    assert any(of == 3 and 0 < at < 3 for at, of in ended)  # a row ended in a launch's first or second step
    assert np.all(engine.runner.positions.numpy() == -1)


def test_the_steps_beside_an_admission_are_as_many_as_fit_in_its_host_time(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, decode_steps_ahead=4)
    engine._step_s, engine._admission_host_s = 0.002, 0.02
    assert engine._steps_beside_admission() == 1  # on the CPU a step runs whole at its launch: nothing to overlap
    monkeypatch.setattr(engine.runner, "device", torch.device("cuda"))  # only read here: no step runs
    engine._step_s = engine._admission_host_s = None
    assert engine._steps_beside_admission() == 1  # nothing measured yet
    for step_s, admission_s, steps in ((0.002, 0.0066, 3), (0.002, 0.02, 4), (0.002, 0.0009, 1), (0.003, 0.0032, 1)):
        engine._step_s, engine._admission_host_s = step_s, admission_s
        assert engine._steps_beside_admission() == steps
    one = make_engine(tiny_model_dir, decode_steps_ahead=1)
    monkeypatch.setattr(one.runner, "device", torch.device("cuda"))
    one._step_s, one._admission_host_s = 0.002, 0.02
    assert one._steps_beside_admission() == 1


def test_admissions_are_counted_and_those_with_nothing_decoding_apart(tiny_model_dir):
    engine = make_engine(tiny_model_dir, admission_interval_ms=0)
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=6), lambda r: None)
    engine.step()  # nothing decoding: the GPU has only this admission's work
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=3), lambda r: None)
    engine.step()  # beside the first one's steps
    assert (engine.counters["admissions"], engine.counters["admissions_alone"]) == (2, 1)
    engine.run_until_done()
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=3), lambda r: None)
    engine.run_until_done()
    assert (engine.counters["admissions"], engine.counters["admissions_alone"]) == (3, 2)
    assert_idle(engine)
