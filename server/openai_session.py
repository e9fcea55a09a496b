"""An OpenAI Realtime transcription session's configuration: parsed from `session.update` (the GA shape) or
`transcription_session.update` (the older beta shape), echoed back in either shape, and mapped onto qasr's
stream settings.

    RealtimeConfig.updated(session, ga=True)  -> a new RealtimeConfig (ConfigError names the bad field)
    config.stream_settings(defaults)          -> StreamSettings for the session (format, language, context, VAD)
    config.to_ga(session_id) / to_beta(...)   -> the session object as session.updated / .updated events carry it

Only fields present in an update change (as the real service does); `turn_detection: null` switches to manual
turns (the client's commit ends one). docs/integrations.md lists which fields qasr honours and which it accepts and
ignores.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from qasr.server.languages import canonical_language
from qasr.streaming.settings import StreamSettings

PCM_RATE = 24000  # Hz: the only rate OpenAI's audio/pcm takes
G711_RATE = 8000  # Hz: audio/pcmu and audio/pcma are telephony audio
FORMATS = {"audio/pcm": "s16le", "audio/pcmu": "mulaw", "audio/pcma": "alaw"}  # GA format type -> qasr encoding
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
TURN_TYPES = ("server_vad", "semantic_vad")
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 300}  # semantic_vad -> end silence
MANUAL_END_SILENCE_MS = 5000  # turn_detection null: the VAD's longest silence, so a turn is one segment
END_SILENCE_MS = (100, 5000)  # what qasr's VAD accepts (StreamLimits); OpenAI values outside are clamped
PRE_ROLL_MS = (0, 2000)
DEFAULT_TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                          "silence_duration_ms": 500}


class ConfigError(ValueError):
    """A session update qasr cannot take; `param` is the field's path, as OpenAI's error object names it."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RealtimeConfig:
    """What the client configured, in OpenAI's terms (echoed back as it was given)."""

    format: str = "audio/pcm"  # FORMATS key
    rate: int = PCM_RATE  # Hz of audio/pcm
    model: str = ""  # the transcription model the client named: reported, never enforced
    language: str | None = None  # as sent ("en"); None: detect
    languages: tuple[str, ...] = ()  # possible languages; one of them forces it, several mean "detect"
    prompt: str = ""  # -> the decoder context
    keywords: tuple[str, ...] = ()  # -> the decoder context, after the prompt
    delay: str | None = None  # accepted and reported; qasr's latency is set by the partial interval
    turn_detection: dict | None = dataclasses.field(default_factory=lambda: dict(DEFAULT_TURN_DETECTION))
    noise_reduction: dict | None = None  # accepted and reported; qasr does not filter audio
    include: tuple[str, ...] | None = None  # accepted; qasr has no logprobs to include

    @property
    def manual_turns(self) -> bool:
        """turn_detection null: the client's commit ends a turn; no speech_started/stopped events."""
        return self.turn_detection is None

    # -- updates ---------------------------------------------------------------------------------------------

    def updated(self, session: dict, *, ga: bool) -> "RealtimeConfig":
        """This configuration with the fields present in `session` changed. Raises ConfigError."""
        if not isinstance(session, dict):
            raise ConfigError("session", "session must be an object")
        if ga:
            return self._updated_ga(session)
        return self._updated_beta(session)

    def _updated_ga(self, session: dict) -> "RealtimeConfig":
        kind = session.get("type", "transcription")
        if kind != "transcription":
            raise ConfigError("session.type", f"session.type {kind!r} is not supported: qasr serves transcription "
                                              "sessions only (connect with ?intent=transcription, type "
                                              '"transcription")')
        config = self
        audio = _object(session, "audio", "session.audio")
        audio_input = _object(audio, "input", "session.audio.input")
        if "format" in audio_input:
            config = config._with_format(audio_input["format"], "session.audio.input.format")
        if "transcription" in audio_input:
            config = config._with_transcription(audio_input["transcription"], "session.audio.input.transcription")
        if "turn_detection" in audio_input:
            config = config._with_turn_detection(audio_input["turn_detection"], "session.audio.input.turn_detection")
        if "noise_reduction" in audio_input:
            noise = audio_input["noise_reduction"]
            config = dataclasses.replace(config, noise_reduction=_optional_object(
                noise, "session.audio.input.noise_reduction"))
        if "include" in session:
            config = dataclasses.replace(config, include=_optional_strings(session["include"], "session.include"))
        return config

    def _updated_beta(self, session: dict) -> "RealtimeConfig":
        config = self
        if "input_audio_format" in session:
            name = session["input_audio_format"]
            if not isinstance(name, str) or name not in BETA_FORMATS:  # a list or an object is no format name
                raise ConfigError("session.input_audio_format", f"input_audio_format {name!r} is not supported: use "
                                                                f"{', '.join(BETA_FORMATS)}")
            config = config._with_format({"type": BETA_FORMATS[name]}, "session.input_audio_format")
        if "input_audio_transcription" in session:
            config = config._with_transcription(session["input_audio_transcription"],
                                                "session.input_audio_transcription")
        if "turn_detection" in session:
            config = config._with_turn_detection(session["turn_detection"], "session.turn_detection")
        if "input_audio_noise_reduction" in session:
            config = dataclasses.replace(config, noise_reduction=_optional_object(
                session["input_audio_noise_reduction"], "session.input_audio_noise_reduction"))
        if "include" in session:
            config = dataclasses.replace(config, include=_optional_strings(session["include"], "session.include"))
        return config

    def _with_format(self, value, param: str) -> "RealtimeConfig":
        value = _optional_object(value, param) or {}
        kind = value.get("type", "audio/pcm")
        if kind not in FORMATS:
            raise ConfigError(f"{param}.type", f"audio format {kind!r} is not supported: use {', '.join(FORMATS)}")
        rate = value.get("rate", PCM_RATE) if kind == "audio/pcm" else G711_RATE
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise ConfigError(f"{param}.rate", f"rate must be an integer, got {rate!r}")
        return dataclasses.replace(self, format=kind, rate=rate)

    def _with_transcription(self, value, param: str) -> "RealtimeConfig":
        value = _optional_object(value, param) or {}
        config = self
        if "model" in value:
            config = dataclasses.replace(config, model=_string(value, "model", param) or "")
        if "language" in value:
            language = _string(value, "language", param)
            _language(language, f"{param}.language")
            config = dataclasses.replace(config, language=language or None)
        if "languages" in value:
            languages = _optional_strings(value["languages"], f"{param}.languages") or ()
            for index, language in enumerate(languages):
                _language(language, f"{param}.languages[{index}]")
            config = dataclasses.replace(config, languages=languages)
        if "prompt" in value:
            config = dataclasses.replace(config, prompt=_string(value, "prompt", param) or "")
        if "keywords" in value:
            config = dataclasses.replace(config, keywords=_optional_strings(value["keywords"], f"{param}.keywords")
                                         or ())
        if "delay" in value:
            config = dataclasses.replace(config, delay=_string(value, "delay", param))
        return config

    def _with_turn_detection(self, value, param: str) -> "RealtimeConfig":
        if value is None:
            return dataclasses.replace(self, turn_detection=None)
        value = _optional_object(value, param)
        kind = value.get("type", "server_vad")
        if kind not in TURN_TYPES:
            raise ConfigError(f"{param}.type", f"turn_detection.type {kind!r} is not supported: use "
                                               f"{' or '.join(TURN_TYPES)}, or null for manual commits")
        for name in ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
            number = value.get(name)
            if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float))
                                       or not math.isfinite(number) or number < 0):
                raise ConfigError(f"{param}.{name}", f"{name} must be a non-negative number, got {number!r}")
        if value.get("threshold") is not None and value["threshold"] > 1:
            raise ConfigError(f"{param}.threshold", f"threshold must be between 0 and 1, got {value['threshold']}")
        eagerness = value.get("eagerness")
        if eagerness is not None and eagerness not in EAGERNESS_SILENCE_MS:
            raise ConfigError(f"{param}.eagerness", f"eagerness must be one of {', '.join(EAGERNESS_SILENCE_MS)}, "
                                                    f"got {eagerness!r}")
        merged = {**DEFAULT_TURN_DETECTION, **value} if kind == "server_vad" else {"type": kind, **value}
        return dataclasses.replace(self, turn_detection=merged)

    # -- qasr's settings -------------------------------------------------------------------------------------

    def stream_settings(self, defaults: StreamSettings) -> StreamSettings:
        """The stream settings this configuration asks for (the caller's limits check them)."""
        vad = defaults.vad
        turn = self.turn_detection
        if turn is None:
            vad = dataclasses.replace(vad, end_silence_ms=MANUAL_END_SILENCE_MS)
        elif turn["type"] == "semantic_vad":
            vad = dataclasses.replace(vad, end_silence_ms=EAGERNESS_SILENCE_MS[turn.get("eagerness") or "auto"])
        else:
            vad = dataclasses.replace(
                vad, aggressiveness=min(3, int(float(turn["threshold"]) * 4)),
                pre_roll_ms=_clamp(turn["prefix_padding_ms"], *PRE_ROLL_MS),
                end_silence_ms=_clamp(turn["silence_duration_ms"], *END_SILENCE_MS))
        return dataclasses.replace(defaults, sample_rate=self.rate, encoding=FORMATS[self.format], channels=1,
                                   language=self._forced_language(), context=self.context, vad=vad)

    def _forced_language(self) -> str | None:
        if self.language:
            return canonical_language(self.language)
        if len(self.languages) == 1:
            return canonical_language(self.languages[0])
        return None  # none or several: the model detects it

    @property
    def context(self) -> str:
        """The decoder's hints: the prompt, then the keywords."""
        parts = [self.prompt.strip()] if self.prompt.strip() else []
        if self.keywords:
            parts.append(", ".join(keyword.strip() for keyword in self.keywords if keyword.strip()))
        return "\n".join(parts)

    # -- echoes ----------------------------------------------------------------------------------------------

    def transcription(self) -> dict:
        return {"model": self.model, "language": self.language, "prompt": self.prompt,
                **({"languages": list(self.languages)} if self.languages else {}),
                **({"keywords": list(self.keywords)} if self.keywords else {}),
                **({"delay": self.delay} if self.delay is not None else {})}

    def to_ga(self, session_id: str, expires_at: int) -> dict:
        """The GA session object (session.created / session.updated)."""
        audio_format = {"type": self.format, **({"rate": self.rate} if self.format == "audio/pcm" else {})}
        return {"type": "transcription", "object": "realtime.transcription_session", "id": session_id,
                "expires_at": expires_at,
                "audio": {"input": {"format": audio_format, "transcription": self.transcription(),
                                    "noise_reduction": self.noise_reduction, "turn_detection": self.turn_detection}},
                "include": list(self.include) if self.include is not None else None}

    def to_beta(self, session_id: str, expires_at: int) -> dict:
        """The beta session object (transcription_session.updated)."""
        beta_format = {ga: beta for beta, ga in BETA_FORMATS.items()}[self.format]
        return {"id": session_id, "object": "realtime.transcription_session", "expires_at": expires_at,
                "input_audio_format": beta_format, "input_audio_transcription": self.transcription(),
                "turn_detection": self.turn_detection, "input_audio_noise_reduction": self.noise_reduction,
                "include": list(self.include) if self.include is not None else None, "modalities": ["text"],
                "client_secret": {"value": "", "expires_at": expires_at}}  # required by the SDK's type; no secret


def _object(parent: dict, name: str, param: str) -> dict:
    value = parent.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(param, f"{param} must be an object, got {value!r}")
    return value


def _optional_object(value, param: str) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise ConfigError(param, f"{param} must be an object or null, got {value!r}")
    return value


def _string(parent: dict, name: str, param: str) -> str | None:
    value = parent.get(name)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{param}.{name}", f"{param}.{name} must be a string, got {value!r}")
    return value


def _optional_strings(value, param: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(param, f"{param} must be a list of strings, got {value!r}")
    return tuple(value)


def _language(code: str | None, param: str) -> None:
    try:
        canonical_language(code)
    except ValueError as error:
        raise ConfigError(param, str(error)) from None


def _clamp(value, low: int, high: int) -> int:
    return int(min(max(round(value), low), high))
