"""The decoder's weights held quantized, run by kernels/quant_linear.py (CPU) and
kernels/quant_gpu.py (CUDA).

Three sources (`ModelConfig.weight_format`):
- "gguf": a GGUF file's blocks as stored. `install_blocks` swaps the meta decoder's
  linears for `QuantLinear`s before any weight memory is allocated: each fused projection
  (q|k|v, gate|up) whose parts are all in a block type the kernels run becomes one
  QuantLinear of row segments (Q4_K_M stores them in different types); the embedding
  becomes a `QuantEmbedding` (rows decoded as looked up) and the LM head, tied or not, a
  QuantLinear over its blocks. A tensor in another type is dequantized (`DenseView`) and
  runs dense, with the norms.
- "int8": any checkpoint, loaded in its dtype, then `quantize_int8_decoder` quantizes the
  same modules to weight-only int8 (a scale per 32 weights, Q8_0's layout).
- "fp8" (CUDA): any checkpoint, loaded in its dtype, then `quantize_fp8_decoder` stores the
  decoder layers' linears as e4m3 with a float32 scale per output channel (`Fp8Linear`:
  torch._scaled_mm); the embedding and LM head stay in the dtype, as vLLM keeps them.

Where the kernels run is picked per device by `place`: on a CPU the C++ kernels (nothing
moves); on CUDA the blocks move to the GPU and every quantized module runs the Triton
dequant-tile GEMM (the embedding its row decode).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import torch
from torch import nn

from encoders.weights import TensorView
from kernels.packed_linear import PackedLinear
from kernels.quant_linear import Q, QuantLinear, QuantWeight, qtype_name

log = logging.getLogger(__name__)

# Our (fused) linear -> the checkpoint's parts, in row order.
_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
INT8_GROUP = 32  # weights per int8 scale: a row's length must be a multiple


class QuantEmbedding(nn.Module):
    """An embedding table stored quantized: a lookup decodes only the asked rows."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.triton = False  # rows decoded by kernels/quant_gpu.py (blocks on CUDA)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from kernels.quant_gpu import dequantize_rows

            w = self.weight_q
            rows = dequantize_rows(w.blocks, w.qtype, w.in_features, ids, self.dtype)
        else:
            rows = self.weight_q.dequantize(ids.reshape(-1), self.dtype)
        return rows.view(*ids.shape, self.weight_q.in_features)


def install_blocks(
    decoder: nn.Module, tensors: Mapping, prefix: str, lm_head_name: str, dtype: torch.dtype
) -> None:
    """Swap `decoder`'s linears, embedding and LM head for quantized modules wherever the
    checkpoint holds their weights as `QuantWeight`s (read_gguf_tensors(keep_blocks=True))."""
    for i, layer in enumerate(decoder.layers):
        base = f"{prefix}layers.{i}."
        for ours, parts in _LINEARS.items():
            weights = [tensors.get(f"{base}{part}.weight") for part in parts]
            if not all(isinstance(w, QuantWeight) for w in weights):
                continue
            biases = [tensors.get(f"{base}{part}.bias") for part in parts]
            bias = torch.cat(biases).to(dtype) if all(b is not None for b in biases) else None
            _replace(layer, ours, QuantLinear(weights, bias))
    embed = tensors.get(prefix + "embed_tokens.weight")
    if isinstance(embed, QuantWeight):
        decoder.embed_tokens = QuantEmbedding(embed, dtype)
    head = embed if decoder.cfg.tie_word_embeddings else tensors.get(lm_head_name)
    if isinstance(head, QuantWeight):
        decoder.lm_head = QuantLinear([head])


def quantize_int8_decoder(decoder: nn.Module) -> int:
    """Quantize a loaded decoder's linears, embedding and LM head to weight-only int8 in
    place; returns how many weights. A weight whose rows are not a multiple of INT8_GROUP
    long stays as it is (logged)."""
    count = 0
    for layer in decoder.layers:
        for ours in _LINEARS:
            linear = layer.get_submodule(ours)
            if _groups_fit(linear.weight, ours):
                _replace(layer, ours, QuantLinear([quantize_int8(linear.weight)], linear.bias))
                count += 1
    embed = decoder.embed_tokens
    if _groups_fit(embed.weight, "embed_tokens"):
        decoder.embed_tokens = QuantEmbedding(quantize_int8(embed.weight), embed.weight.dtype)
        count += 1
        if decoder.lm_head is None:  # tied: the head reads the embedding's blocks
            decoder.lm_head = QuantLinear([decoder.embed_tokens.weight_q])
    if isinstance(decoder.lm_head, nn.Linear) and _groups_fit(decoder.lm_head.weight, "lm_head"):
        decoder.lm_head = QuantLinear([quantize_int8(decoder.lm_head.weight)])
        count += 1
    return count


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """`--quantization int8`: `weight` [out, in] (in a multiple of 32) as int8 with one
    float16 scale per 32 weights, in the Q8_0 block layout; the bytes gguf.quants.quantize
    writes for Q8_0 (scale amax / 127; values x / scale rounded half away from zero)."""
    out_features, in_features = weight.shape
    if in_features % 32:
        raise ValueError(f"int8 quantization needs in_features a multiple of 32, not {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127  # float32, as numpy computes it
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    whole = magnitude.trunc()
    rounded = (whole + (magnitude - whole >= 0.5).float()).copysign(scaled)
    values = rounded.to(torch.int8).view(torch.uint8)
    scale16 = scale.to(torch.float16).view(torch.uint8)  # [out, in / 32, 2]
    packed = torch.cat([scale16, values], dim=-1).reshape(out_features, -1)
    return QuantWeight(packed.contiguous(), int(Q.Q8_0), in_features)


def quantize_fp8_decoder(decoder: nn.Module) -> int:
    """Store every decoder layer's linears as FP8 (e4m3, per-output-channel scales) in
    place, on the device they are on; returns how many."""
    from kernels.quant_gpu import Fp8Linear

    count = 0
    for layer in decoder.layers:
        for ours in _LINEARS:
            _replace(layer, ours, Fp8Linear.from_linear(layer.get_submodule(ours)))
            count += 1
    return count


def place(decoder: nn.Module, device: torch.device, triton: bool | None = None) -> None:
    """Move the quantized modules' blocks (and biases) to `device` and pick their kernels:
    the Triton GEMM where `triton` (default: on CUDA), else the CPU's (Q8_0 weights packed
    for them where they take it: QuantWeight.pack). A block tensor shared by two modules
    (a tied head) moves once."""
    triton = device.type == "cuda" if triton is None else triton
    moved: set[int] = set()
    for module in decoder.modules():
        if isinstance(module, QuantLinear):
            weights = module.parts
            if module.bias is not None:
                module.bias = module.bias.to(device)
        elif isinstance(module, QuantEmbedding):
            weights = [module.weight_q]
        else:
            continue
        module.triton = triton
        for weight in weights:
            if id(weight) not in moved:
                moved.add(id(weight))
                weight.unpack()
                weight.blocks = weight.blocks.to(device)
                if not triton:
                    weight.pack()


def _fp8_linear() -> type | tuple:
    """Fp8Linear where kernels/quant_gpu.py was imported (only FP8 makes one), else () (an
    isinstance of nothing): a CPU engine never imports triton for it."""
    module = sys.modules.get("kernels.quant_gpu")
    return module.Fp8Linear if module is not None else ()


def calibrate(decoder: nn.Module, dtype: torch.dtype) -> None:
    """Measure (or read from this CPU's cache) every quantized layer's kernel crossover
    now, at load, so that no step measures."""
    for module in decoder.modules():
        if isinstance(module, QuantLinear):
            module.max_rows(dtype)
            module.amx_rows(dtype)


def _groups_fit(weight: torch.Tensor, name: str) -> bool:
    if weight.shape[-1] % INT8_GROUP == 0:
        return True
    log.warning("%s stays unquantized: rows of %d are not a multiple of %d", name,
                weight.shape[-1], INT8_GROUP)  # fmt: skip
    return False


def _replace(parent: nn.Module, path: str, module: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(parent.get_submodule(owner) if owner else parent, name, module)


def materialize(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Allocate (uninitialized, on the CPU, in `dtype`) every parameter still on the meta
    device; what was installed with real tensors is left alone (Module.to_empty would
    replace it)."""
    for child in module.modules():
        for name, param in list(child.named_parameters(recurse=False)):
            if param.is_meta:
                empty = torch.empty(param.shape, dtype=dtype, device="cpu")
                setattr(child, name, nn.Parameter(empty, requires_grad=False))
    return module


class DenseView(TensorView):
    """The checkpoint's tensors with any `QuantWeight` left in them dequantized on read
    (to float32): the weights `install_blocks` did not take run dense."""

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor.dequantize() if isinstance(tensor, QuantWeight) else tensor


def describe(decoder: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """One line per kind of quantized module: its block types, bits per weight and kernel
    paths for activations in `dtype` (`vlmserve info`); empty for a dense decoder."""
    lines: dict[str, int] = {}
    fp8 = _fp8_linear()
    for name, module in decoder.named_modules():
        if isinstance(module, QuantLinear):
            line = f"{name.split('.')[-1]}: {module.describe(dtype)}"
        elif isinstance(module, fp8):
            line = f"{name.split('.')[-1]}: {module.describe()}"
        elif isinstance(module, QuantEmbedding):
            weight = module.weight_q
            line = f"{name}: {qtype_name(weight.qtype)} {weight.bits_per_weight:.3g} " \
                   "bits/weight, rows decoded as looked up"  # fmt: skip
        else:
            continue
        lines[line] = lines.get(line, 0) + 1
    return [f"{line} (x{count})" if count > 1 else line for line, count in lines.items()]


def weight_bytes(decoder: nn.Module) -> tuple[int, int]:
    """(weights, bytes) the decoder holds: dense parameters, oneDNN-packed linears (their
    packed weight and any plain copy: not parameters) and quantized blocks, a tied head's
    blocks counted once."""
    seen: set[int] = set()
    weights = size = 0
    fp8 = _fp8_linear()
    for module in decoder.modules():
        if isinstance(module, QuantLinear):
            quant = module.parts
        elif isinstance(module, QuantEmbedding):
            quant = [module.weight_q]
        else:
            quant = []
        if isinstance(module, fp8):  # its e4m3 weight and scales are buffers
            weights += module.in_features * module.out_features
            size += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        if isinstance(module, PackedLinear):
            weights += module.in_features * module.out_features
            weights += 0 if module.bias is None else module.bias.numel()
            for tensor in (module.weight, module.plain, module.bias):
                if tensor is not None:
                    size += tensor.numel() * tensor.element_size()
        for part in quant:
            if id(part.blocks) not in seen:
                seen.add(id(part.blocks))
                weights += part.out_features * part.in_features
                size += part.blocks.numel()
    for param in decoder.parameters():
        weights += param.numel()
        size += param.numel() * param.element_size()
    return weights, size
