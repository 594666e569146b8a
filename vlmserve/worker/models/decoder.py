"""Llama / Qwen2 family decoder over a flat token batch and a paged KV cache.

RMSNorm, RoPE (scaling variants in `rope.py`), GQA or MHA, SwiGLU, optional q/k/v bias
(Qwen2), tied or untied embeddings. The LM head runs only on the rows the caller asks
for (article §8: computing logits for every prompt position is the prefill logits trap).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from encoders.weights import CheckpointError, TensorView, load_into, take
from kernels import fused_ops, sampling_cpu
from kernels.attention import AttentionBackend
from kernels.lm_head import LogitsHead, linear_float
from kernels.quant_linear import QuantLinear
from vlmserve.worker.models import gemma3
from vlmserve.worker.models.layers import DecoderConfig, RMSNorm
from vlmserve.worker.models.rope import RotaryEmbedding

__all__ = ["Decoder", "DecoderConfig", "DecoderLayer", "RMSNorm", "StepContext"]


@dataclass
class StepContext:
    """Per-step inputs shared by every layer."""

    cos: torch.Tensor  # [num_tokens, head_dim]
    sin: torch.Tensor
    attn_metadata: object
    kv_caches: list[torch.Tensor]  # per layer [2, num_kv_heads, num_slots, head_dim]
    fused: bool  # the fused elementwise kernels (kernels/fused_ops.py) where they apply
    # Sliding-window layers' RoPE tables where they differ (Gemma 3's local base).
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None


# Runs every layer over the step's nano-batches: (layers, inputs_embeds, ctx) -> what the
# last DecoderLayer.forward returns, (its MLP output, the residual before it).
NanoLayers = Callable[[list["DecoderLayer"], torch.Tensor, StepContext], tuple]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg, self.backend = cfg, backend
        # q, k and v as one GEMM: rows [q | k | v], concatenated at load time.
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: StepContext, layer: int) -> torch.Tensor:
        n, c = x.shape[0], self.cfg
        qkv = self.qkv_proj(x)
        fused_qkv = getattr(self.backend, "forward_qkv", None) if ctx.fused else None
        if fused_qkv is not None:  # the CPU backend: RoPE and the K/V write in one op
            out = fused_qkv(qkv, c.num_heads, c.head_dim, None, ctx.cos, ctx.sin,
                            ctx.kv_caches[layer], ctx.attn_metadata, self.scale)  # fmt: skip
            if out is not None:
                return self.o_proj(out.reshape(n, c.num_heads * c.head_dim))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rope_forward = getattr(self.backend, "forward_rope", None)
        if ctx.fused and rope_forward is not None:  # RoPE fused into the backend's K/V write
            out = rope_forward(
                q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim),
                v.view(n, c.num_kv_heads, c.head_dim), ctx.cos, ctx.sin,
                ctx.kv_caches[layer], ctx.attn_metadata, self.scale,
            )  # fmt: skip
            return self.o_proj(out.reshape(n, c.num_heads * c.head_dim))
        q, k = fused_ops.rope(
            q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim),
            ctx.cos, ctx.sin, ctx.fused,
        )  # fmt: skip
        v = v.view(n, c.num_kv_heads, c.head_dim)
        out = self.backend.forward(q, k, v, ctx.kv_caches[layer], ctx.attn_metadata, self.scale)
        return self.o_proj(out.reshape(n, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        # gate and up as one GEMM: rows [gate | up], concatenated at load time.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x), fused))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream rides beside the layer output (vLLM's layout), so each add
        fuses into the norm after it: returns (this layer's MLP output, the residual
        before it); their sum is the layer's output. residual None: x is the first input."""
        if residual is None:
            residual, x = x, self.input_layernorm(x, ctx.fused)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        x = self.self_attn(x, ctx, layer)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, ctx.fused)
        return self.mlp(x, ctx.fused), residual


class Decoder(nn.Module):
    """The language model: embeddings in, hidden states out, logits for chosen rows."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.variant == "gemma3":
            self.layers = nn.ModuleList(
                gemma3.Gemma3DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers)
            )
        else:
            self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.local_rotary = None if cfg.local_rope is None else RotaryEmbedding(cfg.local_rope)
        self.lm_head = None
        # The fused elementwise kernels; the runner turns them on (ModelConfig.fused_ops).
        self.fused = False
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's weight is always dense)."""
        return self.norm.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(token_ids)
        if self.cfg.variant == "gemma3":  # image rows are written over these, unscaled
            return embeds * gemma3.embed_scale(self.cfg, embeds.dtype).to(embeds.device)
        return embeds

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: object,
        kv_caches: list[torch.Tensor],
        nano: NanoLayers | None = None,
    ) -> torch.Tensor:
        # inputs_embeds: [num_tokens, hidden]; positions: [num_tokens]
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        ctx = StepContext(cos, sin, attn_metadata, kv_caches, self.fused)
        if self.local_rotary is not None:
            ctx.local_cos, ctx.local_sin = self.local_rotary.cos_sin(positions, inputs_embeds.dtype)
        x, residual = inputs_embeds, None
        if nano is not None and len(self.layers):  # nano-batched (vlmserve/worker/nano_exec.py)
            x, residual = nano(list(self.layers), x, ctx)
        else:
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, ctx, i)
        if residual is None:  # no layers
            return self.norm(x, self.fused)
        return self.norm.add_forward(x, residual, self.fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> [num_rows, vocab], float32 for sampling. In
        # bfloat16 on a CPU the head's float32 sums come out unrounded (packed_linear).
        if isinstance(self.lm_head, QuantLinear):  # tied or not: its blocks
            logits = self.lm_head.forward_float(hidden)
        elif self.fused or self.lm_head is not None:
            logits = linear_float(self.lm_head, hidden, self.embed_tokens.weight)
        else:  # the eager path (the fused ops off), tied embeddings
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return gemma3.softcap(logits, self.cfg.final_logit_softcapping)

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> [num_rows] long: the greedy tokens, torch.argmax of
        # compute_logits (the first maximum; a NaN first). Straight from the head where it
        # was calibrated to (no logits written: 67 MB a step at 64 rows of a 262k
        # vocabulary), never through a softcap (its float32 tanh can tie what the sums did not).
        heads = (LogitsHead, QuantLinear)
        if isinstance(self.lm_head, heads) and self.cfg.final_logit_softcapping is None:
            ids = self.lm_head.argmax(hidden)
            if ids is not None:
                return ids
        return sampling_cpu.argmax_any(self.compute_logits(hidden))

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str, lm_head_name: str) -> None:
        """Copy HF Llama/Qwen2 weights: `prefix` is where `embed_tokens.weight` lives.
        The fused qkv_proj / gate_up_proj take the checkpoint's separate projections,
        concatenated (each part checked and named on its own, see `_FusedWeights`)."""
        names = {}
        for ours, _ in self.named_parameters():
            if ours == "lm_head.weight":
                names[ours] = lm_head_name
            else:
                names[ours] = prefix + ours
        if self.cfg.variant == "gemma3":
            tensors = gemma3.GemmaNormWeights(tensors)
        tensors = _FusedWeights(tensors, prefix, self.cfg)
        if not self.cfg.tie_word_embeddings and lm_head_name not in tensors:
            raise CheckpointError(
                f"missing weight {lm_head_name!r} and the config does not tie word embeddings"
            )
        load_into(self, tensors, names)


# Our fused parameter -> the checkpoint's parts, in row order.
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class _FusedWeights(TensorView):
    """The checkpoint's tensors plus our fused names, concatenated only when read (one
    layer at a time, so loading never holds a second copy of every projection)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str, cfg: DecoderConfig):
        self.tensors = tensors
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        rows = {
            "self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": cfg.intermediate_size, "mlp.up_proj": cfg.intermediate_size,
        }  # fmt: skip
        # fused name -> [(part name, part shape)]
        self.parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for layer in range(cfg.num_layers):
            base = f"{prefix}layers.{layer}."
            for fused, parts in _FUSED_PARTS.items():
                for kind in ("weight", "bias"):
                    self.parts[f"{base}{fused}.{kind}"] = [
                        (f"{base}{part}.{kind}",
                         (rows[part], cfg.hidden_size) if kind == "weight" else (rows[part],))
                        for part in parts
                    ]  # fmt: skip

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.parts:
            return torch.cat([take(self.tensors, part, shape) for part, shape in self.parts[name]])
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.parts or name in self.tensors
