"""deploy/nginx/qasr.conf in front of two CPU qasr-server replicas on loopback, with a real nginx (issue #15).

Streams go through nginx with qasr.client; one replica is sent SIGTERM mid-stream. What must hold: least_conn puts
the streams evenly on the replicas; the drained replica's streams get the finals of every segment that ended
before the drain and of the segment still open (the drain), then close with 1001; their clients reconnect through
nginx, which skips the draining replica (passive health: it answers the upgrade with 503, which nginx retries) and
lands them on the other one, first sending again what the drained replica never read (its summary says how much it
read: audio in flight through nginx when it stopped reading); no segment's final is lost or repeated, no burst goes
without one, every sample is heard exactly once; the other replica's streams never notice.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import soundfile

from qasr.client.stream import Reconnecting, stream_audio
from qasr.audio import SAMPLE_RATE
from qasr.client.sources import file_source
from qasr.server.app import ServerConfig
from qasr.server.limits import ServerLimits
from qasr.streaming.events import Final, Ready, SpeechStarted, Summary

from fakes import speech_like  # tests/ is on sys.path (tests/conftest.py)
from live_server import free_port
from loopback_cluster import SHIPPED_NGINX_CONFIG, Nginx, Replica, http_get, nginx_binary, render_nginx_config

pytestmark = pytest.mark.skipif(nginx_binary() is None,
                                reason="nginx is not installed (Debian: apt-get install nginx; .ci/run does)")

STARTUP_TIMEOUT_S = 75  # torch import and the model load, two replicas at once on a busy 2-core machine
# A drain that runs out of time closes without its summary, and then no client can know what the replica read: the
# limit must outlast the slowest drain a loaded CI machine makes (a drain that ends sooner ends at once). The decode
# budget is small for the same reason: the random-weight tiny model never stops early (it decodes its whole budget).
DRAIN_TIMEOUT_S = 60
REPLICA_ARGS = ("--base-tokens", "8", "--tokens-per-second", "2")
CLIENTS = 4  # connected one after another: least_conn puts two on each replica
# Four bursts; the drain starts inside the second one, so the first has ended (its final is due) and the second
# is open (the drain must finalise it). Real time: the drain happens mid-stream, as in production.
PATTERN = [("silence", 0.3), ("speech", 1.0), ("silence", 0.8), ("speech", 1.5), ("silence", 0.8),
           ("speech", 1.0), ("silence", 0.8), ("speech", 1.0), ("silence", 0.8)]
EXACT_VAD = {"pre_roll_ms": 0}  # segments start at the first voiced frame: comparable to the truth


class Cluster:
    def __init__(self, nginx: Nginx, replicas: list[Replica]):
        self.nginx, self.replicas = nginx, replicas

    @property
    def stream_url(self) -> str:
        return f"ws://127.0.0.1:{self.nginx.port}/v1/stream"

    def replica_of(self, session_id: str) -> Replica | None:
        owners = [replica for replica in self.replicas if session_id in replica.session_ids()]
        assert len(owners) <= 1, f"session {session_id} in two replicas' logs"
        return owners[0] if owners else None


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """Two replicas and nginx, started once for this module; the drain test (last in the file) stops one."""
    workdir = tmp_path_factory.mktemp("loopback-cluster")
    replicas = [Replica(tiny_model_dir, workdir / f"replica-{index}.log", drain_timeout_s=DRAIN_TIMEOUT_S,
                        extra_args=REPLICA_ARGS) for index in range(2)]
    nginx = None
    try:
        for replica in replicas:
            replica.wait_ready(STARTUP_TIMEOUT_S)
        port = free_port()
        config = render_nginx_config(SHIPPED_NGINX_CONFIG.read_text(), listen_port=port,
                                     replica_ports=[replica.port for replica in replicas])
        (workdir / "nginx").mkdir()
        nginx = Nginx(config, workdir / "nginx", port=port, binary=nginx_binary())
        yield Cluster(nginx, replicas)
    finally:
        if nginx is not None:
            nginx.close()
        for replica in replicas:
            replica.close()


def test_health_readiness_and_metrics_pass_through(cluster):
    assert http_get(f"{cluster.nginx.url}/healthz") == (200, "ok\n")
    assert http_get(f"{cluster.nginx.url}/readyz") == (200, "ready\n")
    status, metrics = http_get(f"{cluster.nginx.url}/metrics")
    assert status == 200 and "qasr_sessions_active" in metrics
    # a plain GET of a stream path reaches a replica, which asks for the WebSocket upgrade
    assert http_get(f"{cluster.nginx.url}/v1/stream")[0] == 426


def test_streams_outlast_the_servers_own_idle_timeout_and_pings():
    """nginx must never be the one that cuts a quiet stream: the replica closes idle streams itself (1008, with
    its finals) and pings every ping_interval_s, so the stream location's timeouts must be longer than both."""
    stream_location = re.search(r"location /v1/ \{(.*?)\n    \}", SHIPPED_NGINX_CONFIG.read_text(), re.DOTALL)
    assert stream_location is not None, "no `location /v1/` block"
    for directive in ("proxy_read_timeout", "proxy_send_timeout"):
        seconds = int(re.search(rf"{directive} (\d+)s;", stream_location.group(1)).group(1))
        assert seconds > max(ServerLimits().idle_timeout_s, ServerConfig().ping_interval_s), directive
    assert "proxy_buffering off;" in stream_location.group(1)


class StreamRun:
    """One client streaming the clip through nginx with reconnects, every event kept."""

    def __init__(self, url: str, wav):
        self.events: list = []
        self.stream = stream_audio(url, file_source(wav), partials=False, vad=EXACT_VAD, reconnect=3,
                                   reconnect_delay_s=0.2)
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async for event in self.stream:
            self.events.append(event)

    def of_type(self, kind) -> list:
        return [event for event in self.events if isinstance(event, kind)]

    def session_ids(self) -> list[str]:
        return [ready.session_id for ready in self.of_type(Ready)]

    def has_final(self, segment_id: int) -> bool:
        return any(final.segment_id == segment_id for final in self.of_type(Final))

    def index_of(self, predicate) -> int:
        return next(index for index, event in enumerate(self.events) if predicate(event))


async def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g} s")
        await asyncio.sleep(0.02)


def test_sigterm_drains_one_replica_while_its_clients_reconnect_to_the_other(cluster, tmp_path):
    audio, truth = speech_like(PATTERN)
    soundfile.write(str(tmp_path / "talk.wav"), audio, SAMPLE_RATE, subtype="PCM_16")
    drained, survivor = cluster.replicas

    async def scenario() -> tuple[list[StreamRun], dict]:
        runs, placement = [], {}
        for _ in range(CLIENTS):  # one at a time, so that least_conn sees the previous one
            # a short request between two streams: round robin would then put every stream on one replica,
            # least_conn still alternates (it counts open connections, not turns)
            assert (await asyncio.to_thread(http_get, f"{cluster.nginx.url}/v1/stream"))[0] == 426
            run = StreamRun(cluster.stream_url, tmp_path / "talk.wav")
            await until(lambda: run.session_ids() or run.task.done(), 15, "no `ready` from nginx")
            if not run.session_ids():
                await run.task  # raises why
            session_id = run.session_ids()[0]
            await until(lambda: cluster.replica_of(session_id) is not None, 5, "session in no replica's log")
            placement[run] = cluster.replica_of(session_id)
            runs.append(run)
        on_drained = [run for run in runs if placement[run] is drained]
        assert len(on_drained) == CLIENTS // 2, "least_conn should have put half of the streams on each replica"
        # SIGTERM while each drained stream has its first segment closed and its second one open
        await until(lambda: all(any(event.segment_id == 1 for event in run.of_type(SpeechStarted))
                                for run in on_drained), 15, "second bursts not heard")
        assert not any(run.has_final(1) for run in on_drained), "the second burst closed before the drain began"
        drained.sigterm()
        await asyncio.wait_for(asyncio.gather(*(run.task for run in runs)), DRAIN_TIMEOUT_S + 60)
        return runs, placement

    runs, placement = asyncio.run(asyncio.wait_for(scenario(), DRAIN_TIMEOUT_S + 120))
    assert drained.wait_exit(DRAIN_TIMEOUT_S + 10) == 0  # finals sent, engine closed, clean exit

    for run in runs:
        finals = run.of_type(Final)
        # exactly one final per segment, numbered on across the reconnect, on one timeline
        assert [final.segment_id for final in finals] == list(range(len(finals))), finals
        assert all(a.end <= b.start + 1e-6 for a, b in zip(finals, finals[1:])), finals
        for start, end in truth:  # no burst of speech went without a final
            assert any(final.start < end and start < final.end for final in finals), (start, end, finals)
        assert isinstance(run.events[-1], Summary)
        # every sample was heard once: what the drained replica never read was sent again, at its own time
        assert run.events[-1].audio_seconds == pytest.approx(len(audio) / SAMPLE_RATE, abs=1e-6)

        if placement[run] is survivor:
            assert not run.of_type(Reconnecting) and len(run.session_ids()) == 1
            continue
        # the drained replica's streams: finals of the ended and the open segment arrived before the close
        reconnected = run.index_of(lambda event: isinstance(event, Reconnecting))
        assert run.index_of(lambda event: isinstance(event, Final) and event.segment_id == 0) < reconnected
        assert run.index_of(lambda event: isinstance(event, Final) and event.segment_id == 1) < reconnected
        assert "close code 1001" in run.of_type(Reconnecting)[0].reason
        # the new connection went to the surviving replica, through nginx's failover
        first, *later = run.session_ids()
        assert later and all(cluster.replica_of(session_id) is survivor for session_id in later), later
