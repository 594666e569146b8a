"""SigLIP vision tower on timm's `VisionTransformer`, loaded from HF SigLIP weight names.

With `act_layer='gelu_tanh'`, no class token and no pooling head, the timm model computes
exactly what HF `SiglipVisionModel` (and Idefics3's SigLIP copy) computes in float32.
The HF checkpoint stores q/k/v separately; timm fuses them into one `qkv` linear.
timm's modules hold the weights; the forward is `siglip_fused`'s (timm's own stays
reachable as the reference, `fused=False`). `pack()` puts the CPU float32 linears in
oneDNN's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from timm.models.vision_transformer import VisionTransformer

from encoders.siglip_fused import check_plain_block, fused_states, tile_kernel
from encoders.weights import CheckpointError, load_into, take
from kernels import cpu_attention
from kernels.packed_linear import Activation, pack_linears

# HF `hidden_act` -> timm `act_layer`; only the ones that stay bit-exact. The fused forward
# names the same two functions the same way (`kernels.packed_linear.Activation`).
_ACT_LAYERS: dict[str, Activation] = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class SiglipConfig:
    """The SigLIP vision hyper-parameters we need (HF `SiglipVisionConfig` field names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACT_LAYERS:
            raise ValueError(
                f"vision hidden_act {self.hidden_act!r} is not supported "
                f"(supported: {sorted(_ACT_LAYERS)})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def patches_per_side(self) -> int:
        # floor, like the stride-`patch_size` conv: 384 / 14 -> 27 (the last 6 pixels unused)
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Mapping, defaults: Mapping[str, object]) -> SiglipConfig:
        """Read an HF vision sub-config; `defaults` fills the fields `save_pretrained` may
        leave out (the config class's own defaults)."""
        values = {}
        for name in cls.__dataclass_fields__:
            value = vision_config.get(name, defaults.get(name))
            if value is None:
                raise CheckpointError(f"vision_config has no {name!r} and no default is known")
            if isinstance(value, (list, tuple)):  # HF allows [h, w]; we serve square tiles
                if len(set(value)) != 1:
                    raise CheckpointError(f"vision_config {name}={value}: only square is supported")
                value = value[0]
            values[name] = value
        return cls(**values)


class SiglipTower(torch.nn.Module):
    """SigLIP ViT over uniform square tiles: `[num_tiles, 3, H, W]` -> hidden states.

    `post_norm=True` keeps the final LayerNorm (HF `post_layernorm`); without it the last
    hidden state is the one before that norm (what LLaVA-OneVision consumes).
    `fused=False` runs timm's own forward (the reference the fused one is tested against).
    `tiles_per_chunk`: run the blocks over this many tiles at a time (None:
    `siglip_fused.default_tiles_per_chunk`).
    """

    def __init__(
        self,
        config: SiglipConfig,
        post_norm: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fused: bool = True,
        tiles_per_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.post_norm = post_norm
        self.fused = fused
        self.tiles_per_chunk = tiles_per_chunk
        # Attention on the C++ kernel or SDPA, as calibrated on this CPU at `pack`
        # (kernels/cpu_attention.tile_kernel_wins; None: not packed, SDPA).
        self.tile_kernel: bool | None = None
        # int(hidden * ratio) must give intermediate_size exactly (e.g. 1152 -> 4304).
        mlp_ratio = (config.intermediate_size + 0.5) / config.hidden_size
        self.vit = VisionTransformer(
            img_size=config.image_size,
            patch_size=config.patch_size,
            in_chans=config.num_channels,
            num_classes=0,
            global_pool="",
            embed_dim=config.hidden_size,
            depth=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=True,
            class_token=False,
            final_norm=post_norm,
            act_layer=_ACT_LAYERS[config.hidden_act],
            norm_layer=functools.partial(torch.nn.LayerNorm, eps=config.layer_norm_eps),
            weight_init="skip",
            dtype=dtype,
            device=device,
        )
        assert self.vit.blocks[0].mlp.fc1.out_features == config.intermediate_size
        for block in self.vit.blocks:
            check_plain_block(block)

    @property
    def num_layers(self) -> int:
        return len(self.vit.blocks)

    def pack(self) -> int:
        """Prepack the blocks' CPU float32 linears (oneDNN layout, fused epilogues);
        returns how many. Both forwards keep working; the plain weights are dropped. The
        attention's kernel choice is settled here too, at the tower's own shape."""
        count = pack_linears(self.vit.blocks)
        embed = self.vit.pos_embed[0]  # [num_patches, hidden]
        heads = self.config.num_attention_heads
        head_dim = self.config.hidden_size // heads
        can_run = tile_kernel(embed, head_dim, embed.shape[0], calibrated=True)
        self.tile_kernel = can_run and cpu_attention.tile_kernel_wins(
            embed.dtype, heads, head_dim, embed.shape[0]
        )
        return count

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Last hidden state (after the post-norm when the tower has one)."""
        # [num_tiles, 3, H, W] -> [num_tiles, num_patches, hidden]
        if not self.fused:
            return self.vit.forward_features(pixel_values)
        (x,) = self._fused_states(pixel_values, [self.num_layers]).values()
        return self.vit.norm(x)  # Identity without a post-norm

    def hidden_states(
        self, pixel_values: torch.Tensor, layers: Sequence[int]
    ) -> list[torch.Tensor]:
        """HF `hidden_states[i]` for each i in `layers` (0 = embeddings, i = after block i,
        negative counts from the end; never post-normed). Runs only the blocks needed."""
        num_states = self.num_layers + 1
        for layer in layers:
            if not -num_states <= layer < num_states:
                raise ValueError(
                    f"vision_feature_layer {layer} out of range for {num_states} states"
                )
        wanted = [layer % num_states for layer in layers]
        if self.fused:
            states = self._fused_states(pixel_values, wanted)
            return [states[i] for i in wanted]
        x = self.vit._pos_embed(self.vit.patch_embed(pixel_values))  # [T, P, D]
        states = {0: x}
        for i, block in enumerate(self.vit.blocks[: max(wanted)], start=1):
            x = block(x)
            states[i] = x
        return [states[i] for i in wanted]

    def _fused_states(self, pixel_values: torch.Tensor, wanted: list[int]) -> dict:
        act = _ACT_LAYERS[self.config.hidden_act]
        return fused_states(
            self.vit, pixel_values, wanted, act, self.tiles_per_chunk, self.tile_kernel
        )


def _tower_prefix_names(num_layers: int, post_norm: bool) -> dict[str, list[str]]:
    """Our parameter name -> the HF SigLIP names (relative to the tower prefix) it is made of;
    several names are concatenated along dim 0 (q, k, v -> qkv)."""
    names: dict[str, list[str]] = {
        "vit.patch_embed.proj.weight": ["embeddings.patch_embedding.weight"],
        "vit.patch_embed.proj.bias": ["embeddings.patch_embedding.bias"],
    }
    for i in range(num_layers):
        ours, hf = f"vit.blocks.{i}.", f"encoder.layers.{i}."
        for part in ("weight", "bias"):
            names[ours + f"norm1.{part}"] = [hf + f"layer_norm1.{part}"]
            names[ours + f"norm2.{part}"] = [hf + f"layer_norm2.{part}"]
            names[ours + f"attn.qkv.{part}"] = [hf + f"self_attn.{p}_proj.{part}" for p in "qkv"]
            names[ours + f"attn.proj.{part}"] = [hf + f"self_attn.out_proj.{part}"]
            names[ours + f"mlp.fc1.{part}"] = [hf + f"mlp.fc1.{part}"]
            names[ours + f"mlp.fc2.{part}"] = [hf + f"mlp.fc2.{part}"]
    if post_norm:
        names["vit.norm.weight"] = ["post_layernorm.weight"]
        names["vit.norm.bias"] = ["post_layernorm.bias"]
    return names


def load_siglip_tower(
    tower: SiglipTower,
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    position_ids: torch.Tensor | None = None,
) -> None:
    """Copy HF SigLIP weights found under `prefix` (e.g. 'model.vision_model.') into `tower`.

    `position_ids` ([num_patches], optional) picks which row of the HF position table each
    patch uses (Idefics3 buckets positions); default is the identity.
    """
    params = dict(tower.named_parameters())
    merged: dict[str, torch.Tensor] = {}
    for ours, parts in _tower_prefix_names(tower.num_layers, tower.post_norm).items():
        shape = tuple(params[ours].shape)
        part_shape = (shape[0] // len(parts), *shape[1:])
        merged[ours] = torch.cat([take(tensors, prefix + p, part_shape) for p in parts], dim=0)
    num_patches, dim = tower.vit.pos_embed.shape[1:]
    # [num_positions, hidden] in HF; timm keeps [1, num_patches, hidden]
    table = take(tensors, prefix + "embeddings.position_embedding.weight", (num_patches, dim))
    if position_ids is not None:
        table = table[position_ids]
    merged["vit.pos_embed"] = table[None]
    load_into(tower, merged, {name: name for name in params})


def idefics3_position_ids(patches_per_side: int) -> torch.Tensor:
    """Rows of the position table Idefics3 uses for a full tile ([num_patches]), computed
    exactly as `Idefics3VisionEmbeddings` buckets them (fractional coordinates)."""
    n = patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    step = 1.0 / torch.tensor([n])  # float32, as HF divides by an integer patch count
    coords = torch.arange(n, dtype=torch.float32)[None, :] * step[:, None]
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)[0]
    return (buckets[:, None] * n + buckets[None, :]).reshape(-1)
