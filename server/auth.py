"""Who may open a stream: API keys (hashed at rest), short-lived signed tokens, and the one `authenticate(request)`
that every WebSocket route uses. Sans-I/O: it reads a handshake request and answers a Principal or raises AuthError.

Where a client puts its credential (the first one found is checked; a wrong one is never retried with another):

    Authorization: Bearer KEY | Token KEY       (any letter case) servers, SDKs (OpenAI, Deepgram)
    X-API-KEY: KEY                              Genesys AudioHook's handshake header
    Sec-WebSocket-Protocol: qasr.key.KEY        browsers, which cannot set headers
                            openai-insecure-api-key.KEY     (the OpenAI Realtime browser style)
                            token, KEY                      (the Deepgram browser style)
                            qasr.token.TOKEN                (a token minted by POST /v1/tokens)
    ?token=TOKEN                                telephony webhooks that can only set a URL (never a key: a URL is
                                                logged by proxies; ?key= / ?api_key= are refused as such)

The key file holds one key per line as its SHA-256 (`sha256:HEX`, from `python -m qasr.server.auth hash-key`),
optionally named and with limits of its own: `sha256:HEX name=acme max_streams=20 audio_seconds_per_minute=1200`.
Keys are compared by digest in constant time; logs and metrics only ever see a key's name.

Tokens: `v1.<payload>.<signature>`, base64url, HMAC-SHA256 over the payload {"k": key name, "e": expiry (unix s)}
with the server's token secret ($QASR_TOKEN_SECRET, else random per process: tokens then die with the process and
are not valid on other replicas). A token carries its key's identity and limits; it cannot mint another token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import http
import json
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

KEY_DIGEST_PREFIX = "sha256:"
KEY_SUBPROTOCOL = "qasr.key."
TOKEN_SUBPROTOCOL = "qasr.token."
OPENAI_KEY_SUBPROTOCOL = "openai-insecure-api-key."
DEEPGRAM_SUBPROTOCOLS = ("token", "bearer")  # ["token", KEY] or ["bearer", TOKEN]: the next entry is the secret
APPLICATION_SUBPROTOCOLS = ("realtime",)  # what the OpenAI browser client asks for besides its key
URL_KEY_PARAMETERS = ("key", "api_key", "apikey", "api-key", "access_token")
KEYS_ENV = "QASR_API_KEYS"  # comma-separated plain keys (hashed when read)
TOKEN_SECRET_ENV = "QASR_TOKEN_SECRET"
TOKEN_VERSION = "v1"
MIN_KEY_CHARS = 16  # shorter keys can be guessed


class AuthError(Exception):
    """The handshake is refused: HTTP `status` with `message` (never echoes the credential)."""

    def __init__(self, message: str, status: http.HTTPStatus = http.HTTPStatus.UNAUTHORIZED):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KeyLimits:
    """What one key's connections may use together (None: no limit of its own)."""

    max_streams: int | None = None  # concurrent streams; one more is closed with 1008
    audio_seconds_per_minute: float | None = None  # audio received over the last 60 s; more closes the stream 1008

    def __post_init__(self):
        if self.max_streams is not None and self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.audio_seconds_per_minute is not None and not self.audio_seconds_per_minute > 0:
            raise ValueError(f"audio_seconds_per_minute must be > 0, got {self.audio_seconds_per_minute}")


@dataclass(frozen=True)
class ApiKey:
    name: str  # what logs, limits and tokens call the key; never the key itself
    digest: bytes = field(repr=False)  # SHA-256 of the key
    limits: KeyLimits = KeyLimits()


@dataclass(frozen=True)
class Principal:
    """Who a connection is: a key's name and limits, or anonymous where authentication is off."""

    name: str | None  # None: anonymous
    limits: KeyLimits = KeyLimits()
    via: str = "none"  # how it authenticated: header, subprotocol, token, none


ANONYMOUS = Principal(None)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def hash_key(key: str) -> str:
    """The key file's line for `key`."""
    return KEY_DIGEST_PREFIX + digest(key).hex()


def parse_key_line(line: str, default_limits: KeyLimits = KeyLimits()) -> ApiKey | None:
    """One line of the key file -> ApiKey; None for a blank line or a # comment. ValueError says what is wrong."""
    line = line.split("#", 1)[0].strip()
    if not line:
        return None
    first, *options = line.split()
    if not first.startswith(KEY_DIGEST_PREFIX):
        raise ValueError("keys are stored hashed: each line starts with sha256:HEX (print it with `python -m "
                         "qasr.server.auth hash-key`), not the key itself")
    try:
        key_digest = bytes.fromhex(first[len(KEY_DIGEST_PREFIX):])
    except ValueError:
        key_digest = b""
    if len(key_digest) != 32:
        raise ValueError(f"{first[:16]}...: not a SHA-256 digest (64 hex digits)")
    values = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in ("name", "max_streams", "audio_seconds_per_minute"):
            raise ValueError(f"unknown option {option!r}: use name=, max_streams= or audio_seconds_per_minute=")
        values[name] = value
    try:
        limits = KeyLimits(
            max_streams=int(values["max_streams"]) if "max_streams" in values else default_limits.max_streams,
            audio_seconds_per_minute=(float(values["audio_seconds_per_minute"])
                                      if "audio_seconds_per_minute" in values
                                      else default_limits.audio_seconds_per_minute))
    except ValueError as error:
        raise ValueError(f"bad limit: {error}") from None
    return ApiKey(values.get("name") or f"key-{key_digest.hex()[:8]}", key_digest, limits)


class KeyStore:
    """The server's API keys, by digest."""

    def __init__(self, keys: Iterable[ApiKey] = ()):
        self.keys = tuple(keys)
        names = [key.name for key in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"two keys share a name: {sorted(n for n in names if names.count(n) > 1)[0]}")
        self._by_name = {key.name: key for key in self.keys}

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, env_value: str | None = None, *,
             default_limits: KeyLimits = KeyLimits()) -> "KeyStore":
        """Keys from a file of digests and/or a comma-separated list of plain keys (the environment variable)."""
        keys: list[ApiKey] = []
        if path is not None:
            try:
                text = Path(path).read_text()
            except OSError as error:
                raise ValueError(f"--api-keys-file {path}: {error.strerror or error}") from None
            for number, line in enumerate(text.splitlines(), 1):
                try:
                    key = parse_key_line(line, default_limits)
                except ValueError as error:
                    raise ValueError(f"--api-keys-file {path} line {number}: {error}") from None
                if key is not None:
                    keys.append(key)
        for plain in (env_value or "").split(","):
            plain = plain.strip()
            if not plain:
                continue
            if len(plain) < MIN_KEY_CHARS:
                raise ValueError(f"${KEYS_ENV}: keys must have at least {MIN_KEY_CHARS} characters")
            key_digest = digest(plain)
            keys.append(ApiKey(f"key-{key_digest.hex()[:8]}", key_digest, default_limits))
        return cls(keys)

    def find(self, key: str) -> ApiKey | None:
        """The key whose digest matches, comparing with every key in constant time (no early exit)."""
        candidate = digest(key)
        found = None
        for stored in self.keys:
            if hmac.compare_digest(candidate, stored.digest):
                found = stored
        return found

    def named(self, name: str) -> ApiKey | None:
        return self._by_name.get(name)


class TokenSigner:
    """Mints and checks short-lived HMAC-SHA256 tokens."""

    def __init__(self, secret: bytes | None = None, *, max_ttl_s: float = 600.0, clock=time.time):
        if secret is not None and len(secret) < 16:
            raise ValueError(f"the token secret must have at least 16 bytes, got {len(secret)}")
        if not max_ttl_s > 0:
            raise ValueError(f"the tokens' max TTL must be > 0, got {max_ttl_s}")
        self._secret = secret or secrets.token_bytes(32)
        self.max_ttl_s = max_ttl_s
        self.clock = clock

    def mint(self, name: str | None, ttl_s: float) -> tuple[str, int]:
        """-> (token, expiry in unix seconds) for the key `name` (None: anonymous)."""
        if not (math.isfinite(ttl_s) and 0 < ttl_s <= self.max_ttl_s):
            raise ValueError(f"ttl_s must be > 0 and <= {self.max_ttl_s:g}, got {ttl_s:g}")
        expires = int(math.ceil(self.clock() + ttl_s))
        payload = _b64(json.dumps({"k": name, "e": expires}, separators=(",", ":")).encode())
        return f"{TOKEN_VERSION}.{payload}.{self._sign(payload)}", expires

    def verify(self, token: str) -> str | None:
        """The key name a valid, unexpired token was minted for; AuthError otherwise."""
        version, _, rest = token.partition(".")
        payload, _, signature = rest.partition(".")
        if version != TOKEN_VERSION or not payload or not signature:
            raise AuthError("not a qasr token")
        if not hmac.compare_digest(self._sign(payload), signature):
            raise AuthError("the token's signature is not valid")
        try:
            claims = json.loads(_unb64(payload))
            name, expires = claims["k"], claims["e"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise AuthError("not a qasr token") from None
        if not isinstance(expires, int) or self.clock() >= expires:
            raise AuthError("the token has expired: mint a new one (POST /v1/tokens)")
        return name

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode(), hashlib.sha256).digest())


@dataclass(frozen=True)
class Credential:
    secret: str = field(repr=False)
    via: str  # header, subprotocol, token
    token_only: bool = False  # from a URL or a token subprotocol: a signed token, never a key


class Authenticator:
    """`authenticate(request) -> Principal` for every WebSocket route; `mint(request)` for POST /v1/tokens."""

    def __init__(self, keys: KeyStore = KeyStore(), signer: TokenSigner | None = None, *, required: bool = False):
        if required and not len(keys):
            raise ValueError(f"authentication is required but no API keys are configured: give --api-keys-file or "
                             f"${KEYS_ENV} (or --auth none to serve without keys)")
        self.keys = keys
        self.signer = signer or TokenSigner()
        self.required = required

    def authenticate(self, path: str, headers: Mapping[str, str] | object) -> Principal:
        """The principal of a handshake (its path with the query, and its headers); AuthError (401) if refused."""
        if not self.required:  # authentication is off: whatever a client sends is neither read nor checked
            return ANONYMOUS
        credential = find_credential(path, headers)
        if credential is None:
            raise AuthError("an API key is required: send Authorization: Bearer KEY, a qasr.key.KEY subprotocol, "
                            "or a token from POST /v1/tokens")
        return self._principal(credential)

    def mint(self, path: str, headers) -> dict:
        """POST /v1/tokens: a key in the Authorization header (a token cannot mint tokens) -> a token for a
        browser or a telephony URL. `?ttl_s=` (default 60)."""
        credential = _header_credential(headers)
        if self.required:
            if credential is None:
                raise AuthError("minting a token needs Authorization: Bearer KEY")
            key = self.keys.find(credential.secret)
            if key is None:
                raise AuthError("the API key is not valid")
            name = key.name
        else:
            name = None
        query = parse_qs(urlsplit(path).query)
        try:
            ttl_s = float(query.get("ttl_s", ["60"])[-1])
            token, expires = self.signer.mint(name, ttl_s)
        except ValueError as error:
            raise AuthError(f"ttl_s: {error}", http.HTTPStatus.BAD_REQUEST) from None
        return {"token": token, "expires_at": expires, "subprotocol": TOKEN_SUBPROTOCOL + token,
                "key": name}

    def _principal(self, credential: Credential) -> Principal:
        if not credential.token_only:
            key = self.keys.find(credential.secret)
            if key is not None:
                return Principal(key.name, key.limits, credential.via)
            if not credential.secret.startswith(TOKEN_VERSION + "."):
                raise AuthError("the API key is not valid")
        name = self.signer.verify(credential.secret)
        if name is None:  # minted while authentication was off
            raise AuthError("the token was minted without a key")
        key = self.keys.named(name)
        if key is None:
            raise AuthError("the token's key no longer exists")
        return Principal(key.name, key.limits, "token")


def find_credential(path: str, headers) -> Credential | None:
    """The first credential of a handshake, in the order of the module docstring."""
    credential = _header_credential(headers)
    if credential is not None:
        return credential
    api_key = _header(headers, "X-API-KEY")
    if api_key:
        return Credential(api_key.strip(), "header")
    offered = offered_subprotocols(headers)
    for index, subprotocol in enumerate(offered):
        if subprotocol.startswith(KEY_SUBPROTOCOL):
            return Credential(subprotocol[len(KEY_SUBPROTOCOL):], "subprotocol")
        if subprotocol.startswith(OPENAI_KEY_SUBPROTOCOL):
            return Credential(subprotocol[len(OPENAI_KEY_SUBPROTOCOL):], "subprotocol")
        if subprotocol.startswith(TOKEN_SUBPROTOCOL):
            return Credential(subprotocol[len(TOKEN_SUBPROTOCOL):], "token", token_only=True)
        if subprotocol.lower() in DEEPGRAM_SUBPROTOCOLS and index + 1 < len(offered):
            return Credential(offered[index + 1], "subprotocol")
    query = parse_qs(urlsplit(path).query)
    for name in URL_KEY_PARAMETERS:
        if name in query:
            raise AuthError(f"API keys never go in a URL (?{name}=): mint a short-lived token with POST /v1/tokens "
                            "and pass ?token=")
    if "token" in query:
        return Credential(query["token"][-1], "token", token_only=True)
    return None


def choose_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol the server echoes (a browser fails the connection unless one it offered comes back): the
    application's ("realtime") where offered, else the one that carried the credential."""
    for subprotocol in offered:
        if subprotocol in APPLICATION_SUBPROTOCOLS:
            return subprotocol
    for index, subprotocol in enumerate(offered):
        if subprotocol.startswith((KEY_SUBPROTOCOL, TOKEN_SUBPROTOCOL, OPENAI_KEY_SUBPROTOCOL)):
            return subprotocol
        if subprotocol.lower() in DEEPGRAM_SUBPROTOCOLS and index + 1 < len(offered):
            return subprotocol
    return None


def offered_subprotocols(headers) -> list[str]:
    values = headers.get_all("Sec-WebSocket-Protocol") if hasattr(headers, "get_all") else \
        [headers.get("Sec-WebSocket-Protocol") or ""]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _header(headers, name: str) -> str | None:
    if hasattr(headers, "get_all"):  # websockets' Headers: case-insensitive
        values = headers.get_all(name)
        return values[0] if values else None
    lowered = {key.lower(): value for key, value in headers.items()}
    return lowered.get(name.lower())


def _header_credential(headers) -> Credential | None:
    authorization = _header(headers, "Authorization")
    if not authorization:
        return None
    scheme, _, secret = authorization.strip().partition(" ")
    if scheme.lower() not in ("bearer", "token") or not secret.strip():
        raise AuthError("Authorization must be `Bearer KEY` or `Token KEY`")
    return Credential(secret.strip(), "header")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def main(argv: list[str] | None = None) -> int:
    """`python -m qasr.server.auth hash-key` (the key on stdin) or `new-key`: lines for --api-keys-file."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["hash-key"]:
        key = sys.stdin.readline().strip()
        if len(key) < MIN_KEY_CHARS:
            print(f"give the key on stdin (at least {MIN_KEY_CHARS} characters)", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    if argv == ["new-key"]:
        key = secrets.token_urlsafe(32)
        print(f"key (give it to the client, store it nowhere else): {key}", file=sys.stderr)
        print(hash_key(key))
        return 0
    print("usage: python -m qasr.server.auth hash-key < key.txt | new-key", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
