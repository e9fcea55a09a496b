"""The engine's face over a connection to an engine process: `RemoteEngine` (what a pipe-fed face does, whoever
owns the process) and `EngineClient` (a front-end worker's connection to an engine process its supervisor owns).

`EngineProcess` (engine_process.py) owns its engine process through one pipe and restarts it when it dies. With
several front-end workers (`qasr-server --workers N`, issue #15) the engine process also listens on a Unix socket
(multiprocessing.connection, an authkey, a private folder) and every worker holds an `EngineClient`: its own
connection, its own request ids, replies on that connection only. Both faces share `RemoteEngine`: questions go out
by a sender thread (a 2 MB clip never blocks the event loop), answers come back on a receiver thread, and when the
connection drops what was sent over it fails with EngineCrashed (a stream gets an empty final for that segment and
goes on) while what was not sent yet waits for the next connection. `_replace()` says where the next connection
comes from: EngineProcess starts a new process (its restart budget), EngineClient connects again once the engine is
back. The engine process's lifecycle is published in an `EngineHealth` cell (shared memory) that the owner writes and
the workers read: a worker learns there that the engine failed for good (its `error`) or was restarted.

Messages, pickled (protocol 5, the audio out of band; `send` and `receive` frame them) over each connection:

    to the engine      ("add", id, DecodeRequest) | ("cancel", id) | ("release", stream_id)
                       | ("check", id, context, language, max_audio_seconds) | ("close",) (the owner only)
    from the engine    ("ready", model_name) | ("failed", message) | ("done", id, answer or exception)
                       | ("stats", dict)

Torch-free: the server's processes import this, never the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import socket
import struct
import threading
import time

import numpy as np

from .futures import settle
from .request import DecodeRequest, DecodeResult, EngineClosed, EngineCrashed

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 0.1  # how often a worker tries its engine process's socket while it is not there


# A message on the wire: PREFIX (the pickle's length, the number of out-of-band buffers), each buffer's length (8 bytes
# little-endian), the pickle, then the buffers' bytes, back to back. One writev sends it; the reader reads the prefix,
# then the lengths and the pickle, then each buffer straight into a numpy array of its own (bench/engine_ipc.py
# measures both ends against multiprocessing's framing, which this replaced).
PREFIX = struct.Struct("<II")
MAX_IOV = 1024  # buffers per writev (Linux's IOV_MAX)


def send(conn, message) -> None:
    """Pickle protocol 5 with the audio out of band: one writev takes the pickle and the array from its own memory (a
    partial carries its whole segment: no copy of it into a pickle or a message, and the GIL is released while the
    kernel copies it). Senders on one connection take turns (its users hold a lock, or send from one thread)."""
    buffers = []
    pickled = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    head = b"".join([PREFIX.pack(len(pickled), len(views)), *(view.nbytes.to_bytes(8, "little") for view in views),
                     pickled])
    _write_all(conn.fileno(), [head, *views])


def receive(conn):
    """The next message; EOFError when the connection ends (OSError if it ends within a message).

    Every read goes straight into its destination, the out-of-band buffers into numpy arrays that the unpickled
    arrays then view (writable, not copied again), with the GIL released for each read: not multiprocessing's Python
    loop of reads into a BytesIO and the copies out of it (a partial's 30 s of audio is 1.9 MB)."""
    fd = conn.fileno()
    prefix = memoryview(bytearray(PREFIX.size))
    done = os.readv(fd, [prefix])
    if done == 0:
        raise EOFError
    _fill(fd, prefix, done)
    pickled_size, count = PREFIX.unpack(prefix)
    head = memoryview(bytearray(8 * count + pickled_size))
    _fill(fd, head)
    buffers = [np.empty(int.from_bytes(head[8 * i:8 * i + 8], "little"), np.uint8) for i in range(count)]
    for buffer in buffers:
        _fill(fd, memoryview(buffer))
    return pickle.loads(head[8 * count:], buffers=buffers)


def _write_all(fd: int, views: list) -> None:
    views = [memoryview(view) for view in views]
    while views:
        written = os.writev(fd, views[:MAX_IOV])
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]


def _fill(fd: int, view: memoryview, done: int = 0) -> None:
    """Read view[done:] in full; OSError if the connection ends first. One plain read takes what has arrived (all of
    a small message); on a socket, what is still missing then comes in one read that the kernel returns only once it
    is all there (MSG_WAITALL), so that a large buffer costs two reads, not one per socket buffer's worth."""
    if done < view.nbytes:
        done += os.readv(fd, [view[done:]])  # 0 at the end of the connection: the next read says so
    if done == view.nbytes:
        return
    with _socket(fd) as sock:
        while done < view.nbytes:
            n = sock.recv_into(view[done:], 0, socket.MSG_WAITALL) if sock is not None else os.readv(fd, [view[done:]])
            if n == 0:
                raise OSError("the connection ended within a message")
            done += n


@contextlib.contextmanager
def _socket(fd: int):
    """A socket object over the connection's descriptor (for MSG_WAITALL), let go of without closing it; None if the
    descriptor is not a socket (a plain pipe) or would be made non-blocking (a default socket timeout is set)."""
    if socket.getdefaulttimeout() is not None:
        yield None
        return
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


class EngineHealth:
    """One engine process's state in shared memory: written by its owner (EngineProcess), read by every worker.
    Created before the workers are spawned and handed to them as a Process argument."""

    LOADING, READY, RESTARTING, FAILED, CLOSED = range(5)

    def __init__(self):
        self._cells = multiprocessing.get_context("spawn").RawArray("q", 2)  # [state, restarts]

    @property
    def state(self) -> int:
        return self._cells[0]

    @state.setter
    def state(self, value: int) -> None:
        self._cells[0] = value

    @property
    def restarts(self) -> int:
        return self._cells[1]

    @restarts.setter
    def restarts(self, value: int) -> None:
        self._cells[1] = value


class RemoteEngine:
    """The face (qasr.engine.face.SpeechEngine) over one connection to an engine process at a time.

    Subclasses give the first connection to `_begin(link, model_name)` (a link is anything with `.conn`) and
    implement `_replace(link, cause)`: the next link once the old one dropped, or None (then `self._error`, if set,
    is what everything waiting gets; EngineClosed otherwise)."""

    model_name: str

    def _begin(self, link, model_name: str) -> None:
        self.model_name = model_name
        self._link = link  # None while it is replaced
        self._lock = threading.Lock()  # the link's replacement against the sender and the waiters
        self._link_changed = threading.Condition(self._lock)
        self._started = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._pending: dict[int, _Waiter] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what waits here while the link is replaced goes
        # over the next one
        self._stats: dict = {}
        self._closing = False
        self._over = False  # no link will come any more (closed or failed): waiters get EngineClosed
        self._threads = [threading.Thread(target=self._send_loop, name="qasr-engine-send", daemon=True),
                         threading.Thread(target=self._receive_loop, name="qasr-engine-receive", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- the face --------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """False while the connection is replaced, as well as before start() and after close() or a failure."""
        return self._started and self._link is not None and not self._closing and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Set once the engine is down for good; None while it restarts."""
        return self._error

    async def start(self) -> None:
        self._started = True

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

    def stats(self) -> dict:
        return dict(self._stats)

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

    def _join(self, timeout_s: float = 30.0) -> bool:
        """Wait for the receiver to finish; False if it did not within `timeout_s`."""
        receiver = self._threads[1]
        receiver.join(timeout_s)
        if receiver.is_alive():
            return False
        self._threads[0].join(5)
        return True

    # -- the two threads -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            self._send(message)

    def _send(self, message) -> None:
        """Over the current link; while it is replaced, wait for the next one (nothing unsent is lost)."""
        asks = message[0] in ("add", "check")
        with self._lock:
            while self._link is None and not self._over:
                self._link_changed.wait()
            link = self._link
            waiter = self._pending.get(message[1]) if asks else None
            if link is None or (asks and waiter is None):  # no engine any more, or the asker gave up meanwhile
                return
            if waiter is not None:
                waiter.sent_to = link  # from here its fate is the link's
        try:
            send(link.conn, message)
        except (OSError, ValueError):  # it dropped: wait until the receiver has seen it, so that what comes next
            with self._lock:  # waits for the replacement instead of failing against the dead link too
                while self._link is link and not self._over:
                    self._link_changed.wait()

    def _receive_loop(self) -> None:
        """Receive the answers; when the link drops, fail what it held and get the next one."""
        link = self._link
        while link is not None:
            failure = self._receive_from(link)
            cause = self._lost(link, failure)
            with self._lock:
                if not self._closing:  # closed: it stays as the last link (an owner's child: its pid, exit code)
                    self._link = None
                self._stats = {}
                held = [waiter for waiter in self._pending.values() if waiter.sent_to is link]
                self._link_changed.notify_all()
            if self._closing:
                break
            log.error("the engine process died (%s) holding %d requests", cause, len(held))
            for waiter in held:
                waiter.settle(EngineCrashed(f"the engine process died under this request ({cause})"))
            link = self._replace(link, cause)
            if link is not None:
                with self._lock:  # even when closing: the sender delivers "close" to it
                    self._link = link
                    self._link_changed.notify_all()
        with self._lock:
            self._over = True
            self._link_changed.notify_all()
            waiters = list(self._pending.values())
        closed = self._error or EngineClosed("the engine was closed")
        for waiter in waiters:
            waiter.settle(closed)
        self._outbox.put(None)  # ends the sender

    def _receive_from(self, link) -> str | None:
        """Until the link closes -> what the engine said of its failure, if it said anything."""
        failure = None
        while True:
            try:
                message = receive(link.conn)
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

    def _lost(self, link, failure: str | None) -> str:
        """The link dropped: let go of it -> the cause, for the logs and the EngineCrashed messages."""
        link.conn.close()
        return failure or "connection lost"

    def _replace(self, link, cause: str):
        raise NotImplementedError


class EngineClient(RemoteEngine):
    """A front-end worker's face of an engine process that listens on `address` (its supervisor owns and restarts
    it). When the connection drops (the engine process died) what was sent fails with EngineCrashed and the client
    connects again once the process is back; once `health` says the engine failed for good, `error` is set."""

    def __init__(self, address: str, authkey: bytes, health: EngineHealth, *, timeout_s: float | None = None):
        """Connect (blocking: a worker calls this in a thread while the engine may still be loading); RuntimeError
        if the engine failed, or after `timeout_s` (None: wait as long as it loads)."""
        self.address, self._authkey, self.health = address, authkey, health
        link, model_name = self._connect(deadline=None if timeout_s is None else time.monotonic() + timeout_s)
        if link is None:
            raise RuntimeError(f"the engine process at {address} is not serving (it failed, or did not start in "
                               f"{timeout_s} s)")
        self._begin(link, model_name)

    @classmethod
    def connect(cls, address: str, authkey: bytes, health: EngineHealth) -> EngineClient:
        return cls(address, authkey, health)

    @property
    def error(self) -> BaseException | None:
        if self._error is None and self.health.state == EngineHealth.FAILED:
            self._error = EngineClosed("the engine process died and its supervisor does not restart it any more")
        return self._error

    async def close(self) -> None:
        """Disconnect (the engine goes on serving the other workers); work still pending gets EngineClosed."""
        link = None
        with self._lock:
            if not self._closing:
                self._closing = True
                link = self._link
                self._outbox.put(None)
                self._link_changed.notify_all()
        if link is not None:
            shut_down(link.conn)  # the receiver sees the end of it and stops
        await asyncio.to_thread(self._join, 10.0)

    def stats(self) -> dict:
        """The engine process's stats (empty while it restarts) and `restarts`, from the supervisor."""
        return dict(self._stats) | {"restarts": self.health.restarts}

    def _replace(self, link, cause: str):
        link, _ = self._connect(deadline=None)
        if link is None and not self._closing:
            self.error  # noqa: B018 -- sets it from the health cell
        return link

    def _connect(self, *, deadline: float | None) -> tuple[_Connection | None, str]:
        """A connection whose engine has said ready -> (link, model name); (None, "") once the engine failed for
        good, the client is closing, or past `deadline`."""
        while not getattr(self, "_closing", False) and self.health.state != EngineHealth.FAILED:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                conn = multiprocessing.connection.Client(self.address, family="AF_UNIX", authkey=self._authkey)
            except (OSError, EOFError):  # not listening (yet, or again)
                time.sleep(RECONNECT_INTERVAL_S)
                continue
            try:
                message = receive(conn)
            except (OSError, EOFError):  # it died right after accepting
                conn.close()
                continue
            if message[0] == "ready":
                return _Connection(conn), message[1]
            conn.close()
        return None, ""


def shut_down(conn) -> None:
    """End a socket connection that another thread is reading (closing its fd would not wake that thread)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class _Connection:
    """A worker's connection to the engine process."""

    def __init__(self, conn):
        self.conn = conn


class _Waiter:
    """One question to the engine process: who awaits the answer, and which link it was sent over (None: unsent)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop, self.future = loop, future
        self.sent_to = None

    def settle(self, answer) -> None:
        try:
            self.loop.call_soon_threadsafe(settle, self.future, answer)
        except RuntimeError:  # its event loop is closed: nobody awaits it any more
            pass
