"""A GGUF file's tensors under the HF names our decoders load: blocks or float32.

GGUF names a decoder's tensors `blk.N.<part>` (llama.cpp's convert_hf_to_gguf.py wrote
them from a HF checkpoint); this module undoes that conversion for the families served
from GGUF (llama, qwen2, gemma3):
- names: the table below, per family (Gemma 3's four norms a layer have names of their own);
- llama's q/k rows: the converter interleaves each head's two rotary halves for ggml's
  "normal" RoPE; HF's rotate-half layout takes them back apart (`_unpermute`);
- Gemma's norms: the converter stored (1 + w) (ggml has no Gemma RMSNorm); w = stored - 1.
Blocks (read by gguf_file.py) stay blocks where the quantized kernels run their type
(`keep_blocks`, kernels/quant_linear.py: copied once into one area on huge pages, laid out
for the layers' fused linears), or are dequantized by `gguf.quants.dequantize`
(the reference llama.cpp's Python package ships; transformers' GGUF path uses it too),
one tensor at a time, straight into float32 torch tensors.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from encoders.weights import CheckpointError
from kernels.malloc_tuning import huge_page_area
from vlmserve.worker.models.gguf_file import GGUFFile, TensorInfo

if TYPE_CHECKING:
    from kernels.quant_linear import QuantWeight

# GGUF `general.architecture` -> the HF model_type our loader serves from it.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_FAMILY_PARTS = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor (None: not one our decoders load, e.g. rope_freqs)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    part = _FAMILY_PARTS[arch].get(parts[2], _LAYER_PARTS.get(parts[2]))
    return None if part is None else f"model.layers.{parts[1]}.{part}.{suffix}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation undone: per head, rows (pairs, 2) -> (2, pairs)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def dequantized(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """One tensor's values as float32 [rows, cols] (or [n]), whatever its block type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.qtype)
    raw = file.raw(info)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape).copy()  # the file is mapped read-only
    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"GGUF tensor {info.name} is stored as {qtype.name}, a block type this gguf "
            "package cannot dequantize: requantize the file (llama-quantize) to Q8_0, Q6_K, "
            "Q5_K, Q4_K, Q5_0 or Q4_0"
        ) from exc
    return values.astype(np.float32, copy=False).reshape(info.shape)


def read_gguf_tensors(
    path: str | Path, config: dict, keep_blocks: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor the decoder loads, by its HF name, as float32. `config`: the HF config
    the checkpoint's metadata gave (heads for llama's un-permutation). `keep_blocks`: a
    2-D tensor in a block type the quantized kernels run stays a `QuantWeight` (its blocks
    copied, never dequantized; rows un-permuted as blocks)."""
    from kernels.quant_linear import SUPPORTED_QTYPES, QuantWeight

    file = GGUFFile(path)
    arch = str(file.field("general.architecture"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(unsupported_architecture(arch))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    named = [(name, info) for info in file.tensors if (name := hf_name(info.name, arch))]
    kept = {
        name: info for name, info in named
        if keep_blocks and len(info.shape) == 2 and info.qtype in SUPPORTED_QTYPES
    }  # fmt: skip
    order = sorted(kept, key=_layout_key)
    starts = itertools.accumulate((kept[name].num_bytes for name in order), initial=0)
    offsets = dict(zip(order, starts, strict=False))  # accumulate's last: the total
    area = _blocks_area(sum(i.num_bytes for i in kept.values()))
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    for name, info in named:
        permuted = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        num_heads = heads if "q_proj" in name else kv_heads
        if name in kept:
            blocks = area[offsets[name] : offsets[name] + info.num_bytes]
            weight = QuantWeight.from_gguf(file.raw(info), info.qtype, info.shape, blocks)
            if permuted:  # the rows in HF's order, in place
                rows = _unpermute(np.arange(info.shape[0])[:, None], num_heads)[:, 0]
                weight.permute_rows(torch.from_numpy(rows))
            tensors[name] = weight
            continue
        values = dequantized(file, info)
        if permuted:
            values = _unpermute(values, num_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values))
    return tensors


def _blocks_area(nbytes: int) -> torch.Tensor:
    """`nbytes` (uint8) for the blocks a file's weights keep: one mapping on huge pages
    where Linux grants them (kernels/malloc_tuning.py), else malloc's; it lives while any
    weight in it does. A decode step reads every weight once from memory in calls of 10-50
    us each; on 4 KiB pages each call starts with TLB misses and a hardware prefetcher that
    stops at every page (Gemma 3 270M's Q4_K_M file at batch 1 on a Zen 4: a decode step
    5-7% faster, benchmarks/engine/weight_layout.py)."""
    area = huge_page_area(nbytes)
    if area is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(area, dtype=torch.uint8)


_LAYER_ORDER = {part: i for i, part in enumerate(_LAYER_PARTS.values())}


def _layout_key(name: str) -> tuple[int, int]:
    """Where a tensor's blocks go in the area: by layer, each layer's linears in the order
    they are fused (q|k|v, gate|up): neighbours of one block type then join without a
    copy (kernels/quant_linear.py: `_merge_same_type`)."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return (-1, 0)
    return int(parts[2]), _LAYER_ORDER.get(".".join(parts[3:-1]), len(_LAYER_ORDER))


def unsupported_architecture(arch: str) -> str:
    return (
        f"GGUF architecture {arch!r} is not served: vlmserve runs GGUF files of "
        f"{', '.join(sorted(ARCHITECTURES))}; for another family serve its HF checkpoint "
        "folder (config.json + *.safetensors)"
    )
