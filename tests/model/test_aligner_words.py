"""qasr.model.aligner_words: the aligner's units are the official Qwen3ForceAlignProcessor's, language by language."""

import random
import unicodedata

import pytest

from qasr.model import aligner_words
from qasr.model.aligner_words import SplitterUnavailable, clean, split_korean, split_spaced, split_words

official = pytest.importorskip("official", reason="tests/official.py needs transformers and qwen-asr")

SPACED_TEXTS = [
    ("English", "Hello, world! It's a test -- isn't it? 3.14 apples & 12 pears."),
    ("English", "  Mr. O'Neil's e-mail: bob@example.com  (twice)  "),
    ("German", "Guten Morgen, wie geht es Ihnen? Straße, Größe."),
    ("French", "Bonjour, je voudrais un café et un croissant, s'il vous plaît. Merci!"),
    ("Spanish", "¿Cómo estás? ¡Mañana vamos a la playa!"),
    ("Russian", "Привет, как дела? Сегодня мы проверяем распознавание речи."),
    ("Portuguese", "Olá, tudo bem? Eu gostaria de saber o horário do próximo ônibus."),
    ("Italian", "Buongiorno! L'aereo parte alle 9:45."),
    ("Chinese", "今天天气很好，我们去公园散步吧。语音识别把说的话变成文字。"),
    ("Chinese", "我用iPhone15拍了3张照片，OK吗？"),
    ("Cantonese", "你食咗飯未呀？我哋一齊去飲茶啦！"),
    ("Chinese", "兼容字符﨑和扩展𠀀也是单独的单位"),
]
JAPANESE_TEXTS = [
    "こんにちは、今日はいい天気ですね。音声認識のテストです。",
    "東京駅で午後3時に会いましょう！ Hello 世界",
]
KOREAN_TEXTS = [
    "안녕하세요, 만나서 반갑습니다. 오늘 회의는 세 시에 시작합니다.",
    "가마솥에 밥을 합니다만 가만히 있어요!",
    "Qwen3 모델로 음성을 인식합니다 (테스트).",
]


@pytest.fixture(scope="module")
def official_splitter():
    official.import_official()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    return Qwen3ForceAlignProcessor()


@pytest.mark.parametrize("language, text", SPACED_TEXTS)
def test_whitespace_languages_split_as_the_official(official_splitter, language, text):
    words, _ = official_splitter.encode_timestamp(text, language)
    assert split_words(text, language) == words
    assert words  # the case says something


def test_japanese_splits_as_the_official_with_nagisa(official_splitter):
    pytest.importorskip("nagisa", reason="Japanese word splitting needs nagisa (the test extra installs it)")
    for text in JAPANESE_TEXTS:
        words, _ = official_splitter.encode_timestamp(text, "Japanese")
        assert split_words(text, "japanese") == words


def test_korean_splits_as_the_official_soynlp_tokenizer(official_splitter):
    pytest.importorskip("soynlp", reason="the official Korean splitter is soynlp's (the test extra installs it)")
    rng = random.Random(0)
    known = sorted(aligner_words._korean_words())
    # Random tokens built around known words: prefixes that are words, words with endings and punctuation, short
    # tokens, unknown syllable runs, Latin and digits.
    syllables = "가나다라마바사아자차카타파하은는이가을를에서도만요다"
    tokens = []
    for _ in range(400):
        word = rng.choice(known)
        ending = "".join(rng.choice(syllables) for _ in range(rng.randint(0, 3)))
        tokens.append(rng.choice([word + ending, word, ending or "요", word[:1] + ending, "abc" + word]))
        if rng.random() < 0.2:
            tokens[-1] += rng.choice([",", ".", "!", "?", "·"])
    texts = [" ".join(tokens[i : i + 20]) for i in range(0, len(tokens), 20)] + KOREAN_TEXTS
    for text in texts:
        words, _ = official_splitter.encode_timestamp(text, "Korean")
        assert split_korean(text) == words, text


def test_korean_cuts_after_the_longest_known_prefix():
    known = aligner_words._korean_words()
    assert {"가마", "가마솥", "합니다", "합니다만"} <= known and "가마솥에" not in known
    assert split_korean("가마솥에") == ["가마솥", "에"]  # 가마 and 가마솥 are both words: the longer wins
    assert split_korean("합니다만") == ["합니다만"]  # the whole token is a word
    assert split_korean("밥을") == ["밥을"]  # two characters stay whole
    assert split_korean("쀍쀍쀍") == ["쀍쀍쀍"]  # no known prefix
    assert split_korean("합니다만, 가마솥!") == ["합니다만", "가마솥"]  # punctuation goes after the cut


def test_cleaning_keeps_letters_numbers_and_apostrophes_only():
    assert clean("It's,") == "It's"
    assert clean("3.14%") == "314"
    assert clean("—!?") == ""
    assert split_spaced("a - b") == ["a", "b"]
    assert split_spaced("今天hello世界") == ["今", "天", "hello", "世", "界"]
    assert split_spaced("!!! ... ，。") == []


def test_the_ascii_fast_paths_keep_the_unicode_rule():
    every_ascii = "".join(map(chr, range(128)))
    by_category = "".join(ch for ch in every_ascii if ch == "'" or unicodedata.category(ch)[0] in "LN")
    assert clean(every_ascii) == by_category == "'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    assert clean("don't!") == "don't" and clean("café,") == "café"  # not ASCII: the category rule
    assert split_spaced("call 911, now. 我们 ok") == ["call", "911", "now", "我", "们", "ok"]


def test_japanese_without_nagisa_is_unavailable_not_wrong(monkeypatch):
    aligner_words._nagisa.cache_clear()
    monkeypatch.setattr(aligner_words, "japanese_available", lambda: False)
    try:
        with pytest.raises(SplitterUnavailable, match="nagisa"):
            split_words("こんにちは", "Japanese")
    finally:
        aligner_words._nagisa.cache_clear()
