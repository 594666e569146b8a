"""Gemma 3's decoder layer: what differs from Llama, on the same flat batch and paged KV.

QK-norm (an RMSNorm over each head of q and k before RoPE), `(1 + weight)` RMSNorms
before and after both attention and the MLP (the sandwich), a GeLU-tanh gated MLP,
embeddings scaled by sqrt(hidden), scores scaled by `query_pre_attn_scalar ** -0.5`, and
per layer (`layer_types`) either a sliding window with the local RoPE base or global
attention with its own RoPE base and scaling. The `(1 + weight)` is folded into the
weights at load time (`GemmaNormWeights`), so the plain RMSNorm kernels serve it.
"""

from __future__ import annotations

import torch
from torch import nn

from encoders.weights import TensorView
from kernels import fused_ops
from kernels.attention import LayeredMetadata
from vlmserve.worker.models.layers import DecoderConfig, RMSNorm
from vlmserve.worker.models.rope import rope_config_from_hf

__all__ = ["Gemma3Attention", "Gemma3DecoderLayer", "GemmaNormWeights", "gemma3_decoder_config"]


def gemma3_decoder_config(text_config: dict, *, tie: bool, causal_lm: bool) -> DecoderConfig:
    """DecoderConfig of a Gemma 3 text config (transformers 5 `rope_parameters` per layer
    type, or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`).
    `causal_lm`: Gemma3ForCausalLM applies `final_logit_softcapping`;
    Gemma3ForConditionalGeneration does not (as in transformers)."""
    if text_config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation {text_config['hidden_activation']!r}: only gelu_pytorch_tanh"
        )
    if text_config.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 has none)")
    if text_config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
    num_layers = text_config["num_hidden_layers"]
    num_heads = text_config["num_attention_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // num_heads
    pattern = text_config.get("sliding_window_pattern", 6)
    layer_types = text_config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    window = text_config.get("sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    params = text_config.get("rope_parameters") or {}
    if "full_attention" in params:
        global_rope = rope_config_from_hf({**text_config, "rope_parameters":
                                           params["full_attention"]}, head_dim)  # fmt: skip
        local_rope = rope_config_from_hf({**text_config, "rope_parameters":
                                          params["sliding_attention"]}, head_dim)  # fmt: skip
    else:  # the older layout: global base + scaling, and a local base
        global_rope = rope_config_from_hf(
            {**text_config, "rope_theta": text_config.get("rope_theta", 1_000_000.0)}, head_dim
        )
        local_rope = rope_config_from_hf(
            {"rope_theta": text_config.get("rope_local_base_freq", 10_000.0),
             "max_position_embeddings": text_config.get("max_position_embeddings", 2048)},
            head_dim,
        )  # fmt: skip
    return DecoderConfig(
        vocab_size=text_config["vocab_size"],
        hidden_size=text_config["hidden_size"],
        intermediate_size=text_config["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=text_config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=text_config.get("rms_norm_eps", 1e-6),
        rope=global_rope,
        max_position_embeddings=text_config.get("max_position_embeddings", 131_072),
        qkv_bias=bool(text_config.get("attention_bias", False)),
        tie_word_embeddings=tie,
        variant="gemma3",
        layer_windows=windows,
        local_rope=local_rope,
        query_pre_attn_scalar=float(text_config.get("query_pre_attn_scalar", head_dim)),
        final_logit_softcapping=(text_config.get("final_logit_softcapping") if causal_lm else None),
    )


class Gemma3Attention(nn.Module):
    """GQA with QK-norm; a layer reads its KV cache group's metadata (a sliding-window one
    built with the window) and, sliding, the local RoPE tables."""

    def __init__(self, cfg, backend, layer: int) -> None:
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward(self, x: torch.Tensor, ctx, layer: int) -> torch.Tensor:
        n, c = x.shape[0], self.cfg
        qkv = self.qkv_proj(x)
        cos, sin = (ctx.local_cos, ctx.local_sin) if self.window else (ctx.cos, ctx.sin)
        meta = ctx.attn_metadata
        if isinstance(meta, LayeredMetadata):  # this layer's KV cache group's
            meta = meta.for_layer(layer)
        fused_qkv = getattr(self.backend, "forward_qkv", None) if ctx.fused else None
        if fused_qkv is not None:  # the CPU backend: norms, RoPE and the K/V write in one op
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            out = fused_qkv(qkv, c.num_heads, c.head_dim, norms, cos, sin,
                            ctx.kv_caches[layer], meta, self.scale)  # fmt: skip
            if out is not None:
                return self.o_proj(out.reshape(n, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [n * heads, head_dim]: the norm runs over each head's vector
        q = self.q_norm(q.reshape(-1, c.head_dim), ctx.fused).view(n, c.num_heads, c.head_dim)
        k = self.k_norm(k.reshape(-1, c.head_dim), ctx.fused).view(n, c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        q, k = fused_ops.rope(q, k, cos, sin, ctx.fused)
        out = self.backend.forward(q, k, v, ctx.kv_caches[layer], meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.down_proj(fused_ops.gelu_tanh_and_mul(self.gate_up_proj(x), fused))


class Gemma3DecoderLayer(nn.Module):
    """norm -> attention -> norm, + residual; norm -> MLP -> norm, + residual."""

    def __init__(self, cfg, backend, layer: int) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Gemma3Attention(cfg, backend, layer)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DecoderLayer.forward`: (the post-MLP-normed output, the residual before it)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x, ctx.fused)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        x = self.post_attention_layernorm(self.self_attn(x, ctx, layer), ctx.fused)
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual, ctx.fused)
        return self.post_feedforward_layernorm(self.mlp(x, ctx.fused), ctx.fused), residual


class GemmaNormWeights(TensorView):
    """The checkpoint's tensors with every RMSNorm weight `w` read as `1 + w` (computed in
    float32, as Gemma's norm multiplies), so the plain `x_normed * weight` kernels apply."""

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        if name.endswith("norm.weight"):
            return 1.0 + tensor.float()
        return tensor


def embed_scale(cfg, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden) rounded to the weights' dtype, as transformers multiplies it."""
    return torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap
