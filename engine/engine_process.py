"""The engine in a process of its own, so that its Python never waits on the event loop's GIL.

Inside the server process the engine thread and the event loop share one interpreter. Every torch call releases and
retakes the GIL, and retaking it while the event loop holds it can wait a whole switch interval (5 ms): at 300
streams on an H200 the engine spent 74% of its time admitting work the GPU did in a fraction of that, while the
GPU idled (docs/benchmarks.md). In its own process the engine thread has an interpreter to itself.

`EngineProcess` implements the engine's face (qasr.engine.face.SpeechEngine), so the server does not know which
engine it drives. The server process holds no tokenizer: even `check_context` is answered by the engine process.
Pickled messages over one pipe (qasr.engine.engine_client lists them; `RemoteEngine` there is the half of this face
that sends and receives). With `listen`, the process also serves front-end workers' `EngineClient`s on a Unix socket
(`qasr-server --workers N`): each connection has its own request ids and gets its own replies, and the stats go to
all; the owner stays the one that stops it and restarts it.

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
import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import typing
import weakref

from .engine_client import EngineHealth, RemoteEngine, receive, send, shut_down
from .gc_pauses import LONG_PAUSE_S, GcPauses, freeze_loaded_heap, thaw
from .gpu_timeline import EngineProfiler
from .options import EngineOptions, display_name
from .request import EngineClosed
from .restart_budget import RestartBudget

if typing.TYPE_CHECKING:
    from .engine import AsyncEngine, Engine

log = logging.getLogger(__name__)

ENGINE_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval in the engine process (the default is 5 ms)
STATS_INTERVAL_S = 0.25  # how often the engine process reports its stats (what /metrics shows)


class EngineProcess(RemoteEngine):
    def __init__(self, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                 log_setup: typing.Callable[[], None] | None = None, max_restarts: int = 3,
                 restart_window_s: float = 300.0, listen: tuple[str, bytes] | None = None,
                 health: EngineHealth | None = None):
        """Spawn the engine process and wait until it has loaded the model and captured its graphs (minutes on a
        large model: the server calls this in a worker thread). RuntimeError if it could not.

        log_setup: run first in the engine process to configure its logging (picklable: a module-level function or
        a functools.partial of one); None: text lines at this process's log level.
        max_restarts, restart_window_s: an engine process that dies is replaced, at most `max_restarts` times in
        any `restart_window_s` seconds (0: never); past that the engine has failed (`error` is set).
        listen: (Unix socket path, authkey): the process also serves `EngineClient`s there (front-end workers).
        health: where its state is published for them (qasr.engine.engine_client.EngineHealth)."""
        self.options = options
        self.health = health or EngineHealth()
        self.health.state = EngineHealth.LOADING
        self._spawn_args = (model, device, dtype, options,
                            log_setup or functools.partial(_text_logs, log.getEffectiveLevel()), listen)
        self._budget = RestartBudget(max_restarts, restart_window_s)
        child = _Child.start(*self._spawn_args)
        try:
            child.wait_ready()
        except RuntimeError:
            self.health.state = EngineHealth.FAILED
            raise
        self._starting: _Child | None = None  # a replacement still loading (close() terminates it)
        self._restarts = 0
        self._begin(child, display_name(model))
        self.health.state = EngineHealth.READY

    @classmethod
    def from_pretrained(cls, model: str, *, device=None, dtype=None, options: EngineOptions = EngineOptions(),
                        log_setup: typing.Callable[[], None] | None = None, **serving):
        """serving: max_restarts, restart_window_s, listen, health (see __init__)."""
        return cls(model, device=device, dtype=dtype, options=options, log_setup=log_setup, **serving)

    @property
    def pid(self) -> int | None:
        """The engine process's (a restarted one has a new pid); None while it restarts or once it failed."""
        child = self._link
        return child.process.pid if child is not None else None

    async def close(self) -> None:
        """Work still pending gets EngineClosed; returns once the process has exited."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._outbox.put(("close",))
                self._outbox.put(None)
                if self._starting is not None:  # a replacement still loading: it takes SIGTERM until loaded
                    self._starting.process.terminate()
        await asyncio.to_thread(self._join_process)
        if self.health.state != EngineHealth.FAILED:
            self.health.state = EngineHealth.CLOSED

    def _join_process(self) -> None:
        if not self._join(30):  # stuck (a hung device call): do not keep the server from exiting
            log.error("the engine process did not exit in 30 s: killing it")
            for child in (self._link, self._starting):
                if child is not None:
                    child.process.kill()
            self._join(None)

    def stats(self) -> dict:
        """The engine process's stats (empty while it restarts) and `restarts`: engine processes replaced so far."""
        return dict(self._stats) | {"restarts": self._restarts}

    # -- RemoteEngine: a dead process is replaced --------------------------------------------------------------

    def _lost(self, child: _Child, failure: str | None) -> str:
        child.process.join(5)
        child.conn.close()
        if not self._closing:
            self.health.state = EngineHealth.RESTARTING
        return failure or f"exit code {child.process.exitcode}"

    def _replace(self, child: _Child, cause: str) -> _Child | None:
        if not self._budget.take():
            self._fail(f"the engine process died ({cause}) and its restart budget ({self._budget.max_restarts} in "
                       f"{self._budget.window_s:g} s) is spent: not restarting it")
            return None
        return self._restart()

    def _fail(self, message: str) -> None:
        self._error = EngineClosed(message)
        self.health.state = EngineHealth.FAILED
        log.error("%s", message)

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
                self._fail(f"the engine process could not be restarted: {error}")
            return None
        finally:
            with self._lock:
                self._starting = None
        self._restarts += 1
        self.health.restarts = self._restarts
        if not self._closing:
            self.health.state = EngineHealth.READY
        log.warning("the engine process is back (pid %d, restart %d)", child.process.pid, self._restarts)
        return child


class _Child:
    """One engine process and the owner's end of its pipe."""

    def __init__(self, process, conn, model: str):
        self.process, self.conn, self.model = process, conn, model

    @classmethod
    def start(cls, model: str, device, dtype, options: EngineOptions, log_setup, listen) -> _Child:
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        process = context.Process(target=_engine_main, name="qasr-engine", daemon=True,
                                  args=(child_end, model, device, dtype, options, log_setup, listen))
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


# -- the engine process ------------------------------------------------------------------------------------------

def _text_logs(level: int) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def only_this_gpu(device):
    """An engine process for "cuda:N" sees only that GPU, as cuda:0 (CUDA_VISIBLE_DEVICES, set before torch loads).

    CUDA's current device is per thread and Triton launches on it: with every GPU visible, the engine loop's thread
    (and any other) would launch on GPU 0 whatever device the model is on (seen on a two-GPU H200 host: "Pointer
    argument cannot be accessed from Triton"). N counts among the GPUs this process was allowed to see."""
    if not isinstance(device, str) or not device.startswith("cuda:"):
        return device
    index = int(device.split(":", 1)[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")] if visible else None
    if ids is not None and index >= len(ids):
        raise ValueError(f"{device}: only {len(ids)} GPUs are visible (CUDA_VISIBLE_DEVICES={visible})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index] if ids is not None else str(index)
    return "cuda:0"


def cpu_threads(device: str, cores: int | None = None) -> int | None:
    """Torch threads for an engine process on the CPU: every usable core but one, which the front end (the server's
    event loop or its workers) keeps; None (torch's default) on a GPU or when OMP_NUM_THREADS says how many.

    By default torch takes every core, and its OpenMP threads wait for each other at the end of every op: on a machine
    whose other core runs the event loop, a decode step of the tiny model took 289 ms on two threads and 27 ms on one
    (the soak on two cores, docs/reliability.md)."""
    if device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores - 1)


def _engine_main(conn, model: str, device, dtype, options: EngineOptions, log_setup,
                 listen: tuple[str, bytes] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    log_setup()
    try:
        device = only_this_gpu(device)  # before torch is imported
        from .engine import AsyncEngine, Engine  # here, not at the top: the server process never imports torch

        import torch

        auto = "cuda" if torch.cuda.is_available() else "cpu"
        threads = cpu_threads(auto if device in (None, "auto") else str(device).split(":")[0])
        if threads is not None:
            torch.set_num_threads(threads)
            log.info("engine on the CPU: %d torch threads (a core left to the front end; OMP_NUM_THREADS overrides)",
                     threads)

        core = Engine.from_pretrained(model, device=device, dtype=dtype, options=options)
        engine = AsyncEngine(core)
        profiler = EngineProfiler.from_env(core.runner.device.type)  # $QASR_ENGINE_PROFILE (gpu_timeline.py)
        if profiler is not None:
            engine.after_step = profiler.after_step
        freeze_loaded_heap()  # a full collection would walk the loaded engine: 204 ms on the H200
    except BaseException as e:
        log.exception("cannot load %s", model)
        send(conn, ("failed", f"{type(e).__name__}: {e}"))
        return
    # The engine thread gives up the GIL at every device wait; with the request readers busy unpickling, the default
    # 5 ms switch interval can hold it off that long each time (a 0.5 ms wait cost 9 ms beside one busy thread, 1.6 ms
    # at 0.5 ms: measured on the CPU, #17). A shorter interval gives it back sooner.
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    # Only now: a server stopped while this process loads exits at once, and Python's exit terminates its daemon
    # processes (SIGTERM) and waits for them; once serving, only the server's "close" ends it (after the drain).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    owner = _Peer(conn, owner=True)
    peers = _Peers(owner)
    owner.reply(("ready", engine.model_name))
    requests = threading.Thread(target=_serve_requests, args=(owner, core, engine, peers),
                                name="qasr-engine-requests", daemon=True)
    requests.start()
    acceptor = _Acceptor(*listen, core, engine, peers) if listen is not None else None
    stats = threading.Thread(target=_report_stats, args=(engine, peers), name="qasr-engine-stats", daemon=True)
    stats.start()
    pauses = GcPauses.watch()
    engine.run()  # returns once "close" arrives (or the owner vanished), after failing what was left
    pauses.stop()
    if profiler is not None:
        profiler.close()  # a window still open: what it saw so far
    thaw()
    (log.warning if pauses.longest_pause >= LONG_PAUSE_S else log.info)(
        "garbage collection in the engine process while it served: %s", pauses.summary())
    if acceptor is not None:
        acceptor.stop()  # no new worker connections; removes the socket file
    peers.broadcast(("stats", _stats(engine)))
    if engine.error is not None:
        peers.broadcast(("failed", f"{type(engine.error).__name__}: {engine.error}"))
    # These threads hold the engine. Joined, so that none drops the last reference during the interpreter's exit: it
    # would free the model's tensors there, torch releases the GIL to do it, and a daemon thread retaking the GIL after
    # finalization began is ended by pthread_exit, whose unwinding through torch's C++ aborts ("terminate called
    # without an active exception"). The workers' readers wait on their sockets: shut down to wake them. The owner's
    # reader ended the loop itself unless the loop failed; then it may still wait on the pipe (holding, not freeing,
    # the engine).
    peers.disconnect_workers()
    stats.join()
    if engine.error is None:
        requests.join()


class _Peer:
    """One connection the engine process serves: its owner's pipe, or a front-end worker's socket (its own request
    ids; its replies go to it alone)."""

    def __init__(self, conn, *, owner: bool):
        self.conn, self.owner = conn, owner
        self._sending = threading.Lock()

    def reply(self, message) -> None:
        with self._sending:
            try:
                send(self.conn, message)
            except (OSError, ValueError):  # it is gone; its reader stops
                pass


class _Peers:
    """Everyone the stats and a failure go to, and the workers' reader threads (joined before the process exits)."""

    JOIN_TIMEOUT_S = 10.0  # a reader wakes at once from its socket's shutdown; past this it is left (and logged)

    def __init__(self, owner: _Peer):
        self._lock = threading.Lock()
        self._peers = {owner}
        self._readers: list[tuple[_Peer, threading.Thread]] = []

    def add(self, peer: _Peer, reader: threading.Thread) -> None:
        with self._lock:
            self._peers.add(peer)
            self._readers.append((peer, reader))
            self._readers = [(p, thread) for p, thread in self._readers if thread.is_alive() or thread is reader]

    def disconnect_workers(self) -> None:
        """Shut down every worker's connection (its reader wakes from receive and ends) and join the readers."""
        with self._lock:
            readers = list(self._readers)
        for peer, _ in readers:
            shut_down(peer.conn)
        for _, reader in readers:
            reader.join(self.JOIN_TIMEOUT_S)
            if reader.is_alive():
                log.error("a worker connection's reader did not end in %g s", self.JOIN_TIMEOUT_S)

    def remove(self, peer: _Peer) -> None:
        with self._lock:
            self._peers.discard(peer)

    def broadcast(self, message) -> None:
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.reply(message)


def _listen(address: str, authkey: bytes):
    """The workers' socket; a file left by a killed predecessor is replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    return multiprocessing.connection.Listener(address, family="AF_UNIX", backlog=64, authkey=authkey)


class _Acceptor:
    """The workers' socket and the thread accepting on it. Closing a listener does not wake a thread blocked in its
    accept(), so `stop()` wakes it with a connection of its own, joins it, then closes the listener."""

    def __init__(self, address: str, authkey: bytes, core: Engine, engine: AsyncEngine, peers: _Peers):
        self.address = address
        self._listener = _listen(address, authkey)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, args=(core, engine, peers), name="qasr-engine-accept",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:  # closed at once: its handshake fails
                wake.connect(self.address)
        except OSError:  # not listening any more
            pass
        self._thread.join(10)
        if self._thread.is_alive():
            log.error("the engine process's accept thread did not stop")
        self._listener.close()  # removes the socket file

    def _accept(self, core: Engine, engine: AsyncEngine, peers: _Peers) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._listener.accept()
            except multiprocessing.AuthenticationError:
                if not self._stopping.is_set():
                    log.warning("refused a connection to the engine process: wrong authkey")
                continue
            except (OSError, EOFError):  # the connection dropped during the handshake (stop()'s does)
                continue
            if self._stopping.is_set():
                conn.close()
                return
            peer = _Peer(conn, owner=False)
            peer.reply(("ready", engine.model_name))
            reader = threading.Thread(target=_serve_requests, args=(peer, core, engine, peers),
                                      name="qasr-engine-client", daemon=True)
            peers.add(peer, reader)
            reader.start()


def _serve_requests(peer: _Peer, core: Engine, engine: AsyncEngine, peers: _Peers) -> None:
    """One peer's messages. core: the synchronous engine that `engine` (its loop, on the main thread) steps;
    `check_context` needs only its tokenizer, so it is answered here, beside the loop. The owner's pipe closing
    stops the engine; a worker's closing cancels what it still had running."""
    running = weakref.WeakValueDictionary()  # this peer's request id -> Sequence, until the engine lets go of it
    while True:
        try:
            message = receive(peer.conn)
        except (EOFError, OSError):
            if not peer.owner:
                peers.remove(peer)
                _cancel(running.values(), engine)
                peer.conn.close()
                return
            message = ("close",)
        kind = message[0]
        if kind == "add":
            request_id = message[1]
            running[request_id] = engine.submit(
                message[2], lambda result, i=request_id: peer.reply(("done", i, _portable(result))))
        elif kind == "check":
            request_id, context, language, max_audio_seconds = message[1:]
            try:
                core.check_context(context, language=language, max_audio_seconds=max_audio_seconds)
                answer = None
            except ValueError as error:
                answer = error
            peer.reply(("done", request_id, _portable(answer)))
        elif kind == "cancel":
            _cancel([running.get(message[1])], engine)
        elif kind == "release":
            engine.release_stream(message[1])
        elif kind == "close" and peer.owner:
            engine.stop()
            return


def _cancel(sequences, engine: AsyncEngine) -> None:
    """Mark these sequences cancelled (None: already let go of) and wake the engine loop to drop them."""
    sequences = [seq for seq in list(sequences) if seq is not None]
    for seq in sequences:
        seq.cancelled = True
    if sequences:
        engine.wake()


def _portable(answer):
    """A ValueError subclass of the model's (e.g. UnsupportedLanguageError) as a plain ValueError: unpickling it would
    import the model's modules (and the tokenizer) into the server process."""
    if isinstance(answer, ValueError) and type(answer) is not ValueError:
        return ValueError(str(answer))
    return answer


def _report_stats(engine: AsyncEngine, peers: _Peers) -> None:
    while not engine.stopped:
        peers.broadcast(("stats", _stats(engine)))
        time.sleep(STATS_INTERVAL_S)


def _stats(engine: AsyncEngine) -> dict:
    return engine.stats() | {"process_cpu_seconds": time.process_time()}
