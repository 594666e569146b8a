"""The CPU backend: decodes and verifications read K/V straight from the paged cache in a
C++ kernel (kernels/csrc/paged_attention_cpu.cpp), with no per-layer gather.

The torch backend gathers every short-query sequence's context into a padded buffer per
layer and runs batched matmuls: at batch 64 that copy is about half of a decode step on
this CPU. The kernel walks each (sequence, kv head)'s blocks once with an online softmax
instead, threads over those pairs, and writes its rows of the output in place. Everything
else (the cache layout, the K/V write, fresh prefills by SDPA, long chunks on a prefix) is
the torch backend's, unchanged.

The kernel is compiled the first time it is needed (kernels/cpu_build.py). Where no C++
compiler is found the build fails once, `available()` says why, and `select_backend` keeps
the torch one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_build
from kernels.attention import AttentionBatch, TorchAttentionMetadata, TorchPagedAttention


def available() -> str | None:
    """None when the kernel is built and loaded; otherwise the reason it is not."""
    return cpu_build.load("paged_attention_cpu")


@dataclass
class PagedRows:
    """The short-query sequences, for the kernel: int32 on the host."""

    block_tables: torch.Tensor  # [S, max_blocks]
    query_starts: torch.Tensor  # [S] first flat token index
    query_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    block_size: int


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    paged: PagedRows | None = None


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> CpuAttentionMetadata:
        meta, starts, small = self._split(batch, slot_mapping, device)
        paged = None
        if small:
            width = max(len(batch.block_tables[i]) for i in small)
            # One tensor from padded lists: a tensor per sequence costs ~10 us each.
            padded = [t + [0] * (width - len(t)) for t in (batch.block_tables[i] for i in small)]
            tables = torch.tensor(padded, dtype=torch.int32)
            paged = PagedRows(
                tables,
                torch.tensor([starts[i] for i in small], dtype=torch.int32),
                torch.tensor([batch.query_lens[i] for i in small], dtype=torch.int32),
                torch.tensor([batch.context_lens[i] for i in small], dtype=torch.int32),
                batch.block_size,
            )
        return CpuAttentionMetadata(meta.slot_mapping, meta.groups, meta.fresh, paged)

    def _attend(self, out, q, k, v, kv_cache, metadata: CpuAttentionMetadata, scale) -> None:
        super()._attend(out, q, k, v, kv_cache, metadata, scale)
        p = metadata.paged
        if p is not None:
            torch.ops.vlmserve.paged_attention(
                out, q, kv_cache, p.block_tables, p.query_starts,
                p.query_lens, p.context_lens, p.block_size, scale,
            )  # fmt: skip
