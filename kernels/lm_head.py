"""The LM head on the CPU, each path chosen by measurement on the CPU that runs it
(kernels/calibration.py; `vlmserve info` prints the choices).

`LogitsHead` (made once at load by `logits_head`; `linear_float` for a head that is not
one) writes float32 logits straight from the skinny kernel's float32 sums up to
`head_choice`'s rows, instead of rounding them to bfloat16 and widening them back
(sampling and logprobs read float32 logits); above them oneDNN's packed GEMM (AMX tiles
where the CPU has them; a tied head gets a packed copy of the embedding for it) or
F.linear on the plain weight, or, on an AMX CPU, our tile kernel on its own packed copy
(`packed_linear.amx_linear`), whichever was faster here. Greedy tokens come straight from
those tiles (`LogitsHead.argmax`: `amx_argmax`, no logits written) at the rows
`greedy_rows` chose. The kernels themselves are in kernels/packed_linear.py.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kernels import calibration, packed_linear, sampling_cpu
from kernels.packed_linear import (
    PACKED_DTYPES,
    PackedLinear,
    amx_head_available,
    dtype_name,
    measure_ladder,
    measured_rows,
    packable,
    plain_gemm,
    skinny_available,
)  # fmt: skip

# skinny_linear, amx_linear and amx_argmax are called through `packed_linear` (the tests
# count each path's calls there).

__all__ = ["LogitsHead", "greedy_rows", "head_choice", "linear_float", "logits_head"]

# Sampling rows (on a Zen 5 the skinny kernel won up to 256; on an AMX Xeon oneDNN's
# bfloat16 GEMM ran [64 x 640] x [262,144 x 640] several times faster).
HEAD_LADDER = (1, 4, 16, 64, 256)
# A head is measured on at most this many bytes of its rows: the per-row cost of a weight
# streamed from memory, in a bounded time (a 262k-token head is 335 MB).
HEAD_MAX_BYTES = 32 << 20
# The largest choice at stake (half a decode step on an AMX Xeon) gets the longest ladder.
HEAD_BUDGET_S = 5.0


def head_choice(dtype: torch.dtype, hidden: int, vocab: int) -> calibration.HeadChoice:
    """How an LM head of [vocab, hidden] in `dtype` computes its logits on this CPU."""
    if skinny_available() is not None:
        return calibration.HeadChoice(0, "packed")
    out_m = measured_rows(vocab, hidden, dtype, HEAD_MAX_BYTES)
    paths = ("skinny", "packed", "plain") if packable(dtype) else ("skinny", "plain")
    if amx_head_available(dtype, hidden, vocab):
        paths, out_m = (*paths, "amx"), max(16, out_m // 16 * 16)  # whole AMX tiles
    name = f"lm_head/{dtype_name(dtype)}/{hidden}x{out_m}"
    return calibration.calibrated(
        name,
        lambda: measure_ladder(
            dtype, hidden, out_m, HEAD_LADDER, paths, HEAD_BUDGET_S, logits=True
        ),
        calibration.decide_head,
    )


def greedy_rows(
    dtype: torch.dtype, hidden: int, vocab: int, choice: calibration.HeadChoice
) -> tuple[int, int | None] | None:
    """The rows (fewest, most; None: no end) at which greedy decoding takes its tokens
    straight from the AMX tiles of a [vocab, hidden] head that `choice` runs (`amx_argmax`,
    no logits written) rather than from its float32 logits and the argmax kernel, as
    measured on this CPU (`calibration.decide_greedy`); None: never, and for a head
    without the AMX kernel (its own copy of the weight)."""
    if choice.amx_min_rows is None or not amx_head_available(dtype, hidden, vocab):
        return None
    out_m = max(16, measured_rows(vocab, hidden, dtype, HEAD_MAX_BYTES) // 16 * 16)
    return calibration.calibrated(
        f"lm_head_argmax/{dtype_name(dtype)}/{hidden}x{out_m}",
        lambda: _measure_greedy(dtype, hidden, out_m, choice),
        calibration.decide_greedy,
    )


def _measure_greedy(
    dtype: torch.dtype, hidden: int, vocab: int, choice: calibration.HeadChoice
) -> calibration.Measured:
    """Seconds per greedy pick of the rows of HEAD_LADDER for a [vocab, hidden]
    head: "logits" (the head as `choice` runs it, then the argmax kernel) against "fused"
    (`amx_argmax`), interleaved, within HEAD_BUDGET_S."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)
    tied = nn.Linear(hidden, vocab, bias=False, device="meta")
    tied.weight = nn.Parameter(weight, requires_grad=False)
    head = LogitsHead(weight, PackedLinear(tied) if choice.gemm == "packed" else None, choice)
    measured, start = [], time.perf_counter()
    for rows in HEAD_LADDER:
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        seconds = calibration.time_paths({
            "logits": lambda x=x: sampling_cpu.argmax_any(head(x)),
            "fused": lambda x=x: packed_linear.amx_argmax(x, head.amx),
        })  # fmt: skip
        measured.append({"rows": rows, **seconds})
        if time.perf_counter() - start > HEAD_BUDGET_S:
            break
    return measured


def linear_float(layer: nn.Module | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head: `layer(x)` (or x @ weight.T where `layer` is None: tied embeddings) as
    float32. A `LogitsHead` computes them its calibrated way; so does a CPU head with a
    plain weight (a packed layer's, or the tied embedding itself: no copy), calibrated on
    first use; otherwise the layer's output, widened."""
    if isinstance(layer, LogitsHead):
        return layer(x)
    plain = weight if layer is None else getattr(layer, "plain", None)
    if can_choose_head(plain, x.dtype):
        choice = head_choice(x.dtype, plain.shape[1], plain.shape[0])
        packed = layer if isinstance(layer, PackedLinear) else None
        return _logits(x, plain, packed, getattr(layer, "bias", None), choice)
    out = plain_gemm(x, weight) if layer is None else layer(x)
    return out.float()


def can_choose_head(plain: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a head with this plain weight takes its calibrated paths on this CPU."""
    return (
        plain is not None
        and plain.device.type == "cpu"
        and plain.dtype == dtype
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and skinny_available() is None
    )


def _logits(
    x: torch.Tensor, plain: torch.Tensor, packed: PackedLinear | None,
    bias: torch.Tensor | None, choice: calibration.HeadChoice, amx: torch.Tensor | None = None,
    widen: bool = True,
) -> torch.Tensor:  # fmt: skip
    """float32 logits; `widen` False: a GEMM's output as it is (x's dtype, widened exactly
    by .float(): the same argmax, for half the bytes)."""
    rows = x.numel() // x.shape[-1]
    if rows <= choice.skinny_max_rows:
        # the float32 sums, unrounded
        return packed_linear.skinny_linear(x, plain, bias, torch.float32)
    if amx is not None and choice.takes_amx(rows):
        return packed_linear.amx_linear(x, amx)  # float32 sums too
    below_plain = choice.plain_min_rows is None or rows < choice.plain_min_rows
    if choice.gemm == "packed" and packed is not None and below_plain:
        out = packed.forward_packed(x)
    else:
        out = plain_gemm(x, plain, bias)
    return out.float() if widen else out


class LogitsHead(nn.Module):
    """A CPU LM head with its calibrated choice (`head_choice`), made once at load
    (`logits_head`): float32 logits through the skinny kernel up to the chosen rows, then
    oneDNN's packed GEMM or F.linear on the plain weight, or the AMX kernel on its own
    packed copy (`amx`) from the rows it won. `argmax`: greedy tokens straight from the
    AMX tiles at the rows `greedy_rows` chose (calibrated too), no logits written."""

    def __init__(
        self, plain: torch.Tensor, packed: PackedLinear | None, choice: calibration.HeadChoice
    ) -> None:
        super().__init__()
        self.plain = plain  # [vocab, hidden]: the tied embedding itself, or the layer's
        self.packed = packed
        self.choice = choice
        self.bias = None if packed is None else packed.bias
        self.amx = None
        if choice.amx_min_rows is not None and self.bias is None:
            self.amx = torch.ops.vlmserve_skinny.amx_pack(plain)
        self.greedy_rows: tuple[int, int | None] | None = None  # `calibrate_greedy` sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _logits(x, self.plain, self.packed, self.bias, self.choice, self.amx)

    def calibrate_greedy(self) -> None:
        if self.amx is not None:
            self.greedy_rows = greedy_rows(self.plain.dtype, *self.plain.shape[::-1], self.choice)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows] long: torch.argmax of `self(x)` per row, from the AMX tiles where the
        calibration chose them for this many rows; elsewhere of the logits, a GEMM's not
        widened first (at 64 rows of a 262k vocabulary: 67 MB written, not 134 and 67)."""
        rows, window = x.numel() // x.shape[-1], self.greedy_rows
        if window is None or rows < window[0] or (window[1] is not None and rows > window[1]):
            logits = _logits(x, self.plain, self.packed, self.bias, self.choice, self.amx, False)
            return sampling_cpu.argmax_any(logits)
        return packed_linear.amx_argmax(x, self.amx)


def logits_head(layer: nn.Module | None, embedding: torch.Tensor) -> nn.Module | None:
    """The LM head a CPU decoder computes its logits with (after `pack_linears`): `layer`
    (None: tied to `embedding`) as a LogitsHead where its paths can be chosen here, with
    a packed copy of a tied embedding only where oneDNN's packed GEMM won (vocab x hidden
    more memory); `layer` unchanged elsewhere."""
    plain = embedding.detach() if layer is None else getattr(layer, "plain", None)
    if not can_choose_head(plain, plain.dtype if plain is not None else torch.float64):
        return layer
    choice = head_choice(plain.dtype, plain.shape[1], plain.shape[0])
    packed = layer if isinstance(layer, PackedLinear) else None
    amx_throughout = (  # every GEMM size: no oneDNN copy
        choice.takes_amx(choice.skinny_max_rows + 1) and choice.amx_max_rows is None
    )
    if packed is None and choice.gemm == "packed" and not amx_throughout:
        tied = nn.Linear(plain.shape[1], plain.shape[0], bias=False, device="meta")
        tied.weight = nn.Parameter(plain, requires_grad=False)  # the embedding: no copy
        packed = PackedLinear(tied)  # the packed copy
    head = LogitsHead(plain.contiguous(), packed, choice)
    head.calibrate_greedy()
    return head
