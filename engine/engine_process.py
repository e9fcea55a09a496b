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
closes, so it never outlives the server.

When the process dies (a CUDA error, an out-of-memory, a kill), `EngineProcess` starts another (within its restart
budget: qasr.engine.restart_budget). What the dead one held fails with EngineCrashed (a stream gets an empty final
for that segment and goes on); what was not yet sent, and `check_context` questions, wait for the new one; meanwhile
`ready` is False and `error` None. Once the budget is spent `error` is set and everything gets EngineClosed. A
cancel or release for the old process's work reaches the new one, which ignores what it does not know.

This module imports no torch and no tokenizer: the engine is imported in
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
from .request import DecodeRequest, DecodeResult, EngineClosed, EngineCrashed
from .restart_budget import RestartBudget

if typing.TYPE_CHECKING:
    from .engine import AsyncEngine, Engine

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often the engine process reports its stats (what /metrics shows)


class EngineProcess:
    model_name: str

    def __init__(self, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                 log_setup: typing.Callable[[], None] | None = None, max_restarts: int = 3,
                 restart_window_s: float = 300.0):
        """Spawn the engine process and wait until it has loaded the model and captured its graphs (minutes on a
        large model: the server calls this in a worker thread). RuntimeError if it could not.

        log_setup: run first in the engine process to configure its logging (picklable: a module-level function or
        a functools.partial of one); None: text lines at this process's log level.
        max_restarts, restart_window_s: an engine process that dies is replaced, at most `max_restarts` times in
        any `restart_window_s` seconds (0: never); past that the engine has failed (`error` is set)."""
        self.options = options
        self.model_name = display_name(model)
        self._spawn_args = (model, device, dtype, options,
                            log_setup or functools.partial(_text_logs, log.getEffectiveLevel()))
        self._budget = RestartBudget(max_restarts, restart_window_s)
        self._child: _Child | None = _Child.start(*self._spawn_args)  # None while it restarts
        self._child.wait_ready()
        self._starting: _Child | None = None  # a replacement still loading (close() terminates it)
        self._lock = threading.Lock()  # the child's replacement against the sender and the waiters
        self._child_changed = threading.Condition(self._lock)
        self._started = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._pending: dict[int, _Waiter] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # sent by a thread: a 2 MB clip never blocks the loop;
        # what waits here while the child restarts goes to the next one
        self._stats: dict = {}
        self._restarts = 0
        self._closing = False
        self._over = False  # no child will come any more (closed or failed): waiters get EngineClosed
        self._threads = [threading.Thread(target=self._send_loop, name="qasr-engine-send", daemon=True),
                         threading.Thread(target=self._supervise, name="qasr-engine-receive", daemon=True)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                        log_setup: typing.Callable[[], None] | None = None):
        return cls(model, device=device, dtype=dtype, options=options, log_setup=log_setup)

    @property
    def pid(self) -> int | None:
        """The engine process's (a restarted one has a new pid); None while it restarts or once it failed."""
        child = self._child
        return child.process.pid if child is not None else None

    @property
    def ready(self) -> bool:
        """False while the engine process restarts, as well as before start() and after close() or a failure."""
        return self._started and self._child is not None and not self._closing and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Set once the engine is down for good (its restart budget is spent, or it could not be restarted); None
        while it restarts."""
        return self._error

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        """Work still pending gets EngineClosed; returns once the process has exited."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._outbox.put(("close",))
                self._outbox.put(None)
                if self._starting is not None:  # a replacement still loading: it takes SIGTERM until loaded
                    self._starting.process.terminate()
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        supervisor = self._threads[1]
        supervisor.join(30)
        if supervisor.is_alive():  # stuck (a hung device call): do not keep the server from exiting
            log.error("the engine process did not exit in 30 s: killing it")
            for child in (self._child, self._starting):
                if child is not None:
                    child.process.kill()
            supervisor.join()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5)

    async def transcribe(self, request: DecodeRequest) -> DecodeResult:
        return await self._ask(lambda request_id: ("add", request_id, request), cancel=True)

    def release_stream(self, stream_id: str) -> None:
        self._outbox.put(("release", stream_id))

    async def check_context(self, context: str, *, language: str | None = None, max_audio_seconds: float) -> None:
        while True:
            try:
                return await self._ask(lambda request_id: ("check", request_id, context, language, max_audio_seconds))
            except EngineCrashed:  # the process died under the question: ask its replacement (the budget bounds it)
                continue

    async def _ask(self, message, *, cancel: bool = False):
        """Send message(request_id) and await the process's ("done", request_id, answer); `cancel`: a cancelled
        wait cancels the work in the process too. EngineCrashed if the process dies holding it."""
        loop = asyncio.get_running_loop()
        request_id = next(self._ids)
        waiter = _Waiter(loop, loop.create_future())
        with self._lock:
            if self._closing or self._over:
                raise EngineClosed("the engine is not running")
            self._pending[request_id] = waiter
        self._outbox.put(message(request_id))
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if cancel and waiter.sent_to is not None:
                self._outbox.put(("cancel", request_id))
            raise
        finally:
            with self._lock:
                self._pending.pop(request_id, None)

    def stats(self) -> dict:
        """The engine process's stats (empty while it restarts) and `restarts`: engine processes replaced so far."""
        return dict(self._stats) | {"restarts": self._restarts}

    # -- the server's two threads ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            self._send(message)

    def _send(self, message) -> None:
        """To the engine process; while it restarts, wait for the replacement (nothing unsent is lost)."""
        asks = message[0] in ("add", "check")
        with self._lock:
            while self._child is None and not self._over:
                self._child_changed.wait()
            child = self._child
            waiter = self._pending.get(message[1]) if asks else None
            if child is None or (asks and waiter is None):  # no engine any more, or the asker gave up meanwhile
                return
            if waiter is not None:
                waiter.sent_to = child  # from here its fate is the child's
        try:
            send(child.conn, message)
        except (OSError, ValueError):  # it died: wait until the supervisor has seen it, so that what comes next
            with self._lock:  # waits for the replacement instead of failing against the dead pipe too
                while self._child is child and not self._over:
                    self._child_changed.wait()

    def _supervise(self) -> None:
        """Receive the child's answers; when it dies, fail what it held and start another (within the budget)."""
        child = self._child
        while child is not None:
            failure = self._receive_from(child)
            child.process.join(5)
            child.conn.close()
            with self._lock:
                if not self._closing:  # closed: it stays as the last engine process (its pid, its exit code)
                    self._child = None
                self._stats = {}
                held = [waiter for waiter in self._pending.values() if waiter.sent_to is child]
                self._child_changed.notify_all()
            if self._closing:
                break
            cause = failure or f"exit code {child.process.exitcode}"
            log.error("the engine process died (%s) holding %d requests", cause, len(held))
            for waiter in held:
                waiter.settle(EngineCrashed(f"the engine process died under this request ({cause})"))
            if not self._budget.take():
                self._error = EngineClosed(
                    f"the engine process died ({cause}) and its restart budget ({self._budget.max_restarts} in "
                    f"{self._budget.window_s:g} s) is spent: not restarting it")
                log.error("%s", self._error)
                break
            child = self._restart()
        with self._lock:
            self._over = True
            self._child_changed.notify_all()
            waiters = list(self._pending.values())
        closed = self._error or EngineClosed("the engine was closed")
        for waiter in waiters:
            waiter.settle(closed)
        self._outbox.put(None)  # ends the sender

    def _receive_from(self, child: _Child) -> str | None:
        """Until the child's pipe closes -> what it said of its failure, if it said anything."""
        failure = None
        while True:
            try:
                message = receive(child.conn)
            except (EOFError, OSError):
                return failure
            if message[0] == "done":
                waiter = self._pending.get(message[1])
                if waiter is not None:
                    answer = message[2]
                    if isinstance(answer, EngineClosed) and not self._closing:  # its loop died: so did the process
                        answer = EngineCrashed(str(answer))
                    waiter.settle(answer)
            elif message[0] == "stats":
                self._stats = message[1]
            elif message[0] == "failed":  # the engine loop died (a device error): the process exits next
                failure = f"engine failed: {message[1]}"
                log.error("%s", failure)

    def _restart(self) -> _Child | None:
        """A new engine process once it has loaded; None if closing meanwhile, or if it cannot load (error set)."""
        log.warning("restarting the engine process (at most %d restarts in %g s)", self._budget.max_restarts,
                    self._budget.window_s)
        child = _Child.start(*self._spawn_args)
        with self._lock:
            self._starting = child
            if self._closing:
                child.process.terminate()
        try:
            child.wait_ready()
        except RuntimeError as error:
            if not self._closing:
                self._error = EngineClosed(f"the engine process could not be restarted: {error}")
                log.error("%s", self._error)
            return None
        finally:
            with self._lock:
                self._starting = None
        with self._lock:  # even when closing: the sender delivers "close" to it
            self._child = child
            self._restarts += 1
            self._child_changed.notify_all()
        log.warning("the engine process is back (pid %d, restart %d)", child.process.pid, self._restarts)
        return child


class _Waiter:
    """One question to the engine process: who awaits the answer, and which process it was sent to (None: unsent)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop, self.future = loop, future
        self.sent_to: _Child | None = None

    def settle(self, answer) -> None:
        try:
            self.loop.call_soon_threadsafe(settle, self.future, answer)
        except RuntimeError:  # its event loop is closed: nobody awaits it any more
            pass


class _Child:
    """One engine process and the server's end of its pipe."""

    def __init__(self, process, conn, model: str):
        self.process, self.conn, self.model = process, conn, model

    @classmethod
    def start(cls, model: str, device, dtype, options: EngineOptions, log_setup) -> _Child:
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        process = context.Process(target=_engine_main, name="qasr-engine", daemon=True,
                                  args=(child_end, model, device, dtype, options, log_setup))
        process.start()
        child_end.close()
        return cls(process, conn, model)

    def wait_ready(self) -> None:
        """Until it has loaded the model; RuntimeError (and its pipe closed) if it could not."""
        try:
            message = receive(self.conn)
        except (EOFError, OSError):
            self.process.join(5)
            message = ("failed", f"the engine process exited with code {self.process.exitcode}")
        if message[0] != "ready":
            self.process.join(5)
            self.conn.close()
            raise RuntimeError(f"the engine process could not load {self.model}: {message[1]}")


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
