"""The engine in a process of its own, so that its Python never waits on the event loop's GIL.

Inside the server process the engine thread and the event loop share one interpreter. Every torch call releases and
retakes the GIL, and retaking it while the event loop holds it can wait a whole switch interval (5 ms): at 300
streams on an H200 the engine spent 74% of its time admitting work the GPU did in a fraction of that, while the
GPU idled (docs/benchmarks.md). In its own process the engine thread has an interpreter to itself.

`EngineProcess` implements the engine's face (qasr.engine.face.SpeechEngine), so the server does not know which
engine it drives. The server process holds no tokenizer: even `check_context` is answered by the engine process.
Pickled messages over one pipe:

    server -> engine   ("add", id, DecodeRequest) | ("cancel", id) | ("release", stream_id)
                       | ("check", id, context, language, max_audio_seconds) | ("close",)
    engine -> server   ("ready", model_name) | ("failed", message) | ("done", id, answer or exception)
                       | ("stats", dict)

The process is spawned (CUDA cannot be forked), ignores SIGINT, and SIGTERM once it has loaded (the server decides
when it stops; while it loads, a stopped server's exit terminates it), and exits when the server's end of the pipe
closes, so it never outlives the server. This module imports no torch and no tokenizer: the engine is imported in
the child's main; its logs go to the server's stderr, set up by the server's `log_setup` (the same format).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import typing
import weakref

from .futures import settle
from .options import EngineOptions, display_name
from .request import DecodeRequest, DecodeResult, EngineClosed

if typing.TYPE_CHECKING:
    from .engine import AsyncEngine, Engine

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often the engine process reports its stats (what /metrics shows)


class EngineProcess:
    model_name: str

    def __init__(self, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                 log_setup: typing.Callable[[], None] | None = None):
        """Spawn the engine process and wait until it has loaded the model and captured its graphs (minutes on a
        large model: the server calls this in a worker thread). RuntimeError if it could not.

        log_setup: run first in the engine process to configure its logging (picklable: a module-level function or
        a functools.partial of one); None: text lines at this process's log level."""
        self.options = options
        self.model_name = display_name(model)
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_engine_main, name="qasr-engine", daemon=True,
                                        args=(child_end, model, device, dtype, options,
                                              log_setup or functools.partial(_text_logs, log.getEffectiveLevel())))
        self._process.start()
        child_end.close()
        try:
            message = receive(self._conn)
        except EOFError:
            self._process.join(5)
            message = ("failed", f"the engine process exited with code {self._process.exitcode}")
        if message[0] != "ready":
            self._process.join(5)
            raise RuntimeError(f"the engine process could not load {model}: {message[1]}")
        self._ready = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # sent by a thread: a 2 MB clip never blocks the loop
        self._stats: dict = {}
        self._gone = False  # the pipe closed: set before failing what is pending, checked after registering
        self._closing = False
        self._threads = [threading.Thread(target=self._send_loop, name="qasr-engine-send", daemon=True),
                         threading.Thread(target=self._receive_loop, name="qasr-engine-receive", daemon=True)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                        log_setup: typing.Callable[[], None] | None = None):
        return cls(model, device=device, dtype=dtype, options=options, log_setup=log_setup)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def start(self) -> None:
        self._ready = not (self._gone or self._closing)

    async def close(self) -> None:
        """Work still pending gets EngineClosed; returns once the process has exited."""
        self._ready = False
        if not self._closing:
            self._closing = True
            self._outbox.put(("close",))
            self._outbox.put(None)
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        self._process.join(30)
        if self._process.is_alive():  # stuck (a hung device call): do not keep the server from exiting
            log.error("the engine process did not exit in 30 s: killing it")
            self._process.kill()
            self._process.join()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5)
        self._conn.close()

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        return await self._ask(lambda request_id: ("add", request_id, request), cancel=True)

    def release_stream(self, stream_id: str) -> None:
        self._outbox.put(("release", stream_id))

    async def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        await self._ask(lambda request_id: ("check", request_id, context, language, max_audio_seconds))

    async def _ask(self, message, *, cancel: bool = False):
        """Send message(request_id) and await the process's ("done", request_id, answer); `cancel`: a cancelled
        wait cancels the work in the process too."""
        if self._closing or self._gone or self._error is not None:
            raise EngineClosed("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = next(self._ids)
        self._pending[request_id] = (loop, future)
        if self._gone:  # the receiver already failed everything pending: nobody will answer this one
            self._pending.pop(request_id, None)
            raise EngineClosed("the engine is not running")
        self._outbox.put(message(request_id))
        try:
            return await future
        except asyncio.CancelledError:
            if cancel:
                self._outbox.put(("cancel", request_id))
            raise
        finally:
            self._pending.pop(request_id, None)

    def stats(self) -> dict:
        return dict(self._stats)

    # -- the server's two threads ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                send(self._conn, message)
            except (OSError, ValueError):  # the process is gone; the receiver reports it
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                message = receive(self._conn)
            except (EOFError, OSError):
                break
            if message[0] == "done":
                entry = self._pending.get(message[1])
                if entry is not None:
                    loop, future = entry
                    loop.call_soon_threadsafe(settle, future, message[2])
            elif message[0] == "stats":
                self._stats = message[1]
            elif message[0] == "failed":  # the engine loop died (a device error): the process exits next
                self._error = EngineClosed(f"engine failed: {message[1]}")
                log.error("%s", self._error)
        self._gone = True
        self._ready = False
        if not self._closing and self._error is None:
            self._process.join(5)
            self._error = EngineClosed(f"the engine process exited unexpectedly (exit code {self._process.exitcode})")
            log.error("%s", self._error)
        closed = self._error or EngineClosed("the engine was closed")
        for loop, future in list(self._pending.values()):
            loop.call_soon_threadsafe(settle, future, closed)
        self._outbox.put(None)  # ends the sender


def send(conn, message) -> None:
    """Pickle protocol 5 with the audio out of band: the array goes to the pipe from its own memory, not copied
    into the pickle first (a partial carries its whole segment; the copy held the server's GIL)."""
    buffers = []
    header = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(len(buffers).to_bytes(4, "little") + header)
    for buffer in buffers:
        conn.send_bytes(buffer.raw())


def receive(conn):
    data = conn.recv_bytes()
    buffers = [conn.recv_bytes() for _ in range(int.from_bytes(data[:4], "little"))]
    return pickle.loads(data[4:], buffers=buffers)


# -- the engine process ------------------------------------------------------------------------------------------

def _text_logs(level: int) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _engine_main(conn, model: str, device, dtype, options: EngineOptions, log_setup) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    log_setup()
    from .engine import AsyncEngine, Engine  # here, not at the top: the server process never imports torch

    try:
        core = Engine.from_pretrained(model, device=device, dtype=dtype, options=options)
        engine = AsyncEngine(core)
    except BaseException as e:
        log.exception("cannot load %s", model)
        send(conn, ("failed", f"{type(e).__name__}: {e}"))
        return
    # Only now: a server stopped while this process loads exits at once, and Python's exit terminates its daemon
    # processes (SIGTERM) and waits for them; once serving, only the server's "close" ends it (after the drain).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sending = threading.Lock()

    def reply(message) -> None:
        with sending:
            try:
                send(conn, message)
            except (OSError, ValueError):  # the server is gone; the receiver stops the loop
                pass

    reply(("ready", engine.model_name))
    threading.Thread(target=_serve_requests, args=(conn, core, engine, reply), name="qasr-engine-requests",
                     daemon=True).start()
    threading.Thread(target=_report_stats, args=(engine, reply), name="qasr-engine-stats", daemon=True).start()
    engine.run()  # returns once "close" arrives (or the server vanished), after failing what was left
    reply(("stats", _stats(engine)))
    if engine.error is not None:
        reply(("failed", f"{type(engine.error).__name__}: {engine.error}"))


def _serve_requests(conn, core: Engine, engine: AsyncEngine, reply) -> None:
    """core: the synchronous engine that `engine` (its loop, on the main thread) steps; `check_context` needs only its
    tokenizer, so it is answered here, beside the loop."""
    running = weakref.WeakValueDictionary()  # request id -> Sequence, until the engine lets go of it
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            message = ("close",)
        kind = message[0]
        if kind == "add":
            request_id = message[1]
            running[request_id] = engine.submit(message[2],
                                                lambda result, i=request_id: reply(("done", i, _portable(result))))
        elif kind == "check":
            request_id, context, language, max_audio_seconds = message[1:]
            try:
                core.check_context(context, language=language, max_audio_seconds=max_audio_seconds)
                answer = None
            except ValueError as error:
                answer = error
            reply(("done", request_id, _portable(answer)))
        elif kind == "cancel":
            seq = running.get(message[1])
            if seq is not None:
                seq.cancelled = True
                engine.wake()
        elif kind == "release":
            engine.release_stream(message[1])
        elif kind == "close":
            engine.stop()
            return


def _portable(answer):
    """A ValueError subclass of the model's (e.g. UnsupportedLanguageError) as a plain ValueError: unpickling it would
    import the model's modules (and the tokenizer) into the server process."""
    if isinstance(answer, ValueError) and type(answer) is not ValueError:
        return ValueError(str(answer))
    return answer


def _report_stats(engine: AsyncEngine, reply) -> None:
    while not engine.stopped:
        reply(("stats", _stats(engine)))
        time.sleep(STATS_INTERVAL_S)


def _stats(engine: AsyncEngine) -> dict:
    return engine.stats() | {"process_cpu_seconds": time.process_time()}
