"""`qasr-server --workers N`: a supervisor process, an engine process per device and N front-end workers on one port.

One asyncio process runs out of event loop before the engine runs out of GPU (issue #15: at 800-1000 streams on an
H200 the loop ran 114-125 ms late while the engine idled a third of the time). So the supervisor (this module, the
process `qasr-server` was started as) starts:

- an engine process per device of `--devices` (`EngineProcess` with `listen`, each on a Unix socket of its own): it
  owns each through its pipe, restarts each when it dies (each its own restart budget) and publishes each one's state
  in an `EngineHealth` cell of its own;
- N workers, each today's server (`cli.serve`: WebSockets, adapters, auth, sessions, VAD, /healthz, /metrics) bound
  to the same port with SO_REUSEPORT (the kernel spreads new connections over them) and feeding every engine over a
  connection of its own (an `EngineClient` per engine, pooled in an `EnginePool`). Placement is per worker: a worker
  puts each new stream on the engine with the fewest of its own streams, ties broken by the work each engine reports
  (its stats reach every worker). A worker whose connection to an engine drops (that engine died) fails what it had
  sent there with EngineCrashed (a `decode_failed` empty final; the stream goes on) and connects again once the
  supervisor has that engine back.

The supervisor binds the port first (SO_REUSEPORT, never listening: it resolves `--port 0` and keeps the port while
a worker restarts), sets `PROMETHEUS_MULTIPROC_DIR` to a private folder (metrics.py: /metrics from any worker sums
them all) and `QASR_TOKEN_SECRET` when unset (a token one worker issued is good at every worker), then:

- a worker that dies is restarted (at most 3 times in 5 minutes; past that the replica has failed: /healthz 500);
- SIGTERM or SIGINT: every worker drains as one server does (new streams refused, open ones get their finals, 1001),
  then the engine process is closed, the private folder removed, exit 0;
- the engine cannot be loaded at start, or a worker cannot start (e.g. --max-len too small for --max-segment-s): the
  workers are stopped, exit 1.

Health, the same from whichever worker answers (`ReplicaHealth`, shared memory each worker writes every 100 ms):
/readyz is 200 only when every worker can take a stream (it is up, one of its engine connections is up, it is not
stopping) and an engine is ready (a degraded pool serves, as one server's does); /healthz is 500 once every engine has
failed for good or a worker could not be kept up.
Limits (--max-sessions, per-address and per-key limits) are counted per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from qasr.engine.engine_client import EngineClient, EngineHealth
from qasr.engine.pool import EnginePool, LoadPolicy
from qasr.engine.restart_budget import RestartBudget

log = logging.getLogger("qasr.server")

WORKER_RESTARTS = (3, 300.0)  # a worker that dies is replaced at most 3 times in 300 s
STOP_GRACE_S = 15.0  # past the drain timeout, how long a worker may take to exit before it is killed
TOKEN_SECRET_ENV = "QASR_TOKEN_SECRET"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


class WorkerFailed(Exception):
    """A front-end worker kept dying and is not restarted any more (/healthz 500)."""


class ReplicaHealth:
    """What every process of the replica knows of the others, in shared memory: each worker's readiness (its own
    slot, written by it every 100 ms and cleared by the supervisor when it dies), whether a worker could not be kept
    up, and each engine's `EngineHealth` (one per device). Created before the workers are spawned and handed to them."""

    def __init__(self, num_workers: int, engines: list[EngineHealth]):
        context = multiprocessing.get_context("spawn")
        self._ready = context.RawArray("b", num_workers)
        self._failed = context.RawValue("b", 0)
        self.engines = engines

    @property
    def num_workers(self) -> int:
        return len(self._ready)

    def set_ready(self, worker: int, ready: bool) -> None:
        self._ready[worker] = int(ready)

    def is_ready(self, worker: int) -> bool:
        return bool(self._ready[worker])

    def num_ready(self) -> int:
        return sum(self._ready)

    def fail(self) -> None:
        self._failed.value = 1

    def ready(self) -> bool:
        """Every worker can take a stream and an engine is ready (a degraded pool serves on the others)."""
        return self.num_ready() == self.num_workers and any(e.state == EngineHealth.READY for e in self.engines)

    def error(self) -> BaseException | None:
        if self._failed.value:
            return WorkerFailed("a front-end worker kept dying and was not restarted")
        if all(engine.state == EngineHealth.FAILED for engine in self.engines):
            return EngineFailed("every engine process failed and is not restarted any more")
        return None

    def for_worker(self, worker: int) -> ReplicaView:
        return ReplicaView(self, worker)


class EngineFailed(Exception):
    """Every engine process failed for good (its restart budget is spent, or it could not be restarted)."""


@dataclasses.dataclass(frozen=True)
class EngineSocket:
    """Where a worker finds one engine process: its socket and its health cell (handed to the spawned workers)."""

    address: str
    health: EngineHealth


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """One worker's side of ReplicaHealth: what QasrServer(replica=...) uses."""

    health: ReplicaHealth
    worker: int

    def publish(self, ready: bool) -> None:
        self.health.set_ready(self.worker, ready)

    def ready(self) -> bool:
        return self.health.ready()

    def error(self) -> BaseException | None:
        return self.health.error()


# -- the supervisor -------------------------------------------------------------------------------------------------

def supervise(args: argparse.Namespace, argv: list[str], config) -> int:
    """Run the replica until SIGTERM/SIGINT (0), or until an engine cannot be loaded or the port bound (1)."""
    from qasr.server import engine_load

    devices = engine_load.engine_devices(args.device, args.devices)  # checked by cli.build_config already
    folder = tempfile.mkdtemp(prefix="qasr-workers-")  # 0700: the engine sockets, the metrics files
    try:
        return _Supervisor(args, argv, config, folder, devices).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Supervisor:
    def __init__(self, args: argparse.Namespace, argv: list[str], config, folder: str, devices: list[str | None]):
        self.args, self.argv, self.config, self.folder, self.devices = args, argv, config, folder, devices
        self.num_workers = args.workers
        self.sockets = [EngineSocket(os.path.join(folder, f"engine-{i}.sock"), EngineHealth())
                        for i in range(len(devices))]
        self.health = ReplicaHealth(self.num_workers, [engine.health for engine in self.sockets])
        self.authkey = secrets.token_bytes(32)
        self.metrics_dir = os.path.join(folder, "metrics")
        self.stopping = threading.Event()
        self.workers: list[multiprocessing.Process | None] = [None] * self.num_workers
        self.budget = RestartBudget(*WORKER_RESTARTS)
        self.engines: list = []  # the EngineProcesses, in device order, once every one has loaded
        self.engine_failed: BaseException | None = None
        self.served = [False] * self.num_workers  # each worker has been ready once (a later death is a crash)
        self.port: int | None = None

    def run(self) -> int:
        try:
            reserved = _reserve_port(self.config.host, self.config.port)
        except OSError as error:
            from qasr.server.cli import _bind_problem

            log.error("cannot listen on %s:%d: %s", self.config.host, self.config.port, _bind_problem(error))
            return 1
        with reserved:
            self.port = reserved.getsockname()[1]
            os.mkdir(self.metrics_dir)
            os.environ[METRICS_ENV] = self.metrics_dir  # the workers inherit it (spawned: a fresh import of the library)
            os.environ.setdefault(TOKEN_SECRET_ENV, secrets.token_hex(32))
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: self.stopping.set())
            loading = threading.Thread(target=self._load_engines, name="qasr-load-engines", daemon=True)
            loading.start()
            for worker in range(self.num_workers):
                self._start_worker(worker)
            log.info("supervising %d front-end workers on port %d, %d engine processes", self.num_workers, self.port,
                     len(self.sockets))
            code = self._watch(loading)
            self._stop_workers()
            asyncio.run(_close_all(self.engines))
            return code

    def _load_engines(self) -> None:
        """One engine process per device, loading at once; if one cannot load, the others are closed."""
        from qasr.server.cli import engine_factory

        loaded: list = [None] * len(self.devices)
        failures: list[tuple[str | None, BaseException]] = []

        def load(i: int) -> None:
            build = engine_factory(self.args, listen=(self.sockets[i].address, self.authkey),
                                   health=self.sockets[i].health)
            try:
                loaded[i] = build() if self.devices[i] is None else build(device=self.devices[i])
            except Exception as error:  # reported below, once every load has ended
                failures.append((self.devices[i], error))

        threads = [threading.Thread(target=load, args=(i,), name=f"qasr-load-engine-{i}", daemon=True)
                   for i in range(len(self.devices))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        engines = [engine for engine in loaded if engine is not None]
        if failures:
            for engine_socket in self.sockets:  # the workers' clients see FAILED and give up too
                engine_socket.health.state = EngineHealth.FAILED
            asyncio.run(_close_all(engines))
            device, error = failures[0]
            self.engine_failed = error if device is None else RuntimeError(f"the engine on {device}: {error}")
            return
        if self.stopping.is_set():  # stopped meanwhile: nobody will close them but us
            asyncio.run(_close_all(engines))
            return
        self.engines = engines

    def _start_worker(self, worker: int) -> None:
        context = multiprocessing.get_context("spawn")
        process = context.Process(target=_worker_main, name=f"qasr-worker-{worker}", daemon=True,
                                  args=(self.argv, worker, self.port, self.sockets, self.authkey, self.health,
                                        os.getpid()))
        process.start()
        self.workers[worker] = process

    def _watch(self, loading: threading.Thread) -> int:
        """Until SIGTERM/SIGINT (0) or an engine that cannot be loaded (1); restarts workers that die."""
        while not self.stopping.is_set():
            if self.engine_failed is not None:
                log.error("cannot load model %s: %s", self.args.model, self.engine_failed)
                return 1
            sentinels = {process.sentinel: worker for worker, process in enumerate(self.workers)
                         if process is not None}
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.2):
                worker = sentinels[sentinel]
                if not self.served[worker] and self.workers[worker].exitcode == 1:  # as one server would: exit 1
                    log.error("front-end worker %d could not start (its log says why): stopping", worker)
                    return 1
                if not self.stopping.is_set():
                    self._worker_died(worker)
            self.served = [served or self.health.is_ready(worker) for worker, served in enumerate(self.served)]
        return 0

    def _worker_died(self, worker: int) -> None:
        from prometheus_client import multiprocess

        process = self.workers[worker]
        process.join()
        self.health.set_ready(worker, False)
        multiprocess.mark_process_dead(process.pid, self.metrics_dir)  # its live gauges (open streams) go
        if not self.budget.take():
            log.error("front-end worker %d died (exit code %s) and its restart budget (%d in %g s) is spent: not "
                      "restarting it", worker, process.exitcode, *WORKER_RESTARTS)
            self.workers[worker] = None
            self.health.fail()
            return
        log.warning("front-end worker %d died (exit code %s): restarting it", worker, process.exitcode)
        self._start_worker(worker)

    def _stop_workers(self) -> None:
        """SIGTERM to each: it drains as one server does; one still running past the drain timeout is killed."""
        alive = [process for process in self.workers if process is not None and process.is_alive()]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + self.config.limits.drain_timeout_s + STOP_GRACE_S
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("front-end worker %s did not stop within the drain timeout: killing it", process.name)
                process.kill()
                process.join()


async def _close_all(engines: list) -> None:
    await asyncio.gather(*(engine.close() for engine in engines))


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and never listening: the kernel hands connections only to
    listening sockets, so it takes none, but it fails as a taken port would and it holds the port (and resolves 0)
    for the workers, which bind beside it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    reserved = socket.socket(family, kind, proto)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind(address)
    except OSError:
        reserved.close()
        raise
    return reserved


# -- a worker -------------------------------------------------------------------------------------------------------

def _worker_main(argv: list[str], worker: int, port: int, sockets: list[EngineSocket], authkey: bytes,
                 health: ReplicaHealth, supervisor_pid: int) -> None:
    """Today's server, on the shared port, its engine a pool of connections to the supervisor's engine processes."""
    from qasr.server import cli, logs

    args = cli.build_parser().parse_args(argv)
    config = dataclasses.replace(cli.build_config(args, check_device=False), port=port, worker=worker)
    logs.configure(args.log_level, args.log_format)
    build = functools.partial(connect_pool, sockets, authkey, LoadPolicy(target_ms=args.admission_target_ms))
    sys.exit(_run(_serve_worker(args, config, build, health.for_worker(worker), supervisor_pid)))


def connect_pool(sockets: list[EngineSocket], authkey: bytes, policy: LoadPolicy) -> EnginePool:
    """A worker's engine: an EngineClient to every engine process (connecting at once: each waits while its engine
    loads), pooled. An engine that failed for good is left out (a worker restarted beside a degraded pool serves on the
    others); RuntimeError when none serves."""
    clients: list[EngineClient | None] = [None] * len(sockets)

    def connect(i: int) -> None:
        try:
            clients[i] = EngineClient.connect(sockets[i].address, authkey, sockets[i].health)
        except RuntimeError as error:  # that engine failed for good
            log.warning("engine %d is not serving: %s", i, error)

    threads = [threading.Thread(target=connect, args=(i,), name=f"qasr-connect-engine-{i}", daemon=True)
               for i in range(len(sockets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    connected = [client for client in clients if client is not None]
    if not connected:
        raise RuntimeError("no engine process is serving (every one failed)")
    return EnginePool(connected, policy)


async def _serve_worker(args, config, build, replica: ReplicaView, supervisor_pid: int) -> int:
    from qasr.server import cli

    orphaned = asyncio.create_task(_until_orphaned(supervisor_pid))
    try:
        return await cli.serve(args, config, build=build, replica=replica)
    finally:
        orphaned.cancel()


async def _until_orphaned(supervisor_pid: int) -> None:
    """A supervisor killed outright (SIGKILL) cannot stop its workers: they stop themselves (the drain)."""
    while os.getppid() == supervisor_pid:
        await asyncio.sleep(0.5)
    log.error("the supervisor is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def _run(coroutine) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
