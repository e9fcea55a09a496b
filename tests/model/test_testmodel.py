"""qasr.model.testmodel: the random checkpoints load into the official model exactly, in every layout."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qasr.model import testmodel
from qasr.model.testmodel import SHAPES, checkpoint_config, hf_name, make_test_model, tensor_specs

official = pytest.importorskip("official", reason="tests/official.py needs transformers and qwen-asr")
pytest.importorskip("transformers")


def read_tensors(model_dir) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, single file or sharded."""
    index = model_dir / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


@pytest.fixture(scope="module")
def official_tiny(tiny_model_dir):
    """(model, loading info, processor) of the tiny checkpoint, loaded by the official code."""
    official.import_official()
    from transformers import AutoModel, AutoProcessor

    model, info = AutoModel.from_pretrained(str(tiny_model_dir), dtype=torch.float32, output_loading_info=True)
    processor = AutoProcessor.from_pretrained(str(tiny_model_dir), fix_mistral_regex=True)
    return model.eval(), info, processor


def test_checkpoint_folder_is_complete(tiny_model_dir):
    for name in (
        "config.json", "generation_config.json", "preprocessor_config.json", "vocab.json", "merges.txt",
        "tokenizer_config.json", "chat_template.json", "model.safetensors", "README.md",
    ):  # fmt: skip
        assert (tiny_model_dir / name).is_file(), name
    assert "random" in (tiny_model_dir / "README.md").read_text().lower()
    assert len(json.loads((tiny_model_dir / "vocab.json").read_text(encoding="utf-8"))) == 151643
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = tokenizer_config["added_tokens_decoder"]
    assert sorted(map(int, added)) == list(range(151643, 151705))
    assert added["151704"] == {**added["151704"], "content": "<asr_text>", "special": False}
    assert added["151676"]["content"] == "<|audio_pad|>" and added["151676"]["special"]
    assert tokenizer_config["extra_special_tokens"]["audio_token"] == "<|audio_pad|>"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    thinker = config["thinker_config"]
    assert (thinker["audio_token_id"], thinker["audio_start_token_id"], thinker["audio_end_token_id"]) == (
        151676, 151669, 151670,
    )  # fmt: skip
    assert thinker["text_config"]["rope_scaling"]["mrope_section"] == [4, 2, 2]


def test_official_model_loads_every_tensor_exactly(tiny_model_dir, official_tiny):
    model, info, _ = official_tiny
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    saved = read_tensors(tiny_model_dir)
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert "thinker.lm_head.weight" in saved  # tiny is untied
    assert not torch.equal(model.thinker.lm_head.weight, model.thinker.model.embed_tokens.weight)


def test_tied_checkpoint_loads_with_lm_head_as_the_embedding(tmp_path):
    official.import_official()
    from transformers import AutoModel

    model_dir = make_test_model(tmp_path, size="tiny", tie_word_embeddings=True)
    saved = read_tensors(model_dir)
    assert "thinker.lm_head.weight" not in saved
    # the official model ties on thinker_config.text_config.tie_word_embeddings
    assert json.loads((model_dir / "config.json").read_text())["thinker_config"]["text_config"]["tie_word_embeddings"]
    model, info = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(model.thinker.lm_head.weight, saved["thinker.model.embed_tokens.weight"])


def test_sharded_checkpoint_has_a_correct_index_and_the_same_tensors(tiny_model_dir, tiny_model_dir_sharded):
    index = json.loads((tiny_model_dir_sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = 0
    for file_name in files:
        with safe_open(str(tiny_model_dir_sharded / file_name), "pt") as f:
            names = list(f.keys())
            assert names, file_name
            for name in names:
                assert index["weight_map"][name] == file_name
                total += f.get_tensor(name).nbytes
    assert index["metadata"]["total_size"] == total
    assert not (tiny_model_dir_sharded / "model.safetensors").exists()
    single, sharded = read_tensors(tiny_model_dir), read_tensors(tiny_model_dir_sharded)
    assert set(single) == set(sharded) == set(index["weight_map"])
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_official_model_loads_the_sharded_checkpoint(tiny_model_dir_sharded):
    official.import_official()
    from transformers import AutoModel

    _, info = AutoModel.from_pretrained(str(tiny_model_dir_sharded), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info


def test_hf_layout_has_the_transformers_names_and_the_same_values(tiny_model_dir, tiny_model_dir_hf):
    original, hf = read_tensors(tiny_model_dir), read_tensors(tiny_model_dir_hf)
    assert set(hf) == {hf_name(name) for name in original}
    for name in (
        "model.audio_tower.conv2d1.weight", "model.audio_tower.conv2d3.bias", "model.audio_tower.conv_out.weight",
        "model.audio_tower.layers.1.self_attn.out_proj.bias", "model.audio_tower.layers.0.fc1.weight",
        "model.audio_tower.ln_post.weight", "model.multi_modal_projector.linear_1.weight",
        "model.multi_modal_projector.linear_2.bias", "model.language_model.embed_tokens.weight",
        "model.language_model.layers.1.self_attn.k_norm.weight", "model.language_model.layers.0.mlp.gate_proj.weight",
        "model.language_model.norm.weight", "lm_head.weight",
    ):  # fmt: skip
        assert name in hf, name
    assert not any("proj1" in name or "proj2" in name or name.startswith("thinker.") for name in hf)
    assert all(torch.equal(original[name], hf[hf_name(name)]) for name in original)
    config = json.loads((tiny_model_dir_hf / "config.json").read_text())
    assert config["model_type"] == "qwen3_asr" and "thinker_config" not in config
    assert config["audio_config"]["model_type"] == "qwen3_asr_encoder"
    assert config["text_config"]["model_type"] == "qwen3"
    assert config["audio_token_id"] == 151676
    assert config["tie_word_embeddings"] is config["text_config"]["tie_word_embeddings"] is False
    # same tokenizer files in both layouts
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tiny_model_dir / name).read_bytes() == (tiny_model_dir_hf / name).read_bytes()


@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
def test_real_size_tensors_match_the_official_model(size):
    """Names and shapes of the real sizes, checked on a weightless (meta) official model."""
    official.import_official()
    from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    config = Qwen3ASRConfig.from_dict(checkpoint_config(size))
    with torch.device("meta"):
        model = Qwen3ASRForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name != "thinker.lm_head.weight"}
    specs = {spec.name: spec.shape for spec in tensor_specs(SHAPES[size], tie_word_embeddings=True)}
    assert specs == expected
    assert model.thinker.config.text_config.tie_word_embeddings  # tied like the real checkpoints
    text = config.thinker_config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.rope_scaling["mrope_section"]) == (
        {"0.6B": 1024, "1.7B": 2048}[size], 28, [24, 20, 20],
    )  # fmt: skip


def test_weights_depend_only_on_seed_and_name_and_bfloat16_is_their_cast(tmp_path, tiny_model_dir):
    spec = next(s for s in tensor_specs(SHAPES["tiny"], tie_word_embeddings=False) if s.kind == "linear")
    assert torch.equal(testmodel.init_tensor(spec, 0), testmodel.init_tensor(spec, 0))
    assert not torch.equal(testmodel.init_tensor(spec, 0), testmodel.init_tensor(spec, 1))
    bf16 = read_tensors(make_test_model(tmp_path, size="tiny", dtype="bfloat16", num_shards=2))
    fp32 = read_tensors(tiny_model_dir)
    assert all(bf16[name].dtype == torch.bfloat16 for name in bf16)
    assert all(torch.equal(bf16[name], fp32[name].to(torch.bfloat16)) for name in fp32)


def test_lm_head_rows_past_the_tokenizer_are_zero(tiny_model_dir):
    lm_head = read_tensors(tiny_model_dir)["thinker.lm_head.weight"]
    assert lm_head.shape == (151936, 64)
    assert not lm_head[151705:].any() and lm_head[:151705].abs().sum(1).gt(0).all()


def test_official_greedy_generation_is_long_and_follows_the_audio(official_tiny):
    model, _, processor = official_tiny
    rng = np.random.default_rng(0)
    noise = (0.1 * rng.standard_normal(2 * 16000)).astype(np.float32)
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * 16000) / 16000)).astype(np.float32)
    ids = official.official_generate(model, processor, noise, max_new_tokens=24)
    assert len(ids) == 24 and not set(ids) & {151643, 151645}
    assert len(set(ids)) > 5  # not one token repeated
    assert official.official_decode(processor, ids).strip()
    assert official.official_generate(model, processor, tone, max_new_tokens=24) != ids


def test_cli_refuses_a_file_or_a_non_empty_folder_unless_forced(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    for argv in ([str(notes)], [str(notes), "--force"]):  # a file is never replaced
        with pytest.raises(SystemExit) as exc:
            testmodel.main(argv)
        assert exc.value.code == 2 and f"{notes} is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        testmodel.main([str(tmp_path)])
    error = capsys.readouterr().err
    assert exc.value.code == 2 and f"{tmp_path} is not empty" in error and "--force" in error
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert testmodel.main([str(tmp_path), "--force"]) == 0
    assert (tmp_path / "config.json").is_file() and notes.read_text() == "keep me"


def test_cli_writes_a_checkpoint_and_rejects_bad_arguments(tmp_path, capsys):
    assert testmodel.main([str(tmp_path / "m"), "--layout", "hf", "--shards", "2", "--seed", "3"]) == 0
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]["model_type"] == "qwen3"
    make_test_model(tmp_path / "m")  # rewriting in place leaves no stale shards or index behind
    assert sorted(p.name for p in (tmp_path / "m").glob("model*")) == ["model.safetensors"]
    for bad in (["--size", "7B"], ["--shards", "0"], ["--dtype", "float8"]):
        with pytest.raises(SystemExit) as exc:
            testmodel.main([str(tmp_path / "bad"), *bad])
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="layout"):
        make_test_model(tmp_path / "bad", layout="gguf")
