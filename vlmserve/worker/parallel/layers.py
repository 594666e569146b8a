"""The row-parallel half of Megatron's pair: a linear layer over this rank's columns of
the input, whose output is a partial sum, all-reduced across the ranks.

The column-parallel layers (qkv_proj, gate_up_proj) need no wrapper: the rank's Decoder
is built from `TPShard.local_config`, so they hold its rows and their outputs are its
heads / MLP rows, consumed locally. One all-reduce after attention, one after the MLP:
two per layer (article §16: t_step + 2L·t_all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.worker.models.decoder import Decoder
from vlmserve.worker.parallel.comm import TPGroup


class RowParallelLinear(nn.Module):
    """`linear` (holding this rank's input columns, no bias), then a sum over the ranks.
    `linear` stays a child module, so `pack_linears` prepacks it like any other."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        assert getattr(linear, "bias", None) is None, "a row-parallel bias would add n times"
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def shard_decoder(decoder: Decoder, group: TPGroup) -> None:
    """Make the rank's loaded decoder's o_proj and down_proj row-parallel, in place."""
    for layer in decoder.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
