"""Deepgram's live transcription (`/v1/listen`) as a sans-I/O wire adapter.

Binary frames carry raw audio in the query's encoding; text frames carry control messages. What maps to what:

    binary audio             -> Start (first message) + Audio          (an empty frame: CloseStream, as Deepgram)
    {"type": "KeepAlive"}    -> nothing
    {"type": "Finalize"}     -> Flush (of one "channel" if given); its result has from_finalize: true
    {"type": "CloseStream"}  -> End: the finals, then Metadata, then close 1000
    {"type": "Configure"}    -> ConfigureSuccess (features accepted) or ConfigureFailure (keyterms cannot change)
    SpeechStarted            -> SpeechStarted (vad_events=true)
    Partial                  -> Results, is_final false (interim_results=true)
    Final                    -> Results, is_final true; UtteranceEnd after it when silence ended it (utterance_end_ms)
    Summary                  -> Metadata
    Error                    -> {"type": "Error", "variant", "description"}

Results carry every field the deepgram-sdk's types require (alternatives[].confidence and words, metadata with
request_id, model_info and model_uuid). On a server with a forced aligner (qasr-server --aligner) every stream asks
for word times and a final's `words` are the aligner's; otherwise (and on interim results, and where the aligner
gives none, e.g. an unsupported language) they are estimated, spread over the segment by characters. Confidences
are 1.0 (the model gives none).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import string
import uuid

from qasr.audio import AudioError, decode_pcm
from qasr.server.commands import Audio, Command, End, Flush, Reply, Start
from qasr.server.deepgram_options import ListenOptions, QueryError
from qasr.server.wire_decode import json_dumps, json_loads
from qasr.streaming import events
from qasr.streaming.settings import SettingsError, StreamLimits, StreamSettings

MODEL_VERSION = "qasr"
MODEL_ARCH = "qwen3-asr"
CONFIDENCE = 1.0  # Qwen3-ASR gives no confidence; the SDK's types require one
FINALIZE_REASON = "flush"  # Final.reason of a segment closed by a flush (here: Finalize)
SPEECH_FINAL_REASONS = {"silence", "flush", "end"}  # the utterance ended; "max_length" cuts speech that goes on


class DeepgramAdapter:
    """One `/v1/listen` connection, built from the handshake's query string."""

    def __init__(self, query: str, *, defaults: StreamSettings, limits: StreamLimits,
                 now: datetime.datetime | None = None):
        """Raises QueryError (the handshake is refused) for options qasr cannot take."""
        self.options = ListenOptions.parse(query)
        try:
            # Deepgram's results always carry words: real ones when this server can time them
            self.settings = dataclasses.replace(self.options.stream_settings(defaults), words=limits.word_times)
            limits.check(self.settings)
        except SettingsError as error:
            raise QueryError(f"{error.field}: {error}") from None
        now = now or datetime.datetime.now(datetime.timezone.utc)
        self.created = now.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        self.request_id = str(uuid.uuid4())
        self.model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"qasr:{self.options.model}"))
        self.started = False
        self._sha256 = hashlib.sha256()
        self._frames_received = 0  # audio frames (one sample on every channel)
        self._remainder = b""  # a trailing partial frame, completed by the next message

    @property
    def num_channels(self) -> int:
        """Channels with results of their own: all of them with multichannel, else one mixed channel."""
        return self.settings.channels if self.settings.multichannel else 1

    # -- client -> server ------------------------------------------------------------------------------------

    def greeting(self) -> list[str]:
        return []

    def receive(self, message: str | bytes) -> list[Command]:
        """One client message -> commands; a bad one is answered with an Error message, never raised."""
        commands = self._audio(message) if isinstance(message, (bytes, bytearray, memoryview)) else self._text(message)
        if self.started:
            return commands
        self.started = True
        return [Start(self.settings), *commands]

    def _audio(self, data: bytes) -> list[Command]:
        """The hot path (one message per 20-100 ms of every stream): the message's bytes are decoded as they are; a
        trailing partial frame costs a copy only when there is one."""
        if not data:
            return [End()]  # Deepgram's older way to close a stream
        self._sha256.update(data)  # Metadata's sha256 is of the audio received
        if self._remainder:
            data = self._remainder + data
        partial = len(data) % self.settings.bytes_per_frame
        if partial:
            data, self._remainder = data[:-partial], bytes(data[-partial:])
        else:
            self._remainder = b""
        if not data:
            return []
        try:
            samples = decode_pcm(data, self.settings.encoding, self.settings.channels)
        except AudioError as error:
            return [self._error("DATA-0000", str(error))]
        self._frames_received += len(samples)
        return [Audio(samples)]

    def _text(self, text: str) -> list[Command]:
        try:
            message = json_loads(text)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            return [self._error("SchemaError", 'text messages must be JSON objects with a "type": KeepAlive, '
                                               "Finalize, CloseStream or Configure", message=text)]
        kind = message["type"]
        if kind == "KeepAlive":
            return []
        if kind == "CloseStream":
            return [End()]
        if kind == "Finalize":
            return self._finalize(message, text)
        if kind == "Configure":
            return [self._configure(message)]
        return [self._error("SchemaError", f"unknown message type {kind!r}: use KeepAlive, Finalize, CloseStream "
                                           "or Configure", message=text)]

    def _finalize(self, message: dict, text: str) -> list[Command]:
        channel = message.get("channel")
        if channel is None:
            return [Flush()]
        if isinstance(channel, bool) or not isinstance(channel, int) or not 0 <= channel < self.num_channels:
            return [self._error("SchemaError", f"Finalize channel must be an integer in 0..{self.num_channels - 1}, "
                                               f"got {channel!r}", message=text)]
        return [Flush(channel=channel)]

    def _configure(self, message: dict) -> Reply:
        if message.get("keyterms") is not None:
            return Reply([_json({"type": "ConfigureFailure", "request_id": self.request_id,
                                 "code": "CONFIGURE_KEYTERMS_NOT_SUPPORTED",
                                 "description": "qasr cannot change a stream's keyterms once it has started: pass "
                                                "keyterm in the query string of a new stream"})])
        features = message.get("features")
        if features is not None and (not isinstance(features, dict)
                                     or not all(isinstance(value, bool) for value in features.values())):
            return Reply([_json({"type": "ConfigureFailure", "request_id": self.request_id,
                                 "code": "CONFIGURE_INTERNAL_ERROR",
                                 "description": "features must be an object of booleans"})])
        return Reply([_json({"type": "ConfigureSuccess", "request_id": self.request_id})])  # formatting: ignored

    # -- server -> client ------------------------------------------------------------------------------------

    def encode(self, event: events.ServerEvent) -> list[str]:
        channel = getattr(event, "channel", 0) or 0  # set on events of multichannel streams
        if isinstance(event, events.SpeechStarted):
            if not self.options.vad_events:
                return []
            return [_json({"type": "SpeechStarted", "channel": [channel, self.num_channels],
                           "timestamp": round(event.start, 3)})]
        if isinstance(event, events.Partial):
            if not self.options.interim_results:
                return []
            return [self._results(event.text, event.start, event.end, channel, is_final=False)]
        if isinstance(event, events.Final):
            return self._final(event, channel)
        if isinstance(event, events.Error):
            return [self._error(event.code, event.message).frames[0]]
        if isinstance(event, events.Summary):
            return [self._metadata()]
        return []  # Ready, SpeechEnded: nothing on Deepgram's wire

    def _final(self, event: events.Final, channel: int) -> list[str]:
        frames = [self._results(event.text, event.start, event.end, channel, is_final=True,
                                speech_final=event.reason in SPEECH_FINAL_REASONS,
                                from_finalize=event.reason == FINALIZE_REASON, aligned=event.words)]
        if self.options.utterance_end_ms is not None and event.reason == "silence" and event.text.strip():
            frames.append(_json({"type": "UtteranceEnd", "channel": [channel, self.num_channels],
                                 "last_word_end": event.words[-1].end if event.words else round(event.end, 3)}))
        return frames

    def _results(self, text: str, start: float, end: float, channel: int, *, is_final: bool,
                 speech_final: bool = False, from_finalize: bool = False,
                 aligned: tuple[events.Word, ...] | None = None) -> str:
        words = aligned_words(text, aligned) if aligned else estimated_words(text, start, end)
        return _json({
            "type": "Results", "channel_index": [channel, self.num_channels],
            "duration": round(end - start, 3), "start": round(start, 3),
            "is_final": is_final, "speech_final": speech_final, "from_finalize": from_finalize,
            "channel": {"alternatives": [{"transcript": text, "confidence": CONFIDENCE,
                                          "words": words}]},
            "metadata": {"request_id": self.request_id, "model_uuid": self.model_uuid,
                         "model_info": {"name": self.options.model, "version": MODEL_VERSION, "arch": MODEL_ARCH}},
        })

    def _metadata(self) -> str:
        return _json({
            "type": "Metadata", "transaction_key": "deprecated", "request_id": self.request_id,
            "sha256": self._sha256.hexdigest(), "created": self.created,
            "duration": round(self._frames_received / self.settings.sample_rate, 3),
            "channels": self.settings.channels, "models": [self.model_uuid],
            "model_info": {self.model_uuid: {"name": self.options.model, "version": MODEL_VERSION,
                                             "arch": MODEL_ARCH}},
        })

    def _error(self, variant: str, description: str, *, message: str | None = None) -> Reply:
        return Reply([_json({"type": "Error", "variant": variant, "description": description,
                             **({"message": message} if message is not None else {})})])


def aligned_words(text: str, aligned: tuple[events.Word, ...]) -> list[dict]:
    """Deepgram's `words` from the aligner's (stream time). The aligner's units carry no punctuation; where they
    are the transcript's whitespace words one for one, `punctuated_word` is the transcript's word."""
    spelled = text.split()
    if len(spelled) != len(aligned):  # e.g. one unit per CJK character, or a word of punctuation alone
        spelled = [word.word for word in aligned]
    return [{"word": word.word.lower(), "start": word.start, "end": word.end, "confidence": CONFIDENCE,
             "punctuated_word": punctuated} for word, punctuated in zip(aligned, spelled)]


def estimated_words(text: str, start: float, end: float) -> list[dict]:
    """Deepgram's `words` for a transcript without an aligner: each word gets a share of [start, end] in
    proportion to its characters. An estimate (pauses and pre-roll inside the segment are not known)."""
    words = text.split()
    total = sum(len(word) for word in words)
    if not total:
        return []
    per_char, position, result = (end - start) / total, start, []
    for word in words:
        word_end = position + len(word) * per_char
        result.append({"word": word.strip(string.punctuation).lower() or word, "start": round(position, 3),
                       "end": round(word_end, 3), "confidence": CONFIDENCE, "punctuated_word": word})
        position = word_end
    return result


def _json(payload: dict) -> str:
    return json_dumps(payload)
