"""Loading the engine without holding the process: the load runs in a daemon thread that a shutdown may abandon.

Loading weights (and an engine process's start) takes minutes and cannot be interrupted. A SIGTERM meanwhile must
end the server promptly (issue #14 item 1): `asyncio.to_thread` would make the interpreter wait for the load at
exit, so the load gets a daemon thread of its own instead. An engine process still loading is terminated with the
server (it takes SIGTERM until it has loaded: qasr.engine.engine_process); an engine that arrives after the server
gave up on it is closed by the loading thread itself, so nothing outlives the server.

    load = EngineLoad(factory)    # starts at once
    engine = await load.result()  # the engine (None once abandoned), or the factory's exception
    load.abandon()                # stop(): returns the engine if it arrived and was not taken (close it)

An engine per device: `pool_factory(build, engine_devices(device, devices), policy)` loads one engine per device at
once (each in a thread of its own: an engine process's load is minutes of waiting) into a qasr.engine.pool
EnginePool; `qasr-server` always serves through a pool, of one engine on one device.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from qasr.engine.face import SpeechEngine
from qasr.engine.pool import EnginePool, LoadPolicy

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


def engine_devices(device: str, devices: str | None) -> list[str | None]:
    """The device of each engine. `devices`: `qasr-server --devices`, CUDA indices ("0,1") or device names
    ("cuda:0,cuda:1"; "cpu,cpu" runs two engines on the CPU); None: every visible GPU when `device` is auto or cuda
    and a GPU is there, else one engine on `device` ([None]: the factory's own device). ValueError says what is
    wrong. Imports torch."""
    import torch

    from qasr.model.checkpoint import resolve_device

    if devices is None:
        if device in ("auto", "cuda") and resolve_device(device).type == "cuda" and torch.cuda.device_count() > 1:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return [None]
    names = [name.strip() for name in devices.split(",")]
    if not all(names):
        raise ValueError(f"--devices must be a comma-separated list such as 0,1 or cpu,cpu, got {devices!r}")
    names = [f"cuda:{name}" if name.isdigit() else name for name in names]
    for name in names:
        try:
            resolved = resolve_device(name)
        except RuntimeError as error:  # torch's own words for a device string it cannot parse
            raise ValueError(f"--devices: {error}") from None
        if resolved.type == "cuda":
            if resolved.index is None or resolved.index >= torch.cuda.device_count():
                raise ValueError(f"--devices: {name} is not one of the {torch.cuda.device_count()} visible GPUs "
                                 "(name them by index: 0,1)")
            if device not in ("auto", "cuda"):
                raise ValueError(f"--devices lists GPUs: leave --device at auto or cuda (it is {device})")
    gpus = [name for name in names if name.startswith("cuda")]
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--devices names a GPU twice: {devices}")
    return names


def pool_factory(build: Callable[..., SpeechEngine], devices: list[str | None],
                 policy: LoadPolicy = LoadPolicy()) -> Callable[[], EnginePool]:
    """What loads an engine per device (build(device=...); build() for None) at once and pools them. If one cannot
    load, the others are closed and the error names its device."""

    def load() -> EnginePool:
        if devices == [None]:
            return EnginePool([build()], policy)
        engines: list[SpeechEngine | None] = [None] * len(devices)
        failures: list[tuple[str, BaseException]] = []

        def load_one(i: int, device: str) -> None:
            try:
                engines[i] = build(device=device)
            except BaseException as error:  # reported below, after every load has ended
                failures.append((device, error))

        threads = [threading.Thread(target=load_one, args=(i, device), name=f"qasr-load-engine-{device}",
                                    daemon=True) for i, device in enumerate(devices)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            for engine in engines:
                if engine is not None:
                    asyncio.run(engine.close())
            device, error = failures[0]
            raise RuntimeError(f"the engine on {device} could not load: {error}") from error
        return EnginePool(engines, policy)

    return load
