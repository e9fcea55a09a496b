"""CUDA graphs for the forced aligner's forward: static buffers per bucket, replayed instead of ~500 eager launches.

Eagerly, one aligner forward is ~24 encoder and 28 decoder layers of small kernels launched from Python: 34.9 ms per
final at batch 1 on the H200, nearly all of it launch overhead (docs/benchmarks.md). Here a batch laid out by
qasr.model.aligner_batch is padded up to a bucket and replays two graphs: the encoder over W windows (convolutions
and transformer, qasr.model.aligner's `encode_chunks`), writing the shared `audio` buffer, and the decoder + head over
(rows, tokens) (`timestamp_logits`), whose argmax per position is the output. Padding changes no real row: padding
chunks are zero and past their window's length, padding positions past their row's length, padding rows and windows
have length 1 (tests/engine/test_aligner_graphs.py compares padded and unpadded on the CPU).

Buckets come from the real shapes: a segment is at most 30 s (the server's VadSettings.max_segment_s), 13 audio
tokens a second (4 windows of 104) plus ~3 tokens a word (the word's tokens and its two timestamp slots): 390 + 2 +
~270 positions for 30 s of fast speech, under the largest token bucket. A batch past the largest buckets (longer
clips through `qasr-transcribe`, an unusually long transcript) runs eagerly: correct, only slower. The mel and the
chunk gather stay eager (a handful of kernels whose shapes follow the clips). Without `capture` the same buffers and
padding run eagerly, which is how the CPU tests check them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from qasr.audio import SAMPLE_RATE
from qasr.model.audio import num_frames

from .runner import capture_graph, capture_stream

if TYPE_CHECKING:
    from qasr.model.aligner import ForcedAligner
    from qasr.model.aligner_batch import AlignerBatch

log = logging.getLogger(__name__)

SEGMENT_SECONDS = 30.0  # the longest segment the server's VAD closes (VadSettings.max_segment_s's limit)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)  # finals per forward (capped at the runner's max_batch)
TOKEN_BUCKETS = (128, 256, 384, 512, 768)  # decoder positions per row


class DecoderBucket:
    """Static inputs and output of one (rows, tokens) decoder shape and, when captured, its graph."""

    def __init__(self, graphs: "AlignerGraphs", rows: int, tokens: int):
        device = graphs.device
        self.graphs = graphs
        self.ids = torch.full((rows, tokens), graphs.pad_id, dtype=torch.long, device=device)
        self.audio_index = torch.zeros(rows, tokens, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)
        self.classes = torch.zeros(rows, tokens, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self) -> None:
        aligner = self.graphs.aligner
        logits = aligner.network.timestamp_logits(self.ids, self.audio_index, self.lengths, self.graphs.audio,
                                                  aligner.tokenizer.audio_pad_id)
        self.classes.copy_(logits.argmax(dim=-1))


class AlignerGraphs:
    """The aligner's bucketed static buffers; `run()` pads a batch into them and replays (or runs) the forward."""

    def __init__(self, aligner: "ForcedAligner", *, max_rows: int, capture: bool,
                 row_buckets: tuple[int, ...] = ROW_BUCKETS, token_buckets: tuple[int, ...] = TOKEN_BUCKETS,
                 max_windows: int | None = None):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.aligner = aligner
        self.device = aligner.device
        self.pad_id = aligner.tokenizer.endoftext_id
        audio_cfg = aligner.config.model.audio
        self.row_buckets = tuple(b for b in row_buckets if b < max_rows) + (max_rows,)
        self.token_buckets = tuple(sorted(token_buckets))
        if max_windows is None:  # every row a longest segment
            longest = audio_cfg.num_tokens(int(num_frames(int(SEGMENT_SECONDS * SAMPLE_RATE))))
            max_windows = max_rows * -(-longest // audio_cfg.window_tokens)
        self.window_buckets = tuple(1 << i for i in range(max_windows.bit_length()) if 1 << i < max_windows) + (
            max_windows,)
        chunks_per_window = audio_cfg.window_tokens // audio_cfg.tokens_per_chunk
        dtype = aligner.network.classifier.weight.dtype
        # the encoder's static inputs, shared by its buckets (a bucket of W windows reads the first W), and its output
        self.chunks = torch.zeros(chunks_per_window * max_windows, audio_cfg.num_mel_bins, audio_cfg.chunk_frames,
                                  dtype=dtype, device=self.device)
        self.chunk_valid = torch.ones(self.chunks.shape[0], dtype=torch.long, device=self.device)
        self.window_lengths = torch.ones(max_windows, dtype=torch.long, device=self.device)
        self.audio = torch.zeros(max_windows * audio_cfg.window_tokens, audio_cfg.output_dim, dtype=dtype,
                                 device=self.device)
        self.encoder_graphs: dict[int, torch.cuda.CUDAGraph | None] = dict.fromkeys(self.window_buckets)
        self.decoders = {(b, t): DecoderBucket(self, b, t) for b in self.row_buckets for t in self.token_buckets}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    @property
    def num_graphs(self) -> int:
        return (sum(g is not None for g in self.encoder_graphs.values())
                + sum(d.graph is not None for d in self.decoders.values()))

    def shape_for(self, batch: "AlignerBatch") -> tuple[int, int, int] | None:
        """The bucket (rows, tokens, windows) that holds `batch`, or None if it is larger than the largest one."""
        rows, tokens, windows = batch.shape
        pick = lambda buckets, n: next((b for b in buckets if b >= n), None)  # noqa: E731
        shape = pick(self.row_buckets, rows), pick(self.token_buckets, tokens), pick(self.window_buckets, windows)
        return None if None in shape else shape

    def run(self, batch: "AlignerBatch", clips: list[torch.Tensor]) -> torch.Tensor:
        """Classes at every position [rows, tokens] of a batch padded to a bucket's shape (`shape_for`): a view of
        the bucket's static output, overwritten by the next run."""
        rows, tokens, windows = batch.shape
        if (rows, tokens) not in self.decoders or windows not in self.encoder_graphs:
            raise ValueError(f"no aligner bucket of shape {batch.shape}: pad the batch to shape_for() first")
        arrays = self.aligner.upload(batch)
        chunks = self.aligner.chunks(clips, batch, arrays["chunk_source"])
        n = chunks.shape[0]
        self.chunks[:n].copy_(chunks)
        self.chunk_valid[:n].copy_(arrays["chunk_valid"])
        self.window_lengths[:windows].copy_(arrays["window_lengths"])
        self._replay_encoder(windows)
        decoder = self.decoders[rows, tokens]
        decoder.ids.copy_(arrays["ids"])
        decoder.audio_index.copy_(arrays["audio_index"])
        decoder.lengths.copy_(arrays["lengths"])
        if decoder.graph is None:
            decoder.forward()
        else:
            decoder.graph.replay()
        return decoder.classes

    def _encode(self, windows: int) -> None:
        chunk_slots = self.chunks.shape[0] // self.window_lengths.shape[0] * windows
        audio = self.aligner.network.encode_chunks(self.chunks[:chunk_slots], self.chunk_valid[:chunk_slots],
                                                   self.window_lengths[:windows])
        self.audio[: audio.shape[0]].copy_(audio)

    def _replay_encoder(self, windows: int) -> None:
        graph = self.encoder_graphs[windows]
        if graph is None:
            self._encode(windows)
        else:
            graph.replay()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool of the aligner's own (it replays on a
        side stream while the engine's decode graphs replay on theirs)."""
        start = time.perf_counter()
        pool = None
        with capture_stream() as stream:
            for key in sorted(self.decoders, key=lambda k: k[0] * k[1], reverse=True):
                decoder = self.decoders[key]
                decoder.graph, _ = capture_graph(decoder.forward, stream, pool, warmups=1)
                pool = decoder.graph.pool() if pool is None else pool
            for windows in sorted(self.encoder_graphs, reverse=True):
                self.encoder_graphs[windows], _ = capture_graph(lambda: self._encode(windows), stream, pool, warmups=1)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d aligner graphs in %.1f s: decoder rows %s x tokens %s, encoder windows %s",
                 self.num_graphs, self.capture_seconds, list(self.row_buckets), list(self.token_buckets),
                 list(self.window_buckets))
