"""Qwen3-ASR in plain PyTorch: the audio encoder and the Qwen3 text decoder over a static per-slot KV cache.

The encoder packs the fixed 8 s attention windows of many clips into one padded batch (block-diagonal attention by
construction). The decoder has two entry points over one cache: `prefill` (many new tokens for a few slots) and
`decode` (one token for every row, row i = slot i, fixed shapes so a CUDA graph can replay it), both through one
layer loop over the layer ops the caller chose once: PlainLayerOps (PyTorch, anywhere) or FusedLayerOps (the Triton
kernels of kernels.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, gemv, kernels, kv_int8
from .config import AudioEncoderConfig, ModelConfig, TextDecoderConfig


# ----------------------------------------------------------------------------------------------------------------
# Audio encoder


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True: may attend) -> 0 / -inf bias, built once per forward: SDPA would convert a bool mask again
    in every layer (two extra launches each)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper-style positions, computed exactly as the official encoder does (float32)."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class EncoderAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        # x: [W, T, D] windows; key_bias: [W, 1, 1, T] 0 where the key is a real token, -inf elsewhere
        return self.attend(*(p(x) for p in (self.q_proj, self.k_proj, self.v_proj)), key_bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        # q, k, v: [W, T, D] projected -> [W, T, D] after out_proj
        W, T, D = q.shape
        q, k, v = (t.view(W, T, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias)
        return self.out_proj(out.transpose(1, 2).reshape(W, T, D))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = EncoderAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor, fp8_products: bool = False) -> torch.Tensor:
        # fp8_products: q/k/v, fc1 and fc2 in FP8 (fp8.attach_encoder), their inputs quantized by the kernels before
        if fp8_products:
            return self._forward_fp8(x, key_bias)
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_bias)
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as the official encoder: keep fp16 activations finite
            clamp = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-clamp, clamp)
        return x

    def _forward_fp8(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        W, T, D = x.shape

        def normed(norm: nn.LayerNorm, x: torch.Tensor) -> fp8.Rows:  # [W, T, D] -> its W * T rows, quantized
            return fp8.Rows(*kernels.layer_norm(x.reshape(W * T, D), norm.weight, norm.bias, norm.eps, fp8=True))

        h, attn = normed(self.self_attn_layer_norm, x), self.self_attn
        x = x + attn.attend(*(fp8.linear(h, p).view(W, T, D) for p in (attn.q_proj, attn.k_proj, attn.v_proj)),
                            key_bias)
        h = fp8.Rows(*kernels.gelu(fp8.linear(normed(self.final_layer_norm, x), self.fc1), fp8=True))
        return x + fp8.linear(h, self.fc2).view(W, T, D)


class AudioEncoder(nn.Module):
    """Mel chunks -> convs -> windowed transformer -> projector into the decoder's hidden size."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv_out = nn.Linear(cfg.conv_out_features, cfg.d_model, bias=False)
        self.register_buffer("positions", sinusoids(cfg.tokens_per_chunk, cfg.d_model), persistent=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    def embed_chunks(self, chunks: torch.Tensor, first_conv=None) -> torch.Tensor:
        # chunks: [N, mels, chunk_frames] (the last chunk of a clip zero-padded) -> [N, tokens_per_chunk, D].
        # first_conv(chunks, conv2d1): the first convolution with its GELU in one kernel (conv_kernels.conv1_gelu,
        # channels-last, which the next two convolutions then keep); None: PyTorch's
        x = first_conv(chunks, self.conv2d1) if first_conv else F.gelu(self.conv2d1(chunks.unsqueeze(1)))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))
        n, c, f, t = x.shape
        # contiguous: the permuted view reshapes without a copy, its features 13 elements apart (time is innermost in
        # memory), and F.linear ran it as an unaligned batched matmul (cutlass_75 align1: 1.2 ms for 81 chunks on the
        # H200, against ~30 us)
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, c * f).contiguous())
        return x + self.positions[:t].to(x.dtype)

    def encode_windows(self, windows: torch.Tensor, lengths: torch.Tensor, fp8_products: bool = False
                       ) -> torch.Tensor:
        # windows: [W, window_tokens, D] zero-padded; lengths: [W] real tokens per window -> [W, window_tokens, out].
        # fp8_products: the layers' products in FP8 (EncoderLayer.forward; fp8.attach_encoder first)
        T = windows.shape[1]
        key_mask = (torch.arange(T, device=windows.device)[None, :] < lengths[:, None])[:, None, None, :]
        key_bias = additive_mask(key_mask, windows.dtype)
        x = windows
        for layer in self.layers:
            x = layer(x, key_bias, fp8_products)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    def forward(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Encode whole clips. mels: list of [mels, F_i] -> list of [num_tokens(F_i), out]."""
        windows, lengths, owners = self.pack_windows(self.embed_clips(mels))
        out = self.encode_windows(windows, lengths)
        return self.unpack_windows(out, lengths, owners, len(mels))

    # -- packing helpers: plain tensor bookkeeping, shared with the engine's incremental encoder ------------------

    def embed_clips(self, mels: list[torch.Tensor], tails: list[bool] | None = None,
                    embed_chunks=None) -> list[torch.Tensor]:
        """Conv front end for whole clips: list of [mels, F_i] -> list of [num_tokens(F_i), D].

        A clip's last chunk is zero-padded to the chunk length, except in a clip shorter than one chunk, which the
        official encoder convolves unpadded (the padding would leak into its edge tokens through the convs).
        `tails[i]` marks mel i as the tail of a longer clip (whose earlier windows are cached): padded like a long clip.
        Full-length chunks of all clips share one conv call: `embed_chunks` (default: self.embed_chunks; the engine's
        runner passes its graphed one). Its output is read before it is called again: the clips' tokens are views of
        it, read before the next call (a caller keeping some copies them).
        """
        size, dtype = self.cfg.chunk_frames, self.conv_out.weight.dtype
        for mel in mels:
            if mel.shape[-1] == 0:
                raise ValueError("cannot encode an empty clip (0 mel frames)")
        short = {i: self.embed_chunks(mel[None].to(dtype))[0, : self.cfg.num_tokens(mel.shape[-1])]
                 for i, mel in enumerate(mels) if mel.shape[-1] < size and not (tails and tails[i])}
        full = [mel for i, mel in enumerate(mels) if i not in short]
        if not full:
            return [short[i] for i in range(len(mels))]
        # the chunks of every clip by one cat and one gather (a pad per clip was a launch each: ~400 in an offline
        # admission of 512 rows), the last chunk's missing frames reading the zero column after the clips
        frames = np.array([mel.shape[-1] for mel in full])
        index = host_to_device(torch.from_numpy(padded_gather(frames, size)), full[0].device)
        flat = torch.cat([*full, full[0].new_zeros(full[0].shape[0], 1)], dim=1)  # [mels, frames + 1]
        chunks = flat.index_select(1, index).view(flat.shape[0], -1, size)  # [mels, N, size]
        embedded = (embed_chunks or self.embed_chunks)(
            torch.empty(chunks.shape[1], flat.shape[0], size, dtype=dtype, device=flat.device).copy_(
                chunks.transpose(0, 1)))
        # a clip's tokens are its chunks' rows flattened, cut after its last chunk's (every chunk but the last whole)
        out, row = [], 0
        for i, mel in enumerate(mels):
            if i in short:
                out.append(short[i])
                continue
            n = -(-mel.shape[-1] // size)
            count = (n - 1) * self.cfg.tokens_per_chunk + self.cfg.num_tokens(mel.shape[-1] - (n - 1) * size)
            out.append(embedded[row : row + n].flatten(0, 1)[:count])
            row += n
        return out

    def pack_windows(self, clips: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Cut every clip's tokens into fixed windows and stack them: -> ([W, window, D], lengths [W], owner per window)."""
        size = self.cfg.window_tokens
        cuts = [window_lengths(x.shape[0], size) for x in clips]
        lengths = [n for cut in cuts for n in cut]
        owners = [i for i, cut in enumerate(cuts) for _ in cut]
        # one cat and one gather for the whole batch: a pad per clip, ~400 launches in an admission of 512 offline
        # rows, held 7% of the engine thread (py-spy on the H200, session 21)
        flat = torch.cat([*clips, clips[0].new_zeros(1, clips[0].shape[1])])
        index = host_to_device(torch.from_numpy(padded_gather(np.array([x.shape[0] for x in clips]), size)),
                               flat.device)
        windows = flat.index_select(0, index).view(len(lengths), size, -1)
        on_cuda = flat.device.type == "cuda"
        lengths = torch.tensor(lengths, pin_memory=on_cuda).to(flat.device, non_blocking=on_cuda)
        return windows, lengths, owners

    @staticmethod
    def unpack_windows(out: torch.Tensor, lengths: torch.Tensor, owners: list[int], num_clips: int) -> list[torch.Tensor]:
        parts: list[list[torch.Tensor]] = [[] for _ in range(num_clips)]
        for w, (n, owner) in enumerate(zip(lengths.tolist(), owners)):
            parts[owner].append(out[w, :n])
        return [torch.cat(p) for p in parts]


def ranges(starts, lengths) -> np.ndarray:
    """[start, start + length) for each (start, length), one after the other: an index built without a loop in Python
    (an np.arange a sequence cost 1-2% of the engine thread in an offline run of 512 rows, py-spy on an H100)."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(lengths.sum())


def padded_gather(sizes: np.ndarray, multiple: int) -> np.ndarray:
    """Pieces of sizes[i] rows laid one after the other, then one zero row -> the rows that lay each piece out padded
    to a whole number of `multiple` rows: row r of piece i is its row r, or past its last row the zero row."""
    firsts = np.cumsum(sizes) - sizes
    padded = -(-sizes // multiple) * multiple
    index = ranges(firsts, padded)
    index[index >= np.repeat(firsts + sizes, padded)] = sizes.sum()
    return index


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting. On CUDA through pinned memory, non-blocking: a copy from pageable
    memory synchronizes the stream (the host would wait for everything queued on it: a decode step, the admission's
    convolutions)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def window_lengths(num_tokens: int, size: int) -> list[int]:
    """How pack_windows cuts a clip's `num_tokens` conv tokens into windows of `size`: each window's real tokens
    (the host's copy of what it puts on the device: reading that back would wait for the device)."""
    k = -(-num_tokens // size)
    return [size] * (k - 1) + [num_tokens - (k - 1) * size]


# ----------------------------------------------------------------------------------------------------------------
# Text decoder


class RMSNorm(nn.Module):
    feeds_fp8 = False  # fp8.attach sets it where the product after this norm can multiply in FP8 (FusedLayerOps
    # with fp8_products then has the norm quantize its output rows for it)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: TextDecoderConfig) -> torch.Tensor:
    """Default RoPE frequencies (float32). The checkpoint's mRoPE gives every axis the same position: plain 1-D RoPE."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache:
    """Static per-slot cache, one k and one v tensor per layer: [slots, kv_heads, length, head_dim] each.

    length = max_len + 1 rounded up to 16. The positions past max_len are scratch: rows that must not write (padding
    rows of a graph bucket, padded prompt positions) write to the last one, and no mask ever admits them. The
    rounding keeps attention masks aligned for the fused SDPA kernels. Separate tensors per layer (not one
    [layers, ...] tensor): each layer's K/V write is a plain in-place write into its own tensor (a torch.compile'd
    step on the stacked layout copied the whole cache back per layer: a 100 ms step on the H200).

    int8: each vector stored as kv_int8 stores it (about half the bytes a decode step's attention reads): k and v are
    int32 words [slots, kv_heads, length, head_dim / 4], with float32 scales k_scale, v_scale [slots, kv_heads,
    length] a layer. The plain path goes through `store` and `read`; the fused kernels take the tensors themselves.
    """

    def __init__(self, cfg: TextDecoderConfig, num_slots: int, max_len: int, device=None, dtype=None,
                 int8: bool = False):
        if int8 and cfg.head_dim % 4:
            raise ValueError(f"an int8 KV cache packs a head's values four to a word: head_dim {cfg.head_dim} is not "
                             "a multiple of 4")
        self.length = _round_up(max_len + 1, 16)
        self.int8 = int8
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        shape = (num_slots, cfg.num_key_value_heads, self.length)
        vector = (cfg.head_dim // 4,) if int8 else (cfg.head_dim,)
        kind = torch.int32 if int8 else dtype
        layers = range(cfg.num_hidden_layers)
        self.k = [torch.zeros(shape + vector, device=device, dtype=kind) for _ in layers]
        self.v = [torch.zeros(shape + vector, device=device, dtype=kind) for _ in layers]
        self.k_scale = [torch.zeros(shape, device=device, dtype=torch.float32) for _ in layers] if int8 else []
        self.v_scale = [torch.zeros(shape, device=device, dtype=torch.float32) for _ in layers] if int8 else []
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache, each [slots, kv_heads, length, ...]: the layers' keys and values, and an int8
        cache's scales (what copying a slot's positions, or filling the cache, must cover)."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 cache's (key, value) scales of `layer`, for the fused kernels; None for a plain cache."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.int8 else None

    def store(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v [..., kv_heads, head_dim] into [slots, :, positions] (index tensors of the leading shape)."""
        if not self.int8:
            self.k[layer][slots, :, positions] = k
            self.v[layer][slots, :, positions] = v
            return
        for words, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            words[layer][slots, :, positions], scales[layer][slots, :, positions] = kv_int8.quantize(x)

    def read(self, layer: int, slots, num_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [len(slots), kv_heads, num_keys (all), head_dim] of the slots (an index or a slice), as
        the cache's dtype (an int8 cache's dequantized)."""
        keys = slice(None) if num_keys is None else slice(num_keys)
        k, v = self.k[layer][slots, :, keys], self.v[layer][slots, :, keys]
        if not self.int8:
            return k, v
        return (kv_int8.dequantize(k, self.k_scale[layer][slots, :, keys], self.dtype),
                kv_int8.dequantize(v, self.v_scale[layer][slots, :, keys], self.dtype))

    @property
    def scratch(self) -> int:
        return self.length - 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prefill_keys(max_end: int, cache: KVCache) -> int:
    """Key positions a prefill attends over: its furthest position, rounded up to 16 for the fused kernels."""
    return min(_round_up(max_end, 16), cache.length)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul (the loader fills the three row blocks)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, D], cos/sin: [B, T, head_dim] -> q [B, H, T, hd], k/v [B, KVH, T, hd]
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attention_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """bool [B, T, L] (True: may attend) -> the additive [B, 1, group * T, L] bias `attend` takes (once per
        forward, not per layer)."""
        group = self.num_heads // self.num_kv_heads
        return additive_mask(mask.repeat(1, group, 1) if group > 1 else mask, dtype)[:, None]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # q: [B, H, T, hd]; keys/values: [B, KVH, L, hd]; bias: from attention_bias -> [B, T, H * hd]
        # Grouped-query attention without copying K/V: fold each KV head's query heads into the query axis.
        B, H, T, hd = q.shape
        q = q.reshape(B, self.num_kv_heads, H // self.num_kv_heads * T, hd)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
        return out.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)


class MLP(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.self_attn = DecoderAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin [B, T, head_dim], computed in float32 then cast (as the official)
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rope_table(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_positions, head_dim] for FusedLayerOps: the same ops as `rope`, so both paths rotate by
        identical values."""
        positions = torch.arange(num_positions, device=self.inv_freq.device)[None]
        cos, sin = self.rope(positions, self.embed_tokens.weight.dtype)
        return cos[0].contiguous(), sin[0].contiguous()

    def run_layers(self, begun: tuple[torch.Tensor, torch.Tensor], ops: "LayerOps", attention) -> torch.Tensor:
        """The one layer loop: begun = (the first layer's input norm of x, the residual stream x), as `ops` shapes
        them (ops.begin's) -> final-normed hidden of the same shape.

        attention(layer index, DecoderAttention, h) writes the layer's K/V of the new tokens into the cache and
        returns their attention output before o_proj. Each residual add feeds the norm that follows it, the last one
        the final norm (so the fused ops can fuse them, and take a product's split-K partial sums).
        """
        h, residual = begun
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, residual = ops.add_norm(ops.project(attn.o_proj, attention(i, attn, h)), residual,
                                       layer.post_attention_layernorm)
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, residual = ops.add_norm(ops.mlp(layer.mlp, h), residual, following)
        return h

    def prefill(self, embeds, slots, starts, lengths, cache: KVCache, ops: "LayerOps",
                num_keys: int | None = None) -> torch.Tensor:
        """Append `lengths[b]` new tokens to slot `slots[b]` after its first `starts[b]` cached positions.

        embeds: [B, T, D] (row b valid for t < lengths[b]); slots, starts, lengths: [B] long -> final-normed hidden
        [B, T, D] (lm_head of a position gives its logits). ops: plain or fused (chosen once, by the runner).
        num_keys (plain ops only): see PlainLayerOps.prefill_attention.
        """
        B, T, _ = embeds.shape
        t = torch.arange(T, device=embeds.device)
        positions = starts[:, None] + t[None, :]
        valid = t[None, :] < lengths[:, None]
        write_pos = torch.where(valid, positions, torch.full_like(positions, cache.scratch))
        x, attention = ops.prefill_attention(self, embeds, positions, slots, starts, lengths, write_pos, cache,
                                             num_keys)
        return self.run_layers(ops.begin(x, self.layers[0].input_layernorm), ops, attention).view(B, T, -1)

    def decode(self, tokens, positions, cache: KVCache, ops: "LayerOps") -> torch.Tensor:
        """One new token for each of the first B slots (row b = slot b): fixed shapes, CUDA-graph friendly.

        tokens: [B] long; positions: [B] long, -1 for a padding row (writes only scratch, output ignored) -> logits [B, V].
        """
        return ops.logits(self.lm_head, self._decode_hidden(tokens, positions, cache, ops))

    def decode_greedy(self, tokens, positions, cache: KVCache,
                      ops: "LayerOps") -> tuple[torch.Tensor, torch.Tensor | kernels.BlockMaxima]:
        """decode, and each row's greedy next token -> (logits [B, V], the tokens [B] long or, where the lm_head's
        kernel takes the argmax (FusedLayerOps.greedy), its kernels.BlockMaxima: kernels.advance_rows takes both)."""
        return ops.greedy(self.lm_head, self._decode_hidden(tokens, positions, cache, ops))

    def _decode_hidden(self, tokens, positions, cache: KVCache, ops: "LayerOps") -> torch.Tensor:
        begun, attention = ops.decode_start(self, tokens, positions, cache)
        return self.run_layers(begun, ops, attention).view(tokens.shape[0], -1)

    def decode_inputs(self, tokens, positions, cache: KVCache):
        """The decode step's inputs in PyTorch: tokens, positions [B] -> (their embeddings x [B, 1, D], the positions
        to rotate by pos [B, 1] (0 for -1), slots [B] (row b = slot b), write_pos [B, 1] (scratch for -1)).
        kernels.decode_begin computes the same in one launch."""
        x = self.embed_tokens(tokens)[:, None]
        live = positions >= 0
        pos = positions.clamp(min=0)[:, None]
        write_pos = torch.where(live[:, None], pos, torch.full_like(pos, cache.scratch))
        slots = torch.arange(tokens.shape[0], device=tokens.device)
        return x, pos, slots, write_pos


class PlainLayerOps:
    """The decoder's per-layer ops in plain PyTorch: any device, the reference the fused kernels are tested against.

    Tokens stay [B, T, D]; attention reads each row's cache through a mask (prefill gathers its slots' rows).
    """

    def begin(self, x: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x), the residual stream x)."""
        return norm(x), x

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x -> (its norm, the new residual)."""
        residual = residual + x
        return norm(residual), residual

    def mlp(self, mlp: MLP, h: torch.Tensor) -> torch.Tensor:
        return mlp(h)

    def project(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection whose product feeds `add_norm` (o_proj)."""
        return linear(x)

    def logits(self, lm_head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return lm_head(h)

    def greedy(self, lm_head: nn.Linear, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, their argmax [B])."""
        logits = self.logits(lm_head, h)
        return logits, logits.argmax(dim=-1)

    def decode_start(self, decoder: TextDecoder, tokens, positions, cache: KVCache):
        """-> ((h, residual) for run_layers, attention) of a decode step (see decode_attention)."""
        x, pos, slots, write_pos = decoder.decode_inputs(tokens, positions, cache)
        x, attention = self.decode_attention(decoder, x, positions, pos, slots, write_pos, cache)
        return self.begin(x, decoder.layers[0].input_layernorm), attention

    def prefill_attention(self, decoder: TextDecoder, x, positions, slots, starts, lengths, write_pos,
                          cache: KVCache, num_keys: int | None):
        """-> (x as the layer loop takes it, attention(layer index, DecoderAttention, h) -> [B, T, H * hd]).

        num_keys: the cache positions to attend over, >= max(starts + lengths) (computed here when not given;
        passing it keeps prefill free of device syncs). Reading the cache through `slots` copies those rows."""
        if num_keys is None:
            num_keys = prefill_keys(int((starts + lengths).max()), cache)
        keys_at = torch.arange(num_keys, device=x.device)
        # a new token sees every cached position of its slot up to itself; padded rows see position 0 (no NaN)
        mask = (keys_at[None, None, :] <= positions[:, :, None]) | (keys_at[None, None, :] == 0)
        read = lambda i: cache.read(i, slots, num_keys)  # noqa: E731
        return x, self._attention(decoder, x, positions, slots, write_pos, read, mask, cache)

    def decode_attention(self, decoder: TextDecoder, x, positions, pos, slots, write_pos, cache: KVCache):
        """x: [B, 1, D]; pos, write_pos: [B, 1] -> as prefill_attention (rows read their own slot, b = slot b)."""
        B = x.shape[0]
        keys_at = torch.arange(cache.length, device=x.device)
        mask = (keys_at[None, None, :] <= pos[:, :, None]) & (keys_at[None, None, :] < cache.max_len)
        read = lambda i: cache.read(i, slice(B))  # noqa: E731
        return x, self._attention(decoder, x, pos, slots, write_pos, read, mask, cache)

    @staticmethod
    def _attention(decoder, x, positions, write_slots, write_pos, read_keys, mask, cache: KVCache):
        # rope and the bias once per forward, not per layer; k/v: [B, KVH, T, hd] -> cache[layer][slot, :, pos, :]
        cos, sin = decoder.rope(positions, x.dtype)
        bias = decoder.layers[0].self_attn.attention_bias(mask, x.dtype)
        slot_index = write_slots[:, None].expand_as(write_pos)

        def attention(i: int, attn: DecoderAttention, h: torch.Tensor) -> torch.Tensor:
            q, k, v = attn.project(h, cos, sin)
            cache.store(i, slot_index, write_pos, k.transpose(1, 2), v.transpose(1, 2))
            keys, values = read_keys(i)
            return attn.attend(q, keys, values, bias)

        return attention


class FusedLayerOps:
    """The decoder's per-layer ops on the fused Triton kernels (model/kernels.py, model/gemv.py).

    Tokens are flattened to [N, D]; each residual add is fused into the RMSNorm that follows it (the residual stream
    is updated in place); attention reads the cache in place. rope_table: `TextDecoder.rope_table`, cos and sin
    [positions, head_dim] computed as the plain path's rope, so both rotate by identical values.

    Products of up to `gemv_rows` rows (the decode step's small buckets; default gemv.max_rows(), $QASR_DECODE_GEMV)
    stream their weights through gemv.py, larger ones run on cuBLAS: that row count is the one place the choice is
    made. With gemv a layer is eight launches (add+RMSNorm, qkv, q/k-norm+RoPE+KV write, attention, o_proj,
    add+RMSNorm, gate_up+SiLU*mul, down; o_proj, qkv and down hand split-K partial sums to the kernel after them),
    with cuBLAS nine (SiLU*mul apart).

    The decode step's ends are kernels too (#16): its start is one launch (kernels.decode_begin: the embedding
    lookup, the position arithmetic, the residual copy and the first RMSNorm) and, where the lm_head is a GEMV, the
    argmax is taken by it and the bookkeeping kernel after it (`greedy`). With the GEMV products a step is then one
    unbroken chain of Triton kernels (programmatic dependent launch overlaps each with the one before).
    """

    def __init__(self, rope_table: tuple[torch.Tensor, torch.Tensor], gemv_rows: int | None = None,
                 fp8_products: bool = False, fp8_lm_head: bool = False):
        self.cos, self.sin = rope_table
        self.gemv_rows = gemv.max_rows() if gemv_rows is None else gemv_rows
        self.fp8_products = fp8_products  # the products fp8.attach prepared multiply in FP8, their RMSNorm or
        # SiLU*mul quantizing for them (the runner's prefill ops, with EngineOptions.fp8_prefill)
        self.fp8_lm_head = fp8_lm_head  # the lm_head on the weight fp8_lm_head.attach rounded: gemv.py reads its
        # FP8 bytes, cuBLAS its exact image (EngineOptions.fp8_lm_head)

    def _small(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.shape[0] <= self.gemv_rows and gemv.supports(x, weight)

    def _lm_head_weights(self, lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the weight gemv.py streams, its FP8 scales or None, the weight cuBLAS multiplies) of the lm_head."""
        if self.fp8_lm_head:
            rounded = lm_head.rounded
            return rounded.values, rounded.scales, rounded.image
        return lm_head.weight, None, lm_head.weight

    def _norm(self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None) -> torch.Tensor | fp8.Rows:
        if self.fp8_products and norm.feeds_fp8:
            return fp8.Rows(*kernels.rms_norm(x, norm.weight, norm.eps, residual, fp8=True))
        return kernels.rms_norm(x, norm.weight, norm.eps, residual)

    def begin(self, x: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor | fp8.Rows, torch.Tensor]:
        residual = x.contiguous().clone()
        return self._norm(residual, norm, None), residual

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 norm: RMSNorm) -> tuple[torch.Tensor | fp8.Rows, torch.Tensor]:
        """x: [N, D] or a product's float32 split-K partial sums [S, N, D]."""
        return self._norm(x, norm, residual), residual

    def project(self, linear: nn.Linear, x: torch.Tensor | fp8.Rows) -> torch.Tensor:
        """x @ W.T for a kernel that sums partial products itself (add+RMSNorm, q/k-norm+RoPE): [N, out] or
        float32 [S, N, out]."""
        if isinstance(x, fp8.Rows):
            return fp8.linear(x, linear)
        return gemv.partial_products(x, linear.weight) if self._small(x, linear.weight) else linear(x)

    def logits(self, lm_head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        weight, scale, dense = self._lm_head_weights(lm_head)
        return gemv.linear(h, weight, scale=scale) if self._small(h, weight) else F.linear(h, dense, lm_head.bias)

    def greedy(self, lm_head: nn.Linear,
               h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | kernels.BlockMaxima]:
        """-> (logits, their argmax): [B] long, or the GEMV lm_head's kernels.BlockMaxima (kernels.advance_rows
        finishes that argmax in its own launch, bit for bit torch.argmax's)."""
        weight, scale, _ = self._lm_head_weights(lm_head)
        if self._small(h, weight):
            return gemv.linear_argmax(h, weight, scale=scale)
        logits = self.logits(lm_head, h)
        return logits, logits.argmax(dim=-1)

    def decode_start(self, decoder: TextDecoder, tokens, positions, cache: KVCache):
        """-> ((h, residual) [B, D] for run_layers, attention) of a decode step: its start in one kernel
        (kernels.decode_begin), then attention reading each row's positions itself (no mask to build)."""
        norm = decoder.layers[0].input_layernorm
        h, residual, rope_pos, slots, write_pos = kernels.decode_begin(
            tokens, positions, decoder.embed_tokens.weight, norm.weight, norm.eps, cache.scratch)
        def attend(i, q):
            if cache.int8:
                return kv_int8.decode_attention(q, cache.k[i], cache.v[i], cache.scales(i), positions)
            return kernels.decode_attention(q, cache.k[i], cache.v[i], positions)

        return (h, residual), self._attention(rope_pos, slots, write_pos, attend, cache)

    def mlp(self, mlp: MLP, h: torch.Tensor | fp8.Rows) -> torch.Tensor:
        """-> [N, D], or down's float32 split-K partial sums [S, N, D] (for add_norm)."""
        if isinstance(h, fp8.Rows):
            act = kernels.silu_mul(fp8.linear(h, mlp.gate_up_proj), fp8=True)
            return fp8.linear(fp8.Rows(*act), mlp.down_proj)
        if self._small(h, mlp.gate_up_proj.weight):
            return gemv.partial_products(gemv.gate_up_silu(h, mlp.gate_up_proj.weight), mlp.down_proj.weight)
        return mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(h)))

    def prefill_attention(self, decoder: TextDecoder, x, positions, slots, starts, lengths, write_pos,
                          cache: KVCache, num_keys: int | None):
        B, T, _ = x.shape
        rope_pos = positions.clamp(max=self.cos.shape[0] - 1)  # padded positions may run past the table
        slot_of = slots[:, None].expand_as(write_pos)
        def attend(i, q):
            if cache.int8:
                return kv_int8.prefill_attention(q, cache.k[i], cache.v[i], cache.scales(i), slots, starts, lengths)
            return kernels.prefill_attention(q, cache.k[i], cache.v[i], slots, starts, lengths)

        return x.reshape(B * T, -1), self._attention(rope_pos.reshape(-1), slot_of.reshape(-1), write_pos.reshape(-1),
                                                     attend, cache)

    def _attention(self, rope_pos, slots, write_pos, attend, cache: KVCache):
        # rope_pos, slots, write_pos: [N]; attend(layer, q [N, H, hd]) -> [N, H * hd]
        def attention(i: int, attn: DecoderAttention, h: torch.Tensor) -> torch.Tensor:
            q = kernels.qk_norm_rope_store(self.project(attn.qkv_proj, h), attn.q_norm.weight, attn.k_norm.weight, self.cos,
                                           self.sin, rope_pos, slots, write_pos, cache.k[i], cache.v[i],
                                           attn.num_heads, attn.num_kv_heads, attn.q_norm.eps, cache.scales(i))
            return attend(i, q)

        return attention


LayerOps = PlainLayerOps | FusedLayerOps


# ----------------------------------------------------------------------------------------------------------------


class Qwen3ASR(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = AudioEncoder(cfg.audio)
        self.decoder = TextDecoder(cfg.text)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def new_cache(self, num_slots: int, max_len: int, int8: bool = False) -> KVCache:
        return KVCache(self.cfg.text, num_slots, max_len, device=self.device, dtype=self.dtype, int8=int8)

    def embed_prompt(self, input_ids: torch.Tensor, audio: torch.Tensor, audio_offset: int) -> torch.Tensor:
        # input_ids: [T]; audio: [N, D] placed at positions audio_offset .. audio_offset + N -> [T, D]
        return self.splice_audio(self.decoder.embed_tokens(input_ids), audio, audio_offset)

    @staticmethod
    def splice_audio(token_embeds: torch.Tensor, audio: torch.Tensor, audio_offset: int) -> torch.Tensor:
        """The prompt's embedded tokens [T, D] with the audio placeholders from audio_offset replaced by audio [N, D]."""
        end = audio_offset + audio.shape[0]
        return torch.cat([token_embeds[:audio_offset], audio.to(token_embeds.dtype), token_embeds[end:]])
