"""Shape records and presets the cost model runs on: models, vision encoders, accelerators,
precisions. Any HF ``config.json`` can stand in for a preset model.

Units everywhere: bytes, seconds, FLOP/s, bytes/s (decimal GB = 1e9, as the article uses).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ComputeDtype = Literal["bf16", "fp8"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shapes; enough to count parameters, FLOPs and KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    attention_bias: bool = False
    # MLA (article §6): cache a latent of width d_c plus a rotary key of width d_h^R.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    # MoE: experts per layer and experts each token routes to (article §16).
    num_experts: int = 1
    num_experts_per_tok: int = 1
    # Where the article prices a backbone by its nominal size ("7B"), not its exact count.
    num_params_override: float | None = None
    # Hybrid attention (Gemma 3: 5 of 6 layers): `num_sliding_layers` layers attend over
    # the last `sliding_window` positions only, so a hybrid KV manager holds (and decode
    # reads) at most that many of their tokens per sequence.
    sliding_window: int | None = None
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"model {self.name!r}: {name} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("intermediate_size", "vocab_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"model {self.name!r}: {name} must be >= 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model {self.name!r}: need 1 <= num_experts_per_tok <= num_experts")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"model {self.name!r}: num_sliding_layers must be in [0, layers]")
        if self.num_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"model {self.name!r}: sliding layers need a sliding_window >= 1")

    @property
    def group_size(self) -> int:
        """g = n_q / n_kv: 1 for MHA, n_q for MQA (article §6)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_kind(self) -> Literal["MHA", "GQA", "MQA", "MLA"]:
        if self.kv_lora_rank is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_params(self) -> float:
        """P: every weight, embeddings and LM head included (the article's 8.03e9 for 8B)."""
        if self.num_params_override is not None:
            return self.num_params_override
        d = self.hidden_size
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = 2 * d * q_dim + 2 * d * kv_dim + (q_dim + 2 * kv_dim if self.attention_bias else 0)
        # Gated MLP (gate, up, down); a router per layer when there are experts.
        mlp = 3 * d * self.intermediate_size * self.num_experts
        router = d * self.num_experts if self.num_experts > 1 else 0
        per_layer = attn + mlp + router + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return float(self.num_layers * per_layer + embed + d)


@dataclass(frozen=True)
class VisionEncoder:
    """A ViT tower: one tile of image_size² pixels gives (image_size / patch_size)² tokens."""

    name: str
    image_size: int
    patch_size: int
    num_layers: int
    hidden_size: int
    num_params: float

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.image_size < self.patch_size:
            raise ValueError(f"encoder {self.name!r}: need 1 <= patch_size <= image_size")

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class Accelerator:
    """One device: capacity, HBM bandwidth, dense tensor-core peaks, collective latency."""

    name: str
    memory_bytes: float
    mem_bandwidth: float
    flops_bf16: float
    flops_fp8: float | None = None
    # Article §16 / Lab 2: ~6 µs per all-reduce over NVLink, latency-bound at decode sizes.
    allreduce_latency_s: float = 6e-6
    interconnect_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if min(self.memory_bytes, self.mem_bandwidth, self.flops_bf16) <= 0:
            raise ValueError(f"accelerator {self.name!r}: memory, bandwidth and FLOP/s must be > 0")

    def peak_flops(self, dtype: ComputeDtype = "bf16") -> float:
        """Dense peak; fp8 falls back to bf16 on devices without fp8 tensor cores (A100)."""
        if dtype == "fp8" and self.flops_fp8 is not None:
            return self.flops_fp8
        return self.flops_bf16

    def ridge(self, dtype: ComputeDtype = "bf16") -> float:
        """Machine balance π/β in FLOP/byte (H100 bf16: 295)."""
        return self.peak_flops(dtype) / self.mem_bandwidth


@dataclass(frozen=True)
class Precision:
    """Bytes per element and the tensor-core format the GEMMs then run in."""

    name: str
    bytes_per_element: float
    compute_dtype: ComputeDtype = field(default="bf16")


def _llama(
    name: str, layers: int, d: int, heads: int, kv: int, ff: int, vocab: int, **kw
) -> ModelShape:
    return ModelShape(name, layers, d, heads, kv, d // heads, ff, vocab, **kw)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
        # NanoFlow's primary model (GQA, 8 KV heads), served there on 8×A100 at TP 8.
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        # Lab 4's "7B full-MHA backbone": Llama-2-7B shapes priced at a nominal 7e9 params,
        # the only P for which §17's "LLM prefill over 2,400 tokens ≈ 36.6 TFLOP" reproduces.
        _llama("mha-7b", 32, 4096, 32, 32, 11008, 32000, num_params_override=7.0e9),
        _llama("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, attention_bias=True),
        # Gemma 3 (google/gemma-3-{4b,27b}-it text_config): head_dim 256 / 128, tied
        # embeddings, window 1024 on 5 of every 6 layers (34 layers: 29 sliding).
        ModelShape(
            "gemma-3-4b",
            34,
            2560,
            8,
            4,
            256,
            10240,
            262208,
            tie_embeddings=True,
            sliding_window=1024,
            num_sliding_layers=29,
        ),
        ModelShape(
            "gemma-3-27b",
            62,
            5376,
            32,
            16,
            128,
            21504,
            262208,
            tie_embeddings=True,
            sliding_window=1024,
            num_sliding_layers=52,
        ),
    )
}
# A model's own tower and connector ratio, the `estimate image` defaults for it.
MODEL_VISION: dict[str, tuple[str, int]] = {
    "gemma-3-4b": ("siglip-so400m-14-896", 16),
    "gemma-3-27b": ("siglip-so400m-14-896", 16),
}

ENCODERS: dict[str, VisionEncoder] = {
    e.name: e
    for e in (
        # §17 prices the tower at the class's nominal 400M (its 8.4 TFLOP figure needs that);
        # the released SigLIP so400m vision tower counts ≈428M with its pooling head.
        VisionEncoder("siglip-so400m-14-384", 384, 14, 27, 1152, 0.400e9),
        VisionEncoder("siglip-base-16-224", 224, 16, 12, 768, 0.093e9),
        VisionEncoder("siglip-base-16-512", 512, 16, 12, 768, 0.094e9),
        # Gemma 3's tower: so400m at 896 px (4,096 patches, average-pooled 16:1 to 256).
        VisionEncoder("siglip-so400m-14-896", 896, 14, 27, 1152, 0.400e9),
    )
}

# Dense (non-sparse) tensor-core peaks and HBM bandwidth from the vendor datasheets; the
# ridges they give match the article's 153 (A100), 295 (H100), 419 (L40S).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a100-80gb", 80e9, 2.039e12, 312e12, None, interconnect_bandwidth=600e9),
        Accelerator("h100-sxm", 80e9, 3.35e12, 989e12, 1979e12, interconnect_bandwidth=900e9),
        Accelerator("h200", 141e9, 4.8e12, 989e12, 1979e12, interconnect_bandwidth=900e9),
        Accelerator("l40s", 48e9, 0.864e12, 362e12, 733e12, interconnect_bandwidth=64e9),
        Accelerator("b200", 192e9, 8.0e12, 2250e12, 4500e12, interconnect_bandwidth=1800e9),
    )
}
_ACCELERATOR_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}

# int8/int4 are weight-only (dequantised into bf16 GEMMs, article §14); fp8 is W8A8 and
# runs the fp8 tensor cores where the device has them.
WEIGHT_PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2.0, "bf16"),
    "fp8": Precision("fp8", 1.0, "fp8"),
    "int8": Precision("int8", 1.0, "bf16"),
    "int4": Precision("int4", 0.5, "bf16"),
}
CACHE_PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2.0, "bf16"),
    "fp8": Precision("fp8", 1.0, "fp8"),
}


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(sorted(table))}")
    return table[key]


def get_encoder(name: str) -> VisionEncoder:
    return _lookup(ENCODERS, name, "vision encoder")


def get_weight_precision(name: str) -> Precision:
    return _lookup(WEIGHT_PRECISIONS, name, "weight precision")


def get_cache_precision(name: str) -> Precision:
    return _lookup(CACHE_PRECISIONS, name, "cache precision")


def get_accelerator(name: str) -> Accelerator:
    """A preset by name, or ``cpu``: this machine, measured now."""
    key = name.strip().lower()
    if key == "cpu":
        return measure_cpu()
    return _lookup(ACCELERATORS, _ACCELERATOR_ALIASES.get(key, key), "accelerator")


# A GPU's name (torch.cuda.get_device_name) -> the accelerator preset it runs as, by the
# first of these its lowered name contains.
GPU_NAME_PRESETS = (("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("a100", "a100"),
                    ("l40s", "l40s"))  # fmt: skip


def gpu_preset(device_name: str, what_to_do: str = "") -> str:
    """The accelerator preset a GPU's name matches ('NVIDIA H100 80GB HBM3' -> 'h100'). A
    GPU no preset matches is refused (ValueError, with `what_to_do` appended): its
    bandwidth and FLOP/s are unknown, and another device's would be silently wrong."""
    lowered = device_name.lower()
    for needle, preset in GPU_NAME_PRESETS:
        if needle in lowered:
            return preset
    known = ", ".join(preset for _, preset in GPU_NAME_PRESETS)
    raise ValueError(
        f"no accelerator preset matches the GPU {device_name!r} (presets: {known})"
        + (f"; {what_to_do}" if what_to_do else "")
    )


def get_model(spec: str) -> ModelShape:
    """A preset name, or a path to an HF ``config.json`` (or the folder holding one)."""
    if spec.strip().lower() in MODELS:
        return MODELS[spec.strip().lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return model_from_hf_config(path)
    if path.suffix == ".json" or os.sep in spec:
        raise ValueError(f"model config not found: {spec}")
    raise ValueError(
        f"unknown model {spec!r}; choose one of {', '.join(sorted(MODELS))} "
        "or give a path to an HF config.json"
    )


def model_from_hf_config(path: str | Path) -> ModelShape:
    """Shapes from an HF config; a VLM's decoder is read from its ``text_config``."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {path} is not a JSON object")
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(cfg.get(key), dict):
            cfg = {**cfg, **cfg[key]}
            break
    try:
        d = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1)
        sliding = sliding_layers(cfg)
        ff_key = (
            "moe_intermediate_size"
            if experts > 1 and "moe_intermediate_size" in cfg
            else ("intermediate_size")
        )
        return ModelShape(
            name=str(cfg.get("_name_or_path") or Path(path).parent.name or "hf-config"),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=d,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or d // heads),
            intermediate_size=int(cfg[ff_key]),
            vocab_size=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            kv_lora_rank=cfg.get("kv_lora_rank"),
            qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1) if experts > 1 else 1,
            sliding_window=int(cfg["sliding_window"]) if sliding else None,
            num_sliding_layers=sliding,
        )
    except KeyError as exc:
        raise ValueError(f"model config {path} lacks {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model config {path}: {exc}") from exc


def sliding_layers(cfg: dict) -> int:
    """Layers an HF config puts on a sliding window: `layer_types`, or Gemma's
    `sliding_window_pattern` (every n-th layer global); 0 without a window."""
    if not cfg.get("sliding_window"):
        return 0
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return sum(t == "sliding_attention" for t in types)
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None and str(cfg.get("model_type", "")).startswith("gemma3"):
        pattern = 6
    if not pattern:
        return 0
    return sum(bool((i + 1) % int(pattern)) for i in range(int(cfg["num_hidden_layers"])))


def measure_cpu(budget_s: float = 0.6) -> Accelerator:
    """This CPU as an Accelerator: fp32 matmul FLOP/s and copy bandwidth, measured now.

    Not pure (it times the machine); stays well under 2 s. The peak is what numpy's BLAS
    reaches on a 1024² matmul, so read it as "achievable", not a datasheet figure.
    """
    import numpy as np

    n = 1024
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b  # warm-up: thread pool and page faults out of the timing
    best_flops, deadline = 0.0, time.perf_counter() + budget_s / 2
    while True:
        t0 = time.perf_counter()
        a @ b
        best_flops = max(best_flops, 2 * n**3 / (time.perf_counter() - t0))
        if time.perf_counter() > deadline:
            break
    return cpu_accelerator(best_flops, copy_bandwidth(budget_s / 2))


def copy_bandwidth(budget_s: float = 0.3) -> float:
    """Bytes/s a 64 MiB copy moves on this CPU (read + write), the best of `budget_s`."""
    import numpy as np

    src = np.ones(64 * 2**20 // 4, dtype=np.float32)  # 64 MiB: past the last-level cache
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best_bw, deadline = 0.0, time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_bw = max(best_bw, 2 * src.nbytes / (time.perf_counter() - t0))  # read + write
        if time.perf_counter() > deadline:
            return best_bw


def cpu_accelerator(flops: float, bandwidth: float) -> Accelerator:
    """This CPU as an Accelerator of the given peak and bandwidth, with its memory."""
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = 16e9
    return Accelerator("cpu", memory, bandwidth, flops, None, allreduce_latency_s=0.0)
