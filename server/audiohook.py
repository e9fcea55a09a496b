"""Genesys Cloud AudioHook (protocol version 2), qasr as the AudioHook server, sans-I/O; served at `/v1/audiohook`.

Handshake headers: `Audiohook-Organization-Id`, `Audiohook-Session-Id` (every message's `id` must equal it),
`Audiohook-Correlation-Id`, `X-API-KEY`. The API key is the server's own authentication (qasr.server.auth reads
`X-API-KEY`): the handshake gate answers a missing or wrong key with HTTP 401 before the upgrade, as AudioHook
expects, so this adapter never sees an unauthenticated client.
Text frames are JSON messages `{"version": "2", "id", "type", "seq", "parameters", ...}`; the client's also carry
`serverseq` (the last server seq it saw) and `position` ("PT12.34S", the audio sent so far); the server's carry
`clientseq` (the last client seq it saw). Binary frames are audio in the media chosen at `open`.

    client                                     server (this adapter)
    open {organizationId, conversationId,      opened {media: [the one chosen offer], startPaused: false}
          participant, media: [offers],          chosen: PCMU or L16 at 8 kHz, two channels (external, internal)
          language?, supportedLanguages?}        before one; none usable: disconnect (error)
    binary audio (ACTIVE only)                 -> the stream's sessions (one per channel); position advances
    ping {rtt?}                                pong
    update {language}                          updated (qasr detects the language per segment; see docs)
    paused / resumed                           PAUSED (open segments are finalised) / ACTIVE
    discarded, error                           noted (an error becomes an `error` event of the call)
    close {reason}                             the remaining finals as events, then closed
                                               event {entities: [{type: "transcript", data: {id, channelId, isFinal,
                                                 offset, duration, alternatives: [{confidence, interpretations:
                                                 [{type: "display", transcript, tokens?}]}]}}]}  (partials:
                                                 isFinal false; tokens: a final's words, on a server with --aligner)

A `conversationId` of all zeros is Genesys's connection probe: it is opened and closed like a call, but nothing is
transcribed and no call is published. Protocol violations (a `seq` that is not the last one + 1, a `serverseq`
ahead of the server's, another session's `id`, a malformed message, audio outside ACTIVE) are answered with
`disconnect` {reason: "error", info: "Client Error: ..."} and the connection closes. The call id is the
`conversationId`; channel 0 is `external` (the customer: "caller"), channel 1 `internal` (the agent).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from typing import Mapping

from qasr.audio import AudioError, decode_pcm
from qasr.server import errors
from qasr.server.calls import AGENT, CALLER, CallRegistry, CallStream, Track
from qasr.server.commands import Audio, Command, End, Flush, Notice, Reply, Start
from qasr.server.languages import canonical_language
from qasr.server.media_stream import stream_settings
from qasr.streaming import events
from qasr.streaming.settings import StreamLimits, StreamSettings

VERSION = "2"
PROBE_CONVERSATION = "00000000-0000-0000-0000-000000000000"
UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
DURATION = re.compile(r"^PT(\d*\.)?\d+S$")
FORMATS = {"PCMU": "mulaw", "L16": "s16le"}  # AudioHook format -> qasr.audio encoding
RATE = 8000
SPEAKERS = {"external": CALLER, "internal": AGENT}
CLIENT_TYPES = {"open", "close", "ping", "update", "paused", "resumed", "discarded", "error"}
CONFIDENCE = 1.0  # Qwen3-ASR gives no confidence; the transcript entity requires one
MAX_TEXT_CHARS = 65535  # the reference server's limit on a text message


class State(enum.Enum):
    PREPARING = "preparing"  # awaiting open
    ACTIVE = "active"
    PAUSED = "paused"
    CLOSING = "closing"  # close received: finals, then closed
    CLOSED = "closed"
    DISCONNECTED = "disconnected"  # we sent disconnect


class AudioHookAdapter:
    PLATFORM = "audiohook"
    finalise_on_disconnect = True  # a socket lost without `close` still finalises the call's open segments

    def __init__(self, *, defaults: StreamSettings, limits: StreamLimits, calls: CallRegistry,
                 headers: Mapping[str, str]):
        """headers: the handshake's (case-insensitive lookups)."""
        self.defaults = defaults
        self.limits = limits
        self.calls = calls
        self.headers = {key.lower(): value for key, value in headers.items()}
        self.session_id = self.headers.get("audiohook-session-id", "")
        self.state = State.PREPARING
        self.seq = 0  # the last server message's seq
        self.clientseq = 0  # the last client message's seq
        self.position_samples = 0  # audio received, per channel
        self.probe = False
        self.media: dict | None = None  # the chosen offer
        self.settings: StreamSettings | None = None
        self.call: CallStream | None = None

    @property
    def position(self) -> str:
        return duration(self.position_samples / RATE)

    # -- client -> server ------------------------------------------------------------------------------------

    def greeting(self) -> list[str | bytes]:
        return []

    def receive(self, message: str | bytes) -> list[Command]:
        if self.state in (State.CLOSED, State.DISCONNECTED):
            return []
        if isinstance(message, str):
            return self._text(message)
        return self._audio(bytes(message))

    def _text(self, text: str) -> list[Command]:
        if len(text) > MAX_TEXT_CHARS:
            raise errors.MalformedMessage(f"Text message too large (>64K). Length: {len(text)}")
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):
            raise errors.MalformedMessage("Text message not valid JSON") from None
        if not _is_client_message(message):
            raise errors.MalformedMessage("Message not a well-formed client message")
        if message["seq"] != self.clientseq + 1:
            raise errors.MalformedMessage(f"Invalid seq value (not monotonically increasing): expected "
                                          f"{self.clientseq + 1}, got {message['seq']}")
        self.clientseq = message["seq"]
        if message["serverseq"] > self.seq:
            raise errors.MalformedMessage(f"Invalid serverseq value: {message['serverseq']} is beyond the server's "
                                          f"{self.seq}")
        if message["id"] != self.session_id:
            if self.session_id:
                raise errors.MalformedMessage("Session identifier mismatch")
            self.session_id = message["id"]  # no Audiohook-Session-Id header: the first message sets it
        kind, parameters = message["type"], message["parameters"]
        if kind not in CLIENT_TYPES:
            raise errors.MalformedMessage(f"Invalid Message: '{kind}' is not a supported client message")
        return getattr(self, f"_on_{kind}")(parameters)

    def _on_open(self, parameters: dict) -> list[Command]:
        if self.state is not State.PREPARING:
            return []  # as the reference server: a repeated open is ignored
        if not (_is_uuid(parameters.get("organizationId")) and _is_uuid(parameters.get("conversationId"))
                and isinstance(parameters.get("participant"), dict) and isinstance(parameters.get("media"), list)):
            raise errors.MalformedMessage("Invalid Message: Invalid/missing parameters")
        self.media = choose_media(parameters["media"])
        if self.media is None:
            raise errors.UnsupportedFormat("no supported media offered: qasr takes PCMU or L16 at 8000 Hz, "
                                           "one or two channels")
        channels = self.media["channels"]
        language = _language(parameters.get("language"))
        custom = parameters.get("customConfig") if isinstance(parameters.get("customConfig"), dict) else {}
        wanted = {key: str(value) for key, value in custom.items() if isinstance(value, (str, int, float))}
        if language and "qasr_language" not in wanted:
            wanted["qasr_language"] = language
        settings = stream_settings(self.defaults, self.limits, sample_rate=RATE,
                                   encoding=FORMATS[self.media["format"]], num_tracks=len(channels),
                                   parameters=wanted)
        # a final's word times become its transcript tokens wherever this server can time words
        self.settings = dataclasses.replace(settings, words=self.limits.word_times)
        self.probe = parameters["conversationId"] == PROBE_CONVERSATION
        if not self.probe:
            participant = parameters["participant"]
            tracks = tuple(Track(channel, name, SPEAKERS[name]) for channel, name in enumerate(channels))
            self.call = self.calls.open(
                parameters["conversationId"], platform=self.PLATFORM, stream_id=self.session_id, tracks=tracks,
                parameters=wanted, metadata={"organization_id": parameters["organizationId"],
                                             "ani": participant.get("ani"), "dnis": participant.get("dnis"),
                                             "correlation_id": self.headers.get("audiohook-correlation-id"),
                                             "media": self.media})
        self.state = State.ACTIVE
        opened = {"media": [self.media], "startPaused": False}
        if parameters.get("supportedLanguages") is True:
            opened["supportedLanguages"] = []  # qasr detects the language: it asks for none
        return [Start(self.settings), self._reply("opened", opened)]

    def _on_ping(self, parameters: dict) -> list[Command]:
        return [self._reply("pong", {})]

    def _on_update(self, parameters: dict) -> list[Command]:
        if self.state not in (State.ACTIVE, State.PAUSED):
            return []
        return [self._reply("updated", {})]

    def _on_paused(self, parameters: dict) -> list[Command]:
        if self.state is not State.ACTIVE:
            return []
        self.state = State.PAUSED
        return [Flush()]  # no audio until resumed: what was said so far is final

    def _on_resumed(self, parameters: dict) -> list[Command]:
        if self.state is State.PAUSED:
            self.state = State.ACTIVE
        return []

    def _on_discarded(self, parameters: dict) -> list[Command]:
        return []  # offsets count the audio received, which is what `position` counts too

    def _on_error(self, parameters: dict) -> list[Command]:
        return [Notice("client_error", f"audiohook client error {parameters.get('code')}: "
                                       f"{str(parameters.get('message', ''))[:256]}")]

    def _on_close(self, parameters: dict) -> list[Command]:
        if self.state is State.CLOSING:
            return []
        if self.state is State.PREPARING:  # closed before it opened: nothing to finalise
            self.state = State.CLOSED
            return [self._reply("closed", {})]
        self.state = State.CLOSING
        return [End()]  # `closed` follows the last final (encode, on the summary)

    def _audio(self, data: bytes) -> list[Command]:
        if self.state is not State.ACTIVE:
            raise errors.MalformedMessage(f"Received audio in state {self.state.name}")
        try:
            samples = decode_pcm(data, self.settings.encoding, self.settings.channels)
        except AudioError as error:
            raise errors.MalformedMessage(f"Binary data not a valid audio frame. Error: {error}") from None
        self.position_samples += len(samples)
        if self.call is not None:
            for channel in range(self.settings.channels):
                self.call.audio(len(samples) / RATE, channel)
        if self.probe or not len(samples):
            return []  # the probe is answered, not transcribed
        return [Audio(samples)]

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> list[str | bytes]:
        channel = getattr(event, "channel", 0) or 0  # set on the events of a multichannel stream
        if self.call is not None:
            self.call.event(event, channel)
        if isinstance(event, events.Error) and event.fatal:
            return self._disconnect(event)
        if self.state is State.DISCONNECTED:
            return []
        if isinstance(event, events.Summary) and self.state is State.CLOSING:
            self.state = State.CLOSED
            return [self._message("closed", {})]
        if isinstance(event, (events.Partial, events.Final)) and event.text.strip() and not self.probe:
            return [self._message("event", {"entities": [self._transcript(event, channel)]})]
        return []

    def _transcript(self, event: events.Partial | events.Final, channel: int) -> dict:
        segment = uuid.uuid5(uuid.NAMESPACE_URL, f"qasr:audiohook:{self.session_id}/{channel}/{event.segment_id}")
        interpretation = {"type": "display", "transcript": event.text}
        if getattr(event, "words", None):  # a final the aligner timed
            interpretation["tokens"] = transcript_tokens(event.words)
        return {"type": "transcript", "data": {
            "id": str(segment), "channelId": channel, "isFinal": isinstance(event, events.Final),
            "offset": duration(event.start), "duration": duration(max(0.0, event.end - event.start)),
            "alternatives": [{"confidence": CONFIDENCE, "interpretations": [interpretation]}]}}

    def _disconnect(self, error: events.Error) -> list[str]:
        if self.state in (State.DISCONNECTED, State.CLOSED):
            return []
        self.state = State.DISCONNECTED
        client_fault = error.code in (errors.MalformedMessage.error_code, errors.UnsupportedFormat.error_code,
                                      errors.MessageTooBig.error_code)
        info = f"Client Error: {error.message}" if client_fault else f"Server error: {error.message}"
        return [self._message("disconnect", {"reason": "error", "info": info})]

    def close(self) -> None:
        if self.call is not None:
            self.call.close("end" if self.state is State.CLOSED else "disconnected")

    # -- messages --------------------------------------------------------------------------------------------

    def _reply(self, kind: str, parameters: dict) -> Reply:
        return Reply([self._message(kind, parameters)])

    def _message(self, kind: str, parameters: dict) -> str:
        self.seq += 1
        return json.dumps({"version": VERSION, "type": kind, "id": self.session_id, "seq": self.seq,
                           "clientseq": self.clientseq, "parameters": parameters}, separators=(",", ":"))


def choose_media(offers: list) -> dict | None:
    """The offer qasr takes: PCMU or L16 at 8 kHz, two channels (one session per speaker) before one."""
    usable = [offer for offer in offers if isinstance(offer, dict) and offer.get("type") == "audio"
              and offer.get("format") in FORMATS and offer.get("rate") == RATE
              and isinstance(offer.get("channels"), list) and 1 <= len(offer["channels"]) <= 2
              and len(set(offer["channels"])) == len(offer["channels"])
              and all(channel in SPEAKERS for channel in offer["channels"])]
    usable.sort(key=lambda offer: -len(offer["channels"]))  # stable: the client's order within a channel count
    return dict(usable[0]) if usable else None


def transcript_tokens(words: tuple[events.Word, ...]) -> list[dict]:
    """AudioHook transcript tokens (entities-transcript.ts TranscriptToken) from the aligner's words: offsets from
    the start of the stream, like the transcript's own offset."""
    return [{"type": "word", "value": word.word, "confidence": CONFIDENCE, "offset": duration(word.start),
             "duration": duration(max(0.0, word.end - word.start))} for word in words]


def duration(seconds: float) -> str:
    """AudioHook's ISO 8601 duration in seconds: 1.5 -> "PT1.5S"."""
    return f"PT{max(0.0, seconds):.3f}".rstrip("0").rstrip(".") + "S"


def _language(code) -> str | None:
    """The open's language ("en-US") if qasr can force it, else None (the model detects it)."""
    try:
        return canonical_language(code) if isinstance(code, str) else None
    except ValueError:
        return None


def _is_uuid(value) -> bool:
    return isinstance(value, str) and UUID.match(value) is not None


def _is_sequence(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_client_message(message) -> bool:
    return (isinstance(message, dict) and message.get("version") == VERSION and _is_uuid(message.get("id"))
            and isinstance(message.get("type"), str) and _is_sequence(message.get("seq"))
            and _is_sequence(message.get("serverseq")) and isinstance(message.get("position"), str)
            and DURATION.match(message["position"]) is not None and isinstance(message.get("parameters"), dict))
