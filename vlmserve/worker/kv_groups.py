"""The runner's side of the hybrid KV manager (scheduler/kv_blocks.py): the KV cache
tensors per KV cache group, and a step's block tables, slots and attention metadata per
group.

A block of the shared pool is the KV of `layers_per_block` layers for block_size tokens,
whichever group holds it. So there are `layers_per_block` cache tensors of the backend's
shape over every block of the pool, and layer l, the j-th layer of its group, writes and
reads tensor j at its group's blocks: the layers of one group never share a tensor, and
two groups never hold the same block, so no two layers share a slot. One group (every
layer alike) is a tensor per layer and a block table per sequence, as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, AttentionBatch, LayeredMetadata
from kernels.malloc_tuning import huge_page_area
from scheduler.config import KVCacheGroup, kv_cache_groups
from scheduler.step_plan import BlockTableDelta


@dataclass(frozen=True)
class KVLayout:
    """How a model's layers map onto the shared KV pool."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int
    layer_group: tuple[int, ...]  # per layer: its group
    layer_index: tuple[int, ...]  # per layer: its place in its group (the tensor it uses)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def is_plain(self) -> bool:
        """One group of full-attention layers: one metadata for every layer."""
        return len(self.groups) == 1 and self.groups[0].sliding_window is None


def kv_layout(layer_windows: Sequence[int | None], num_layers: int) -> KVLayout:
    """The layout of `kv_cache_groups` over the model's layers (no windows: all full)."""
    groups = kv_cache_groups(tuple(layer_windows) or (None,) * num_layers)
    layer_group, layer_index = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            layer_group[layer], layer_index[layer] = g, j
    per_block = max(len(g.layers) for g in groups)
    return KVLayout(groups, per_block, tuple(layer_group), tuple(layer_index))


def allocate_kv_caches(
    layout: KVLayout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Per layer, the cache tensor it uses (`layers_per_block` distinct ones), zeroed; on a
    CPU on huge pages where Linux grants them."""
    shared = [_zeros(shape, dtype, device) for _ in range(layout.layers_per_block)]
    return [shared[j] for j in layout.layer_index]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on a CPU on a mapping advised onto huge pages (`huge_page_area`) where
    the tensor is large enough, its pages faulted in now."""
    nbytes = math.prod(shape) * dtype.itemsize
    area = huge_page_area(nbytes) if device.type == "cpu" else None
    if area is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(area, dtype=dtype).view(shape).zero_()


def apply_delta(table: list[int], delta: BlockTableDelta) -> None:
    del table[delta.num_kept :]
    table.extend(delta.new_block_ids)


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end): slot = block * block_size + offset. A run of
    slots per block, not a division per position (a decode is one slot, a chunk many)."""
    slots: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = block_table[block] * block_size + offset
        slots.extend(range(base, base + take))
        pos += take
    return slots


class GroupBatch:
    """The block tables and slots of KV cache groups 1.. for one step, gathered item by
    item beside group 0's (which the runner keeps in the AttentionBatch itself)."""

    def __init__(self, layout: KVLayout, block_size: int) -> None:
        self.layout, self.block_size = layout, block_size
        extra = len(layout.groups) - 1
        self.tables: list[list[list[int]]] = [[] for _ in range(extra)]
        self.slots: list[list[int]] = [[] for _ in range(extra)]

    def add(
        self, tables: list[list[int]], deltas: tuple[BlockTableDelta, ...], start: int, end: int
    ) -> None:
        """One item: apply its group deltas to the request's `tables` (the runner's copy,
        grown here on first use) and note the slots of positions [start, end)."""
        assert len(deltas) == len(self.tables), f"{len(deltas)} group deltas for {len(self.tables)}"
        while len(tables) < len(deltas):
            tables.append([])
        for g, (table, delta) in enumerate(zip(tables, deltas, strict=False)):
            apply_delta(table, delta)
            self.tables[g].append(table)
            self.slots[g].extend(slots_of(table, start, end, self.block_size))

    def metadata(
        self, backend: AttentionBackend, batch: AttentionBatch, slot_mapping: torch.Tensor
    ) -> object:
        """The backend's metadata for the step: one for a plain layout, else per group (its
        own tables, slots and window) in a LayeredMetadata the layers pick theirs from."""
        host = torch.device("cpu")
        if self.layout.is_plain:
            return backend.build_metadata(batch, slot_mapping, host)
        per_group = []
        for g, group in enumerate(self.layout.groups):
            tables = batch.block_tables if g == 0 else self.tables[g - 1]
            slots = slot_mapping if g == 0 else torch.tensor(self.slots[g - 1], dtype=torch.long)
            grouped = dataclasses.replace(
                batch, block_tables=tables, sliding_window=group.sliding_window
            )
            per_group.append(backend.build_metadata(grouped, slots, host))
        return LayeredMetadata(per_group, self.layout.layer_group)
