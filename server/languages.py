"""Language codes as integrators send them (ISO 639-1 "en", BCP-47 "en-US", a few ISO 639-3) -> qasr's canonical
language names ("English"), the spelling the model and the native protocol use.

OpenAI's Realtime API takes ISO 639-1 codes and Deepgram takes BCP-47 tags; both adapters map them here. The table
covers exactly the languages Qwen3-ASR can be told to transcribe in (tests/server/test_languages.py keeps it equal
to the model's list), so an unknown code is refused here, in the client's own terms.
"""

from __future__ import annotations

AUTO = None  # no forced language: the model detects it

CODES = {  # lower-case ISO 639-1 (or 639-3 where there is no 639-1 code) -> canonical name
    "zh": "Chinese", "cmn": "Chinese", "en": "English", "yue": "Cantonese", "ar": "Arabic", "de": "German",
    "fr": "French", "es": "Spanish", "pt": "Portuguese", "id": "Indonesian", "it": "Italian", "ko": "Korean",
    "ru": "Russian", "th": "Thai", "vi": "Vietnamese", "ja": "Japanese", "tr": "Turkish", "hi": "Hindi",
    "ms": "Malay", "nl": "Dutch", "sv": "Swedish", "da": "Danish", "fi": "Finnish", "pl": "Polish", "cs": "Czech",
    "fil": "Filipino", "tl": "Filipino", "fa": "Persian", "el": "Greek", "ro": "Romanian", "hu": "Hungarian",
    "mk": "Macedonian",
}  # fmt: skip
REGIONS = {"zh-hk": "Cantonese", "zh-mo": "Cantonese"}  # tags whose region changes the language (Deepgram: zh-HK)
NAMES = {name.lower(): name for name in CODES.values()}  # "english" -> "English": names are accepted too
DETECT = {"", "auto", "multi"}  # "multi": Deepgram's code-switching mode; qasr detects the language per segment


def canonical_language(code: str | None) -> str | None:
    """"en", "en-US", "EN_gb", "English" -> "English"; None, "", "auto", "multi" -> None (detect).

    Raises ValueError naming the code when qasr cannot transcribe that language.
    """
    if code is None:
        return AUTO
    if not isinstance(code, str):
        raise ValueError(f"language must be a string, got {code!r}")
    tag = code.strip().lower().replace("_", "-")
    if tag in DETECT:
        return AUTO
    if tag in REGIONS:
        return REGIONS[tag]
    if tag in NAMES:
        return NAMES[tag]
    base = tag.split("-", 1)[0]
    if base in CODES:
        return CODES[base]
    raise ValueError(f"language {code!r} is not supported; use one of {', '.join(sorted(CODES))} "
                     f"(or leave it out to detect the language)")


def language_code(name: str | None) -> str | None:
    """The ISO 639-1 code of a canonical name ("English" -> "en"), for echoing a setting back; None for None."""
    if not name:
        return None
    for code, canonical in CODES.items():
        if canonical == name:
            return code
    return None
