"""Plain HTTP on the WebSocket port: health, readiness, metrics and the static web page.

websockets calls `HttpRoutes` (its `process_request` hook) for every request before the opening handshake; it
returns a response for the HTTP endpoints and None for `/v1/stream`, which then upgrades to a WebSocket.

Where the web page is found (`find_web_root`, first directory holding an index.html wins):
1. the `--web-root` option of qasr-server;
2. the `QASR_WEB_ROOT` environment variable;
3. `web/` beside the `server/` package folder: the repository's top-level `web/` in a source checkout or an
   editable install, `site-packages/qasr/web/` in an installed wheel that ships the page as package data.
Without one, `/` answers 404 saying so; the WebSocket and the other endpoints work regardless.
"""

from __future__ import annotations

import email.utils
import http
import logging
import mimetypes
import os
from pathlib import Path
from typing import Callable, Collection
from urllib.parse import unquote, urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from qasr.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from qasr.server.metrics import ServerMetrics

log = logging.getLogger("qasr.server")

STREAM_PATH = "/v1/stream"
WEB_ROOT_ENV = "QASR_WEB_ROOT"


def find_web_root(explicit: str | os.PathLike | None = None) -> Path | None:
    """The folder the web page is served from, or None; see the module docstring for the order."""
    if explicit:  # asked for by name: that folder or an error, never a silent fallback
        if not (Path(explicit) / "index.html").is_file():
            raise FileNotFoundError(f"--web-root {explicit} has no index.html")
        return Path(explicit).resolve()
    for candidate in (os.environ.get(WEB_ROOT_ENV), Path(__file__).resolve().parents[1] / "web"):
        if candidate and (Path(candidate) / "index.html").is_file():
            return Path(candidate).resolve()
    return None


class HttpRoutes:
    """process_request for websockets.asyncio.server.serve."""

    def __init__(self, *, metrics: ServerMetrics, engine, is_ready: Callable[[], bool], web_root: Path | None,
                 stream_paths: Collection[str] = (STREAM_PATH,)):
        self.stream_paths = stream_paths  # the WebSocket paths of the wire adapters (app.WIRE_ADAPTERS)
        self.metrics = metrics
        self.engine = engine
        self.is_ready = is_ready
        self.web_root = web_root

    def __call__(self, connection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path in self.stream_paths:
            return None  # the WebSocket handshake goes on (a plain GET here gets websockets' 426)
        method = getattr(request, "method", "GET")  # websockets < 14 parses GET only
        if method != "GET":
            return _response(http.HTTPStatus.METHOD_NOT_ALLOWED, b"only GET is served here\n", extra={"Allow": "GET"})
        if path == "/healthz":
            error = self.engine.error
            if error is not None:
                return _text(http.HTTPStatus.INTERNAL_SERVER_ERROR, f"engine failed: {type(error).__name__}\n")
            return _text(http.HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            if self.is_ready():
                return _text(http.HTTPStatus.OK, "ready\n")
            return _text(http.HTTPStatus.SERVICE_UNAVAILABLE, "not ready: the model is loading, the engine is "
                                                              "restarting or the server is stopping\n")
        if path == "/metrics":
            body = self.metrics.render(self.engine).encode()
            return _response(http.HTTPStatus.OK, body, METRICS_CONTENT_TYPE)
        return self._static(path)

    def _static(self, path: str) -> Response:
        if self.web_root is None:
            return _text(http.HTTPStatus.NOT_FOUND, f"no web page installed: point --web-root or ${WEB_ROOT_ENV} at "
                                                    f"a folder with index.html (the WebSocket is at {STREAM_PATH})\n")
        file = _resolve_inside(self.web_root, unquote(path))
        if file is None:
            return _text(http.HTTPStatus.NOT_FOUND, "not found\n")
        try:
            body = file.read_bytes()
        except OSError:
            log.warning("cannot read %s", file, exc_info=True)
            return _text(http.HTTPStatus.NOT_FOUND, "not found\n")
        content_type = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if content_type.startswith("text/") or content_type in ("application/javascript", "application/json"):
            content_type += "; charset=utf-8"
        return _response(http.HTTPStatus.OK, body, content_type, extra={"Cache-Control": "no-cache"})


def _resolve_inside(root: Path, path: str) -> Path | None:
    """root/path if it is a file inside root (a folder means its index.html); None for anything else."""
    parts = [part for part in path.split("/") if part]
    if any(part in ("..", ".") or "\\" in part or "\0" in part for part in parts):
        return None
    file = root.joinpath(*parts).resolve()
    if file.is_dir():
        file = file / "index.html"
    if root != file and root not in file.parents:  # a symlink out of the web root
        return None
    return file if file.is_file() else None


def _text(status: http.HTTPStatus, text: str) -> Response:
    return _response(status, text.encode(), "text/plain; charset=utf-8")


def _response(status: http.HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8", *,
              extra: dict[str, str] | None = None) -> Response:
    headers = Headers([
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        ("Content-Type", content_type),
        *(extra or {}).items(),
    ])
    return Response(status.value, status.phrase, headers, body)
