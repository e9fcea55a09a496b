"""The engine's logic on the CPU (eager, no graphs): slots, buckets, EOS and budgets, continuous batching, row
correctness, cancellation, superseding, validation, and the asyncio face."""

import asyncio
import time

import numpy as np
import pytest
import torch

from qasr.engine.engine import AsyncEngine, Engine, EngineOptions
from qasr.engine.postprocess import is_repeating
from qasr.engine.request import DecodeRequest, EngineClosed, Priority, Superseded

SR = 16000


def speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    t = np.arange(n) / SR
    f0 = rng.uniform(100, 250)
    voiced = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6)) / k for k in range(1, 5))
    envelope = (np.sin(2 * np.pi * rng.uniform(2, 4) * t) > -0.3).astype(np.float64)
    return (0.2 * voiced * envelope + 0.01 * rng.standard_normal(n)).astype(np.float32)


def make_engine(model_dir, **kw) -> Engine:
    opts = dict(num_slots=4, max_len=256, num_retained=2)
    opts.update(kw)
    return Engine.from_pretrained(str(model_dir), device="cpu", options=EngineOptions(**opts))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def alone(engine):
    """Tokens of each test clip decoded alone (batch of one), the reference for batching tests."""
    clips = [speech(s, seed=i) for i, s in enumerate([0.4, 1.3, 2.2, 3.1, 4.0, 1.7, 0.9, 2.8])]
    budgets = [6, 12, 9, 15, 7, 11, 14, 5]
    out = [engine.transcribe([DecodeRequest(audio=c, max_new_tokens=b)])[0] for c, b in zip(clips, budgets)]
    return clips, budgets, out


def assert_idle(engine: Engine):
    assert not engine.scheduler.running
    assert sorted(engine.scheduler.free_slots) == list(range(engine.options.num_slots))
    assert (engine.runner.positions == -1).all()


def test_budget_is_exact_without_eos(alone):
    _, budgets, out = alone
    for b, r in zip(budgets, out):
        assert len(r.token_ids) == b and r.finish_reason == "length"
        assert r.num_audio_tokens > 0 and r.timings["prefill_ms"] >= 0


def test_more_requests_than_slots_all_finish_and_slots_return(engine, alone):
    clips, budgets, out = alone
    reqs = [DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips, budgets)]  # 8 requests, 4 slots
    batched = engine.transcribe(reqs)
    assert [r.token_ids for r in batched] == [r.token_ids for r in out]
    assert max(engine.recent_batch_sizes) <= engine.options.num_slots
    assert_idle(engine)


def test_stats_say_where_the_engine_threads_time_went(tiny_model_dir, alone):
    clips, budgets, _ = alone
    engine = make_engine(tiny_model_dir)
    before = engine.stats()["seconds"]
    assert set(before) == {"admit", "decode_gpu", "decode_host", "align", "idle"} and not any(before.values())
    engine.transcribe([DecodeRequest(audio=c, max_new_tokens=b) for c, b in zip(clips[:3], budgets[:3])])
    seconds = engine.stats()["seconds"]
    assert seconds["admit"] > 0 and seconds["decode_gpu"] > 0 and seconds["decode_host"] > 0
    assert seconds["idle"] == 0  # only AsyncEngine waits for work


def test_device_memory_reads_the_cuda_allocators_counts_and_a_cpu_engine_has_none(engine, monkeypatch):
    from qasr.engine import engine as engine_module

    assert "device_memory" not in engine.stats()
    seen = []
    stats = {"num_device_alloc": 12, "num_device_free": 3, "num_alloc_retries": 1, "reserved_bytes.all.current": 2048,
             "allocated_bytes.all.current": 1024, "active.all.current": 7}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: seen.append(device) or stats)
    cuda = torch.device("cuda", 1)
    assert engine_module.device_memory(cuda) == {"device_allocs": 12, "device_frees": 3, "alloc_retries": 1,
                                                 "reserved_bytes": 2048, "allocated_bytes": 1024}
    assert seen == [cuda]
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})  # an allocator that never ran
    assert set(engine_module.device_memory(cuda).values()) == {0}
    # the engine reads it at most once a second (a CUDA engine's stats; this one's device stands in for one)
    reads = []
    monkeypatch.setattr(engine_module, "device_memory", lambda device: reads.append(device) or {"device_allocs": 1})
    monkeypatch.setattr(engine.runner, "device", cuda)
    ticks = [100.0, 100.5, 101.2]  # then it stays at 101.2 (for anything else that reads the clock meanwhile)
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: ticks.pop(0) if len(ticks) > 1 else ticks[0])
    assert [engine.stats()["device_memory"] for _ in range(3)] == [{"device_allocs": 1}] * 3
    assert len(reads) == 2  # at 100.0 and 101.2, not at 100.5


def test_arrivals_while_decoding_wait_for_the_admission_interval(tiny_model_dir, alone):
    clips, budgets, out = alone
    engine = make_engine(tiny_model_dir, admission_interval_ms=1e6)  # never again while something decodes
    results = {}
    engine.add(DecodeRequest(audio=clips[3], max_new_tokens=budgets[3]), lambda r: results.__setitem__(3, r))
    engine.step()  # nothing was decoding: admitted at once
    for i in (0, 1):
        engine.add(DecodeRequest(audio=clips[i], max_new_tokens=budgets[i]), lambda r, i=i: results.__setitem__(i, r))
    for _ in range(3):
        engine.step()
    assert list(engine.scheduler.running) == [0] and len(engine.scheduler) == 2  # batched for later
    engine.run_until_done()  # admitted together once clip 3 is done
    assert {i: results[i].token_ids for i in (0, 1, 3)} == {i: out[i].token_ids for i in (0, 1, 3)}
    assert_idle(engine)


def test_decoding_gets_the_whole_interval_between_admissions_that_take_longer_than_it(tiny_model_dir, alone):
    clips = alone[0]
    engine = make_engine(tiny_model_dir, num_slots=8, admission_interval_ms=30, ignore_eos=True)
    admissions = []  # (start, end, sequences running at the start)
    admit = engine._admit_apart  # an admission's device work, overlapped with a decode step or not

    def slow_admission(seqs, prepared=None, after=None):  # as under load on a GPU: longer than the interval
        start = time.perf_counter()
        time.sleep(0.06)
        admit(seqs, prepared, after)
        admissions.append((start, time.perf_counter(), len(engine.scheduler.running)))

    engine._admit_apart = slow_admission
    engine.add(DecodeRequest(audio=clips[3], max_new_tokens=150), lambda r: None)  # decodes throughout
    for step in range(60):
        if step % 5 == 0:  # arrivals keep an admission due
            engine.add(DecodeRequest(audio=clips[step // 5 % 8], max_new_tokens=3), lambda r: None)
        engine.step()
    engine.run_until_done()
    while_decoding = [b[0] - a[1] for a, b in zip(admissions, admissions[1:]) if b[2] > 0]
    assert len(while_decoding) >= 3 and min(while_decoding) >= 0.03


def test_requests_joining_mid_flight_get_the_same_tokens(engine, alone):
    clips, budgets, out = alone
    results = {}
    engine.add(DecodeRequest(audio=clips[3], max_new_tokens=budgets[3]), lambda r: results.__setitem__(3, r))
    for _ in range(4):  # clip 3 is decoding when the others arrive
        engine.step()
    assert engine.scheduler.running
    for i in (0, 1, 2):
        engine.add(DecodeRequest(audio=clips[i], max_new_tokens=budgets[i]), lambda r, i=i: results.__setitem__(i, r))
        engine.step()
    engine.run_until_done()
    for i in (0, 1, 2, 3):
        assert results[i].token_ids == out[i].token_ids
    assert_idle(engine)


def test_identical_inputs_give_identical_rows(engine):
    clip = speech(2.5, seed=42)
    rows = engine.transcribe([DecodeRequest(audio=clip, max_new_tokens=10)] * 4)
    assert all(r.token_ids == rows[0].token_ids for r in rows)
    assert len(set(rows[0].token_ids)) > 1  # a real sequence, not a degenerate one


def test_eos_stops_a_row_and_is_not_returned(tiny_model_dir, alone):
    clips, _, out = alone
    tokens = out[3].token_ids
    k = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 3)
    eng = make_engine(tiny_model_dir)
    eng.eos_ids = (tokens[k],)  # pretend that token is EOS, on the host and on the device
    eng.runner.eos = torch.tensor([tokens[k]])
    (r,) = eng.transcribe([DecodeRequest(audio=clips[3], max_new_tokens=15)])
    assert r.finish_reason == "eos" and r.token_ids == tokens[:k]
    assert_idle(eng)


def test_padding_rows_write_no_kv(tiny_model_dir):
    eng = make_engine(tiny_model_dir, num_slots=4)
    runner = eng.runner
    # slot 3 idle: poison its cache rows and check a decode over the bucket of 4 leaves them untouched
    for layer in (*runner.cache.k, *runner.cache.v):
        layer[3].fill_(7.0)
    results = []
    for i in range(3):
        eng.add(DecodeRequest(audio=speech(1.0, seed=i), max_new_tokens=6), results.append)
    eng.step()  # admits 3 sequences into slots 0-2
    assert sorted(eng.scheduler.running) == [0, 1, 2]
    assert runner.bucket_for(3) == 4  # the step runs slot 3 as a padding row
    eng.run_until_done()
    assert len(results) == 3
    for layer in (*runner.cache.k, *runner.cache.v):
        assert (layer[3, :, : runner.cache.max_len] == 7.0).all()


def test_buckets():
    from qasr.engine.runner import DEFAULT_BUCKETS

    assert DEFAULT_BUCKETS[0] == 1 and list(DEFAULT_BUCKETS) == sorted(DEFAULT_BUCKETS)


def test_cancelled_running_sequence_frees_its_slot(engine):
    got = []
    seq = engine.add(DecodeRequest(audio=speech(2.0, seed=5), max_new_tokens=40), got.append)
    engine.step()
    assert seq.slot in engine.scheduler.running
    seq.cancelled = True
    engine.step()
    assert len(got) == 1 and isinstance(got[0], asyncio.CancelledError)
    assert_idle(engine)


def test_newer_partial_supersedes_queued_one_and_finals_go_first(engine):
    got = {}
    a = DecodeRequest(audio=speech(1.0, seed=1), priority=Priority.PARTIAL, stream_id="s/0", max_new_tokens=3)
    b = DecodeRequest(audio=speech(1.5, seed=1), priority=Priority.PARTIAL, stream_id="s/0", max_new_tokens=3)
    f = DecodeRequest(audio=speech(1.0, seed=2), priority=Priority.FINAL, max_new_tokens=3)
    engine.add(a, lambda r: got.__setitem__("a", r))
    engine.add(b, lambda r: got.__setitem__("b", r))
    engine.add(f, lambda r: got.__setitem__("f", r))
    assert isinstance(got["a"], Superseded)
    taken = engine.scheduler.take(1, 10**6, lambda s: 1)
    assert taken[0].request is f  # the final is admitted before the earlier-queued partial
    taken[0].finish(RuntimeError("test drop"))
    engine.run_until_done()
    assert got["b"].token_ids and len(got["b"].token_ids) == 3
    engine.release_stream("s/0")
    engine.step()
    assert engine.streams.peek("s/0") is None


@pytest.mark.parametrize(
    "audio, message",
    [
        (np.zeros(10, dtype=np.float32), "too short"),
        (np.zeros((2, 16000), dtype=np.float32), "1-D"),
    ],
)
def test_bad_audio_fails_that_request_only(engine, audio, message):
    got = []
    engine.add(DecodeRequest(audio=audio), got.append)
    assert isinstance(got[0], ValueError) and message in str(got[0])
    (ok,) = engine.transcribe([DecodeRequest(audio=speech(1.0, seed=9), max_new_tokens=4)])
    assert len(ok.token_ids) == 4


def test_audio_not_all_finite_fails_at_admission_alone(engine, alone):
    """The samples are checked as their admission stages them: a NaN or an infinity anywhere fails that request with
    its message, and the requests admitted with it decode as they do alone."""
    clips, budgets, out = alone
    nan_inside, inf_last = speech(1.0, seed=3), speech(2.0, seed=4)
    nan_inside[7_777] = np.nan
    inf_last[-1] = np.inf
    requests = [DecodeRequest(audio=clips[1], max_new_tokens=budgets[1]), DecodeRequest(audio=nan_inside),
                DecodeRequest(audio=clips[2], max_new_tokens=budgets[2]), DecodeRequest(audio=inf_last)]
    got = {}
    for i, request in enumerate(requests):
        engine.add(request, lambda result, i=i: got.__setitem__(i, result))
    assert not got  # nothing is refused when added: the check is the admission's
    engine.run_until_done()
    for i in (1, 3):
        assert isinstance(got[i], ValueError) and "audio contains NaN or infinite samples" in str(got[i])
    assert got[0].token_ids == out[1].token_ids and got[2].token_ids == out[2].token_ids
    assert_idle(engine)


def test_a_nan_where_a_streams_kept_chunks_stand_is_refused(engine):
    """A stream's partial stages only the samples after its kept chunks; the samples before them are checked too (a
    NaN there passes the stream's fingerprint of the audio seen, and the kept features would hide it)."""
    first = speech(2.5, seed=5)
    engine.transcribe([DecodeRequest(audio=first, priority=Priority.PARTIAL, stream_id="nan/0", max_new_tokens=2)])
    assert engine.streams.peek("nan/0").num_chunks >= 2  # the next partial stages only what follows them
    grown = np.concatenate([first, speech(0.5, seed=6)])
    grown[8_000] = np.nan  # inside the kept chunks, away from the fingerprinted ends
    with pytest.raises(ValueError, match="NaN or infinite"):
        engine.transcribe([DecodeRequest(audio=grown, priority=Priority.PARTIAL, stream_id="nan/0", max_new_tokens=2)])
    engine.release_stream("nan/0")
    engine.step()
    assert_idle(engine)


def test_too_long_audio_is_refused(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_audio_seconds=2.0)
    with pytest.raises(ValueError, match="too long"):
        eng.transcribe([DecodeRequest(audio=speech(3.0, seed=1))])


def test_prompt_longer_than_max_len_fails_cleanly(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        eng.transcribe([DecodeRequest(audio=speech(8.0, seed=1))])
    assert_idle(eng)


def test_token_repetition_guard(engine):
    w = engine.options.repetition_window
    assert is_repeating([5, 6] * (w // 2), w)
    assert is_repeating(list(range(3)) + [9] * w, w)
    assert not is_repeating(list(range(w)), w)
    assert not is_repeating([1, 2] * 4, w)  # too short to judge
    assert not is_repeating([9] * w, 0)  # off


def test_the_repetition_guards_quick_reject_changes_no_answer():
    """is_repeating first rejects a tail whose newest token is not among the 8 before it (this runs per row per
    step); a pattern of p <= 8 tokens always repeats the newest one p back, so the answers are the full check's
    (windows of 8 tokens or fewer, where every tail is trivially a pattern, skip the reject)."""
    def full_check(tokens, window):
        tail = tokens[-window:]
        return len(tokens) >= window and any(all(tail[i] == tail[i - p] for i in range(p, window))
                                             for p in range(1, 9))

    rng = np.random.default_rng(0)
    cases = [list(rng.integers(0, vocab, rng.integers(1, 80))) for vocab in (2, 3, 5, 50) for _ in range(300)]
    cases += [list(rng.integers(0, 50, p)) * (80 // p) + list(rng.integers(0, 50, k)) for p in range(1, 10)
              for k in range(3)]  # loops of every period, some broken by a few tokens after them
    for tokens in cases:
        for window in (8, 16, 64):
            assert is_repeating(tokens, window) == full_check(tokens, window), (tokens, window)
    looping = sum(is_repeating(t, 16) for t in cases)
    assert 9 <= looping < len(cases) // 2  # every period's unbroken loop, and most cases not looping


def test_async_engine_results_cancel_and_close(tiny_model_dir):
    async def scenario():
        eng = AsyncEngine(make_engine(tiny_model_dir))
        await eng.start()
        assert eng.ready
        results = await asyncio.gather(
            *(eng.transcribe(DecodeRequest(audio=speech(1.0 + i / 3, seed=i), max_new_tokens=5)) for i in range(6))
        )
        assert all(len(r.token_ids) == 5 for r in results)
        assert eng.stats()["thread_cpu_seconds"] > 0  # the engine thread's own CPU, not the process's
        task = asyncio.create_task(eng.transcribe(DecodeRequest(audio=speech(2.0, seed=3), max_new_tokens=200)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the engine thread frees the slot at its next step
            if not eng.engine.scheduler.running:
                break
            await asyncio.sleep(0.02)
        assert not eng.engine.scheduler.running
        await eng.close()
        with pytest.raises(EngineClosed):
            await eng.transcribe(DecodeRequest(audio=speech(1.0, seed=1)))

    asyncio.run(scenario())


def test_a_request_added_just_as_the_engine_loop_fails_gets_engine_closed_not_a_hang(tiny_model_dir):
    async def scenario():
        eng = AsyncEngine(make_engine(tiny_model_dir))
        await eng.start()
        add = eng.engine.add

        def add_after_the_loop_failed(request, on_done):  # the race: the loop fails between the check and add
            def broken_step():
                raise RuntimeError("device lost")

            eng.engine.step = broken_step
            eng._wake.set()
            eng._thread.join(5)
            return add(request, on_done)

        eng.engine.add = add_after_the_loop_failed
        with pytest.raises(EngineClosed):
            await asyncio.wait_for(eng.transcribe(DecodeRequest(audio=speech(1.0, seed=1))), 5)
        assert eng.error is not None
        await eng.close()

    asyncio.run(scenario())


def test_a_request_that_cannot_fit_fails_alone_in_its_batch(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_len=128)
    got = {}
    eng.add(DecodeRequest(audio=speech(10.0, seed=1)), lambda r: got.__setitem__("long", r))  # 130 audio tokens
    eng.add(DecodeRequest(audio=speech(1.0, seed=2), language="Klingon"), lambda r: got.__setitem__("lang", r))
    eng.add(DecodeRequest(audio=speech(1.0, seed=3), max_new_tokens=4), lambda r: got.__setitem__("ok", r))
    eng.run_until_done()
    assert isinstance(got["long"], ValueError) and "max_len" in str(got["long"])
    assert isinstance(got["lang"], ValueError) and "Klingon" in str(got["lang"])
    assert len(got["ok"].token_ids) == 4
    assert_idle(eng)


def test_a_runaway_partial_prefix_is_dropped_not_failed(engine):
    clip = speech(1.0, seed=4)
    tokenizer = engine.tokenizer
    rollback = engine.options.rollback_tokens
    # far more tokens than 1 s of audio could hold, as if the stream's previous partial had run on
    engine.streams.get("x/0").answer_ids = tuple(tokenizer.encode("la " * 400))
    (r,) = engine.transcribe([DecodeRequest(audio=clip, priority=Priority.PARTIAL, stream_id="x/0",
                                            max_new_tokens=5)])
    (plain,) = engine.transcribe([DecodeRequest(audio=clip, priority=Priority.PARTIAL, max_new_tokens=5)])
    assert r.token_ids == plain.token_ids and not r.raw_text.startswith("la la")
    engine.streams.get("y/0").answer_ids = tuple(tokenizer.encode("hello")) + (11,) * rollback
    (p,) = engine.transcribe([DecodeRequest(audio=clip, priority=Priority.PARTIAL, stream_id="y/0",
                                            max_new_tokens=5)])
    assert p.raw_text.startswith("hello")  # a plausible prefix is kept
    engine.release_stream("x/0")
    engine.release_stream("y/0")
    engine.step()


def test_a_partial_continues_its_streams_previous_partial_minus_the_rollback_and_a_final_never_does(engine):
    """The engine applies the rollback itself, on token ids: partial n + 1 is given partial n's answer (its given
    prefix + its tokens) minus the last `rollback_tokens`."""
    tokenizer, rollback = engine.tokenizer, engine.options.rollback_tokens
    clip = speech(3.0, seed=6)
    first, second, third = (engine.transcribe([DecodeRequest(audio=clip[: n * SR], priority=Priority.PARTIAL,
                                                             stream_id="r/0", max_new_tokens=8)])[0]
                            for n in (1, 2, 3))
    given = first.token_ids[:-rollback]
    assert len(given) == 8 - rollback and second.raw_text == tokenizer.decode(given + second.token_ids)
    given = (given + second.token_ids)[:-rollback]
    assert third.raw_text == tokenizer.decode(given + third.token_ids)
    (alone,) = engine.transcribe([DecodeRequest(audio=clip[: 2 * SR], priority=Priority.PARTIAL, max_new_tokens=8)])
    assert second.raw_text != alone.raw_text  # (the prefix changed the decode's input)
    (final,) = engine.transcribe([DecodeRequest(audio=clip, stream_id="r/0", max_new_tokens=8)])
    (offline,) = engine.transcribe([DecodeRequest(audio=clip, max_new_tokens=8)])
    assert final.token_ids == offline.token_ids and final.raw_text == tokenizer.decode(final.token_ids)
    engine.release_stream("r/0")
    engine.step()
    assert engine.streams.peek("r/0") is None


def test_no_rollback_prefix_when_rollback_tokens_is_0(tiny_model_dir):
    eng = make_engine(tiny_model_dir, rollback_tokens=0)
    clip = speech(2.0, seed=6)
    for n in (1, 2):
        (r,) = eng.transcribe([DecodeRequest(audio=clip[: n * SR], priority=Priority.PARTIAL, stream_id="z/0",
                                             max_new_tokens=8)])
        assert r.raw_text == eng.tokenizer.decode(r.token_ids)
    with pytest.raises(ValueError, match="invalid engine options"):
        EngineOptions(rollback_tokens=-1)


def test_check_context_refuses_a_context_that_leaves_no_room_for_the_longest_segment(engine):
    engine.check_context("Names: Qasr, Qwen.", max_audio_seconds=2.0)  # fits: no error
    with pytest.raises(ValueError, match="context too long"):
        engine.check_context("word " * 200, max_audio_seconds=2.0)  # max_len is 256 in these tests


def test_rows_finishing_in_one_step_get_the_texts_of_one_at_a_time(engine, alone):
    """A step's finished rows have their answers decoded in one batch (Tokenizer.decode_batch): each result is the
    one a decode of its own gives."""
    clips, budgets, out = alone
    same_end = [DecodeRequest(audio=clip, max_new_tokens=5) for clip in clips[:4]]  # all four end in one step
    results = engine.transcribe(same_end)
    assert {len(r.token_ids) for r in results} == {5}  # no EOS before the budget: all four ended in one step
    for result in results:
        assert result.raw_text == engine.tokenizer.decode(result.token_ids) and result.finish_reason
    assert engine.tokenizer.decode_batch([r.token_ids for r in results]) == [r.raw_text for r in results]
    assert_idle(engine)
