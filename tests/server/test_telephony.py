"""The telephony front's wiring: each platform's path builds its adapter from the handshake, and the webhook flags."""

from __future__ import annotations

import argparse

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from qasr.server import telephony
from qasr.server.app import WIRE_ADAPTERS, Handshake, ServerConfig
from qasr.server.audiohook import AudioHookAdapter
from qasr.server.calls import CallOptions, CallRegistry
from qasr.server.telnyx import TelnyxAdapter
from qasr.server.twilio import TwilioAdapter
from qasr.server.vonage import VonageAdapter
from qasr.server.webhooks import WebhookOptions
from qasr.streaming.settings import StreamSettings


def handshake(path: str, headers: dict | None = None, calls: CallRegistry | None = None) -> Handshake:
    config = ServerConfig(defaults=StreamSettings(partial_interval_ms=700))
    return Handshake(Request(path, Headers(headers or {})), config, "tiny",
                     calls=calls if calls is not None else CallRegistry())


@pytest.mark.parametrize("path, kind", [("/v1/twilio", TwilioAdapter), ("/v1/telnyx", TelnyxAdapter),
                                        ("/v1/vonage", VonageAdapter), ("/v1/audiohook", AudioHookAdapter)])
def test_each_platform_path_builds_its_adapter_on_the_servers_calls_and_defaults(path, kind):
    calls = CallRegistry()
    adapter = WIRE_ADAPTERS[path](handshake(path, calls=calls))
    assert isinstance(adapter, kind)
    assert adapter.calls is calls
    assert adapter.defaults.partial_interval_ms == 700


def test_vonage_reads_the_call_id_from_the_query_and_audiohook_its_handshake_headers():
    vonage = WIRE_ADAPTERS["/v1/vonage"](handshake("/v1/vonage?call_id=conv-7&x=1"))
    assert vonage.query == {"call_id": "conv-7", "x": "1"}
    hook = WIRE_ADAPTERS["/v1/audiohook"](handshake("/v1/audiohook", {"Audiohook-Session-Id": "abc"}))
    assert hook.session_id == "abc"


def test_a_telephony_adapter_without_the_call_registry_is_a_wiring_error():
    bare = Handshake(Request("/v1/twilio", Headers()), ServerConfig(), "tiny")
    with pytest.raises(RuntimeError, match="call registry"):
        WIRE_ADAPTERS["/v1/twilio"](bare)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    telephony.add_arguments(parser)
    return parser.parse_args(argv)


def test_webhook_flags_become_call_and_webhook_options():
    calls, webhooks = telephony.from_args(parse("--webhook-url", "https://crm.example.com/qasr", "--webhook-allow",
                                                "https://a.example.com/", "--webhook-allow", "http://b.example.com/x",
                                                "--webhook-partials"), environ={"QASR_WEBHOOK_SECRET": "s3cret"})
    assert calls == CallOptions(webhook_url="https://crm.example.com/qasr", webhook_partials=True,
                                webhook_prefixes=("https://a.example.com/", "http://b.example.com/x"))
    assert webhooks == WebhookOptions(secret=b"s3cret")
    _, flagged = telephony.from_args(parse("--webhook-url", "https://c.example.com/", "--webhook-secret", "flag"),
                                     environ={"QASR_WEBHOOK_SECRET": "env"})
    assert flagged.secret == b"flag"  # the flag wins over the environment
    assert telephony.from_args(parse(), environ={}) == (CallOptions(), None)


@pytest.mark.parametrize("argv, environ, match", [
    (["--webhook-url", "https://crm.example.com/"], {}, "signing secret"),
    (["--webhook-allow", "https://crm.example.com/"], {}, "signing secret"),
    (["--webhook-url", "ftp://crm.example.com/"], {"QASR_WEBHOOK_SECRET": "s"}, "--webhook-url"),
    (["--webhook-allow", "crm.example.com/"], {"QASR_WEBHOOK_SECRET": "s"}, "--webhook-allow"),
    (["--webhook-allow", "https://crm.example.com"], {"QASR_WEBHOOK_SECRET": "s"}, "end the host with a path"),
])
def test_bad_webhook_flags_say_which_flag(argv, environ, match):
    with pytest.raises(ValueError, match=match):
        telephony.from_args(parse(*argv), environ=environ)


def test_a_server_config_with_a_webhook_url_but_no_secret_is_refused():
    with pytest.raises(ValueError, match="signing secret"):
        ServerConfig(calls=CallOptions(webhook_url="https://crm.example.com/"))
