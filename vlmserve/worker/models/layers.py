"""The decoder's shape (`DecoderConfig`, from a HF text config) and its RMSNorm: shared
by the Llama / Qwen2 layers (`decoder.py`) and Gemma 3's (`gemma3.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from kernels import fused_ops
from vlmserve.worker.models.rope import RopeConfig, rope_config_from_hf


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    # Gemma 3 (models/gemma3.py): per layer a sliding window (None: global attention),
    # the sliding layers' RoPE, the score scale's base, the text model's logit cap.
    variant: Literal["llama", "gemma3"] = "llama"
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"sliding windows {set(self.layer_windows)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, text_config: dict, *, qkv_bias: bool, tie: bool) -> DecoderConfig:
        if text_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {text_config['hidden_act']!r}: only silu is supported")
        num_heads = text_config["num_attention_heads"]
        head_dim = text_config.get("head_dim") or text_config["hidden_size"] // num_heads
        return cls(
            vocab_size=text_config["vocab_size"],
            hidden_size=text_config["hidden_size"],
            intermediate_size=text_config["intermediate_size"],
            num_layers=text_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=text_config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=text_config.get("rms_norm_eps", 1e-6),
            rope=rope_config_from_hf(text_config, head_dim),
            max_position_embeddings=text_config.get("max_position_embeddings", 2048),
            qkv_bias=qkv_bias or bool(text_config.get("attention_bias", False)),
            tie_word_embeddings=tie,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps, fused)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): may overwrite x and residual."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps, fused)
