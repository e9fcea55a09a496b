"""qasr.model.aligner against the OFFICIAL Qwen3ForcedAligner (qwen-asr 0.0.6), fp32 on the CPU, on tiny random
aligner checkpoints written by qasr.model.testmodel (both layouts; the official loads the original one).

Compared per (clip, transcript) pair: the input ids, the timestamp class of every slot and the repaired word times,
identical; qasr aligns all pairs in one batch, the official one pair at a time (its batches pad the audio before the
STFT, so its rows depend on their batch mates; qasr's do not, and the batch tests below show it). Clips longer than
one 8 s encoder window run the official encoder with its window mask (see test_parity's module docstring).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

official = pytest.importorskip("official", reason="tests/official.py needs transformers and qwen-asr")
pytest.importorskip("transformers")

from fakes import speech_clip  # noqa: E402
from test_parity import official_encoder_windows  # noqa: E402  (the official encoder's own 8 s window mask)

from qasr.model import aligner_words, testmodel  # noqa: E402
from qasr.model.aligner import AlignerInput, ForcedAligner  # noqa: E402
from qasr.model.audio import num_frames  # noqa: E402
from qasr.model.checkpoint import CheckpointError  # noqa: E402
from qasr.model.config import ALIGNER_LANGUAGES  # noqa: E402
from qasr.model.testmodel import CLASSIFY_NUM, TIMESTAMP_TOKEN_ID, make_test_aligner  # noqa: E402

SEED = 3

# (seconds, language, transcript): >= 20 pairs, CJK among them, clips across the 1 s chunk and 8 s window edges
CASES = [
    (0.4, "English", "Hi."),
    (0.93, "English", "Hello, world!"),
    (1.0, "Chinese", "你好。"),
    (1.7, "English", "It's a test, isn't it?"),
    (2.5, "Chinese", "今天天气很好，我们去公园散步吧。"),
    (3.3, "Cantonese", "你食咗飯未呀？"),
    (4.0, "Japanese", "こんにちは、今日はいい天気ですね。"),
    (4.6, "Korean", "안녕하세요, 만나서 반갑습니다."),
    (5.2, "German", "Guten Morgen, wie geht es Ihnen?"),
    (6.1, "French", "Bonjour, je voudrais un café, s'il vous plaît."),
    (6.75, "Spanish", "¿Cómo estás? Mañana vamos a la playa con mis amigos."),
    (7.4, "Russian", "Привет, как дела? Сегодня мы проверяем распознавание речи."),
    (7.99, "Portuguese", "Olá, tudo bem? Eu gostaria de saber o horário do próximo ônibus."),
    (8.0, "Italian", "Buongiorno, il treno parte alle nove e mezza."),
    (8.6, "Chinese", "我用iPhone拍了三张照片，然后发给了朋友。"),
    (9.5, "English", "Please call me back tomorrow morning at nine thirty, or send a short message instead."),
    (10.2, "Korean", "오늘 회의는 세 시에 시작합니다. 가마솥에 밥을 합니다만 가만히 있어요!"),
    (11.0, "Japanese", "東京駅で午後三時に会いましょう。音声認識のテストです。"),
    (12.3, "English", "We measured the latency of every request and wrote the numbers into a small table."),
    (2.2, "english", "lower-case language names work"),
    (3.0, "Chinese", "一二三四五六七八九十百千万"),
    (1.3, "English", "one"),
    (5.5, "Cantonese", "我哋一齊去飲茶啦！好唔好？"),
    (16.4, "Spanish", "Hola, ¿cómo estás? Mañana vamos a la playa con mis amigos, y después al cine."),
]


@pytest.fixture(scope="module")
def aligner_dir(tmp_path_factory):
    return make_test_aligner(tmp_path_factory.mktemp("aligner"), layout="original", seed=SEED)


@pytest.fixture(scope="module")
def aligner_dir_hf(tmp_path_factory):
    return make_test_aligner(tmp_path_factory.mktemp("aligner-hf"), layout="hf", seed=SEED, num_shards=2)


@pytest.fixture(scope="module")
def reference(aligner_dir):
    official.import_official()
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForcedAligner

    aligner = Qwen3ForcedAligner.from_pretrained(str(aligner_dir), dtype=torch.float32)
    aligner.model.eval()
    return aligner


@pytest.fixture(scope="module")
def ours(aligner_dir):
    return ForcedAligner.from_pretrained(aligner_dir)


def clip(case_index: int) -> np.ndarray:
    return speech_clip(CASES[case_index][0], seed=case_index)


def official_alignment(reference, wav: np.ndarray, text: str, language: str):
    """(input ids, slot classes, word times) of the official aligner for one pair, each from its own code path."""
    with official_encoder_windows(reference.model), torch.no_grad():
        items = reference.align(audio=(wav, 16000), text=text, language=language)[0]
        _, input_text = reference.aligner_processor.encode_timestamp(text, language)
        inputs = reference.processor(text=[input_text], audio=[wav], return_tensors="pt", padding=True)
        logits = reference.model.thinker(**inputs).logits[0]
    ids = inputs["input_ids"][0]
    classes = logits[ids == reference.timestamp_token_id].argmax(dim=-1).tolist()
    return ids.tolist(), classes, [(item.text, item.start_time, item.end_time) for item in items]


def num_audio_tokens(aligner: ForcedAligner, wav: np.ndarray) -> int:
    return aligner.config.model.audio.num_tokens(num_frames(len(wav)))


# ---------------------------------------------------------------------------------------------------------------
# The test checkpoint


def test_official_loads_the_test_aligner_completely(aligner_dir):
    official.import_official()
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(str(aligner_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert tuple(model.thinker.lm_head.weight.shape) == (CLASSIFY_NUM, testmodel.SHAPES["tiny"].text_hidden)
    assert (model.config.timestamp_token_id, model.config.timestamp_segment_time) == (TIMESTAMP_TOKEN_ID, 80)
    config = json.loads((aligner_dir / "config.json").read_text())
    assert config["thinker_config"]["model_type"] == "qwen3_forced_aligner"
    assert config["support_languages"] == list(ALIGNER_LANGUAGES)
    added = json.loads((aligner_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert added[str(TIMESTAMP_TOKEN_ID)]["content"] == "<timestamp>"


def test_hf_layout_names_and_config(aligner_dir_hf):
    index = json.loads((aligner_dir_hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert "classifier.weight" in index and "lm_head.weight" not in index
    assert "model.audio_tower.proj1.weight" in index and "model.language_model.norm.weight" in index
    assert not [name for name in index if name.endswith("k_proj.bias")]
    assert "model.audio_tower.layers.0.self_attn.q_proj.bias" in index
    config = json.loads((aligner_dir_hf / "config.json").read_text())
    assert (config["model_type"], config["num_timestamp_bins"], config["timestamp_token_id"]) == (
        "qwen3_forced_aligner", CLASSIFY_NUM, TIMESTAMP_TOKEN_ID,
    )  # fmt: skip


def test_real_aligner_shapes_pair_the_large_encoder_with_the_small_decoder():
    config = testmodel.aligner_config("0.6B")
    audio, text = config["thinker_config"]["audio_config"], config["thinker_config"]["text_config"]
    assert (audio["d_model"], audio["encoder_layers"], audio["encoder_attention_heads"]) == (1024, 24, 16)
    assert (text["hidden_size"], text["num_hidden_layers"], audio["output_dim"]) == (1024, 28, 1024)


def test_cli_writes_an_aligner_and_refuses_what_does_not_apply(tmp_path, capsys):
    assert testmodel.main([str(tmp_path / "a"), "--aligner", "--layout", "hf"]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "qwen3_forced_aligner"
    for bad in (["--size", "1.7B"], ["--tie-word-embeddings"]):
        with pytest.raises(SystemExit):
            testmodel.main([str(tmp_path / "b"), "--aligner", *bad])
    assert "aligner" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Loading


def test_both_layouts_load_the_same_network(ours, aligner_dir_hf):
    hf = ForcedAligner.from_pretrained(aligner_dir_hf)
    assert ours.config.model.layout == "original" and hf.config.model.layout == "hf"
    ours_params, hf_params = dict(ours.network.named_parameters()), dict(hf.network.named_parameters())
    assert ours_params.keys() == hf_params.keys()
    for name, value in ours_params.items():
        if name.startswith("encoder.") and name.endswith("k_proj.bias"):
            assert not hf_params[name].any()  # dropped by the -hf layout: zeros, which softmax cannot tell apart
        else:
            assert torch.equal(value, hf_params[name]), name
    wavs, texts, languages = [clip(i) for i in (1, 4, 15)], [CASES[i][2] for i in (1, 4, 15)], "English"
    assert [r.words for r in hf.align(wavs, texts, languages)] == [r.words for r in ours.align(wavs, texts, languages)]


def test_an_asr_checkpoint_is_not_an_aligner(tiny_model_dir):
    with pytest.raises(CheckpointError, match="classify_num"):
        ForcedAligner.from_pretrained(tiny_model_dir)


def test_a_timestamp_id_the_tokenizer_disagrees_with_is_refused(aligner_dir, tmp_path):
    for item in aligner_dir.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((aligner_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "timestamp_token_id": 151704}))
    with pytest.raises(CheckpointError, match="timestamp_token_id 151704"):
        ForcedAligner.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Parity with the official aligner


@pytest.fixture(scope="module")
def batch_result(ours):
    """All the cases aligned in one call: (alignments, slot classes)."""
    wavs = [clip(i) for i in range(len(CASES))]
    texts, languages = [c[2] for c in CASES], [c[1] for c in CASES]
    inputs = [ours.prepare(text, language) for text, language in zip(texts, languages)]
    return ours.align(wavs, texts, languages), ours.timestamp_classes(wavs, inputs)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[1]}-{c[0]}s" for c in CASES])
def test_timestamps_match_the_official(reference, ours, batch_result, index):
    seconds, language, text = CASES[index]
    wav = clip(index)
    ids, classes, times = official_alignment(reference, wav, text, language)
    item = ours.prepare(text, language)
    assert ours.prompt_ids(item, num_audio_tokens(ours, wav)) == ids
    alignments, our_classes = batch_result
    assert our_classes[index] == classes
    assert [tuple(w) for w in alignments[index].words] == times
    assert alignments[index].reason is None and times


def test_the_cases_exercise_the_repair(batch_result):
    """Random weights give non-monotonic classes: the repair changed something in most cases (else parity of the
    times would say little beyond the classes)."""
    alignments, classes = batch_result
    repaired = 0
    for alignment, row in zip(alignments, classes):
        raw = [c * 0.08 for c in row]
        got = [t for w in alignment.words for t in (w.start, w.end)]
        repaired += any(abs(a - b) > 1e-6 for a, b in zip(raw, got))
    assert repaired >= len(CASES) // 2
    assert len({c for row in classes for c in row}) > 10  # and the classes vary


# ---------------------------------------------------------------------------------------------------------------
# Batching


def slot_logit_rows(aligner: ForcedAligner, indices: list[int]) -> list[torch.Tensor]:
    inputs = [aligner.prepare(CASES[i][2], CASES[i][1]) for i in indices]
    flat = aligner.slot_logits([clip(i) for i in indices], inputs)
    return list(flat.split([2 * len(item.words) for item in inputs]))


def test_identical_inputs_give_identical_rows(ours):
    rows = slot_logit_rows(ours, [9, 9, 9])
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


def test_a_row_does_not_depend_on_its_batch_mates(ours):
    alone = slot_logit_rows(ours, [9])[0]
    for mates in ([0, 9], [9, 18], [23, 9, 2, 6]):  # shorter and longer clips and texts, before and after
        row = slot_logit_rows(ours, mates)[mates.index(9)]
        assert torch.equal(row.argmax(-1), alone.argmax(-1))
        torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# What cannot be aligned


def test_unaligned_rows_get_a_reason_and_the_others_still_align(ours):
    wavs = [clip(1)] * 5
    texts = ["Hello, world!", "مرحبا كيف حالك", "...!?", "Hello, world!", "Hello"]
    results = ours.align(wavs, texts, ["English", "Arabic", "English", None, "Klingon"])
    assert [w.word for w in results[0].words] == ["Hello", "world"] and results[0].reason is None
    assert not results[1].words and "does not support Arabic" in results[1].reason and "Korean" in results[1].reason
    assert not results[2].words and "no words" in results[2].reason
    assert not results[3].words and "no language" in results[3].reason
    assert not results[4].words and "Klingon" in results[4].reason
    assert ours.align([], [], []) == []


def test_japanese_without_nagisa_gets_a_reason(ours, monkeypatch):
    aligner_words._nagisa.cache_clear()
    monkeypatch.setattr(aligner_words, "japanese_available", lambda: False)
    try:
        (result,) = ours.align([clip(6)], [CASES[6][2]], "Japanese")
        assert not result.words and "nagisa" in result.reason
    finally:
        aligner_words._nagisa.cache_clear()


def test_bad_input_is_refused_clearly(ours):
    with pytest.raises(ValueError, match="batch sizes differ"):
        ours.align([clip(1)], ["a", "b"], "English")
    with pytest.raises(ValueError, match="mono"):
        ours.align([np.zeros((2, 16000), np.float32)], ["a"], "English")
    with pytest.raises(ValueError, match="under one"):
        ours.align([np.zeros(100, np.float32)], ["a"], "English")
    with pytest.raises(ValueError, match="400 s"):
        ours.align([np.zeros(401 * 16000, np.float32)], ["a"], "English")
    with pytest.raises(ValueError, match="nothing to align"):
        ours.timestamp_classes([clip(1)], [AlignerInput((), (), "no words")])
