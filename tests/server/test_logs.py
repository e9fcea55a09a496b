"""qasr.server.logs: JSON lines parse one by one and carry the session of the connection that logged them; the
access lines of websockets appear at debug only."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from qasr.server import logs


@pytest.fixture
def restore_logging():
    """configure() replaces the root handlers (pytest's capture among them): put everything back afterwards."""
    root, access = logging.getLogger(), [logging.getLogger(name) for name in logs.ACCESS_LOGGERS]
    saved = root.handlers[:], root.level, [logger.level for logger in access]
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for logger, level in zip(access, saved[2]):
        logger.setLevel(level)


def test_json_format_is_one_parseable_object_per_line_with_the_session_where_known(restore_logging):
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    log = logging.getLogger("qasr.test")

    async def connection(session_id: str) -> None:
        logs.bind_session(session_id)
        log.info("started")
        await asyncio.create_task(asyncio.sleep(0))  # a task the connection starts inherits its session
        await asyncio.create_task(asyncio.to_thread(log.info, "from a task\nand a second line"))

    async def server() -> None:
        log.info("listening")
        await asyncio.gather(asyncio.create_task(connection("a1")), asyncio.create_task(connection("b2")))
        log.info("stopped")  # the server's own task was never bound

    asyncio.run(server())
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    log.debug("below the level")

    lines = out.getvalue().splitlines()
    entries = [json.loads(line) for line in lines]
    assert len(lines) == 7 and all(set(e) >= {"time", "level", "logger", "message"} for e in entries)
    by_session: dict = {}
    for entry in entries[1:5]:  # the two connections' lines, interleaved in any order
        by_session.setdefault(entry.get("session"), []).append(entry["message"])
    assert by_session == {"a1": ["started", "from a task\nand a second line"],
                          "b2": ["started", "from a task\nand a second line"]}
    assert "session" not in entries[0] and "session" not in entries[5]
    assert entries[6]["level"] == "error" and "RuntimeError: boom" in entries[6]["error"]
    assert entries[0]["logger"] == "qasr.test" and entries[0]["time"].endswith("Z")


def test_text_format_keeps_one_line_per_record(restore_logging):
    out = io.StringIO()
    logs.configure("warning", "text", stream=out)
    logging.getLogger("qasr.test").info("hidden")
    logging.getLogger("qasr.test").warning("shown")
    assert out.getvalue().count("\n") == 1 and out.getvalue().rstrip().endswith("WARNING qasr.test: shown")


def test_websockets_access_lines_show_at_debug_only(restore_logging):
    out = io.StringIO()
    access = logging.getLogger("websockets.server")
    logs.configure("info", "text", stream=out)
    access.info("connection rejected (200 OK)")
    access.error("a real problem")
    assert "200 OK" not in out.getvalue() and "a real problem" in out.getvalue()
    logs.configure("debug", "text", stream=out)
    access.info("connection rejected (200 OK)")
    access.debug("< TEXT '{...}' [12 bytes]")  # per-frame lines stay out even at debug
    assert "200 OK" in out.getvalue() and "TEXT" not in out.getvalue()


def test_bad_level_or_format_is_a_clear_error():
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        logs.configure("info", "xml")
    with pytest.raises(ValueError, match="log level"):
        logs.configure("loud", "text")
