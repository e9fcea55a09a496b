"""The server's security settings in one frozen object, and the qasr-server flags that build it.

Authentication is off by default on a loopback address and required on any other unless `--auth none` says
otherwise (docs/security.md). `add_arguments` / `from_args` keep these flags out of cli.py's way.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
from dataclasses import dataclass, field

from qasr.server.auth import KEYS_ENV, TOKEN_SECRET_ENV, Authenticator, KeyLimits, KeyStore, TokenSigner
from qasr.server.quotas import ClientLimits

AUTH_MODES = ("auto", "keys", "none")  # auto: required unless the host is loopback and no key is configured


@dataclass(frozen=True)
class SecuritySettings:
    auth: Authenticator = field(default_factory=Authenticator)  # off unless built with required=True
    allowed_origins: frozenset[str] | None = None  # browser Origins allowed on stream paths; None: any
    trusted_proxies: tuple = ()  # ipaddress networks whose X-Forwarded-For is believed
    max_pending_per_address: int = 64  # connections per peer address still in their handshake
    max_connections_per_address: int | None = None  # open connections per client address (None: no limit)
    client_limits: ClientLimits = field(default_factory=ClientLimits)  # message rate, audio per stream
    ssl: ssl.SSLContext | None = None  # TLS served directly (qasr.server.tls)

    def __post_init__(self):
        if self.max_pending_per_address < 1:
            raise ValueError(f"max_pending_per_address must be >= 1, got {self.max_pending_per_address}")
        if self.max_connections_per_address is not None and self.max_connections_per_address < 1:
            raise ValueError(f"max_connections_per_address must be >= 1, got {self.max_connections_per_address}")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--auth", choices=AUTH_MODES, default="auto",
                       help="keys: every stream needs an API key; none: no authentication (only behind something "
                            "that authenticates); auto: keys unless --host is loopback and no key is configured")
    group.add_argument("--api-keys-file", default=None,
                       help=f"API keys as SHA-256 digests, one per line (`python -m qasr.server.auth new-key`); "
                            f"plain keys may also come comma-separated in ${KEYS_ENV}")
    group.add_argument("--token-max-ttl-s", type=float, default=600.0,
                       help=f"longest lifetime of a token from POST /v1/tokens (signed with ${TOKEN_SECRET_ENV}, "
                            "else a secret random per process)")
    group.add_argument("--key-max-streams", type=int, default=None,
                       help="concurrent streams per API key (the key file's max_streams= overrides it)")
    group.add_argument("--key-audio-seconds-per-minute", type=float, default=None,
                       help="audio per API key over any minute, all its streams together (audio_seconds_per_minute=)")
    group.add_argument("--ssl-certfile", default=None, help="serve TLS (wss://, https://) with this certificate chain")
    group.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (if not in the certfile)")
    group.add_argument("--allowed-origins", default=None,
                       help="comma-separated browser origins allowed to open streams (e.g. https://app.example.com; "
                            "the server's own page is always allowed); others get 403; default: any")
    group.add_argument("--trusted-proxies", default=None,
                       help="comma-separated addresses or networks of proxies whose X-Forwarded-For is believed")
    defaults, limits = SecuritySettings.__dataclass_fields__, ClientLimits()
    group.add_argument("--max-pending-per-address", type=int, default=defaults["max_pending_per_address"].default,
                       help="connections per address still in their WebSocket handshake; more get HTTP 429")
    group.add_argument("--max-connections-per-address", type=int, default=None,
                       help="open connections per client address; more get HTTP 429 (default: no limit)")
    group.add_argument("--max-messages-per-s", type=float, default=limits.max_messages_per_s,
                       help=f"sustained client messages per second per stream (bursts of {limits.message_burst}); "
                            "more close the stream with 1008 rate_limited")
    group.add_argument("--max-stream-audio-s", type=float, default=limits.max_stream_audio_s,
                       help="audio one stream may send in all; more closes it with 1008 stream_audio_limit (0: no limit)")


def from_args(args: argparse.Namespace, environ=os.environ) -> SecuritySettings:
    """ValueError says which flag is wrong (and that a non-loopback server needs keys or --auth none)."""
    from qasr.server import tls

    key_limits = KeyLimits(max_streams=args.key_max_streams,
                           audio_seconds_per_minute=args.key_audio_seconds_per_minute)
    keys = KeyStore.load(args.api_keys_file, environ.get(KEYS_ENV), default_limits=key_limits)
    required = args.auth == "keys" or (args.auth == "auto" and (len(keys) > 0 or not is_loopback(args.host)))
    if required and not len(keys):
        raise ValueError(f"--host {args.host} is not a loopback address, so streams need API keys: give "
                         f"--api-keys-file or ${KEYS_ENV}, or --auth none if something in front authenticates")
    secret = environ.get(TOKEN_SECRET_ENV)
    signer = TokenSigner(secret.encode() if secret else None, max_ttl_s=args.token_max_ttl_s)
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    origins = None
    if args.allowed_origins:
        origins = frozenset(origin.strip().lower().rstrip("/") for origin in args.allowed_origins.split(",")
                            if origin.strip())
    try:
        proxies = tuple(ipaddress.ip_network(item.strip(), strict=False)
                        for item in (args.trusted_proxies or "").split(",") if item.strip())
    except ValueError as error:
        raise ValueError(f"--trusted-proxies: {error}") from None
    stream_audio = args.max_stream_audio_s if args.max_stream_audio_s and args.max_stream_audio_s > 0 else None
    return SecuritySettings(
        auth=Authenticator(keys, signer, required=required), allowed_origins=origins, trusted_proxies=proxies,
        max_pending_per_address=args.max_pending_per_address,
        max_connections_per_address=args.max_connections_per_address,
        client_limits=ClientLimits(max_messages_per_s=args.max_messages_per_s, max_stream_audio_s=stream_audio),
        ssl=tls.server_context(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None)
