"""What text wire formats carry, decoded fast and exactly as the standard library decodes it: JSON messages and base64
audio (OpenAI Realtime appends, Twilio and Telnyx media frames: one of each per 20-100 ms of every stream); and the
JSON events the adapters send, encoded fast.

orjson and pybase64 (SIMD) do the work, ~3x and ~10x faster than `json` and `base64` on these messages. They differ
at the edges: orjson refuses NaN, Infinity, lone surrogates and very deep nesting and reads integers beyond 64 bits as floats;
pybase64 refuses padding beyond a whole quantum, which `base64` accepts. So whatever they refuse, and any message in
which orjson found a float (rare in these protocols), is decoded again by the standard library, which then gives
its own value or raises its own error with its own message: the adapters behave as before, only faster.

`json_dumps` writes what `json.dumps(value, ensure_ascii=False, separators=(",", ":"))` writes, character for
character, except a float below 1e-4, which orjson writes positionally (0.00001 where json writes 1e-05: the same
number), and NaN or an infinity, null (json writes NaN, which is not JSON; no event carries one); what orjson refuses (integers beyond 64 bits, lone surrogates, keys that are not strings) the standard library
encodes.
"""

from __future__ import annotations

import base64
import binascii
import json

import orjson
import pybase64


def json_loads(text: str | bytes):
    """json.loads(text): the same value, or the same exception (ValueError, RecursionError)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
    return json.loads(text) if _has_float(value) else value


def _has_float(value) -> bool:
    """Whether a decoded JSON value holds a float anywhere (orjson's reading of a huge integer is one)."""
    kind = type(value)
    if kind is dict:
        value = value.values()
    elif kind is not list:
        return kind is float
    for item in value:
        kind = type(item)
        if kind is float or (kind is dict or kind is list) and _has_float(item):
            return True
    return False


def json_dumps(value) -> str:
    """Compact JSON text, non-ASCII as it is (see the module's note on floats)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def b64decode(text: str | bytes) -> bytes:
    """base64.b64decode(text, validate=True): the same bytes, or the same exception (binascii.Error, ValueError)."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return base64.b64decode(text, validate=True)
