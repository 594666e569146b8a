"""Engine configuration: one frozen dataclass per subsystem, composed in EngineConfig.
Environment variables are read here and nowhere else."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from encoders.config import EncoderConfig
from kernels.cpu_build import native_bf16
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.sample.structured import StructuredConfig
from vlmserve.worker.models.gguf_checkpoint import resolve_model_path, weights_file

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *_DTYPES)


class DtypeChoice(NamedTuple):
    """The engine's weight and activation dtype, and why it was picked."""

    dtype: torch.dtype
    reason: str


def choose_dtype(
    requested: str, device: str, checkpoint_dtype: str | None, native_bf16: str | None
) -> DtypeChoice:
    """`--dtype auto` as vLLM resolves it, with its CPU rule: an explicit dtype wins; on a
    GPU the checkpoint's `torch_dtype` (bfloat16 where it names none, or float32);
    on a CPU bfloat16 where the CPU has native bfloat16 (`native_bf16`, the flag found)
    and the checkpoint is 16-bit, float32 otherwise (an emulated bfloat16 GEMM is slower
    than float32, and a float32 checkpoint stays exact)."""
    if requested != "auto":
        return DtypeChoice(_DTYPES[requested], f"--dtype {requested}")
    sixteen = checkpoint_dtype in ("bfloat16", "float16")
    if device != "cpu":
        if checkpoint_dtype in _DTYPES and checkpoint_dtype != "float32":
            return DtypeChoice(_DTYPES[checkpoint_dtype], f"checkpoint is {checkpoint_dtype}")
        return DtypeChoice(torch.bfloat16, f"checkpoint is {checkpoint_dtype or 'unmarked'}")
    if not sixteen:
        return DtypeChoice(torch.float32, f"checkpoint is {checkpoint_dtype or 'unmarked'}")
    if native_bf16 is None:
        return DtypeChoice(
            torch.float32, f"checkpoint is {checkpoint_dtype}, but this CPU has no native bfloat16"
        )
    return DtypeChoice(
        torch.bfloat16, f"checkpoint is {checkpoint_dtype} and this CPU has {native_bf16}"
    )


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype a HF checkpoint's config.json names (`torch_dtype`, or `dtype` as newer
    transformers write it; the text config's for a VLM that names none at the top)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        name = part.get("torch_dtype") or part.get("dtype")
        if isinstance(name, str):
            return name.removeprefix("torch.")
    return None


def default_device() -> str:
    return os.environ.get("VLMSERVE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    device: str = field(default_factory=default_device)
    # "auto": `choose_dtype` (the checkpoint's dtype on a GPU; on a CPU bfloat16 where the
    # CPU has native bfloat16 and the checkpoint is 16-bit, else float32); or a dtype name.
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_images_per_request: int = 16
    # None / "auto", "torch", "cpu", "triton", "flashinfer" (kernels.backends.select_backend)
    attention_backend: str | None = None
    # CPU float32: the decoder's and the vision encoder's linear layers in oneDNN's
    # prepacked layout (PackedLinear; the tower's GELU and residual adds fused into them).
    pack_weights: bool = True
    # CPU, with pack_weights: the decoder's linears also keep their plain weights (a second
    # copy) for the skinny kernel at decode rows and float32 MKL at large prefill chunks,
    # where each wins on this CPU (kernels/packed_linear.py, calibrated); off: half the
    # decoder's weight memory, slower there.
    plain_weights: bool = True
    # CPU float32: fused C++ RMSNorm + residual, RoPE and SiLU-mul (kernels/fused_ops.py).
    fused_ops: bool = True
    # CUDA: replay the decode step from CUDA graphs per batch-size bucket (Triton backend,
    # fused ops on; vlmserve/worker/cuda_graphs.py).
    cuda_graphs: bool = True
    # Nano-batched layers (NanoFlow §4.2, vlmserve/worker/nano_batch.py): "off"; "auto", the
    # auto-search's schedules for this model and device (vlmserve/worker/nano_schedules.py,
    # cached); or a schedule JSON (search/nanoflow/schedule.py) or a folder of them, one per dense
    # batch size.
    nano_batch: str = "off"
    # A GGUF file's tokenizer: a HF tokenizer folder instead of the file's own vocabulary.
    tokenizer: str | None = None
    # How the decoder's weights are held (QUANTIZATION_CHOICES; kernels/quant_linear.py):
    # "auto" runs a GGUF file's quantized blocks as stored on a CPU and anything else in its
    # dtype; "none" dequantizes a GGUF file at load; "gguf" insists on the file's blocks;
    # "int8" quantizes a checkpoint's linears, embedding and LM head to int8 at load
    # (weight-only, a scale per 32 weights); on CUDA gguf and int8 run in a Triton GEMM
    # (kernels/quant_gpu.py); "fp8" (CUDA only) stores the decoder layers' linears as e4m3
    # with per-channel scales. `weight_format` is what it resolved to.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        # A GGUF file (or a folder holding one) is served through its sidecar folder.
        object.__setattr__(self, "path", resolve_model_path(self.path, self.tokenizer))
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPE_CHOICES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.nano_batch not in ("off", "auto") and not Path(self.nano_batch).exists():
            raise ValueError(
                f"nano_batch {self.nano_batch!r} is neither 'off', 'auto' nor a schedule path"
            )
        if self.max_images_per_request < 0:
            raise ValueError(f"max_images_per_request={self.max_images_per_request} must be >= 0")
        self._check_quantization()

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization {self.quantization!r} is not one of {list(QUANTIZATION_CHOICES)}"
            )
        if self.quantization == "gguf" and weights_file(self.path) is None:
            raise ValueError(
                "--quantization gguf runs a GGUF file's blocks, but the model is a checkpoint "
                "folder: pass a .gguf file, or --quantization int8 to quantize this one"
            )
        device = torch.device(self.device).type
        if self.quantization in ("gguf", "int8") and device not in ("cpu", "cuda"):
            raise ValueError(
                f"--quantization {self.quantization} runs on a CPU or a CUDA GPU; on "
                f"{self.device} use --quantization none (a GGUF file is dequantized at load)"
            )
        if self.quantization == "fp8" and device != "cuda":
            raise ValueError(
                f"--quantization fp8 runs on GPUs (CUDA), not on {self.device}: on a CPU use "
                "--quantization int8 (weight-only int8 at load), or a GGUF file's blocks"
            )

    @property
    def weight_format(self) -> str:
        """ "none", "gguf", "int8" or "fp8": what `quantization` resolved to for this model
        ("auto" on CUDA dequantizes a GGUF file: its Triton GEMM is chosen by name)."""
        if self.quantization != "auto":
            return self.quantization
        on_cpu = torch.device(self.device).type == "cpu"
        return "gguf" if on_cpu and weights_file(self.path) is not None else "none"

    @functools.cached_property
    def dtype_choice(self) -> DtypeChoice:
        device = torch.device(self.device).type
        return choose_dtype(self.dtype, device, checkpoint_dtype(self.path), native_bf16())

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice.dtype


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype as a torch dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vlmserve/parallel): the decoder's heads and MLP rows split over
    this many ranks, one process each; 1 runs in the engine's process alone."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # adaptive
    encoder: EncoderConfig = field(default_factory=EncoderConfig)  # preprocessing, cache
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP 1
    structured: StructuredConfig = field(default_factory=StructuredConfig)  # grammars
    # Run the step shapes live traffic will meet once at start-up (vlmserve/engine/warmup.py;
    # no phase starts after warmup_max_seconds): `serve` turns it on, before /health
    # answers 200.
    warmup: bool = False
    warmup_max_seconds: float = 20.0

    def __post_init__(self) -> None:
        if not self.warmup_max_seconds > 0:
            raise ValueError(f"warmup_max_seconds={self.warmup_max_seconds} must be > 0")
