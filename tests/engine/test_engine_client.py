"""The engine process's wire (qasr.engine.engine_client.send/receive): messages cross a socket and a plain pipe
unchanged, whatever pieces they arrive in, with the audio read into writable arrays; the end of a connection, before
or within a message; a default socket timeout does not make the connection non-blocking."""

import multiprocessing
import multiprocessing.connection
import os
import socket
import threading

import numpy as np
import pytest

from qasr.engine.engine_client import receive, send, shut_down
from qasr.engine.request import DecodeRequest, DecodeResult, Priority

RNG = np.random.default_rng(0)
AUDIO = RNG.normal(0, 0.1, 16000 * 30).astype(np.float32)  # a partial's longest segment: 1.9 MB, past any socket buffer
RESULT = DecodeResult(text="hello", language="English", raw_text="language English<asr_text>hello", token_ids=(1, 2),
                      finish_reason="eos", num_audio_tokens=13, timings={"queue_ms": 1.5})


def messages() -> list:
    read_only = AUDIO[:16000].copy()
    read_only.flags.writeable = False
    return [("add", 7, DecodeRequest(audio=AUDIO, priority=Priority.PARTIAL, stream_id="s/1", context="Names.")),
            ("done", 7, RESULT), ("cancel", 3), ("release", "s/1"), ("stats", {"running": 2, "counters": {"a": 1}}),
            ("done", 8, ValueError("audio too short")),
            ("two arrays", np.arange(10, dtype=np.int16), np.zeros(0, np.float32), AUDIO[:1000]),
            ("strided", AUDIO[:2000:2]), ("read-only", read_only), ("close",)]


def pipe(kind: str):
    """(sending end, receiving end): a socket pair (the owner's pipe), a plain os.pipe, or a listener's socket."""
    if kind == "socketpair":
        here, there = multiprocessing.Pipe()
        return here, there
    if kind == "os.pipe":
        there, here = multiprocessing.Pipe(duplex=False)
        return here, there
    raise AssertionError(kind)


def sent_by_a_thread(conn, items, *, close: bool = False) -> threading.Thread:
    def run():
        for item in items:
            send(conn, item)
        if close:
            conn.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def assert_same(got, want) -> None:
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert got.flags.writeable == want.flags.writeable
    elif isinstance(want, DecodeRequest):
        assert_same(got.audio, want.audio)
        assert (got.priority, got.stream_id, got.context) == (want.priority, want.stream_id, want.context)
    elif isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, Exception):
        assert str(got) == str(want)
    else:
        assert got == want


@pytest.mark.parametrize("kind", ["socketpair", "os.pipe"])
def test_messages_cross_unchanged_and_the_audio_arrives_writable(kind):
    here, there = pipe(kind)
    sender = sent_by_a_thread(here, messages(), close=True)
    for want in messages():
        assert_same(receive(there), want)
    with pytest.raises(EOFError):  # the sender closed its end between messages
        receive(there)
    sender.join(10)
    there.close()


def test_messages_cross_a_workers_authenticated_socket(tmp_path):
    address, authkey = str(tmp_path / "engine.sock"), b"k" * 32
    with multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        accepted = []
        acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        acceptor.start()
        client = multiprocessing.connection.Client(address, family="AF_UNIX", authkey=authkey)
        acceptor.join(10)
        sender = sent_by_a_thread(client, messages())
        for want in messages():
            assert_same(receive(accepted[0]), want)
        sender.join(10)
        send(accepted[0], ("done", 1, RESULT))  # and back
        assert_same(receive(client), ("done", 1, RESULT))
        client.close()
        accepted[0].close()


def wire_bytes(items) -> bytes:
    """What send writes for these messages."""
    here, there = multiprocessing.Pipe()
    sent_by_a_thread(here, items, close=True)
    chunks = []
    while chunk := os.read(there.fileno(), 1 << 20):
        chunks.append(chunk)
    there.close()
    return b"".join(chunks)


@pytest.mark.parametrize("piece", [1, 5, 4099, 300_000])
def test_a_message_arriving_in_pieces_is_read_whole(piece):
    items = [("add", 1, DecodeRequest(audio=AUDIO[:40_000])), ("cancel", 1), ("done", 2, RESULT)]
    data = wire_bytes(items)
    a, b = socket.socketpair()
    here = multiprocessing.connection.Connection(b.detach())

    def trickle():
        for start in range(0, len(data), piece):
            a.sendall(data[start:start + piece])
        a.close()
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    for want in items:
        assert_same(receive(here), want)
    with pytest.raises(EOFError):
        receive(here)
    thread.join(10)
    here.close()


@pytest.mark.parametrize("cut", [3, 20, 200_000])  # within the prefix, the pickle, the audio
def test_a_connection_that_ends_within_a_message_is_an_error_not_an_end(cut):
    data = wire_bytes([("add", 1, DecodeRequest(audio=AUDIO[:100_000]))])
    a, b = socket.socketpair()
    here = multiprocessing.connection.Connection(b.detach())
    thread = threading.Thread(target=lambda: (a.sendall(data[:cut]), a.close()), daemon=True)
    thread.start()
    with pytest.raises(OSError):
        receive(here)
    thread.join(10)
    here.close()


def test_a_reader_waiting_for_a_message_wakes_when_its_connection_is_shut_down():
    here, there = multiprocessing.Pipe()
    outcome = []

    def read():
        try:
            receive(there)
        except (EOFError, OSError) as error:
            outcome.append(type(error))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()
    shut_down(there)
    reader.join(10)
    assert outcome == [EOFError]
    here.close()
    there.close()


def test_a_default_socket_timeout_leaves_the_connection_blocking():
    """A socket object made over the connection's descriptor while a default timeout is set would make it
    non-blocking (for the sender on the same connection too): then receive reads without one."""
    here, there = multiprocessing.Pipe()
    socket.setdefaulttimeout(5.0)
    try:
        sender = sent_by_a_thread(here, messages()[:2])
        for want in messages()[:2]:
            assert_same(receive(there), want)
        sender.join(10)
    finally:
        socket.setdefaulttimeout(None)
    assert os.get_blocking(there.fileno()) and os.get_blocking(here.fileno())
    here.close()
    there.close()
