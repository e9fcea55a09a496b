"""Word times in a Session (StreamSettings.words): finals ask the engine for them, partials never do, and the engine's
clip-relative times come out in stream time, offset by the segment's start."""

from __future__ import annotations

import dataclasses

from qasr.engine.request import WordTime
from qasr.streaming import events
from qasr.streaming.session import Session

from fakes import speech_like
from test_session import TWO_BURSTS, Engine, settings, take_all


@dataclasses.dataclass(frozen=True)
class Aligned:
    """The engine's answer to a final that asked for words: two words over the clip's first and second halves."""

    text: str
    language: str = "English"
    words: tuple | None = None
    words_reason: str | None = None


def aligned(request) -> Aligned:
    half = round(len(request.audio) / 16000 / 2, 3)
    if not request.words:
        return Aligned("hello world")
    return Aligned("hello world", words=(WordTime("hello", 0.0, half), WordTime("world", half, 2 * half)))


def run_stream(stream_settings, answer=aligned):
    session = Session("s", stream_settings)
    engine = Engine(session, auto=False)
    audio, _ = speech_like(TWO_BURSTS)
    for start in range(0, len(audio), 1600):
        session.feed(audio[start:start + 1600])
        engine.run()
        for request in engine.pending():
            engine.answer(request, answer(request))
    session.end()
    engine.run()
    for request in engine.pending():
        engine.answer(request, answer(request))
    return engine, take_all(session)


def test_finals_of_a_stream_that_asked_carry_words_in_stream_time_and_partials_never_ask():
    engine, out = run_stream(settings(words=True, partial_interval_ms=300))
    assert any(r.partial for r in engine.requests) and not any(r.words for r in engine.requests if r.partial)
    assert all(r.words for r in engine.requests if not r.partial)
    finals = [e for e in out if isinstance(e, events.Final)]
    assert len(finals) == 2 and finals[1].start > 1.0  # the second segment starts well into the stream
    for final in finals:
        assert [w.word for w in final.words] == ["hello", "world"] and final.words_reason is None
        half = round((final.end - final.start) / 2, 3)
        assert abs(final.words[0].start - final.start) < 0.001 and abs(final.words[1].start - (final.start + half)) \
            < 0.002
        assert all(final.start <= w.start <= w.end <= final.end for w in final.words)


def test_finals_of_other_streams_have_no_words():
    engine, out = run_stream(settings())
    assert not any(r.words for r in engine.requests)
    assert all(e.words is None and e.words_reason is None for e in out if isinstance(e, events.Final))


def test_a_final_without_words_says_why():
    def unsupported(request):
        return Aligned("marhaba", "Arabic", words=(), words_reason="the aligner does not support Arabic")

    _, out = run_stream(settings(words=True), unsupported)
    finals = [e for e in out if isinstance(e, events.Final)]
    assert finals and all(f.words == () and "Arabic" in f.words_reason for f in finals)
    _, out = run_stream(settings(words=True), lambda request: RuntimeError("boom"))
    finals = [e for e in out if isinstance(e, events.Final)]
    assert finals and all(f.words == () and f.words_reason == "the segment could not be transcribed" for f in finals)
