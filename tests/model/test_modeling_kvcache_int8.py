"""The int8 KV cache's plain-path side (model/kv_int8.py, KVCache(int8=True)): the format round-trips within half a
step of the scale, the cache stores and reads through it, and a head that cannot be packed is refused."""

import dataclasses

import pytest
import torch

from qasr.model import kv_int8
from qasr.model.config import TextDecoderConfig
from qasr.model.modeling import KVCache


def test_quantize_packs_four_values_a_word_and_dequantizes_within_half_a_step():
    x = torch.randn(3, 2, 5, 16)
    x[0, 0, 0] = 0  # an all-zero vector: scale 0, zeros back
    words, scales = kv_int8.quantize(x)
    assert words.dtype == torch.int32 and words.shape == (3, 2, 5, 4) and scales.shape == (3, 2, 5)
    q = kv_int8.unpack(words)
    assert q.shape == x.shape and int(q.abs().max()) == kv_int8.QMAX  # each nonzero vector's largest value: +-127
    assert q[0, 0, 1, 8] == words[0, 0, 1, :1].view(torch.int8)[2]  # byte 2 of word 0 is dimension 2 * 16/4
    back = kv_int8.dequantize(words, scales, torch.float32)
    assert torch.all((back - x).abs() <= scales[..., None] / 2 + 1e-7)
    assert scales[0, 0, 0] == 0 and not back[0, 0, 0].any()


def test_an_int8_cache_stores_and_reads_through_the_format(tiny_model_dir):
    from qasr.model.checkpoint import load_model

    cfg = load_model(tiny_model_dir, device="cpu", dtype="float32").cfg.text
    cache = KVCache(cfg, num_slots=3, max_len=20, dtype=torch.float32, int8=True)
    assert len(cache.tensors) == 4 * cfg.num_hidden_layers and cache.scales(0) is not None
    k, v = torch.randn(2, cfg.num_key_value_heads, cfg.head_dim), torch.randn(2, cfg.num_key_value_heads, cfg.head_dim)
    cache.store(1, torch.tensor([2, 0]), torch.tensor([7, 3]), k, v)
    keys, values = cache.read(1, torch.tensor([0, 2]))
    assert keys.dtype == torch.float32 and keys.shape == (2, cfg.num_key_value_heads, cache.length, cfg.head_dim)
    torch.testing.assert_close(keys[1, :, 7], kv_int8.dequantize(*kv_int8.quantize(k[0]), torch.float32))
    torch.testing.assert_close(values[0, :, 3], kv_int8.dequantize(*kv_int8.quantize(v[1]), torch.float32))
    assert not keys[0, :, 7].any() and not keys[1, :, 3].any()  # nothing else written
    plain = KVCache(cfg, num_slots=3, max_len=20, dtype=torch.float32)
    assert plain.scales(0) is None and len(plain.tensors) == 2 * cfg.num_hidden_layers


def test_an_int8_cache_refuses_a_head_it_cannot_pack():
    cfg = dataclasses.replace(TextDecoderConfig(), head_dim=18)
    with pytest.raises(ValueError, match="multiple of 4"):
        KVCache(cfg, num_slots=1, max_len=8, int8=True)
