"""The sampler's C++ CPU kernels (kernels/csrc/sampling_cpu.cpp) and their plain-torch
references: the structured-output token mask, and the temperature weights' shift.

- `apply_token_bitmask_`: a bitmask row holds one bit a token (xgrammar's layout: int32
  words, bit t % 32 of word t / 32 set when token t is allowed); the refused tokens'
  logits become -inf in place, on the listed rows only, and each listed row reports
  whether it allows any token. `vlmserve.sample.masks` keeps xgrammar's own kernels
  (Triton on a GPU) where this one does not run.
- `temperature_weights`: exp((logits - max) / T) bitwise as the plain ops compute it, but
  torch's exp never sees a -inf (a masked token): it leaves its vector path for every
  vector holding one, which makes a masked row's exp 3-4x a plain one.
- `argmax`: torch.argmax of the listed rows (the first maximum, the first NaN in a row
  holding one) without gathering them, each row's chunks scanned in parallel: greedy over
  a 262,144-token vocabulary at 64 rows was 9% of a decode step through torch's argmax.
- `nucleus_sizes`: per row a number of candidates that surely holds its top-p nucleus,
  from a histogram of the weights' count and mass (no sort), so that a row whose nucleus
  outgrows the first guess is redone once, not widened a topk at a time.
All run for float32 CPU tensors where the kernels build.
"""

from __future__ import annotations

import torch

from kernels import cpu_build


def available() -> str | None:
    """None when the kernels are built and loaded; otherwise why not."""
    return cpu_build.load("sampling_cpu")


def can_run(logits: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype in dtypes
        and logits.dim() == 2
        and logits.stride(1) == 1
        and available() is None
    )


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> list[bool]:
    """The kernel: logits [num_rows, vocab] float32 (CPU), bitmask [>= num_rows,
    >= ceil(vocab / 32)] int32; per row of `rows`, whether it allows any token."""
    index = torch.tensor(rows, dtype=torch.int64)
    return torch.ops.vlmserve_sampling.apply_token_bitmask(logits, bitmask, index).tolist()


_BITS = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)


def apply_token_bitmask_eager(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> list[bool]:
    """The reference: each word's 32 bits unpacked, refused tokens set with masked_fill."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.int64)
    words = bitmask.index_select(0, index)  # [n, num_words] int32
    # [n, num_words, 32] -> [n, vocab]: token t is word t // 32, bit t % 32
    allowed = (words.unsqueeze(-1) & _BITS).ne(0).flatten(1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return allowed.any(-1).tolist()


def temperature_weights(
    logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """exp((logits - top) / temperature) as a new tensor, bitwise what
    `temperature_weights_eager` computes. logits: [rows, vocab] float32 (CPU, `can_run`);
    top: [rows, 1] float32; temperature: [rows] float32."""
    ops = torch.ops.vlmserve_sampling
    shifted, has_neg_inf = ops.shift_scale(logits, top.contiguous(), temperature.contiguous())
    weights = shifted.exp_()  # no lane is -inf: torch's vector path throughout
    ops.zero_neg_inf_(weights, logits, has_neg_inf)  # exp(-inf) = 0
    return weights


def temperature_weights_eager(
    logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """The reference (and the path everywhere the kernel does not run)."""
    return (logits - top).div_(temperature[:, None]).exp_()


def argmax(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n] long: `argmax_eager`'s result from the kernel. logits: [num_rows, vocab] float32
    or bfloat16 (CPU, `can_argmax`); rows: [n] long (None: every row)."""
    if rows is None:
        rows = torch.arange(logits.shape[0])
    return torch.ops.vlmserve_sampling.argmax_rows(logits, rows.contiguous())


def can_argmax(logits: torch.Tensor) -> bool:
    """`can_run`, bfloat16 logits too (a GEMM's, greedy: their argmax is their widened
    values', so a head need not widen them first)."""
    return can_run(logits, (torch.float32, torch.bfloat16))


def argmax_any(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n] long: the listed rows' argmaxes (None: every row), by the kernel where it runs
    (`can_argmax`), else by torch."""
    return argmax(logits, rows) if can_argmax(logits) else argmax_eager(logits, rows)


def argmax_eager(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch.argmax over the gathered rows."""
    return (logits if rows is None else logits.index_select(0, rows)).argmax(-1)


def _rows(weights: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(weights.shape[0]) if rows is None else rows.contiguous()


def nucleus_sizes(
    weights: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """[n] long: per row a number of its largest weights whose mass surely reaches top_p of
    the row's (with a margin), at most the vocabulary; 1 for a row whose weights do not sum
    to a finite number. weights: [num_rows, vocab] float32 (CPU, `can_run`); top_p: [n]
    float32."""
    rows = _rows(weights, rows)
    return torch.ops.vlmserve_sampling.nucleus_sizes(weights, rows, top_p.float().contiguous())
