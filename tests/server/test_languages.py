"""Integrators' language codes -> qasr's canonical names."""

from __future__ import annotations

import pytest

from qasr.model.prompt import SUPPORTED_LANGUAGES
from qasr.server.languages import CODES, canonical_language, language_code


def test_the_table_covers_exactly_the_models_languages():
    assert set(CODES.values()) == set(SUPPORTED_LANGUAGES)


@pytest.mark.parametrize("code, name", [("en", "English"), ("en-US", "English"), ("EN_gb", "English"),
                                        ("zh-CN", "Chinese"), ("zh-HK", "Cantonese"), ("yue", "Cantonese"),
                                        ("fil", "Filipino"), ("tl", "Filipino"), ("pt-BR", "Portuguese"),
                                        ("german", "German"), (None, None), ("", None), ("multi", None),
                                        ("auto", None)])
def test_codes_and_names(code, name):
    assert canonical_language(code) == name


@pytest.mark.parametrize("code", ["xx", "klingon", "sw", 7])
def test_unknown_codes_are_refused_by_name(code):
    with pytest.raises(ValueError, match="not supported|must be a string"):
        canonical_language(code)


def test_codes_of_names():
    assert language_code("English") == "en" and language_code("Cantonese") == "yue" and language_code(None) is None
