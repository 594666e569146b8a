"""vlmserve/worker/kv_groups.py: the layers' cache tensors over the shared pool, and a
step's per-group tables, slots and metadata."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBatch, LayeredMetadata, TorchPagedAttention
from scheduler.step_plan import BlockTableDelta
from vlmserve.worker.kv_groups import GroupBatch, allocate_kv_caches, kv_layout, slots_of

GEMMA_12 = ([64] * 5 + [None]) * 2


def test_layers_of_one_group_never_share_a_tensor_and_one_kind_keeps_one_each():
    layout = kv_layout(GEMMA_12, 12)
    assert layout.layers_per_block == 2 and layout.windows == (None,) + (64,) * 5
    caches = allocate_kv_caches(layout, (2, 1, 8, 4), torch.float32, torch.device("cpu"))
    assert len({id(c) for c in caches}) == 2
    for group in layout.groups:
        assert len({id(caches[layer]) for layer in group.layers}) == len(group.layers)
    assert caches[5] is caches[0] and caches[11] is caches[1]  # global 5 beside sliding 0
    plain = kv_layout((), 3)
    assert plain.is_plain and plain.layers_per_block == 3
    caches = allocate_kv_caches(plain, (2, 1, 8, 4), torch.float32, torch.device("cpu"))
    assert len({id(c) for c in caches}) == 3


def test_each_group_gets_its_own_tables_slots_and_window():
    layout = kv_layout(([4] * 5 + [None]) * 2, 12)  # window 4: block 0 lies before it
    groups = GroupBatch(layout, block_size=4)
    tables: list[list[int]] = []
    # A chunk at positions 8..11 (the first query's window starts at 5, in block 1):
    # sliding group g's table is [0 (the null block), 10g + 1, 10g + 2].
    deltas = tuple(BlockTableDelta(0, (0, 10 * g + 1, 10 * g + 2)) for g in range(1, 6))
    groups.add(tables, deltas, 8, 12)
    assert tables == [[0, 10 * g + 1, 10 * g + 2] for g in range(1, 6)]
    batch = AttentionBatch([4], [12], [[7, 8, 9]], 4)
    meta = groups.metadata(
        TorchPagedAttention(), batch, torch.tensor(slots_of([7, 8, 9], 8, 12, 4))
    )
    assert isinstance(meta, LayeredMetadata) and len(meta.groups) == 6
    assert meta.for_layer(5) is meta.groups[0] and meta.for_layer(6) is meta.groups[3]
    assert meta.groups[0].slot_mapping.tolist() == [36, 37, 38, 39]  # block 9
    assert meta.groups[3].slot_mapping.tolist() == [(10 * 3 + 2) * 4 + i for i in range(4)]
    # A sliding group gathers from its window's first block on, never the null entry.
    first_group = meta.groups[1].groups[0]
    assert 0 not in (first_group.ctx_slots // 4).flatten().tolist()
