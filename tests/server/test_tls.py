"""TLS served directly: a self-signed certificate made here (openssl CLI), qasr's own client streaming over wss://,
the HTTP endpoints over https://, and clear errors for files that cannot serve."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import urllib.request

import pytest
from websockets.asyncio.client import connect

from qasr.client.stream import StreamClient
from qasr.client.protocol import StreamOptions
from qasr.server import tls
from qasr.server.app import QasrServer, ServerConfig
from qasr.server.security import SecuritySettings

from fakes import FakeEngine, speech_like

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI is not installed")


@pytest.fixture
def certificate(tmp_path):
    """(certfile, keyfile) of a self-signed certificate for 127.0.0.1 and localhost."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def test_qasr_client_streams_over_wss_and_health_answers_over_https(certificate, monkeypatch):
    cert, key = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts the test's certificate like a system CA
    audio, _ = speech_like([("silence", 0.3), ("speech", 1.0), ("silence", 0.8)])

    async def main():
        config = ServerConfig(port=0, ping_interval_s=None,
                              security=SecuritySettings(ssl=tls.server_context(cert, key)))
        server = QasrServer(FakeEngine(delay_s=0.005), config)
        await server.start()
        try:
            async with StreamClient(f"wss://127.0.0.1:{server.port}/v1/stream",
                                    StreamOptions(sample_rate=16000)) as client:
                await client.send_audio(audio)
                await client.end()
                events = [event async for event in client.events()]
            with pytest.raises(Exception):  # a plain ws:// client cannot talk to a TLS port
                async with connect(f"ws://127.0.0.1:{server.port}/v1/stream", open_timeout=3):
                    pass
            context = ssl.create_default_context(cafile=str(cert))
            health = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"https://127.0.0.1:{server.port}/healthz", context=context,
                                               timeout=5).status)
            return events, health
        finally:
            await server.stop()

    events, health = asyncio.run(asyncio.wait_for(main(), 30))
    assert [event.TYPE for event in events if event.TYPE == "final"] == ["final"]
    assert events[-1].TYPE == "summary" and health == 200


def test_certificate_files_that_cannot_serve_are_named(certificate, tmp_path):
    cert, key = certificate
    with pytest.raises(ValueError, match="--ssl-certfile .*missing.pem: no such file"):
        tls.server_context(tmp_path / "missing.pem", key)
    other_key = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True)
    with pytest.raises(ValueError, match="cannot load the certificate and its key"):
        tls.server_context(cert, other_key)
    context = tls.server_context(cert, key)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
