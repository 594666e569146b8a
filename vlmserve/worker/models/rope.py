"""Rotary position embeddings with the scaling variants Llama / Qwen2 configs use.

The inverse frequencies follow transformers' `modeling_rope_utils` formula for formula, so
that cos/sin (and hence greedy tokens) match the reference implementation in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.rope_type not in _INV_FREQ:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported (supported: {sorted(_INV_FREQ)})"
            )


def rope_config_from_hf(text_config: dict, head_dim: int) -> RopeConfig:
    """Reads both the transformers 5 `rope_parameters` and the older `rope_theta` +
    `rope_scaling` layouts."""
    params = dict(text_config.get("rope_parameters") or {})
    if not params:
        params = dict(text_config.get("rope_scaling") or {})
        params.setdefault("rope_theta", text_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return RopeConfig(
        head_dim=head_dim,
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        params=params,
        max_position_embeddings=int(text_config.get("max_position_embeddings", 2048)),
    )


def _default(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (cfg.theta**exponents), 1.0


def _linear(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    inv_freq, scale = _default(cfg)
    return inv_freq / cfg.params["factor"], scale


def _llama3(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    inv_freq, _ = _default(cfg)
    p = cfg.params
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    p, dim, base = cfg.params, cfg.head_dim, cfg.theta
    original = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


_INV_FREQ = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q and k given absolute positions of a flat token batch."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Computed on first use, in float32 on the CPU, then moved: the module may be
        # built on the meta device while weights load.
        self._inv_freq: torch.Tensor | None = None
        self.attention_scaling = 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # [num_tokens, head_dim]; computed once per step and shared by every layer.
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            with torch.device("cpu"):
                inv_freq, self.attention_scaling = _INV_FREQ[self.cfg.rope_type](self.cfg)
            self._inv_freq = inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
