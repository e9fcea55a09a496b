"""Loading the engine without holding the process: the load runs in a daemon thread that a shutdown may abandon.

Loading weights (and an engine process's start) takes minutes and cannot be interrupted. A SIGTERM meanwhile must
end the server promptly (issue #14 item 1): `asyncio.to_thread` would make the interpreter wait for the load at
exit, so the load gets a daemon thread of its own instead. An engine process still loading is terminated with the
server (it takes SIGTERM until it has loaded: qasr.engine.engine_process); an engine that arrives after the server
gave up on it is closed by the loading thread itself, so nothing outlives the server.

    load = EngineLoad(factory)    # starts at once
    engine = await load.result()  # the engine (None once abandoned), or the factory's exception
    load.abandon()                # stop(): returns the engine if it arrived and was not taken (close it)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from qasr.engine.face import SpeechEngine

log = logging.getLogger("qasr.server")


class EngineLoad:
    def __init__(self, factory: Callable[[], SpeechEngine]):
        self._loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        self._lock = threading.Lock()  # the thread's hand-over against abandon()
        self._abandoned = False
        self._engine: SpeechEngine | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._load, args=(factory,), name="qasr-load-engine", daemon=True).start()

    async def result(self) -> SpeechEngine | None:
        """The engine once loaded (the caller owns it from then on), None once abandoned, or the factory's
        exception."""
        await self._arrived.wait()
        with self._lock:
            engine, self._engine = self._engine, None
            if self._error is not None and not self._abandoned:
                raise self._error
        return engine

    def abandon(self) -> SpeechEngine | None:
        """Nobody waits for the engine any more. Returns it if it arrived and was not taken (the caller closes it);
        one that arrives later is closed by the loading thread."""
        with self._lock:
            self._abandoned = True
            engine, self._engine = self._engine, None
        self._arrived.set()
        return engine

    def _load(self, factory: Callable[[], SpeechEngine]) -> None:
        try:
            engine, error = factory(), None
        except BaseException as exc:  # handed to result()
            engine, error = None, exc
        with self._lock:
            if not self._abandoned:
                self._engine, self._error = engine, error
                try:
                    self._loop.call_soon_threadsafe(self._arrived.set)
                    return
                except RuntimeError:  # the loop is closed: the server is gone without abandoning it (a crash)
                    self._engine = None
        if engine is not None:
            log.info("engine loaded after the server stopped: closing it")
            asyncio.run(engine.close())
