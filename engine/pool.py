"""Several engines behind the one face: an engine per device (`qasr-server --devices 0,1`), each stream placed on the
least-loaded engine when its first request arrives and kept there until `release_stream` (its encoder windows, KV
prefix and last answer live in that engine). `EnginePool` implements qasr.engine.face.SpeechEngine; the server
drives one pool whatever the number of devices.

Load, for placement: the streams placed on an engine (a stream is one segment: it brings work at the pace of
real-time speech until its final), ties broken by the work the engine reports now (sequences decoding and waiting).
The count is exact and current; the reported work is a snapshot up to 250 ms old (an engine process reports four
times a second) that swings with every partial, so it only breaks ties. An engine without headroom gets a new stream
only when no engine has any.

Headroom, per engine (what admission control reads: qasr.server.admission), the smaller of

    1 - p90 latency of its finals answered in the last `window_s` / target_ms
    1 - decode rows in use / its slots      (rows in use: the mean of its recent decode steps' rows, but no more
                                             than it runs and queues now: an idle engine's old steps do not count)

A final's latency here is what the target is about: from the pool handing the request to its engine to the result
coming back (the engine's queue + encode + prefill + decode, the words' alignment if asked, and the IPC both ways
with a worker's event loop), never less than the engine's own account of it (DecodeResult.timings: `engine_ms`, or
the sum of its pieces). The queue delay alone was the signal before: under load a final's time goes to the encoder,
the prefill and the decode steps, not to the queue, and a 600 ms final had waited < 100 ms (session 5 on the H200).
The end-to-end final latency after the endpoint adds only the session's hand-out to this (the VAD's end silence comes
before the endpoint decision; the front end's event loop is in the round trip).

1: idle; 0: at the latency target; below 0: past it. The pool's headroom is its best serving engine's: where the next
stream goes.

The order of the responses to load: at headroom 0 admission control refuses new streams (qasr.server.admission,
until the headroom is back to its resume level); thinning partials is the last resort after that, for when the
streams already admitted keep the engine past its target (`LoadPolicy.thin_levels`, below 0 by default): on such
an engine a stream passes only one partial in n and the others are answered Superseded at once (the session then
asks for its next partial one partial interval later), so its rows and admissions go to finals first. Thinning
one in two already doubles the partial cadence (1 s -> 2 s, past the 1.2 s target), so it does not come first.

Failures: `ready` while at least one engine is ready; `error` once every engine has failed for good. A stream whose
engine failed for good is placed again; a request that got EngineClosed from such an engine (it never ran there) is
retried on another. EngineCrashed (the engine process died holding it) is not retried: a request that crashed one
engine could crash the next; its segment alone fails, as with one engine.

Torch-free (the server process imports it): it speaks only the request types.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

from .face import SpeechEngine
from .request import DecodeRequest, DecodeResult, EngineClosed, Priority, Superseded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPolicy:
    target_ms: float = 150.0  # the p90 latency of recent finals (submit to result, see above) at which an engine has
    # no headroom left; 0: no target (headroom from decode rows only, and no partial thinning). 150: the target is a
    # p95 of 250 ms after the endpoint as clients measure it, which includes what the engine's figure does not (the
    # endpoint's detection, the workers' IPC, the socket). 1,400 clients arriving over 20 s at one H200 (session 9,
    # bench/h200_stream.sh): at 150 their finals' p95 was 236 / 221 / 233 ms in three runs, ~500 streams refused;
    # at 180 (session 8) 287 ms
    window_s: float = 3.0  # finals answered this recently make the latency signal
    thin_levels: tuple[tuple[float, int], ...] = ((-0.25, 2), (-0.5, 4))  # (headroom below, pass one partial in n),
    # highest level first: past the target by a quarter (refusals did not hold it) a stream's partials pass one in
    # two, by a half one in four

    def __post_init__(self):
        if self.target_ms < 0 or not self.window_s > 0:
            raise ValueError(f"invalid load policy: target_ms must be >= 0 and window_s > 0, got {self}")
        levels = [level for level, _ in self.thin_levels]
        if levels != sorted(levels, reverse=True) or any(n < 1 for _, n in self.thin_levels):
            raise ValueError(f"thin_levels must go from the highest headroom down, each n >= 1: {self.thin_levels}")

    def partials_passed_one_in(self, headroom: float) -> int:
        """1: every partial passes; n: one in n."""
        if self.target_ms == 0:
            return 1
        passed = 1
        for level, one_in in self.thin_levels:
            if headroom < level:
                passed = one_in
        return passed


class RecentDelays:
    """Delays (ms) observed in the last `window_s` seconds, and their 90th percentile."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._p90: float | None = None  # the last answer, until a sample arrives or leaves the window

    def add(self, delay_ms: float) -> None:
        self._samples.append((self._clock(), delay_ms))
        self._p90 = None

    def clear(self) -> None:
        self._samples.clear()
        self._p90 = None

    def p90(self) -> float:
        """0 when nothing was observed within the window. Asked for every partial (thinning), so the sort is redone
        only when the window's samples changed (py-spy at 1000 streams: the sort was ~5% of a worker's time)."""
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
            self._p90 = None
        if self._p90 is None:
            ordered = sorted(delay for _, delay in self._samples)
            self._p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)] if ordered else 0.0
        return self._p90


class _Member:
    """One engine of the pool and what the pool knows of it."""

    def __init__(self, engine: SpeechEngine, window_s: float):
        self.engine = engine
        self.streams: set[str] = set()  # placed here and not released
        self.final_latency = RecentDelays(window_s)  # the signal: each final's latency (final_latency_ms)
        self.final_queue = RecentDelays(window_s)  # the queue part of it, shown beside it

    @property
    def failed(self) -> bool:
        return self.engine.error is not None


class EnginePool:
    model_name: str

    def __init__(self, engines: Sequence[SpeechEngine], policy: LoadPolicy = LoadPolicy(), clock=time.monotonic):
        """engines: loaded engines of one model (one per device), owned by the pool from now on.
        clock: seconds, for each final's round trip."""
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.policy = policy
        self.model_name = engines[0].model_name
        self._members = [_Member(engine, policy.window_s) for engine in engines]
        self._placed: dict[str, _Member] = {}  # stream id -> the engine holding it
        self._partials_seen: dict[str, int] = {}  # stream id -> partials asked of it (for thinning)
        self.partials_thinned = 0
        self._closing = False
        self._clock = clock

    @property
    def ready(self) -> bool:
        """At least one engine can serve (a degraded pool still serves on the others)."""
        return not self._closing and any(member.engine.ready for member in self._members)

    @property
    def error(self) -> BaseException | None:
        """Set once every engine has failed for good."""
        if not all(member.failed for member in self._members):
            return None
        return EngineClosed("every engine failed: " + "; ".join(str(m.engine.error) for m in self._members))

    async def start(self) -> None:
        await asyncio.gather(*(member.engine.start() for member in self._members))

    async def close(self) -> None:
        self._closing = True
        await asyncio.gather(*(member.engine.close() for member in self._members))

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        member = self._place(request.stream_id)
        if request.priority is Priority.PARTIAL and self._thins(member, request.stream_id):
            raise Superseded("partial skipped: its engine is near its latency target (finals go first)")
        while True:
            sent = self._clock()
            try:
                result = await member.engine.transcribe(request)
            except EngineClosed:
                if self._closing or not member.failed or all(m.failed for m in self._members):
                    raise
                log.warning("engine %d failed for good: its stream %s goes on on another engine",
                            self._members.index(member), request.stream_id)
                member = self._place(request.stream_id)  # it never ran there: ask the next
                continue
            if request.priority is Priority.FINAL:
                member.final_latency.add(final_latency_ms(result.timings, (self._clock() - sent) * 1e3))
                if "queue_ms" in result.timings:
                    member.final_queue.add(result.timings["queue_ms"])
            return result

    def forget_recent_finals(self) -> None:
        """Drop the finals seen so far from the signal: the server's warm-up decodes pay first-use costs (kernel
        compiles, autotuning: seconds on a fresh GPU), which would read as no headroom and refuse the first clients."""
        for member in self._members:
            member.final_latency.clear()
            member.final_queue.clear()

    def release_stream(self, stream_id: str) -> None:
        self._partials_seen.pop(stream_id, None)
        member = self._placed.pop(stream_id, None)
        if member is not None:  # a stream never placed had no work: no engine holds anything of it
            member.streams.discard(stream_id)
            member.engine.release_stream(stream_id)

    async def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        """Asked of one engine: they all load the same model with the same options."""
        await self._serving()[0].engine.check_context(context, language=language,
                                                       max_audio_seconds=max_audio_seconds)

    def stats(self) -> dict:
        """`engines`: each engine's own stats plus `streams` placed, `final_latency_ms` and `final_queue_ms` (p90s of
        recent finals: the signal and its queue part), `headroom` and `serving` (0/1), in device order; `headroom`
        (the best serving engine's) and `partials_thinned`. No key is both the pool's and an engine's: /metrics shows
        the engines' with an `engine` label."""
        engines, best = [], None
        for member in self._members:
            headroom = self._headroom(member)
            if member.engine.ready:
                best = headroom if best is None else max(best, headroom)
            engines.append(dict(member.engine.stats()) | {
                "streams": len(member.streams), "final_latency_ms": member.final_latency.p90(),
                "final_queue_ms": member.final_queue.p90(), "headroom": headroom,
                "serving": int(member.engine.ready)})
        return {"engines": engines, "headroom": best if best is not None else 0.0,
                "partials_thinned": self.partials_thinned}

    # -- placement -------------------------------------------------------------------------------------------

    def _place(self, stream_id: str | None) -> _Member:
        """The stream's engine; a new stream (or one whose engine failed for good) goes to the least-loaded."""
        member = self._placed.get(stream_id) if stream_id is not None else None
        if member is not None and not member.failed:
            return member
        if member is not None:
            member.streams.discard(stream_id)
        member = min(self._serving(), key=self._load)
        if stream_id is not None:
            member.streams.add(stream_id)
            self._placed[stream_id] = member
        return member

    def _serving(self) -> list[_Member]:
        """Engines not failed for good (one restarting takes work: it waits for the replacement), ready ones first."""
        alive = [member for member in self._members if not member.failed]
        if not alive:
            raise EngineClosed("every engine failed")
        return sorted(alive, key=lambda member: not member.engine.ready)

    def _load(self, member: _Member) -> tuple:
        stats = member.engine.stats()
        working = stats.get("running", 0) + sum(stats.get("queue", {}).values())
        return not member.engine.ready, self._headroom(member) <= 0, len(member.streams), working

    def _headroom(self, member: _Member) -> float:
        headroom = _row_headroom(member.engine.stats())
        if self.policy.target_ms > 0:
            headroom = min(headroom, 1.0 - member.final_latency.p90() / self.policy.target_ms)
        return headroom

    def _thins(self, member: _Member, stream_id: str | None) -> bool:
        """Whether to skip this partial of the stream (one in n passes, the first one first)."""
        if stream_id is None:
            return False
        one_in = self.policy.partials_passed_one_in(self._headroom(member))
        seen = self._partials_seen.get(stream_id, 0)
        self._partials_seen[stream_id] = seen + 1
        if seen % one_in == 0:
            return False
        self.partials_thinned += 1
        return True


ENGINE_LATENCY_PIECES = ("queue_ms", "encode_ms", "prefill_ms", "decode_ms")


def final_latency_ms(timings: dict, round_trip_ms: float) -> float:
    """A final's latency for the signal: its round trip as the pool saw it, but never less than the engine's own
    account (`engine_ms`, submit to result; else the sum of the pieces it reports) plus its words' alignment."""
    engine_ms = timings.get("engine_ms")
    if engine_ms is None:
        engine_ms = sum(timings.get(piece, 0.0) for piece in ENGINE_LATENCY_PIECES)
    return max(round_trip_ms, engine_ms + timings.get("align_ms", 0.0))


def _row_headroom(stats: dict) -> float:
    """1 - decode rows in use / slots, from an engine's stats (1 when it does not report them, e.g. the fake)."""
    if "free_slots" not in stats or "running" not in stats:
        return 1.0
    slots = stats["running"] + stats["free_slots"]
    recent = stats.get("batch_sizes") or [0]
    now = stats["running"] + sum(stats.get("queue", {}).values())
    in_use = min(sum(recent) / len(recent), now)
    return 1.0 - in_use / slots if slots else 1.0
