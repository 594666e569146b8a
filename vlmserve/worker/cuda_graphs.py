"""CUDA graphs for the decode step, one per batch-size bucket, over persistent buffers.

A decode step at small batch is launch-bound on a GPU: ~10 kernels per layer at a few
microseconds each against a few microseconds of work. Replaying a captured graph launches
them all at once. A graph replays fixed addresses and fixed launch grids, so each bucket
owns views of persistent input buffers (token ids, positions, slots, block tables,
context lengths) and its output; a step of n sequences copies its inputs into the first n
rows of the smallest bucket >= n and pads the rest as empty sequences (slot -1 writes no
K/V, context 0 reads none and outputs zeros; kernels/triton_attention.py and
kernels/triton_ops.py handle both). The decode split count is fixed per bucket from the
longest context the model allows. Graphs are captured lazily, the first time a bucket is
used, after one eager warm-up run that compiles the Triton kernels (vLLM and SGLang
capture at start-up instead; lazily keeps start-up cost to the buckets a workload uses).

Only all-decode steps without images on the Triton backend with fused ops take this path
(the fused RoPE + K/V write is what skips a padded row's write); every other step runs
eagerly as before.
"""

from __future__ import annotations

import torch
import triton

from kernels.cpu_attention import PagedRows
from kernels.triton_attention import TritonAttentionMetadata, decode_splits

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self, decoder: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
        max_model_len: int, block_size: int, capture: bool = True,
    ) -> None:  # fmt: skip
        # capture=False runs each bucket's padded step eagerly instead of replaying it:
        # the same buffers, padding and metadata, checkable on a CPU (Triton interpreter).
        self.capture = capture
        self.decoder, self.kv_caches = decoder, kv_caches
        self.buckets = buckets_up_to(max_batch)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.width = triton.cdiv(max_model_len, block_size)
        device = kv_caches[0].device
        size = self.buckets[-1]

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.token_ids = zeros(size, dtype=torch.long)
        self.positions = zeros(size, dtype=torch.long)
        self.slots = zeros(size, dtype=torch.long)
        self.tables = zeros(size, self.width)
        self.context_lens = zeros(size)
        self.starts = torch.arange(size, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def fits(self, metadata: object) -> bool:
        """Whether a step with this attention metadata can replay a graph."""
        if not isinstance(metadata, TritonAttentionMetadata):
            return False
        rows = metadata.decode
        return (
            metadata.extend is None and rows is not None
            and rows.context_lens.shape[0] <= self.buckets[-1]
            and rows.block_tables.shape[1] <= self.width and rows.block_size == self.block_size
        )  # fmt: skip

    def run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, metadata: TritonAttentionMetadata
    ) -> torch.Tensor:
        """The decoder's hidden states [n, hidden] for an all-decode step (host inputs)."""
        rows = metadata.decode
        n = rows.context_lens.shape[0]
        size = next(b for b in self.buckets if b >= n)
        self.token_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(metadata.slot_mapping)
        self.tables[:n, : rows.block_tables.shape[1]].copy_(rows.block_tables)
        self.context_lens[:n].copy_(rows.context_lens)
        self.token_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(-1)
        self.context_lens[n:size].zero_()
        if not self.capture:
            return self._forward(size)[:n]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        kv_heads = self.kv_caches[0].shape[1]
        splits, split_len = decode_splits(self.max_model_len, size, kv_heads, self.block_size)
        meta = TritonAttentionMetadata(
            self.slots[:size],
            PagedRows(
                self.tables[:size], self.starts[:size], self.query_lens[:size],
                self.context_lens[:size], self.block_size,
            ),
            None, 0, splits, split_len,
        )  # fmt: skip
        embeds = self.decoder.embed(self.token_ids[:size])
        return self.decoder(embeds, self.positions[:size], meta, self.kv_caches)

    def _capture(self, size: int) -> None:
        # Warm up on a side stream (compiles the Triton kernels, sets lazy state such as
        # RoPE's frequencies); its K/V writes are the step's own, rewritten on replay.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.pool = graph.pool()
        self.graphs[size] = graph
