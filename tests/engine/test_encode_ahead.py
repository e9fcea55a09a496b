"""Finals encoded ahead (EngineOptions.encode_ahead): while rows decode and no slot is free, the waiting finals one
admission would take get their host work and encoder then; the admission that finds them slots only prefills. The
tokens are those of encoding at admission, request for request; a partial (whose encoding updates its stream's
cached state) is never taken ahead; a final cancelled while it waits, or held when the engine fails, gets its answer;
one whose ahead encoding fails is encoded again at its admission."""

import asyncio
import dataclasses

import pytest

from qasr.engine.request import DecodeRequest, Priority

from test_engine import assert_idle, make_engine, speech


def workload(engine) -> dict:
    """More finals than slots, some arriving while others decode, and a stream's partials between them -> each
    request's tokens and finish reason."""
    results: dict = {}
    keys = set()

    def add(key, request):
        engine.add(request, lambda r, key=key: results.__setitem__(key, r))

    seconds = [0.4, 1.3, 2.2, 3.1, 1.7, 0.9, 2.8, 1.1]
    budgets = [6, 12, 9, 15, 7, 11, 5, 8]
    finals = [DecodeRequest(audio=speech(s, seed=i), max_new_tokens=b)
              for i, (s, b) in enumerate(zip(seconds, budgets))]
    stream = speech(2.6, seed=11)
    arrivals = {0: finals[:4], 3: finals[4:6], 7: finals[6:]}
    for step in range(300):
        for i, request in enumerate(arrivals.get(step, [])):
            add(f"f{step}.{i}", request)
        if step == 2 or (step > 2 and "p1" in results and "p2" not in keys):  # the next once one answered
            key = "p1" if step == 2 else "p2"
            keys.add(key)
            add(key, DecodeRequest(audio=stream[: int(16000 * (1.2 if key == "p1" else 2.0))],
                                   priority=Priority.PARTIAL, stream_id="s", max_new_tokens=6))
        engine.step()
        if "p2" in keys and not engine.has_work():
            break
    engine.release_stream("s")
    engine.step()
    assert_idle(engine)
    assert len(results) == 10
    return {key: (r.token_ids, r.finish_reason) for key, r in results.items()}


def test_finals_encoded_ahead_get_the_tokens_of_encoding_at_admission(tiny_model_dir):
    before = workload(make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0))
    engine = make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0, encode_ahead=True)
    assert workload(engine) == before
    assert engine.counters["encoded_ahead"] >= 4 and not engine._ahead


def test_the_admission_of_a_final_encoded_ahead_only_prefills_it(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, num_slots=1, admission_interval_ms=0, encode_ahead=True)
    events, results = [], {}
    for name in ("stage_samples", "log_spectrogram", "prefill"):
        method = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda *a, name=name, method=method, **k: events.append(name)
                            or method(*a, **k))
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=5), lambda r: results.__setitem__("a", r))
    engine.step()  # admitted whole
    engine.add(DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=7), lambda r: results.__setitem__("b", r))
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), priority=Priority.PARTIAL, stream_id="s", max_new_tokens=3),
               lambda r: results.__setitem__("p", r))
    events.clear()
    engine.step()  # no free slot: "b" encoded ahead, the partial left waiting
    assert events == ["stage_samples", "log_spectrogram"] and engine.stats()["encoded_ahead"] == 1
    assert engine.scheduler.depths() == {"final": 0, "partial": 1}
    events.clear()
    while "a" not in results:
        engine.step()
    while "b" not in results:
        engine.step()
    assert events[:1] == ["prefill"]  # "b" admitted: prefilled, nothing of its audio computed again
    engine.run_until_done()
    engine.release_stream("s")
    engine.step()
    assert_idle(engine)
    alone = engine.transcribe([DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=7)])[0]
    assert results["b"].token_ids == alone.token_ids and results["b"].timings["encode_ms"] >= 0
    assert results["p"].finish_reason


def test_a_final_cancelled_while_encoded_ahead_is_answered_and_takes_no_slot(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_slots=1, admission_interval_ms=0, encode_ahead=True)
    results = {}
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=6), lambda r: results.__setitem__("a", r))
    engine.step()
    b = engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6), lambda r: results.__setitem__("b", r))
    engine.step()
    assert [seq for seq, _ in engine._ahead] == [b]
    b.cancelled = True
    engine.step()
    assert isinstance(results["b"], asyncio.CancelledError) and not engine._ahead
    engine.run_until_done()
    assert results["a"].finish_reason == "length"
    assert_idle(engine)


def test_finals_encoded_ahead_are_failed_with_the_rest_when_the_engine_fails(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_slots=1, admission_interval_ms=0, encode_ahead=True)
    results = {}
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=20), lambda r: results.__setitem__("a", r))
    engine.step()
    engine.add(DecodeRequest(audio=speech(0.9, seed=2), max_new_tokens=6), lambda r: results.__setitem__("b", r))
    engine.step()
    assert len(engine._ahead) == 1 and not engine.scheduler.depths()["final"]
    engine.fail_all(RuntimeError("engine failed"))
    assert isinstance(results["a"], RuntimeError) and isinstance(results["b"], RuntimeError)
    assert not engine.has_work()


def test_a_final_whose_ahead_encoding_fails_is_encoded_again_at_its_admission(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, num_slots=1, admission_interval_ms=0, encode_ahead=True)
    results = {}
    engine.add(DecodeRequest(audio=speech(1.3, seed=1), max_new_tokens=6), lambda r: results.__setitem__("a", r))
    engine.step()
    engine.add(DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=7), lambda r: results.__setitem__("b", r))
    run = engine.frontend.run

    def fails_once(work):
        monkeypatch.setattr(engine.frontend, "run", run)
        raise RuntimeError("a fault of the encoder")

    monkeypatch.setattr(engine.frontend, "run", fails_once)
    engine.step()
    assert [embeds for _, embeds in engine._ahead] == [None] and engine.counters["encoded_ahead"] == 0
    engine.run_until_done()
    alone = engine.transcribe([DecodeRequest(audio=speech(2.2, seed=3), max_new_tokens=7)])[0]
    assert results["b"].token_ids == alone.token_ids and results["a"].finish_reason == "length"
    assert_idle(engine)


@pytest.mark.parametrize("ahead", [False, True])
def test_offline_transcription_gives_the_same_answers_encoding_ahead_or_not(tiny_model_dir, ahead):
    engine = make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0, encode_ahead=ahead)
    requests = [DecodeRequest(audio=speech(s, seed=i), max_new_tokens=8)
                for i, s in enumerate([1.0, 2.0, 0.7, 1.5, 2.4])]
    got = [r.token_ids for r in engine.transcribe(requests)]
    alone = [engine.transcribe([r])[0].token_ids for r in requests]
    assert got == alone
    assert (engine.counters["encoded_ahead"] > 0) == ahead


def test_an_admission_of_finals_encoded_ahead_takes_no_others(tiny_model_dir, monkeypatch):
    """Slots freed with a final encoded ahead and a partial queued: the admission prefills the final alone (the GPU
    starts at once), the partial comes with a later one."""
    engine = make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0, encode_ahead=True)
    results, admissions = {}, []
    admit = engine._admit_together
    monkeypatch.setattr(engine, "_admit_together", lambda seqs, prepared=None, after=None: admissions.append(
        [seq.request.max_new_tokens for seq in seqs]) or admit(seqs, prepared, after))

    def add(key, seconds, budget, **kw):
        engine.add(DecodeRequest(audio=speech(seconds, seed=ord(key)), max_new_tokens=budget, **kw),
                   lambda r: results.__setitem__(key, r))

    add("a", 1.3, 5)
    add("b", 0.9, 5)
    engine.step()  # both admitted whole, both slots taken (and freed together)
    add("c", 2.2, 7)
    engine.step()  # "c" encoded ahead
    assert len(engine._ahead) == 1
    add("p", 1.7, 3, priority=Priority.PARTIAL, stream_id="s")  # never encoded ahead
    engine.run_until_done()
    assert admissions == [[5, 5], [7], [3]]  # "c" alone once the slots came free, then the partial
    assert all(not isinstance(r, BaseException) for r in results.values()) and len(results) == 4
    engine.release_stream("s")
    engine.step()
    assert_idle(engine)


def test_finals_are_encoded_ahead_up_to_a_slot_each_and_admitted_within_the_prefill_budget(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_slots=2, admission_interval_ms=0, encode_ahead=True)
    results = {}
    for key in "ab":
        engine.add(DecodeRequest(audio=speech(1.0, seed=ord(key)), max_new_tokens=6),
                   lambda r, key=key: results.__setitem__(key, r))
    engine.step()
    for key in "cdef":
        engine.add(DecodeRequest(audio=speech(1.0, seed=ord(key)), max_new_tokens=4),
                   lambda r, key=key: results.__setitem__(key, r))
    engine.step()
    engine.step()
    assert len(engine._ahead) == 2 and engine.scheduler.depths()["final"] == 2  # a slot's worth each, no more
    engine.options = dataclasses.replace(engine.options, max_prefill_tokens=1)  # one prompt an admission
    taken = engine._take_ahead(2)
    assert len(taken) == 1 and len(engine._ahead) == 1  # the first always, then the budget
    engine._ahead.appendleft(taken[0])
    engine.run_until_done()
    assert sorted(results) == list("abcdef") and all(r.finish_reason == "length" for r in results.values())
    assert_idle(engine)
