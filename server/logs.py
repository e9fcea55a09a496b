"""qasr-server's logs on stderr: text lines for people, or JSON lines for log pipelines (`--log-format json`).

A JSON line is one object: `time` (ISO 8601, UTC), `level`, `logger`, `message`, and where known `session` (the
stream's session id, as clients see it in `ready`) and `error` (the traceback of a logged exception). The session is
bound once per connection (`bind_session`) and follows every log call made while serving it, in any module.

websockets logs two INFO lines for each HTTP request (every /readyz poll of a readiness wait): access logs, shown
with --log-level debug only; its per-frame DEBUG lines never (a stream sends ten frames a second).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from typing import TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGERS = ("websockets.server",)

# The connection whose code is running: asyncio copies it into each task a connection starts.
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("qasr_log_session", default=None)


def bind_session(session_id: str) -> None:
    """Tag what the current task (and the tasks it starts from now on) logs with this session id."""
    _session.set(session_id)


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages and tracebacks are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        session = _session.get()
        if session is not None:
            entry["session"] = session
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(level: str = "info", log_format: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's records at `level` and above to `stream` (stderr) in `log_format`; access logs of
    websockets only at debug. Replaces handlers set before, so calling it again reconfigures."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ACCESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if level == "debug" else logging.WARNING)
