"""Linear layers and embeddings run from quantized weights as stored: GGUF's legacy blocks
(Q4_0, Q5_0, Q8_0) and K-quants (Q4_K, Q6_K), and our `--quantization int8` (weight-only
int8 with a scale per 32 weights, in the Q8_0 block layout, so the same kernels run it).

No dequantized copy of a weight is kept. Three paths (kernels/csrc/quant_linear_cpu.cpp):
- a few rows (decode), as llama.cpp does it: each row of x quantized to int8 once a call
  (per 32 values, or 256 with per-16 sums for the K-quants), integer dot products per
  weight block (`dpbusd` on VNNI CPUs, AVX2 `maddubs`, or scalar), float32 across blocks;
  at most 9e-3 relative error against the float64 matmul (tests: bound 2e-2). Q8_0 and
  Q5_0 repacked 16 rows at a time where that is faster here (`QuantWeight.pack`);
- with AMX tiles (bfloat16 x): 16 weight rows at a time dequantized to bfloat16 and run
  against every row of x, float32 sums unrounded (`amx_linear`; `amx_argmax` for greedy);
- more rows: tiles of weight rows dequantized into a scratch buffer, each multiplied by the
  skinny kernel (kernels/packed_linear.py) up to its calibrated rows, oneDNN / MKL above.
Where each takes over is measured per block type, dtype and shape on the CPU that runs
it, at first use (kernels/calibration.py), never a constant. Dequantization is float32
bit-identical to `gguf.quants.dequantize`; bfloat16 is that rounded. Without a C++
compiler: `gguf`'s numpy decoders and torch's GEMM (slow, correct).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from kernels import calibration, cpu_build
from kernels.packed_linear import dtype_name, skinny_linear, skinny_max_rows

__all__ = ["SUPPORTED_QTYPES", "QuantLinear", "QuantWeight", "kernel_available"]

Q = GGMLQuantizationType
SUPPORTED_QTYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K))
KQUANTS = frozenset(int(t) for t in (Q.Q4_K, Q.Q6_K))
# The instruction sets the int-dot kernel can be told to use (`isa`): the best this build
# has, or a fallback forced (tests, benchmarks).
ISA = {"scalar": 0, "avx2": 1, "avx_vnni": 2, "avx512_vnni": 3}
TILED = 1000  # + the block type: the C++ kernels' name for a packed weight (QuantWeight.pack)
Path = Literal["auto", "int_dot", "amx", "tile"]
# Weight rows a dequantized tile holds at most (the scratch stays within ~L2 in bfloat16).
TILE_BYTES = 1 << 20
# Calibration: the rows the two paths are timed at, and how much of the weight (dequantized
# bytes) is measured (kernels/packed_linear.py's ladders, the same protocol).
LADDER = (1, 2, 4, 8, 16, 32, 64, 128)
AMX_LADDER = (64, 128, 256, 512, 1024, 2048)  # the AMX path against the dequant-tile GEMM
MEASURE_BYTES = 8 << 20
PACK_LADDER, PACK_BYTES = (1, 3, 8), 64 << 20  # `pack_chosen`: a decode, with drafts, a batch


def qtype_name(qtype: int) -> str:
    return Q(qtype).name


@functools.cache
def kernel_available() -> str | None:  # None when built and loaded here; otherwise why not
    return cpu_build.load("quant_linear_cpu")


@functools.cache
def _linear_op():  # torch.ops.vlmserve_quant.linear, looked up once (a microsecond each)
    return torch.ops.vlmserve_quant.linear


@functools.cache
def amx_available() -> bool:  # whether the tile path runs on AMX tiles here (bfloat16 x)
    return kernel_available() is None and bool(torch.ops.vlmserve_quant.amx_available())


@functools.cache
def best_isa() -> int:  # the int-dot instruction set the built kernel uses (an `ISA` value)
    return int(torch.ops.vlmserve_quant.best_isa()) if kernel_available() is None else 0


@dataclass
class QuantWeight:
    """One [out_features, in_features] weight stored as GGUF blocks, row by row."""

    blocks: torch.Tensor  # uint8 [out_features, bytes per row], contiguous
    qtype: int
    in_features: int
    tiled: bool = False  # Q8_0 / Q5_0 repacked 16 rows at a time (`pack`)

    def __post_init__(self) -> None:
        if self.qtype not in SUPPORTED_QTYPES:
            names = ", ".join(sorted(qtype_name(t) for t in SUPPORTED_QTYPES))
            raise ValueError(
                f"quantization type {qtype_name(self.qtype)} is not supported by the quantized "
                f"kernels (supported: {names}); use --quantization none to dequantize it"
            )
        block, block_bytes = GGML_QUANT_SIZES[Q(self.qtype)]
        if self.in_features % block:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {block}")
        expected = self.in_features // block * block_bytes
        assert self.blocks.dtype == torch.uint8 and self.blocks.dim() == 2, "uint8 [rows, bytes]"
        assert self.blocks.shape[1] == expected, f"{self.blocks.shape[1]} bytes, not {expected}"
        assert self.blocks.is_contiguous(), "blocks: contiguous"

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def kernel_qtype(self) -> int:  # as the C++ kernels are told it (packed: its own)
        return TILED + self.qtype if self.tiled else self.qtype

    def pack(self, force: bool = False) -> None:
        """A Q8_0 / Q5_0 weight's rows repacked in place 16 at a time, rows in the vector lanes
        (C++ `Q8_0_X16`, `Q5_0_X16`: same bytes, every path reads it), as `pack_chosen` chose."""
        if (
            self.tiled or self.out_features < 16 or self.blocks.device.type != "cpu"
            or kernel_available() is not None or best_isa() != ISA["avx512_vnni"]
            or not torch.ops.vlmserve_quant.packable(self.qtype)
        ) or not (force or pack_chosen(self.qtype, self.in_features)):  # fmt: skip
            return
        torch.ops.vlmserve_quant.pack_rows(self.blocks, self.qtype)
        self.tiled = True

    def unpack(self) -> None:  # the stored layout back (the GPU's kernels read it)
        if self.tiled:
            torch.ops.vlmserve_quant.unpack_rows(self.blocks, self.qtype)
            self.tiled = False

    @property
    def bits_per_weight(self) -> float:
        block, block_bytes = GGML_QUANT_SIZES[Q(self.qtype)]
        return 8 * block_bytes / block

    @classmethod
    def from_gguf(cls, raw: np.ndarray, qtype: int, shape: tuple, out=None) -> QuantWeight:
        """A copy of a GGUF tensor's stored bytes (`GGUFFile.raw`'s view) of `shape` (out,
        in), into `out` (as many uint8; None: a new tensor); refuses types not run here."""
        if int(qtype) not in SUPPORTED_QTYPES:
            cls(torch.empty(0, 0, dtype=torch.uint8), int(qtype), 0)  # raises, naming them
        blocks = torch.empty(raw.size, dtype=torch.uint8) if out is None else out
        blocks.numpy()[:] = raw.reshape(-1)
        return cls(blocks.view(shape[0], -1), int(qtype), int(shape[1]))

    def permute_rows(self, index: torch.Tensor) -> None:
        """The rows in the order `index` (a permutation) gives, in place."""
        self.blocks.copy_(self.blocks[index.long()])

    def dequantize(
        self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The rows `rows` (all: None) as [len(rows) or out, in] in `dtype`: float32
        bit-identical to gguf.quants.dequantize; bfloat16 that rounded."""
        count = self.out_features if rows is None else rows.numel()
        if kernel_available() is None and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(count, self.in_features, dtype=dtype)
            index = None if rows is None else rows.reshape(-1).long().contiguous()
            torch.ops.vlmserve_quant.dequantize(out, self.blocks, self.kernel_qtype, index)
            return out
        blocks = self.blocks if rows is None else self.blocks[rows.reshape(-1).long()]
        return dequantize_reference(blocks, self.qtype).to(dtype)


def dequantize_reference(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf's numpy decoder: float32 [rows, in] (the fallback without the C++ kernels)."""
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks.numpy(), Q(qtype)).copy())


@functools.cache
def pack_chosen(qtype: int, in_features: int) -> bool:
    """Whether weights of this block type with rows this long are packed here: both layouts
    timed at PACK_LADDER's rows on PACK_BYTES of random blocks (streamed from memory, as a
    262k-row LM head or a decode step's layers are), the faster over them."""

    def measure() -> calibration.Measured:
        rows = PACK_BYTES // (in_features // 32 * (block_bytes := GGML_QUANT_SIZES[Q(qtype)][1]))
        raw = torch.randint(0, 256, (rows, in_features // 32, block_bytes), dtype=torch.uint8)
        raw[..., :2] = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
        stored = QuantWeight(raw.reshape(rows, -1), qtype, in_features)
        packed = QuantWeight(stored.blocks.clone(), qtype, in_features)
        packed.pack(force=True)
        layers = {"stored": QuantLinear([stored]), "packed": QuantLinear([packed])}
        xs = [torch.randn(n, in_features).to(torch.bfloat16) for n in PACK_LADDER]
        return [{"rows": x.shape[0], **calibration.time_paths({
            k: lambda x=x, k=k: layers[k].run(x, torch.float32, "int_dot") for k in layers
        })} for x in xs]  # fmt: skip

    decide = lambda m: calibration.decide_faster(m, "packed", "stored")  # noqa: E731
    return calibration.calibrated(f"quant_pack/{qtype_name(qtype)}/{in_features}", measure, decide)


def int_dot_max_rows(qtype: int, dtype: torch.dtype, in_features: int, out_features: int) -> int:
    """The most rows the int-dot kernel takes for this weight in `dtype` (the AMX path or
    the dequant-tile GEMM above), calibrated on this CPU at that shape; 0 where the kernel
    is unavailable."""
    if kernel_available() is not None:
        return 0
    return _crossover(("int_dot", _above_int_dot(dtype)), LADDER, qtype, dtype, in_features,
                      out_features)  # fmt: skip


def amx_max_rows(qtype: int, dtype: torch.dtype, in_features: int, out_features: int) -> int:
    """The most rows the AMX path takes (the dequant-tile GEMM above), calibrated likewise;
    0 where it cannot run (no AMX, float32 x)."""
    if _above_int_dot(dtype) != "amx":
        return 0
    return _crossover(("amx", "tile"), AMX_LADDER, qtype, dtype, in_features, out_features)


def _crossover(
    paths: tuple[Path, Path], ladder: tuple[int, ...], qtype: int, dtype: torch.dtype,
    in_features: int, out_features: int,
) -> int:  # fmt: skip
    """The most rows paths[0] takes before paths[1], both timed up `ladder` at this shape
    (its first MEASURE_BYTES) until paths[0] lost twice in a row (more rows only widen it)."""
    fast, slow = paths
    out_m = max(1, min(out_features, MEASURE_BYTES // (in_features * dtype.itemsize)))
    name = f"quant_{fast}_max_rows/{qtype_name(qtype)}/{dtype_name(dtype)}/{in_features}x{out_m}"

    def measure() -> calibration.Measured:
        layer = QuantLinear([random_weight(qtype, out_m, in_features)])
        layer.parts[0].pack()  # as the engine runs it (loader.py's `place`)
        gen = torch.Generator().manual_seed(1)
        measured, losses = [], 0
        for rows in ladder:
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            run = {path: lambda x=x, path=path: layer.run(x, dtype, path) for path in paths}
            measured.append({"rows": rows, **calibration.time_paths(run)})
            lost = measured[-1][fast] > calibration.MARGIN * measured[-1][slow]
            losses = losses + 1 if lost else 0
            if losses == 2:
                break
        return measured

    decide = lambda m: calibration.decide_max_rows(m, fast, slow)  # noqa: E731
    return calibration.calibrated(name, measure, decide)


def _above_int_dot(dtype: torch.dtype) -> Path:
    """The path that takes the rows above the int-dot kernel's."""
    return "amx" if dtype == torch.bfloat16 and amx_available() else "tile"


def random_weight(qtype: int, out_features: int, in_features: int, seed: int = 0) -> QuantWeight:
    """A weight of random blocks (finite, moderate scales): calibration and benchmarks."""
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    if qtype in KQUANTS:  # gguf cannot quantize these: random bytes, scales set below
        block, block_bytes = GGML_QUANT_SIZES[Q(qtype)]
        nblocks = in_features // block
        raw = torch.randint(0, 256, (out_features, nblocks, block_bytes), generator=gen)
        raw = raw.to(torch.uint8)
        scale = torch.full((out_features, nblocks, 1), 2e-3 / in_features**0.5)
        scale16 = scale.to(torch.float16).view(torch.uint8).reshape(out_features, nblocks, 2)
        if qtype == Q.Q6_K:
            raw[..., 208:210] = scale16
        else:  # Q4_K: d and dmin
            raw[..., 0:4] = scale16.repeat(1, 1, 2)
        blocks = raw.reshape(out_features, -1).contiguous()
        return QuantWeight(blocks, int(qtype), in_features)
    raw = quantize(dense.numpy(), Q(qtype))
    return QuantWeight(torch.from_numpy(raw.copy()), int(qtype), in_features)


class QuantLinear(nn.Module):
    """x @ W.T (+ bias) with W stored quantized: `parts` are row segments stacked along
    out (a fused q|k|v or gate|up projection, each part its own block type), all with
    the same in_features. x: float32 or bfloat16, any leading dims."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts:
            raise ValueError("QuantLinear needs at least one part")
        self.in_features = parts[0].in_features
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("QuantLinear parts must share in_features")
        self.parts = _merge_same_type(parts)  # one kernel call (one x quantized) each
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias
        self.path: Path = "auto"  # "int_dot" / "amx" / "tile": forced (tests, benchmarks)
        # The Triton tile GEMM (kernels/quant_gpu.py) instead of the CPU's kernels: set
        # with the blocks on a CUDA device (models/quantized.py's `place`).
        self.triton = False
        self.isa: int | None = None  # None: the best this build has
        self._max_rows: dict[torch.dtype, list[int]] = {}  # calibrated, per dtype
        self._amx_rows: dict[torch.dtype, list[int]] = {}
        self._biases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._plans: dict[torch.dtype, tuple[bool, list[tuple]]] = {}  # run's, per dtype
        ends = np.cumsum([p.out_features for p in self.parts]).tolist()
        self._spans = [
            (p, end - p.out_features, end) for p, end in zip(self.parts, ends, strict=True)
        ]

    def max_rows(self, dtype: torch.dtype) -> list[int]:
        """Per part, the most rows the int-dot kernel takes in `dtype` (calibrated)."""
        if dtype not in self._max_rows:
            self._max_rows[dtype] = [
                int_dot_max_rows(p.qtype, dtype, p.in_features, p.out_features)
                for p in self.parts
            ]  # fmt: skip
        return self._max_rows[dtype]

    def amx_rows(self, dtype: torch.dtype) -> list[int]:
        """Per part, the most rows the AMX path takes in `dtype` (calibrated; 0: none)."""
        if dtype not in self._amx_rows:
            self._amx_rows[dtype] = [
                amx_max_rows(p.qtype, dtype, p.in_features, p.out_features) for p in self.parts
            ]
        return self._amx_rows[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, x.dtype, self.path)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """As forward, float32 out (the LM head's logits)."""
        return self.run(x, torch.float32, self.path)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """torch.argmax of forward_float(x) over its last dim straight from the AMX path's
        sums (no logits written) where forward_float takes that path, else None."""
        rows, part = x.reshape(-1, self.in_features), self.parts[0]
        n, dtype = rows.shape[0], x.dtype
        if self.triton or self.bias is not None or len(self.parts) > 1 or dtype != torch.bfloat16:
            return None
        auto = self.path == "auto" and self.max_rows(dtype)[0] < n <= self.amx_rows(dtype)[0]
        if not (auto or self.path == "amx") or not amx_available():
            return None
        out = torch.empty(n, dtype=torch.long)
        torch.ops.vlmserve_quant.amx_argmax(out, rows.contiguous(), part.blocks, part.kernel_qtype)
        return out.view(x.shape[:-1])

    def run(self, x: torch.Tensor, out_dtype: torch.dtype, path: Path = "auto") -> torch.Tensor:
        """x @ W.T + bias in `out_dtype` by `path` ("auto": as calibrated)."""
        if self.triton:
            return self._run_triton(x, out_dtype)
        kernel, plan = self._plans.get(x.dtype) or self._plan(x.dtype)
        # A decode step calls each linear once a layer with one row: this path is kept
        # short (each Python-level op here costs about a microsecond, the kernel ~20-100).
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, self.out_features, dtype=out_dtype)
        isa = best_isa() if self.isa is None else self.isa
        limits = self.max_rows(x.dtype) if path == "auto" and kernel else None
        for i, (part, bias, span) in enumerate(plan):
            target = out if span is None else out[:, span[0] : span[1]]
            if kernel and (path == "int_dot" or (limits is not None and num_rows <= limits[i])):
                _linear_op()(target, rows, part.blocks, part.kernel_qtype, bias, isa)
            elif path == "amx" or (limits is not None and num_rows <= self.amx_rows(x.dtype)[i]):
                qtype = part.kernel_qtype
                torch.ops.vlmserve_quant.amx_linear(target, rows, part.blocks, qtype, bias)
            else:
                _tile_linear(target, rows, part, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def _plan(self, dtype: torch.dtype) -> tuple[bool, list[tuple]]:
        """Per input dtype, made once: whether the C++ kernel is here, and per part its
        weight, bias in `dtype` and output columns (None: all)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"QuantLinear runs float32 or bfloat16 inputs, not {dtype}")
        single = len(self._spans) == 1
        plan = [
            (part, self._bias(i, dtype), None if single else (start, end))
            for i, (part, start, end) in enumerate(self._spans)
        ]
        self._plans[dtype] = (kernel_available() is None, plan)
        return self._plans[dtype]

    def _run_triton(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        from kernels.quant_gpu import gguf_linear

        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype, device=x.device)
        for i, (part, start, end) in enumerate(self._spans):
            gguf_linear(rows, part.blocks, part.qtype, self._bias(i, x.dtype), out[:, start:end])
        return out.view(*x.shape[:-1], self.out_features)

    def _bias(self, part: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Part `part`'s bias in `dtype` (made once)."""
        if self.bias is None:
            return None
        if (part, dtype) not in self._biases:
            _, start, end = self._spans[part]
            self._biases[part, dtype] = self.bias[start:end].to(dtype).contiguous()
        return self._biases[part, dtype]

    def describe(self, dtype: torch.dtype = torch.bfloat16) -> str:
        """Block types, bits a weight, paths and crossovers calibrated in `dtype` (the x's)."""
        types = "+".join(qtype_name(p.qtype) + " packed" * p.tiled for p in self.parts)
        bits = sum(p.bits_per_weight * p.out_features for p in self.parts) / self.out_features
        if self.triton:
            return f"{types} {bits:.3g} bits/weight, Triton dequant-tile GEMM"
        if kernel_available() is not None:
            return f"{types} {bits:.2g} bits/weight, dequant-tile GEMM (no C++ kernel)"
        int_dot, amx = (sorted(set(f(dtype))) for f in (self.max_rows, self.amx_rows))
        then = f", then AMX up to {'/'.join(map(str, amx))}" if amx_available() else ""
        return (
            f"{types} {bits:.3g} bits/weight, int-dot up to {'/'.join(map(str, int_dot))} rows"
            f"{then} (calibrated, {str(dtype).removeprefix('torch.')}), then dequant-tile GEMM"
        )


def _merge_same_type(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Neighbouring parts of one block type as one weight (their rows stacked: a view where
    the second's bytes follow the first's, as models/gguf_weights.py lays a file's out)."""
    merged: list[QuantWeight] = []
    for part in parts:
        if merged and merged[-1].qtype == part.qtype:
            assert not (part.tiled or merged[-1].tiled), "packed after merging"
            a, b = merged[-1].blocks, part.blocks
            shared = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            if shared and a.data_ptr() + a.nbytes == b.data_ptr():  # no copy
                rows = a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), a.stride())
            else:
                rows = torch.cat([a, b])
            merged[-1] = QuantWeight(rows, part.qtype, part.in_features)
        else:
            merged.append(part)
    return merged


def _tile_linear(
    out: torch.Tensor, x: torch.Tensor, part: QuantWeight, bias: torch.Tensor | None
) -> None:
    """out = x @ part.T + bias, a tile of weight rows (whole 16-row tiles of a packed one)
    dequantized at a time (in x's dtype) into a scratch buffer, each multiplied by the
    skinny kernel up to the rows calibrated for it at the tile's shape (float32 out: the
    float32 sums as they are), above them by torch's GEMM (bfloat16 x, float32 out: its
    bfloat16 output widened, as the bfloat16 engine's LM head on oneDNN gives it)."""
    tile_rows = min(part.out_features, max(16, TILE_BYTES // (part.in_features * 2) // 16 * 16))
    skinny = x.shape[0] <= skinny_max_rows(x.dtype, part.in_features, tile_rows)
    scratch = torch.empty(tile_rows, part.in_features, dtype=x.dtype)
    native = kernel_available() is None
    for start in range(0, part.out_features, tile_rows):
        end = min(part.out_features, start + tile_rows)
        if native:  # into the scratch buffer, reused tile after tile
            weight = scratch[: end - start]
            blocks = part.blocks[start:end]
            torch.ops.vlmserve_quant.dequantize(weight, blocks, part.kernel_qtype, None)
        else:
            weight = dequantize_reference(part.blocks[start:end], part.qtype).to(x.dtype)
        b = None if bias is None else bias[start:end].to(x.dtype)
        if skinny:
            out[:, start:end] = skinny_linear(x, weight, b, out.dtype)
        else:
            out[:, start:end] = F.linear(x, weight, b)
