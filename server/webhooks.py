"""Call events out by HTTP POST: signed, retried with backoff, in order per call, never blocking the audio path.

`WebhookSender.submit(url, message, key=call_id)` only queues (it never awaits): one delivery task per key posts
that key's messages in order, so one slow or dead receiver delays only its own call. A message that cannot be
delivered (retries used up, a 4xx answer, the key's queue full, the server stopping) is logged and reported to
`on_undelivered(reason)` (the server counts it on /metrics as `qasr_webhooks_undelivered_total{reason}`).

What a receiver gets (docs/integrations.md, "Webhooks"):

    POST <url>
    Content-Type: application/json
    X-Qasr-Timestamp: 1718000000                      unix seconds when this attempt was signed
    X-Qasr-Signature: sha256=<hex>                    HMAC-SHA256(secret, "<timestamp>." + body), hex digest
    <body: one call event as JSON (calls.py draws the shapes)>

A 2xx answer is success. 408, 429 and 5xx answers and transport errors are retried (`max_attempts` in all, waiting
`backoff_s * 2**n`, at most `max_backoff_s`, or the answer's Retry-After seconds when it gives them, capped the
same way); other answers are final failures.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("qasr.webhooks")

SIGNATURE_HEADER = "X-Qasr-Signature"
TIMESTAMP_HEADER = "X-Qasr-Timestamp"
RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    """The X-Qasr-Signature value for `body` signed at `timestamp`: what a receiver recomputes and compares."""
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def check_url(url: str) -> str:
    """`url` if it is an absolute http(s) URL; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"a webhook URL must be an absolute http:// or https:// URL, got {url!r}")
    return url


@dataclass(frozen=True)
class WebhookOptions:
    secret: bytes  # the HMAC key receivers share with the server
    max_attempts: int = 5  # tries per message, the first included
    backoff_s: float = 0.5  # the wait before the second try; doubles for each further one
    max_backoff_s: float = 10.0
    timeout_s: float = 5.0  # per attempt: connect, send, answer
    max_queued_per_key: int = 1000  # messages waiting for one call; more are dropped (and counted)
    drain_timeout_s: float = 10.0  # close() waits this long for queued messages

    def __post_init__(self):
        if not self.secret:
            raise ValueError("webhooks need a non-empty signing secret")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("webhook backoff and timeouts must be >= 0 (timeout_s > 0)")
        if self.max_queued_per_key < 1:
            raise ValueError(f"max_queued_per_key must be >= 1, got {self.max_queued_per_key}")


class WebhookSender:
    """Posts messages on the event loop it is used from. `submit` never blocks; `close` drains, then stops."""

    def __init__(self, options: WebhookOptions, *, on_undelivered: Callable[[str], None] = lambda reason: None,
                 transport: httpx.AsyncBaseTransport | None = None, clock: Callable[[], float] = time.time):
        self.options = options
        self._on_undelivered = on_undelivered
        self._clock = clock
        self._client = httpx.AsyncClient(timeout=options.timeout_s, transport=transport, follow_redirects=False)
        self._queues: dict[str, collections.deque[tuple[str, bytes]]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._closing = False
        self.delivered = 0  # messages a receiver accepted
        self.undelivered = 0

    def submit(self, url: str, message: dict, *, key: str) -> None:
        """Queue `message` for `url`; messages with the same key are delivered in submission order."""
        if self._closing:
            self._give_up(url, message.get("type"), "stopping")
            return
        queue = self._queues.setdefault(key, collections.deque())
        if len(queue) >= self.options.max_queued_per_key:
            self._give_up(url, message.get("type"), "queue_full")
            return
        queue.append((url, json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()))
        if key not in self._tasks:
            self._tasks[key] = asyncio.get_running_loop().create_task(self._deliver_all(key))

    @property
    def num_queued(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def close(self) -> None:
        """Refuse new messages, give the queued ones `drain_timeout_s`, then drop what is left (counted)."""
        self._closing = True
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.options.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for queue in self._queues.values():
            for url, body in queue:
                self._give_up(url, _message_type(body), "stopping")
        self._queues.clear()
        await self._client.aclose()

    # -- delivery --------------------------------------------------------------------------------------------

    async def _deliver_all(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                url, body = queue[0]
                await self._deliver(url, body)
                queue.popleft()
        finally:
            del self._tasks[key]
            if not queue:
                del self._queues[key]

    async def _deliver(self, url: str, body: bytes) -> None:
        """One message, with retries; reports a failure instead of raising."""
        options = self.options
        reason = "unreachable"
        for attempt in range(options.max_attempts):
            wait_s = min(options.backoff_s * 2 ** attempt, options.max_backoff_s)
            try:
                response = await self._client.post(url, content=body, headers=self._headers(body))
            except httpx.HTTPError as error:
                log.info("webhook %s: attempt %d failed: %s", _host(url), attempt + 1, error)
                reason = "unreachable"
            else:
                if 200 <= response.status_code < 300:
                    self.delivered += 1
                    return
                log.info("webhook %s: attempt %d answered %d", _host(url), attempt + 1, response.status_code)
                reason = f"http_{response.status_code // 100}xx"
                if response.status_code not in RETRYABLE_STATUS:
                    break
                wait_s = min(_retry_after(response) or wait_s, options.max_backoff_s)
            if attempt + 1 < options.max_attempts:
                await asyncio.sleep(wait_s)
        self._give_up(url, _message_type(body), reason)

    def _headers(self, body: bytes) -> dict[str, str]:
        timestamp = str(int(self._clock()))
        return {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp,
                SIGNATURE_HEADER: signature(self.options.secret, timestamp, body)}

    def _give_up(self, url: str, message_type, reason: str) -> None:
        self.undelivered += 1
        log.warning("webhook %s: %s event not delivered (%s)", _host(url), message_type, reason)
        try:
            self._on_undelivered(reason)
        except Exception:  # counting must never break delivery
            log.exception("webhook undelivered hook failed")


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # absent, or an HTTP date: the backoff applies


def _message_type(body: bytes) -> str:
    try:
        return str(json.loads(body).get("type"))
    except (ValueError, AttributeError):
        return "?"


def _host(url: str) -> str:
    """The receiver named in logs without its path or query (which may carry tokens)."""
    return urlsplit(url).netloc or "?"
