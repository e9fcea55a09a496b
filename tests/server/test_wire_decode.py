"""server/wire_decode.py: orjson and pybase64 where they agree with the standard library, the standard library's
value or error wherever they do not."""

from __future__ import annotations

import base64
import json
import random

import pytest

from qasr.server.wire_decode import b64decode, json_dumps, json_loads


def outcome(function, text):
    try:
        value = function(text)
    except (ValueError, RecursionError) as error:  # binascii.Error and JSONDecodeError are ValueErrors
        return type(error), str(error)
    return type(value), repr(value)


@pytest.mark.parametrize("text", [
    '{"event": "media", "media": {"track": "inbound", "chunk": "2", "payload": "AAEC"}}', "[1, 2.5, -0.0, 1e400]",
    '{"a": NaN}', "[Infinity, -Infinity]", '"\\ud800"', '{"a": 1, "a": 2}', "\ufeff{}", "[1,2", '"\x00"', "",
    "18446744073709551616", '{"sequenceNumber": 123456789012345678901234567890}', '{"a": [{"b": [99999999999999999999]}]}',
    "[" * 5000 + "]" * 5000, b'{"bytes": true}', "null", "  {} \n",
])
def test_json_gives_the_standard_librarys_value_or_error(text):
    assert outcome(json_loads, text) == outcome(json.loads, text)


def test_a_huge_integer_stays_an_integer_where_orjson_alone_would_give_a_float():
    assert json_loads('{"chunk": 18446744073709551616}') == {"chunk": 18446744073709551616}
    assert type(json_loads('{"chunk": 18446744073709551616}')["chunk"]) is int


@pytest.mark.parametrize("text", ["", "QUJD", "QUJD=", "QUJD====", "QQ==", "QQ=", "QQ", "Q", "QQ==QQ==", "=QQ=",
                                  "QU JD", "QUJD\n", "é", "QUJ-", "QUJ_", b"QUJD", b"QQ=="])
def test_base64_gives_the_standard_librarys_bytes_or_error(text):
    assert outcome(b64decode, text) == outcome(lambda t: base64.b64decode(t, validate=True), text)


def test_base64_agrees_with_the_standard_library_on_random_text_near_base64():
    rng = random.Random(13)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/" + "=" * 8 + " \n-_"
    for _ in range(3000):
        if rng.random() < 0.5:  # valid base64, sometimes damaged at one place
            text = base64.b64encode(rng.randbytes(rng.randrange(0, 40))).decode()
            if text and rng.random() < 0.5:
                at = rng.randrange(len(text) + 1)
                text = text[:at] + rng.choice(alphabet) + text[at:]
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        assert outcome(b64decode, text) == outcome(lambda t: base64.b64decode(t, validate=True), text), text


@pytest.mark.parametrize("value", [
    {"type": "conversation.item.input_audio_transcription.delta", "event_id": "event_1", "item_id": "item_2",
     "content_index": 0, "delta": "naïve café 東京 \u2028 \"quoted\" back\\slash \n\t\x00\x1f\x7f /"},
    {"type": "Results", "start": 12.345, "duration": 0.1, "is_final": True, "words": [], "x": None, "n": -7,
     "usage": {"seconds": 1e16}, "big": 1.2345678901234568e+17, "t": (1, 2), "z": -0.0},
    [1, 2.5, "a"], "text", 3, None, True,
])
def test_json_dumps_writes_what_the_standard_library_writes(value):
    assert json_dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("value", [{"n": 18446744073709551616}, {"s": "\ud800"}, {1: "int key"}])
def test_json_dumps_leaves_what_orjson_refuses_to_the_standard_library(value):
    assert json_dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_json_dumps_writes_a_tiny_float_positionally_as_the_same_number():
    assert json_dumps({"t": 1e-05}) == '{"t":0.00001}' and json.loads(json_dumps({"t": 1e-05})) == {"t": 1e-05}
