"""qasr-server replicas behind a real nginx, all on 127.0.0.1, for the deployment tests.

`render_nginx_config` turns the shipped deploy/nginx/qasr.conf into one for loopback ports (the only lines it
changes are the ones the shipped file says to change: `listen` and the upstream's `server` addresses);
`Nginx` runs it as the current user with every path in a temporary folder (`daemon off;` under a subprocess);
`Replica` is one `qasr-server` process whose log tells which streams it took.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from live_server import stop_process  # tests/ is on sys.path (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_NGINX_CONFIG = REPO / "deploy" / "nginx" / "qasr.conf"

_LISTEN = re.compile(r"^(\s*)listen\s+80;\s*$", re.MULTILINE)
_UPSTREAM = re.compile(r"upstream qasr_replicas \{(.*?)\n\}", re.DOTALL)
_UPSTREAM_SERVER = re.compile(r"^(\s*server\s+)(\S+)(\s[^;]*)?;", re.MULTILINE)


def render_nginx_config(text: str, *, listen_port: int, replica_ports: list[int]) -> str:
    """The shipped config with `listen 80;` -> 127.0.0.1:listen_port and the upstream's server addresses ->
    127.0.0.1:replica_ports (their parameters kept). ValueError when the file no longer has that shape."""
    text, listens = _LISTEN.subn(rf"\g<1>listen 127.0.0.1:{listen_port};", text)
    if listens != 1:
        raise ValueError(f"expected one `listen 80;` line, found {listens}")
    upstream = _UPSTREAM.search(text)
    if upstream is None:
        raise ValueError("no `upstream qasr_replicas { ... }` block")
    servers = _UPSTREAM_SERVER.findall(upstream.group(1))
    if len(servers) != len(replica_ports):
        raise ValueError(f"the upstream lists {len(servers)} servers, the test runs {len(replica_ports)} replicas")
    ports = iter(replica_ports)
    body = _UPSTREAM_SERVER.sub(lambda m: f"{m.group(1)}127.0.0.1:{next(ports)}{m.group(3) or ''};", upstream.group(1))
    return text[:upstream.start(1)] + body + text[upstream.end(1):]


def nginx_binary() -> str | None:
    """nginx on PATH, or where Debian installs it (/usr/sbin is not on every user's PATH)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _wait_for(condition, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tail = "" if log is None or not log.exists() else "\n" + log.read_text()[-3000:]
            raise AssertionError(f"{what} within {timeout_s:g} s{tail}")
        time.sleep(0.2)


class Nginx:
    """nginx with `config` (an http{}-level file) on 127.0.0.1, everything it writes under `workdir`."""

    def __init__(self, config: str, workdir: Path, *, port: int, binary: str):
        self.workdir, self.port = workdir, port
        self.error_log, self.access_log = workdir / "error.log", workdir / "access.log"
        (workdir / "qasr.conf").write_text(config)
        (workdir / "nginx.conf").write_text(self._main_config())
        with open(workdir / "stderr.log", "wb") as stderr:
            self.process = subprocess.Popen([binary, "-p", str(workdir), "-e", str(self.error_log),
                                             "-c", str(workdir / "nginx.conf")], stdout=subprocess.DEVNULL, stderr=stderr)
        _wait_for(self._listening, 10, "nginx did not listen", workdir / "stderr.log")

    def _main_config(self) -> str:
        temp = "\n".join(f"    {kind}_temp_path {self.workdir / kind};"  # Debian's defaults are under /var/lib
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # as root, nginx would hand its workers to `nobody`: keep them the current user
        user = "user root;\n" if os.geteuid() == 0 else ""
        return (f"daemon off;\n{user}worker_processes 1;\npid {self.workdir / 'nginx.pid'};\n"
                f"error_log {self.error_log} info;\nevents {{ worker_connections 256; }}\n"
                "http {\n"
                "    log_format upstreams '$request_uri $status upstream=$upstream_addr';\n"
                f"    access_log {self.access_log} upstreams;\n{temp}\n"
                f"    include {self.workdir / 'qasr.conf'};\n}}\n")

    def _listening(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"nginx exited with {self.process.returncode}: "
                                 f"{(self.workdir / 'stderr.log').read_text()}")
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.process.poll() is None:
            stop_process(self.process, timeout=10)  # nginx's fast shutdown: open connections are dropped


class Replica:
    """`qasr-server --device cpu --port 0` on 127.0.0.1; its log (stdout and stderr) in `log`.

    The engine runs in the server process (--engine-in-process): an engine process of its own would import torch
    a second time per replica (~10 s each on a busy 2-core CI machine) and pay its lazy imports on the first
    request; the SIGTERM drain under test is the server's, the same with either engine."""

    def __init__(self, model_dir: Path, log: Path, *, drain_timeout_s: float, extra_args: tuple[str, ...] = ()):
        self.log = log
        self.port: int | None = None
        command = [sys.executable, "-m", "qasr.server.cli", "--model", str(model_dir), "--device", "cpu",
                   "--host", "127.0.0.1", "--port", "0", "--drain-timeout-s", str(drain_timeout_s),
                   "--log-level", "info", "--engine-in-process", *extra_args]
        with open(log, "wb") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the port is known and /readyz says 200 (the model is loaded)."""
        _wait_for(self._bound, timeout_s, "the replica did not listen", self.log)
        _wait_for(lambda: http_get(f"http://127.0.0.1:{self.port}/readyz")[0] == 200, timeout_s,
                  "the replica did not become ready", self.log)

    def _bound(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"qasr-server exited with {self.process.returncode}:\n{self.log.read_text()}")
        found = re.search(r"listening on ws://127\.0\.0\.1:(\d+)/", self.log.read_text())
        self.port = int(found.group(1)) if found else None
        return self.port is not None

    def session_ids(self) -> set[str]:
        """The streams this replica admitted, by the session id their `ready` event carries."""
        return set(re.findall(r"session (\w+) started", self.log.read_text()))

    def sigterm(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
