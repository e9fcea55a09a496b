"""One request that fails inside the engine (its encoding or its prefill raises) fails alone: the requests admitted in
the same batch decode exactly as they would have without it, and the engine goes on serving."""

import pytest

from qasr.engine.request import DecodeRequest, Priority

from test_engine import assert_idle, make_engine, speech

MARKED_SECONDS = 1.3  # the request the injected fault hits: the only clip of this length


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def batch() -> list[DecodeRequest]:
    return [DecodeRequest(audio=speech(0.7, seed=1), max_new_tokens=8),
            DecodeRequest(audio=speech(MARKED_SECONDS, seed=2), max_new_tokens=8),
            DecodeRequest(audio=speech(2.1, seed=3), priority=Priority.PARTIAL, stream_id="s", max_new_tokens=6),
            DecodeRequest(audio=speech(1.6, seed=4), max_new_tokens=8)]


def faulty(method, is_marked, calls: list[int]):
    """`method` that raises when its batch holds the marked request; records each call's batch size."""
    def wrapper(items, *args):
        calls.append(len(items))
        if any(is_marked(item) for item in items):
            raise RuntimeError("injected fault")
        return method(items, *args)
    return wrapper


def marked_prompt_length(engine) -> int:
    """How many positions the marked request prefills (what identifies it to the prefill)."""
    seen = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda embeds, *args: seen.extend(e.shape[0] for e in embeds) or prefill(embeds, *args)
    try:
        engine.transcribe([batch()[1]])
    finally:
        del engine.runner.prefill
    return seen[0]


@pytest.mark.parametrize("stage", ["log_spectrogram", "prefill"])  # the mel of an admission, its prefill
def test_a_request_that_fails_in_the_engine_fails_alone(engine, stage):
    alone = [engine.transcribe([request])[0] for request in batch()]
    engine.release_stream("s")
    if stage == "log_spectrogram":
        is_marked = lambda clip: clip.size == int(MARKED_SECONDS * 16000)  # noqa: E731
    else:
        length = marked_prompt_length(engine)
        is_marked = lambda embeds: embeds.shape[0] == length  # noqa: E731
    calls: list[int] = []
    setattr(engine.runner, stage, faulty(getattr(engine.runner, stage), is_marked, calls))
    results: list = [None] * 4
    try:
        for i, request in enumerate(batch()):
            engine.add(request, lambda result, i=i: results.__setitem__(i, result))
        engine.run_until_done()
    finally:
        delattr(engine.runner, stage)
        engine.release_stream("s")
    assert calls[0] == 4  # the four were admitted together
    assert isinstance(results[1], RuntimeError) and "injected fault" in str(results[1])
    for i in (0, 2, 3):
        assert results[i].token_ids == alone[i].token_ids and results[i].text == alone[i].text
    assert_idle(engine)  # no slot or decode row left behind
    again = engine.transcribe([batch()[1]])[0]  # and it still serves, the marked request too
    assert again.token_ids == alone[1].token_ids
