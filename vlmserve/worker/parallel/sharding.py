"""Which slice of the decoder a tensor-parallel rank holds (Megatron-style), as pure
functions of the model's shape: no process group, no device.

Attention shards by heads: rank r holds query heads [r·H/n, (r+1)·H/n) and, while
n <= n_kv, KV heads [r·n_kv/n, (r+1)·n_kv/n), so its slice of the KV cache is 1/n of it.
A rank cannot hold less than one KV head (article §16): past n = n_kv each KV head is
replicated on n/n_kv ranks (vLLM's `num_kv_head_replicas`), rank r holding KV head
r // (n/n_kv), the one its query heads read. q/k/v and gate/up are column-parallel (rows
of the weight), o_proj and down_proj row-parallel (columns of the weight; their outputs
are partial sums, all-reduced). Embeddings and the LM head are replicated (see
`executor.py` for why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from encoders.weights import TensorView
from vlmserve.worker.models.decoder import DecoderConfig

# Checkpoint projection -> (dim of its weight that is split, how it is split).
# "q": by query head, "kv": by KV head (replicated past n_kv), "mlp": by intermediate row.
_SPLITS: dict[str, tuple[int, str]] = {
    "self_attn.q_proj": (0, "q"),
    "self_attn.k_proj": (0, "kv"),
    "self_attn.v_proj": (0, "kv"),
    "self_attn.o_proj": (1, "q"),
    "mlp.gate_proj": (0, "mlp"),
    "mlp.up_proj": (0, "mlp"),
    "mlp.down_proj": (1, "mlp"),
}


def check_tensor_parallel(cfg: DecoderConfig, size: int) -> None:
    """ValueError unless `size` ranks can split `cfg`: heads and MLP rows divide evenly,
    and KV heads either divide evenly or (past n_kv) replicate evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be >= 1")
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the {cfg.num_heads} attention heads"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide intermediate_size={cfg.intermediate_size}"
        )
    kv = cfg.num_kv_heads
    if (size <= kv and kv % size) or (size > kv and size % kv):
        raise ValueError(
            f"tensor_parallel_size={size} and the {kv} KV heads: one must divide the other "
            "(KV heads are split, or past their count replicated, evenly)"
        )


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: n_kv/n, but never less than one (§16)."""
    return max(1, num_kv_heads // size)


def kv_replicas(num_kv_heads: int, size: int) -> int:
    """Copies of each KV head across the ranks: 1 while n <= n_kv, n/n_kv past it."""
    return max(1, size // num_kv_heads)


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: which rows/columns of each projection it holds."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} of {self.size}"

    def local_config(self, cfg: DecoderConfig) -> DecoderConfig:
        """The rank's decoder: same layers, hidden size and vocab; its share of the heads
        and MLP rows. A Decoder built from it has exactly the sharded weight shapes."""
        check_tensor_parallel(cfg, self.size)
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=kv_heads_per_rank(cfg.num_kv_heads, self.size),
            intermediate_size=cfg.intermediate_size // self.size,
        )

    def kv_head_range(self, num_kv_heads: int) -> range:
        local = kv_heads_per_rank(num_kv_heads, self.size)
        first = self.rank // kv_replicas(num_kv_heads, self.size) * local
        return range(first, first + local)

    def slice_rows(self, kind: str, cfg: DecoderConfig) -> slice:
        """The rows (or columns) of a projection's split dim that this rank holds."""
        if kind == "mlp":
            n = cfg.intermediate_size // self.size
            return slice(self.rank * n, (self.rank + 1) * n)
        if kind == "q":
            n = cfg.num_heads // self.size * cfg.head_dim
            return slice(self.rank * n, (self.rank + 1) * n)
        heads = self.kv_head_range(cfg.num_kv_heads)
        return slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)


class ShardedWeights(TensorView):
    """A checkpoint's tensors as one rank sees them: the decoder's split projections
    (names under `prefix`) sliced to the rank's rows or columns when read, everything
    else (embeddings, norms, LM head, the vision tower) whole. Slices are views of the
    (memory-mapped) checkpoint tensors; loading copies only them."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], prefix: str, cfg: DecoderConfig, shard: TPShard
    ) -> None:
        self.tensors, self.prefix, self.cfg, self.shard = tensors, prefix, cfg, shard

    def _split_of(self, name: str) -> tuple[int, str] | None:
        if not name.startswith(self.prefix):
            return None
        parts = name[len(self.prefix) :].split(".", 2)  # layers, 3, self_attn.q_proj.weight
        if len(parts) < 3 or parts[0] != "layers":
            return None
        module, _, kind = parts[2].rpartition(".")
        split = _SPLITS.get(module)
        # A row-parallel layer's bias would be added once per rank; the decoder has none
        # there (o_proj, down_proj), so such a tensor is never read.
        if split is None or (kind == "bias" and split[0] == 1):
            return None
        return split

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        split = self._split_of(name)
        if split is None:
            return tensor
        dim, kind = split
        return tensor.narrow(dim, *_start_len(self.shard.slice_rows(kind, self.cfg)))


def _start_len(rows: slice) -> tuple[int, int]:
    return rows.start, rows.stop - rows.start
