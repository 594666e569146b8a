"""Engine configuration: one frozen dataclass per subsystem, composed in EngineConfig.
Environment variables are read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from encoders.config import EncoderConfig
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return os.environ.get("VLMSERVE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    device: str = field(default_factory=default_device)
    # None: float32 on CPU (bfloat16 matmul is far slower there on most CPUs), bfloat16 on
    # GPU.
    dtype: str | None = None
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_images_per_request: int = 16
    # None / "auto", "torch", "cpu", "triton", "flashinfer" (kernels.backends.select_backend)
    attention_backend: str | None = None
    # CPU float32: the decoder's and the vision encoder's linear layers in oneDNN's
    # prepacked layout (PackedLinear; the tower's GELU and residual adds fused into them).
    pack_weights: bool = True
    # CPU float32, with pack_weights: the decoder's linears also keep their plain weights
    # (a second copy) for the skinny kernel at <= 16 rows and MKL at >= 1,536 rows
    # (kernels/packed_linear.py); off: half the decoder's weight memory, slower there.
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

    def __post_init__(self) -> None:
        if not Path(self.path).is_dir():
            raise ValueError(f"model path {self.path!r} is not a directory")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.nano_batch not in ("off", "auto") and not Path(self.nano_batch).exists():
            raise ValueError(
                f"nano_batch {self.nano_batch!r} is neither 'off', 'auto' nor a schedule path"
            )
        if self.max_images_per_request < 0:
            raise ValueError(f"max_images_per_request={self.max_images_per_request} must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.float32 if self.device == "cpu" else torch.bfloat16


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # off
    encoder: EncoderConfig = field(default_factory=EncoderConfig)  # preprocessing, cache
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP 1
