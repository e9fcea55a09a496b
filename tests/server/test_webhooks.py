"""Webhook delivery without a network: an httpx MockTransport plays the receiver."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

import httpx
import pytest

from qasr.server.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookOptions, WebhookSender, check_url, signature

SECRET = b"s3cret"
URL = "http://receiver.test/hook?token=abc"


def sender(handler, *, undelivered: list | None = None, **options) -> WebhookSender:
    options = {"backoff_s": 0.001, "max_backoff_s": 0.01, **options}
    return WebhookSender(WebhookOptions(secret=SECRET, **options), transport=httpx.MockTransport(handler),
                         on_undelivered=(undelivered.append if undelivered is not None else lambda reason: None),
                         clock=lambda: 1_700_000_000.0)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_message_is_posted_as_json_with_a_signature_the_receiver_can_check():
    received = []

    def handler(request: httpx.Request) -> httpx.Response:
        received.append(request)
        return httpx.Response(204)

    async def main():
        webhooks = sender(handler)
        webhooks.submit(URL, {"type": "final", "text": "héllo"}, key="call-1")
        await webhooks.close()
        return webhooks

    webhooks = run(main())
    [request] = received
    body = request.content
    assert json.loads(body) == {"type": "final", "text": "héllo"}
    assert request.headers["content-type"] == "application/json"
    timestamp = request.headers[TIMESTAMP_HEADER]
    assert timestamp == "1700000000"
    expected = "sha256=" + hmac.new(SECRET, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    assert request.headers[SIGNATURE_HEADER] == expected == signature(SECRET, timestamp, body)
    assert (webhooks.delivered, webhooks.undelivered) == (1, 0)


def test_failures_are_retried_with_backoff_then_delivered():
    answers = [httpx.Response(503), httpx.Response(429, headers={"Retry-After": "0"}), httpx.Response(200)]
    attempts = []

    def handler(request):
        attempts.append(request.headers[SIGNATURE_HEADER])
        return answers.pop(0)

    async def main():
        webhooks = sender(handler)
        webhooks.submit(URL, {"type": "final"}, key="c")
        await webhooks.close()
        return webhooks

    webhooks = run(main())
    assert len(attempts) == 3
    assert (webhooks.delivered, webhooks.undelivered) == (1, 0)


def test_an_unreachable_receiver_is_counted_and_logged_after_the_last_attempt(caplog):
    calls = []

    def handler(request):
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    undelivered = []

    async def main():
        webhooks = sender(handler, undelivered=undelivered, max_attempts=3)
        webhooks.submit(URL, {"type": "call_ended"}, key="c")
        await webhooks.close()

    with caplog.at_level("WARNING", logger="qasr.webhooks"):
        run(main())
    assert len(calls) == 3
    assert undelivered == ["unreachable"]
    assert "call_ended event not delivered" in caplog.text
    assert "token=abc" not in caplog.text  # the URL's query may carry a secret


def test_a_client_error_answer_is_not_retried():
    calls = []
    undelivered = []

    def handler(request):
        calls.append(1)
        return httpx.Response(404)

    async def main():
        webhooks = sender(handler, undelivered=undelivered)
        webhooks.submit(URL, {"type": "final"}, key="c")
        await webhooks.close()

    run(main())
    assert calls == [1]
    assert undelivered == ["http_4xx"]


def test_messages_of_one_call_arrive_in_order_while_another_call_is_not_held_up():
    order = []

    async def main():
        gate = asyncio.Event()

        async def handler(request):
            message = json.loads(request.content)
            if message["call"] == "slow" and message["n"] == 0:
                await gate.wait()
            order.append((message["call"], message["n"]))
            return httpx.Response(200)

        webhooks = sender(handler)
        for n in range(3):
            webhooks.submit(URL, {"call": "slow", "n": n}, key="slow")
        for n in range(3):
            webhooks.submit(URL, {"call": "fast", "n": n}, key="fast")
        for _ in range(50):
            if len(order) == 3:
                break
            await asyncio.sleep(0.01)
        assert order == [("fast", 0), ("fast", 1), ("fast", 2)]  # the stuck call delays only itself
        gate.set()
        await webhooks.close()

    run(main())
    assert [n for call, n in order if call == "slow"] == [0, 1, 2]


def test_submit_never_waits_and_a_full_queue_drops_and_counts():
    undelivered = []

    async def main():
        gate = asyncio.Event()

        async def handler(request):
            await gate.wait()
            return httpx.Response(200)

        webhooks = sender(handler, undelivered=undelivered, max_queued_per_key=2)
        for n in range(4):
            webhooks.submit(URL, {"type": "final", "n": n}, key="c")  # returns at once
        assert webhooks.num_queued == 2
        gate.set()
        await webhooks.close()
        return webhooks

    webhooks = run(main())
    assert undelivered == ["queue_full", "queue_full"]
    assert webhooks.delivered == 2


def test_close_gives_up_on_what_cannot_be_sent_within_the_drain_timeout():
    undelivered = []

    async def main():
        async def handler(request):
            await asyncio.sleep(10)
            return httpx.Response(200)

        webhooks = sender(handler, undelivered=undelivered, drain_timeout_s=0.05)
        webhooks.submit(URL, {"type": "final"}, key="c")
        webhooks.submit(URL, {"type": "call_ended"}, key="c")
        await webhooks.close()
        webhooks.submit(URL, {"type": "late"}, key="c")

    run(main())
    assert undelivered == ["stopping", "stopping", "stopping"]


@pytest.mark.parametrize("url", ["ftp://x/y", "/relative", "http://", "not a url"])
def test_only_absolute_http_urls_are_accepted(url):
    with pytest.raises(ValueError, match="absolute http"):
        check_url(url)


def test_options_refuse_an_empty_secret():
    with pytest.raises(ValueError, match="secret"):
        WebhookOptions(secret=b"")
