"""OpenAI Realtime transcription (`/v1/realtime?intent=transcription`) as a sans-I/O wire adapter.

Client events in -> commands for the stream; qasr's session events in -> OpenAI server events out. No socket here:
tests feed messages and assert on the frames. What maps to what:

    session.update / transcription_session.update   -> session.updated / transcription_session.updated
    input_audio_buffer.append (base64)              -> Start (first audio) + Audio
    input_audio_buffer.commit                       -> Flush (the open segment ends; its item follows)
    input_audio_buffer.clear                        -> Flush, its segment(s) dropped; input_audio_buffer.cleared
    SpeechStarted                                   -> input_audio_buffer.speech_started (server VAD only)
    Partial                                         -> conversation.item.input_audio_transcription.delta
    SpeechEnded                                     -> input_audio_buffer.speech_stopped (server VAD only),
                                                       input_audio_buffer.committed
    Final                                           -> ...transcription.completed (or .failed)

One segment is one conversation item. Deltas are append-only: a partial that revises text already sent adds
nothing, and the last word of a partial is held back until a later partial or the final confirms it; `completed`
carries the true transcript. Every problem with a client event is an `error` event with OpenAI's error object
(its `event_id` names the client event) and the connection stays open, as with the real service.
"""

from __future__ import annotations

import binascii
import itertools
import re
import time
import urllib.parse
import uuid
from dataclasses import dataclass

from qasr.audio import ENCODINGS, AudioError, decode_pcm
from qasr.server.commands import Audio, Command, Flush, Reply, Start
from qasr.server.errors import UnsupportedFormat
from qasr.server.openai_session import ConfigError, RealtimeConfig
from qasr.server.wire_decode import b64decode, json_dumps, json_loads
from qasr.streaming import events
from qasr.streaming.settings import SettingsError, StreamLimits, StreamSettings

MIN_COMMIT_MS = 100  # the real service refuses to commit less audio than this
SESSION_LIFETIME_S = 3600  # reported as expires_at; qasr does not expire sessions
TIME_TOLERANCE_S = 0.005  # segment ends closed by a clear's flush land on its position (resampling rounds)
NOT_TRANSCRIPTION = {  # Realtime client events that exist for conversations, not transcription sessions
    "response.create", "response.cancel", "conversation.item.create", "conversation.item.delete",
    "conversation.item.retrieve", "conversation.item.truncate", "output_audio_buffer.clear",
}
CLIENT_ERRORS = {"malformed", "unsupported", "message_too_big", "unknown_field", "ignored", "idle_timeout"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:22]}"


class _IdSequence:
    """new_id's shape for every event of a session without a random draw each: a random stem, then a count."""

    def __init__(self, prefix: str):
        self._stem = new_id(prefix)[:-8]
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._stem}{next(self._count):08x}"


@dataclass
class _Item:
    """One segment's conversation item."""

    item_id: str
    sent: str = ""  # the transcript the deltas have carried so far
    committed: bool = False
    dropped: bool = False  # cleared by the client: nothing more is sent for it


@dataclass(frozen=True)
class _Clear:
    """An `input_audio_buffer.clear` at `at` seconds. Its flush closed the open segment there; with manual turns
    every segment that ended after the last commit (`since`) is dropped too. Decided on a segment's end: a start
    may reach back before either point by the VAD's pre-roll."""

    at: float
    since: float | None  # None: server VAD (only the open segment was uncommitted)

    def drops(self, end: float) -> bool:
        if self.since is not None:
            return self.since + TIME_TOLERANCE_S < end <= self.at + TIME_TOLERANCE_S
        return abs(end - self.at) <= TIME_TOLERANCE_S


class OpenAIRealtimeAdapter:
    """One `/v1/realtime` connection. `greeting()` once, then `receive()` per client message and `encode()` per
    session event; each returns the frames to send."""

    @classmethod
    def for_query(cls, query: str, **options) -> "OpenAIRealtimeAdapter":
        """The adapter for a connection to `/v1/realtime?{query}`. Raises UnsupportedFormat (the handshake is
        refused with HTTP 400) unless the query asks for a transcription session: qasr has no conversations."""
        intent = urllib.parse.parse_qs(query).get("intent", [None])[-1]
        if intent != "transcription":
            raise UnsupportedFormat(f"qasr serves transcription sessions only: connect to "
                                    f"/v1/realtime?intent=transcription (intent was {intent!r})")
        return cls(**options)

    def __init__(self, *, defaults: StreamSettings, limits: StreamLimits, model_name: str, clock=time.time):
        self.defaults = defaults
        self.limits = limits
        self.session_id = new_id("sess")
        self._event_ids = _IdSequence("event")
        self.expires_at = int(clock()) + SESSION_LIFETIME_S
        self.config = RealtimeConfig(model=model_name)
        self.settings = self._checked(self.config, "session")
        self.started = False  # Start sent: the stream's settings are fixed
        self._remainder = b""  # a trailing partial sample, completed by the next append
        self._position_s = 0.0  # audio appended so far, in seconds of the stream
        self._uncommitted_s = 0.0  # audio appended since the last commit or clear
        self._turn_start_s = 0.0  # where the current manual turn began
        self._clears: list[_Clear] = []
        self._items: dict[int, _Item] = {}  # by segment id
        self._last_item_id: str | None = None  # items chain through previous_item_id
        self._failed_next_final = False  # the session reported a decode failure for the next final

    # -- client -> server ------------------------------------------------------------------------------------

    def greeting(self) -> list[str]:
        return [self._frame("session.created", session=self.config.to_ga(self.session_id, self.expires_at))]

    def receive(self, message: str | bytes) -> list[Command]:
        """One client event -> commands. Never raises for a bad event: it is answered with an `error` event."""
        if not isinstance(message, str):
            return [self._error("binary frames are not supported: send audio as input_audio_buffer.append events",
                                code="invalid_message")]
        try:
            event = json_loads(message)
        except (ValueError, RecursionError) as error:
            return [self._error(f"the message is not valid JSON: {error}", code="invalid_json")]
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return [self._error('every client event must be a JSON object with a string "type"', param="type",
                                code="invalid_event")]
        handler = self.HANDLERS.get(event["type"])
        if handler is None:
            return [self._refused(event)]
        try:
            return handler(self, event)
        except ConfigError as error:
            return [self._error(str(error), param=error.param, code=error.code, event_id=_client_event_id(event))]

    def _refused(self, event: dict) -> Reply:
        kind = event["type"]
        if kind in NOT_TRANSCRIPTION:
            message = f"{kind} is not available in a transcription session"
        else:
            message = f"unknown event type {kind!r}"
        return self._error(message, param="type", code="invalid_event", event_id=_client_event_id(event))

    def _update_ga(self, event: dict) -> list[Command]:
        return self._update(event, ga=True)

    def _update_beta(self, event: dict) -> list[Command]:
        return self._update(event, ga=False)

    def _update(self, event: dict, *, ga: bool) -> list[Command]:
        config = self.config.updated(event.get("session"), ga=ga)
        settings = self._checked(config, "session")
        if self.started and settings != self.settings:
            raise ConfigError("session", "the audio format, language, prompt, keywords and turn detection cannot "
                                         "change once audio has been appended: open a new session",
                              code="session_already_started")
        self.config, self.settings = config, settings
        if ga:
            return [Reply([self._frame("session.updated", session=config.to_ga(self.session_id, self.expires_at))])]
        return [Reply([self._frame("transcription_session.updated",
                                   session=config.to_beta(self.session_id, self.expires_at))])]

    def _append(self, event: dict) -> list[Command]:
        """The hot path (one append per 20-100 ms of every stream): the base64 decodes straight to the bytes the
        samples are read from; the remainder of a partial sample costs a copy only when there is one."""
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ConfigError("audio", "audio must be a base64 string", code="invalid_value")
        try:
            data = b64decode(audio)
        except (binascii.Error, ValueError):
            raise ConfigError("audio", "audio is not valid base64", code="invalid_value") from None
        if self._remainder:
            data = self._remainder + data
        settings = self.settings
        partial = len(data) % ENCODINGS[settings.encoding]
        if partial:
            data, self._remainder = data[:-partial], data[-partial:]
        else:
            self._remainder = b""
        if not data:
            return []
        try:
            samples = decode_pcm(data, settings.encoding, 1)
        except AudioError as error:
            raise ConfigError("audio", str(error), code="invalid_value") from None
        seconds = len(samples) / settings.sample_rate
        self._position_s += seconds
        self._uncommitted_s += seconds
        if self.started:
            return [Audio(samples)]
        self.started = True
        return [Start(settings), Audio(samples)]

    def _commit(self, event: dict) -> list[Command]:
        if self._uncommitted_s * 1000 < MIN_COMMIT_MS:
            raise ConfigError(None, f"Error committing input audio buffer: buffer too small. Expected at least "
                                    f"{MIN_COMMIT_MS}ms of audio, but buffer only has "
                                    f"{self._uncommitted_s * 1000:.2f}ms of audio.",
                              code="input_audio_buffer_commit_empty")
        self._uncommitted_s = 0.0
        self._turn_start_s = self._position_s
        return [Flush()]

    def _clear(self, event: dict) -> list[Command]:
        since = self._turn_start_s if self.config.manual_turns else None
        self._uncommitted_s = 0.0
        self._remainder = b""
        self._turn_start_s = self._position_s
        commands: list[Command] = []
        if self.started:
            self._clears.append(_Clear(self._position_s, since))
            commands.append(Flush())
        return [*commands, Reply([self._frame("input_audio_buffer.cleared")])]

    HANDLERS = {  # client event type -> handler(self, event), looked up once per message
        "session.update": _update_ga,
        "transcription_session.update": _update_beta,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
    }

    def _checked(self, config: RealtimeConfig, param: str) -> StreamSettings:
        try:
            settings = config.stream_settings(self.defaults)
            self.limits.check(settings)
        except SettingsError as error:
            raise ConfigError(f"{param}.{error.field}", str(error)) from None
        except ValueError as error:  # a language the table refuses
            raise ConfigError(param, str(error)) from None
        return settings

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> list[str]:
        if isinstance(event, events.SpeechStarted):
            return self._speech_started(event)
        if isinstance(event, events.Partial):
            return self._delta(event)
        if isinstance(event, events.SpeechEnded):
            return self._speech_ended(event.segment_id, event.end)
        if isinstance(event, events.Final):
            return self._final(event)
        if isinstance(event, events.Error):
            if event.code == "decode_failed":  # the session sends it just before that segment's (empty) final
                self._failed_next_final = True
                return []
            error_type = "invalid_request_error" if event.code in CLIENT_ERRORS else "server_error"
            return [self._frame("error", error={"type": error_type, "code": event.code, "message": event.message,
                                                "param": None, "event_id": None})]
        return []  # Ready (session.created went out at connect) and Summary have no OpenAI counterpart

    def _speech_started(self, event: events.SpeechStarted) -> list[str]:
        item = _Item(new_id("item"))
        self._items[event.segment_id] = item
        if self.config.manual_turns:
            return []
        return [self._frame("input_audio_buffer.speech_started", audio_start_ms=_ms(event.start),
                            item_id=item.item_id)]

    def _delta(self, event: events.Partial) -> list[str]:
        item = self._items.get(event.segment_id)
        if item is None or item.dropped:
            return []
        stable = _stable_prefix(event.text)
        if not stable.startswith(item.sent) or len(stable) == len(item.sent):
            return []  # a revision of text already sent (append-only), or nothing new
        delta, item.sent = stable[len(item.sent):], stable
        return [self._frame("conversation.item.input_audio_transcription.delta", item_id=item.item_id,
                            content_index=0, delta=delta)]

    def _speech_ended(self, segment_id: int, end: float) -> list[str]:
        item = self._items.get(segment_id)
        if item is None or item.committed or item.dropped:
            return []
        if self._dropped(end):
            item.dropped = True
            return []
        item.committed = True
        frames = [] if self.config.manual_turns else [
            self._frame("input_audio_buffer.speech_stopped", audio_end_ms=_ms(end), item_id=item.item_id)]
        frames.append(self._frame("input_audio_buffer.committed", item_id=item.item_id,
                                  previous_item_id=self._last_item_id))
        self._last_item_id = item.item_id
        return frames

    def _final(self, event: events.Final) -> list[str]:
        failed, self._failed_next_final = self._failed_next_final, False
        frames = self._speech_ended(event.segment_id, event.end)  # when no SpeechEnded came before it
        item = self._items.pop(event.segment_id, None)
        if item is None or item.dropped:
            return frames
        if failed:
            frames.append(self._frame("conversation.item.input_audio_transcription.failed", item_id=item.item_id,
                                      content_index=0,
                                      error={"type": "server_error", "code": "transcription_failed",
                                             "message": "the audio could not be transcribed", "param": None}))
            return frames
        frames.append(self._frame("conversation.item.input_audio_transcription.completed", item_id=item.item_id,
                                  content_index=0, transcript=event.text,
                                  usage={"type": "duration", "seconds": round(event.end - event.start, 3)}))
        return frames

    def _dropped(self, end: float) -> bool:
        return any(clear.drops(end) for clear in self._clears)

    # -- frames ----------------------------------------------------------------------------------------------

    def _frame(self, kind: str, **fields) -> str:
        return json_dumps({"type": kind, "event_id": self._event_ids.next(), **fields})

    def _error(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> Reply:
        return Reply([self._frame("error", error={"type": "invalid_request_error", "code": code, "message": message,
                                                  "param": param, "event_id": event_id})])


def _client_event_id(event: dict) -> str | None:
    """The client event's own id, which an error about it names."""
    value = event.get("event_id")
    return value if isinstance(value, str) else None


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


_LAST_WORD = re.compile(r"\S+$")
HOLD_BACK_CHARS = 2  # text without spaces (Chinese, Japanese, Thai): the last characters are the likeliest to change


def _stable_prefix(text: str) -> str:
    """The part of a partial the next partial is unlikely to revise: all but its last word (or last characters)."""
    if re.search(r"\s", text.strip()):
        return _LAST_WORD.sub("", text.rstrip())
    return text[:-HOLD_BACK_CHARS] if len(text) > HOLD_BACK_CHARS else ""

