"""server/wire_decode.py: orjson and pybase64 where they agree with the standard library, the standard library's
value or error wherever they do not."""

from __future__ import annotations

import base64
import json
import random

import pytest

from qasr.server.wire_decode import b64decode, json_loads


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
