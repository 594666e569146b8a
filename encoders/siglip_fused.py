"""The SigLIP tower's fast forward: timm's own block weights, run as fewer, fused ops.

It computes the same float32 function as timm's `Block.forward` (the reference path,
`SiglipTower(fused=False)`); what is left on CPU is the GEMMs, at ~93% of the core's
float32 peak, and SDPA (`benchmarks/ops/vision_tower.py`). Against timm's forward:
- rows are flat, `[tiles * patches, hidden]`: every linear is one 2-D GEMM;
- q, k and v are strided views of the fused qkv GEMM's output, passed to SDPA as they
  are, and SDPA's output is read back through a transpose that costs no copy;
- bias, GELU and the residual add run in the GEMM's epilogue when the linears are packed
  (`kernels.packed_linear`), instead of as passes over `[rows, 3072]` tensors.
Seven parallel ops per block. On one CPU thread the tiles go through one at a time: each
tile's buffers fit under glibc's mmap threshold, so ops reuse freed heap memory instead of
page-faulting in fresh pages (as timm's forward does, for every tile of every layer).
With more threads every tile goes at once: chunks multiply the ops, and on a loaded
machine each OpenMP op can wait a scheduler slice for a descheduled thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block, VisionTransformer

from kernels import cpu_attention
from kernels.packed_linear import Activation, linear_act, linear_add


def check_plain_block(block: Block) -> None:
    """The fused forward skips what a SigLIP block does not have (layer scale, q/k norm,
    the attention/MLP inner norms, drop path): assert that they really are identities."""
    parts = [block.ls1, block.ls2, block.drop_path1, block.drop_path2, block.attn.q_norm,
             block.attn.k_norm, block.attn.norm, block.mlp.norm]  # fmt: skip
    assert all(isinstance(p, torch.nn.Identity) for p in parts), "not a plain pre-norm block"
    assert getattr(block.attn, "gate", None) is None, "gated attention is not supported"


def fused_block(
    block: Block, x: torch.Tensor, num_tiles: int, act: Activation, kernel: bool | None = None
) -> torch.Tensor:
    """One pre-norm ViT block. x: [num_tiles * num_patches, hidden], tile-major rows.
    `kernel`: the calibrated attention choice (`tile_kernel`)."""
    attn = block.attn
    num_rows, hidden = x.shape
    num_patches = num_rows // num_tiles
    qkv = attn.qkv(block.norm1(x))  # [rows, 3 * hidden], columns (q|k|v, head, head_dim)
    if tile_kernel(x, attn.head_dim, num_patches, kernel):
        out = cpu_attention.tile_attention(qkv, num_tiles, attn.num_heads, attn.scale)
    else:
        # 3 x [tiles, heads, patches, head_dim] strided views; SDPA reads the strides
        shape = (num_tiles, num_patches, 3, attn.num_heads, attn.head_dim)
        q, k, v = qkv.view(shape).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)
        # CPU SDPA writes [tiles, patches, heads, head_dim] memory: this reshape is a view there
        out = out.transpose(1, 2).reshape(num_rows, hidden)
    x = linear_add(attn.proj, out, x)
    return linear_add(block.mlp.fc2, linear_act(block.mlp.fc1, block.norm2(x), act), x)


def tile_kernel(
    x: torch.Tensor, head_dim: int, num_patches: int, calibrated: bool | None = None
) -> bool:
    """Whether a block's attention runs on the C++ prefill kernel instead of torch's SDPA:
    where the kernel runs (a CPU, bfloat16 at even head dims or float32), as this CPU's
    calibration chose at the tower's shape when it was packed (`calibrated`,
    `SiglipTower.pack`: kernels/cpu_attention.tile_kernel_wins; None without one, as for an
    unpacked tower, the plain path: SDPA)."""
    if not calibrated or x.device.type != "cpu" or cpu_attention.prefill_available() is not None:
        return False
    if x.dtype == torch.bfloat16:
        return head_dim % 2 == 0  # bfloat16 pairs
    return x.dtype == torch.float32


def default_tiles_per_chunk(device: torch.device, num_tiles: int) -> int:
    """1 on a single CPU thread, every tile otherwise (see the module docstring)."""
    return 1 if device.type == "cpu" and torch.get_num_threads() == 1 else num_tiles


def fused_states(
    vit: VisionTransformer,
    pixel_values: torch.Tensor,
    wanted: Sequence[int],
    act: Activation,
    tiles_per_chunk: int | None = None,
    kernel: bool | None = None,
) -> dict[int, torch.Tensor]:
    """Hidden states `wanted` (0 = embeddings, i = after block i; each in
    [0, num_blocks]) of `pixel_values` [tiles, 3, H, W], as {i: [tiles, patches, hidden]}.

    `tiles_per_chunk`: tiles run through the blocks together (None: the default above);
    `kernel`: the calibrated attention choice (`tile_kernel`)."""
    num_tiles = pixel_values.shape[0]
    tiles_per_chunk = tiles_per_chunk or default_tiles_per_chunk(pixel_values.device, num_tiles)
    last = max(wanted)
    chunks: dict[int, list[torch.Tensor]] = {i: [] for i in wanted}
    for start in range(0, num_tiles, tiles_per_chunk):
        tiles = pixel_values[start : start + tiles_per_chunk]
        x = vit._pos_embed(vit.patch_embed(tiles))  # [chunk, patches, hidden]
        chunk, num_patches, hidden = x.shape
        x = x.reshape(chunk * num_patches, hidden)
        for i in range(last + 1):
            if i:
                x = fused_block(vit.blocks[i - 1], x, chunk, act, kernel)
            if i in chunks:
                chunks[i].append(x.view(chunk, num_patches, hidden))
    return {i: parts[0] if len(parts) == 1 else torch.cat(parts) for i, parts in chunks.items()}
