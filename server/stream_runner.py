"""The asyncio glue between one sans-I/O `Session` and the engine: runs its engine actions, hands results back.

The session (a `Session`, or a `MultichannelSession`: one per channel behind the same face) decides (when a partial
or a final is due, what to cancel, which stream the engine may forget); the runner carries it out: one task per
Decode on `engine.transcribe`, Cancel cancels that task, Release calls `engine.release_stream`. It also gives the
connection what needs a loop: `next_event()` waits for the session's next event, `wait_for_capacity()` pauses
reading while too many finals are pending, and `abort()` leaves no task behind. The engine closing (EngineClosed)
is fatal to the stream: raised as errors.EngineStopped from `next_event()` once the events already made are taken.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from qasr.engine.face import SpeechEngine
from qasr.engine.request import DecodeRequest, EngineClosed, Priority, Superseded
from qasr.server.errors import EngineStopped
from qasr.streaming import events
from qasr.streaming.multichannel import MultichannelSession
from qasr.streaming.session import Cancel, Decode, EngineAction, Release, Session

log = logging.getLogger("qasr.session")


class DecodeObserver:
    """Metrics hooks for engine outcomes; no-ops here (qasr.server.metrics.ServerMetrics implements them)."""

    def decode_failed(self, priority: Priority) -> None: ...

    def decoded(self, priority: Priority, timings: dict[str, float]) -> None:
        """Where one request's time went inside the engine (DecodeResult.timings, milliseconds)."""


class StreamRunner:
    """Runs one session's engine work. Call feed/flush/end/notify from the event loop; take events with
    next_event()."""

    def __init__(self, session: Session | MultichannelSession, engine: SpeechEngine, *,
                 observer: DecodeObserver | None = None):
        self.session = session
        self.engine = engine
        self._observer = observer or DecodeObserver()
        self._tasks: dict[int, asyncio.Task] = {}  # request_id -> its transcribe task
        self._wakeup = asyncio.Event()  # something for next_event()
        self._capacity = asyncio.Event()
        self._capacity.set()
        self._failure: BaseException | None = None
        self._done = False  # the summary was taken, or the stream aborted: no more events

    # -- input: the session decides, then its actions run ---------------------------------------------------

    def feed(self, samples: np.ndarray) -> None:
        self.session.feed(samples)
        self._run_actions()

    def flush(self, channel: int | None = None) -> None:
        """Finalise the open segment (of one channel of a multichannel stream; None: of every channel)."""
        if channel is None:
            self.session.flush()
        else:
            self.session.flush(channel)
        self._run_actions()

    def end(self) -> None:
        self.session.end()
        self._run_actions()

    def notify(self, event) -> None:
        """Queue an error event, or a wire adapter's Reply, in order with the stream's events (next_event hands
        both out)."""
        self.session.notify(event)
        self._run_actions()

    def _run_actions(self) -> None:
        for action in self.session.take_actions():
            self._run(action)
        self._capacity.set() if self.session.has_capacity else self._capacity.clear()
        self._wakeup.set()

    def _run(self, action: EngineAction) -> None:
        if isinstance(action, Decode):
            request = DecodeRequest(audio=action.audio, context=action.context, language=action.language,
                                    priority=Priority.PARTIAL if action.partial else Priority.FINAL,
                                    stream_id=action.stream_id, words=action.words)
            self._tasks[action.request_id] = asyncio.get_running_loop().create_task(
                self._decode(action.request_id, request))
        elif isinstance(action, Cancel):
            task = self._tasks.pop(action.request_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(action, Release):
            try:
                self.engine.release_stream(action.stream_id)
            except Exception:  # releasing is best effort: never let it break the stream
                log.warning("release_stream(%s) failed", action.stream_id, exc_info=True)

    async def _decode(self, request_id: int, request: DecodeRequest) -> None:
        try:
            result = await self.engine.transcribe(request)
        except Superseded:
            result = None  # a newer partial of the stream replaced it in the engine's queue
        except EngineClosed as error:
            self._fail(EngineStopped(f"the engine closed: {error}"))
            return
        except Exception as error:  # fails only this segment: an error event and an empty final, or no partial
            log.log(logging.WARNING if request.priority is Priority.PARTIAL else logging.ERROR,
                    "%s of %s failed", request.priority.name.lower(), request.stream_id, exc_info=True)
            self._observer.decode_failed(request.priority)
            result = error
        else:
            self._observer.decoded(request.priority, result.timings)
        finally:
            self._tasks.pop(request_id, None)
        self.session.on_result(request_id, result)
        self._run_actions()

    # -- output ----------------------------------------------------------------------------------------------

    async def next_event(self) -> events.ServerEvent | None:
        """The next event, in order; None after the summary (or an abort). Raises EngineStopped once the events made
        before the engine closed are taken."""
        while True:
            event = self.session.take_event()
            if event is not None:
                if self.session.has_capacity:
                    self._capacity.set()
                if isinstance(event, events.Summary):
                    self._done = True  # by contract the last event
                return event
            if self._failure is not None:
                raise self._failure
            if self._done:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    async def wait_for_capacity(self) -> None:
        """Wait while too many closed segments await their final (backpressure on a client sending too fast)."""
        while not self._capacity.is_set() and self._failure is None and not self._done:
            await self._capacity.wait()
        if self._failure is not None:
            raise self._failure

    @property
    def num_tasks(self) -> int:
        """Engine calls still running for this stream."""
        return sum(not task.done() for task in self._tasks.values())

    # -- teardown --------------------------------------------------------------------------------------------

    async def abort(self) -> None:
        """Stop now (the client is gone or the connection failed): cancel engine work and wait for it, then release
        every stream. Idempotent; no event is produced after it."""
        self.session.abort()
        actions = self.session.take_actions()
        cancelled = [self._tasks.pop(action.request_id) for action in actions
                     if isinstance(action, Cancel) and action.request_id in self._tasks]
        for task in cancelled:
            task.cancel()
        if cancelled:
            await asyncio.gather(*cancelled, return_exceptions=True)
        for action in actions:
            if isinstance(action, Release):
                self._run(action)
        self._done = True
        self._wakeup.set()
        self._capacity.set()

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
        self._wakeup.set()
        self._capacity.set()
