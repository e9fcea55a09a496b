"""The telephony front of the server: each platform's WebSocket path and how its wire adapter is built from the
handshake, and the qasr-server flags of calls out (webhooks).

    /v1/twilio     Twilio Media Streams (qasr.server.twilio)
    /v1/telnyx     Telnyx media streaming (qasr.server.telnyx)
    /v1/vonage     Vonage Voice WebSocket (qasr.server.vonage; the call id may come as ?call_id=)
    /v1/audiohook  Genesys Cloud AudioHook v2 (qasr.server.audiohook; reads the Audiohook-* handshake headers)

Every adapter publishes to the server's one CallRegistry (`handshake.calls`), whose subscribers and webhook
carry the transcripts to the integrator. app.WIRE_ADAPTERS routes these paths like any other wire format.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Mapping
from urllib.parse import parse_qsl, urlsplit

from qasr.server.audiohook import AudioHookAdapter
from qasr.server.calls import WEBHOOK_PARAMETER, CallOptions
from qasr.server.telnyx import TelnyxAdapter
from qasr.server.twilio import TwilioAdapter
from qasr.server.vonage import VonageAdapter
from qasr.server.webhooks import WebhookOptions, check_url

WEBHOOK_SECRET_ENV = "QASR_WEBHOOK_SECRET"


def _common(handshake) -> dict:
    if handshake.calls is None:
        raise RuntimeError("telephony adapters need the server's call registry")
    return {"defaults": handshake.config.defaults, "limits": handshake.config.stream_limits,
            "calls": handshake.calls}


def _query(handshake) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(handshake.request.path).query))


TELEPHONY_ADAPTERS: dict[str, Callable] = {  # path -> (app.Handshake -> WireAdapter)
    "/v1/twilio": lambda handshake: TwilioAdapter(**_common(handshake)),
    "/v1/telnyx": lambda handshake: TelnyxAdapter(**_common(handshake)),
    "/v1/vonage": lambda handshake: VonageAdapter(**_common(handshake), query=_query(handshake)),
    "/v1/audiohook": lambda handshake: AudioHookAdapter(**_common(handshake),
                                                        headers=dict(handshake.request.headers.raw_items())),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("telephony calls out (docs/integrations.md)")
    group.add_argument("--webhook-url", default=None,
                       help="POST every call's call_started, final, dtmf and call_ended messages here, signed")
    group.add_argument("--webhook-secret", default=None,
                       help=f"the webhooks' HMAC-SHA256 signing secret (better: ${WEBHOOK_SECRET_ENV}, which a "
                            "process listing does not show)")
    group.add_argument("--webhook-allow", action="append", default=None, metavar="URL_PREFIX",
                       help=f"a call may name its own webhook (custom parameter {WEBHOOK_PARAMETER}) under this "
                            "prefix, e.g. https://crm.example.com/ (repeatable; none: calls cannot)")
    group.add_argument("--webhook-partials", action="store_true", help="webhooks get partial hypotheses too")


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ
              ) -> tuple[CallOptions, WebhookOptions | None]:
    """ValueError names the flag that is wrong."""
    secret = args.webhook_secret or environ.get(WEBHOOK_SECRET_ENV)
    prefixes = tuple(args.webhook_allow or ())
    wanted = args.webhook_url or prefixes or args.webhook_partials
    if wanted and not secret:
        raise ValueError(f"--webhook-url, --webhook-allow and --webhook-partials need a signing secret: "
                         f"--webhook-secret or ${WEBHOOK_SECRET_ENV}")
    for flag, url in [("--webhook-url", args.webhook_url)] + [("--webhook-allow", p) for p in prefixes]:
        try:
            if url is not None:
                check_url(url)
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None
    for prefix in prefixes:  # "https://crm.example.com" would let https://crm.example.com.evil.example/ through
        if not urlsplit(prefix).path:
            raise ValueError(f"--webhook-allow {prefix}: end the host with a path, e.g. {prefix}/")
    options = CallOptions(webhook_url=args.webhook_url, webhook_partials=args.webhook_partials,
                          webhook_prefixes=prefixes)
    return options, WebhookOptions(secret=secret.encode()) if secret else None
