"""AudioEncoder.pack_windows and embed_clips: a batch's clips cut into fixed attention windows (and conv chunks) by one
gather, exactly as a pad of each clip would cut them (the encoder's input must not change with how it is packed); the
index helper beneath them."""

import numpy as np
import torch
import torch.nn.functional as F

from qasr.model.config import AudioEncoderConfig
from qasr.model.modeling import AudioEncoder, ranges, window_lengths


def padded_per_clip(clips: list[torch.Tensor], size: int) -> torch.Tensor:
    """The plain reference: each clip zero-padded to whole windows, then stacked."""
    pieces = []
    for x in clips:
        k = len(window_lengths(x.shape[0], size))
        pieces.append(F.pad(x, (0, 0, 0, k * size - x.shape[0])).view(k, size, x.shape[1]))
    return torch.cat(pieces)


def test_one_gather_cuts_clips_as_padding_each_would():
    encoder = AudioEncoder(AudioEncoderConfig(encoder_layers=0, d_model=8, encoder_attention_heads=2,
                                              encoder_ffn_dim=16, output_dim=8, downsample_hidden_size=4))
    size = encoder.cfg.window_tokens
    torch.manual_seed(0)
    # a token short of, exactly at and past window boundaries; a one-token clip; a clip of several windows
    clips = [torch.randn(n, 8) for n in (size - 1, size, size + 1, 1, 3 * size + 17, 13)]
    windows, lengths, owners = encoder.pack_windows(clips)
    assert torch.equal(windows, padded_per_clip(clips, size))
    assert lengths.tolist() == [n for x in clips for n in window_lengths(x.shape[0], size)]
    assert owners == [i for i, x in enumerate(clips) for _ in window_lengths(x.shape[0], size)]
    assert not windows[0, size - 1].any() and windows[0, size - 2].any()  # the padding is zeros, the tokens kept
    # one clip alone, as a stream's partial brings it
    alone, _, _ = encoder.pack_windows(clips[4:5])
    assert torch.equal(alone, padded_per_clip(clips[4:5], size))


def test_one_gather_chunks_clips_as_padding_each_would():
    """embed_clips: every clip's chunks for the conv front end by one gather, as a pad of each clip's last chunk with
    zeros would make them; a clip under one chunk runs apart, unpadded, unless it continues a longer clip."""
    encoder = AudioEncoder(AudioEncoderConfig(encoder_layers=0, d_model=8, encoder_attention_heads=2,
                                              encoder_ffn_dim=16, output_dim=8, downsample_hidden_size=4,
                                              num_mel_bins=16))
    cfg, size = encoder.cfg, encoder.cfg.chunk_frames
    torch.manual_seed(1)
    frames = [size - 1, size, size + 1, 3 * size + 17, 40, 2 * size]  # around chunk edges; a short clip (40)
    batch = torch.randn(len(frames), cfg.num_mel_bins, max(frames))
    mels = [batch[i, :, :f] for i, f in enumerate(frames)]  # views of one batch, as the engine's features are
    for tails in (None, [False, False, False, False, True, False]):
        seen = []

        def embed_chunks(chunks):
            seen.append(chunks.clone())
            return encoder.embed_chunks(chunks)

        got = encoder.embed_clips(mels, tails, embed_chunks)
        padded = [i for i, f in enumerate(frames) if f >= size or (tails and tails[i])]
        reference = torch.cat([F.pad(mels[i], (0, -(-frames[i] // size) * size - frames[i]))
                               .view(cfg.num_mel_bins, -1, size).transpose(0, 1) for i in padded])
        assert len(seen) == 1 and torch.equal(seen[0], reference)  # the short clip is not among them
        out = encoder.embed_chunks(reference)
        row = 0
        for i, f in enumerate(frames):
            assert got[i].shape == (cfg.num_tokens(f), cfg.d_model)
            if i not in padded:
                assert torch.equal(got[i], encoder.embed_chunks(mels[i][None])[0, : cfg.num_tokens(f)])
                continue
            n = -(-f // size)
            assert torch.equal(got[i], out[row : row + n].flatten(0, 1)[: cfg.num_tokens(f)])
            row += n


def test_ranges_are_each_start_and_length_laid_out_in_order():
    starts, lengths = [7, 0, 100, 3, 50], [3, 0, 1, 4, 2]  # an empty one among them; starts in any order
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert ranges(starts, lengths).tolist() == expected.tolist() == [7, 8, 9, 100, 3, 4, 5, 6, 50, 51]
    assert ranges([], []).tolist() == []
