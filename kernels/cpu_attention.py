"""The CPU backend: attention reads K/V straight from the paged cache in C++ kernels, with
no per-layer gather.

Decodes and verifications (query_len <= SMALL_QUERY_LEN) go to
kernels/csrc/paged_attention_cpu.cpp: the torch backend gathers every short-query
sequence's context into a padded buffer per layer, a large share of a decode step at a
large batch; the kernel walks each (sequence, kv head)'s blocks once with an
online softmax instead, threads over those pairs, and writes its rows of the output in
place.

Prefills and chunks on a cached prefix go to kernels/csrc/prefill_attention_cpu.cpp: a
flash-style kernel over (sequence, kv head, query block) items whose register-blocked
micro-kernels run near the GEMM peak, where torch's CPU SDPA (flash) kernel reaches about
half of it at head size 64, and where a chunk on a prefix needs no gather or mask.
`prefill_kernel=False` keeps the torch backend's path for them (SDPA per fresh prefill,
gather + masked SDPA per chunk on a prefix); `select_backend(..., "cpu-sdpa")` picks it.

The kernels are compiled the first time they are needed (kernels/cpu_build.py), for the
widest vectors the CPU has (AVX-512 or AVX2 + FMA, `csrc/vec.h`). Where no C++ compiler is
found the build fails once, `available()` says why, and `select_backend` keeps the torch
backend; where the CPU has neither vector set, `prefill_available()` says so and prefills
keep SDPA.

Which of the two runs prefills is measured on the CPU that runs them
(`prefill_kernel_wins`, kernels/calibration.py), per dtype and head shape: the bfloat16
kernel ran at 4.5-6.1x torch's SDPA on a Zen 5 (AVX-512 BF16 dot products) and at
0.36-0.60x on an AMX Xeon, where SDPA's bfloat16 GEMMs run on AMX tiles.

Decodes in bfloat16 on a CPU with AMX may take the decode kernel's AMX path (both
products on tiles, `decode_amx_wins`, also calibrated): at Gemma 3 270M's shape it does the
arithmetic in ~85 cycles a key against ~120, though from memory both wait on the same
bytes (kernels/csrc/paged_amx.h). The vector path prefetches the next block a line at a
time or whole, whichever reads a served step's scattered blocks faster here
(`decode_spread_wins`, calibrated: a Zen 4 reads 1.6x faster spread).

Sliding windows and bidirectional spans (Gemma 3): both kernels take the window (keys
before it are never read, whole blocks before it never touched); the prefill kernel also
takes each token's key end (`key_ends`: the end of its image span, else its position + 1),
so a sequence with spans in its chunk goes to the prefill kernel whatever its length.
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass

import torch

from kernels import calibration, cpu_build, fused_ops
from kernels.attention import (
    SMALL_QUERY_LEN,
    AttentionBatch,
    TorchAttentionMetadata,
    TorchPagedAttention,
    _group,
)


def available() -> str | None:
    """None when the decode kernel is built and loaded; otherwise the reason it is not."""
    return cpu_build.load("paged_attention_cpu")


def prefill_available() -> str | None:
    """None when the prefill kernel is built, loaded and can run on this CPU (it needs
    AVX-512 or AVX2 + FMA); otherwise the reason it is not."""
    why = cpu_build.load("prefill_attention_cpu")
    if why is None and torch.ops.vlmserve_prefill.vector_lanes() == 0:
        return "this CPU has neither AVX-512 nor AVX2 + FMA"
    return why


@functools.cache
def bf16_dot_available() -> bool:
    """Whether the prefill kernel runs bfloat16 on AVX-512 BF16 dot products here (ahead of
    torch's CPU SDPA in bfloat16: `benchmarks/ops/prefill_attention.py --dtype bfloat16`;
    elsewhere it widens to float32)."""
    return prefill_available() is None and torch.ops.vlmserve_prefill.bf16_dot()


@functools.cache
def amx_available() -> bool:
    """Whether the prefill kernel runs bfloat16 at head dims a multiple of 32 on AMX tiles
    here (Intel's `amx_bf16`), the tower's tile attention included."""
    return prefill_available() is None and torch.ops.vlmserve_prefill.amx()


# The prefill cases the calibration times, (cached prefix, new tokens): a fresh prompt and
# a chunk on a prefix; at most this many KV heads (the query heads in the model's ratio).
PREFILL_CASES = ((0, 1024), (512, 512))
MAX_MEASURED_KV_HEADS = 2


def prefill_kernel_wins(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether prefills run faster on the C++ prefill kernel than through torch's SDPA on
    this CPU, in `dtype` at this head shape (calibrated once per CPU; False where the
    kernel does not build)."""
    if prefill_available() is not None:
        return False
    kv_heads = min(num_kv_heads, MAX_MEASURED_KV_HEADS)
    heads = kv_heads * max(1, num_heads // num_kv_heads)
    name = f"prefill_attention/{str(dtype).removeprefix('torch.')}/{heads}x{kv_heads}x{head_dim}"
    return calibration.calibrated(
        name,
        lambda: _measure_prefill(dtype, heads, kv_heads, head_dim),
        lambda m: calibration.decide_faster(m, "kernel", "sdpa"),
    )


def _measure_prefill(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> calibration.Measured:
    """Seconds of one layer's attention (K/V write included) of each PREFILL_CASES
    sequence through the kernel and through SDPA, each backend's `forward`, interleaved."""
    gen = torch.Generator().manual_seed(0)
    block, cpu = 16, torch.device("cpu")
    backends = {"kernel": CpuPagedAttention(True), "sdpa": CpuPagedAttention(False)}
    measured = []
    for cached, new in PREFILL_CASES:
        ctx = cached + new
        num_blocks = -(-ctx // block)
        cache = torch.randn(2, kv_heads, num_blocks * block, head_dim, generator=gen).to(dtype)
        q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(new, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        batch = AttentionBatch([new], [ctx], [list(range(num_blocks))], block)
        slots = torch.arange(cached, ctx)
        paths = {}
        for name, backend in backends.items():
            meta = backend.build_metadata(batch, slots, cpu)
            inputs = (q, k, v, cache, meta, head_dim**-0.5)
            paths[name] = lambda b=backend, x=inputs: b.forward(*x)
        measured.append({"cached": cached, "tokens": new, **calibration.time_paths(paths)})
    return measured


# The decode case decode_amx_wins times: sequences of this many keys, every sequence's
# block table on the same blocks (cache-resident: the arithmetic, which is what differs;
# from memory both paths wait on the same bytes).
DECODE_CASE = (16, 512)


def decode_amx_wins(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether decodes and verifications run faster on the decode kernel's AMX path
    (kernels/csrc/paged_amx.h: both products on tiles) than on its vector path on this
    CPU, at this head shape (calibrated once per CPU; False where the path cannot run:
    not bfloat16, no AMX, head dims not a multiple of 32, more than 16 query heads a KV
    head)."""
    group = max(1, num_heads // num_kv_heads)
    if dtype != torch.bfloat16 or head_dim % 32 or group > 16:
        return False
    if available() is not None or not amx_available():
        return False
    kv_heads = min(num_kv_heads, MAX_MEASURED_KV_HEADS)
    name = f"decode_attention_amx/{kv_heads * group}x{kv_heads}x{head_dim}"
    return calibration.calibrated(
        name,
        lambda: _measure_decode(kv_heads * group, kv_heads, head_dim),
        lambda m: calibration.decide_faster(m, "amx", "vector"),
    )


def _measure_decode(heads: int, kv_heads: int, head_dim: int) -> calibration.Measured:
    """Seconds of one layer's decode attention of DECODE_CASE through each path."""
    gen = torch.Generator().manual_seed(0)
    seqs, ctx = DECODE_CASE
    block = 16
    blocks = -(-ctx // block)
    cache = torch.randn(2, kv_heads, blocks * block, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.arange(blocks, dtype=torch.int32).repeat(seqs, 1)
    starts = torch.arange(seqs, dtype=torch.int32)
    lens = torch.ones(seqs, dtype=torch.int32)
    ctxs = torch.full((seqs,), ctx, dtype=torch.int32)

    def path(amx: bool):
        return lambda: torch.ops.vlmserve.paged_attention(
            out, q, cache, tables, starts, lens, ctxs, block, head_dim**-0.5, 0, amx
        )

    paths = {"amx": path(True), "vector": path(False)}
    return [{"sequences": seqs, "context": ctx, **calibration.time_paths(paths)}]


# The case decode_spread_wins times: sequences of this many keys on scattered blocks, in
# caches (layers) of this many bytes in all: from memory, past any L3, as a served step.
SPREAD_CASE = (16, 512, 256 << 20)


def decode_spread_wins(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the decode kernel's vector path reads K/V faster prefetching the next block
    a line at a time, as it passes the same line of the block in hand (`spread`), than the
    whole block at once, on this CPU in `dtype` at this head shape (calibrated once per
    CPU; True where it cannot matter: no kernel, a float16 cache, prefetched whole)."""
    if available() is not None or dtype not in (torch.float32, torch.bfloat16):
        return True
    group = max(1, num_heads // num_kv_heads)
    kv_heads = min(num_kv_heads, MAX_MEASURED_KV_HEADS)
    name = f"decode_prefetch/{str(dtype).removeprefix('torch.')}/"
    name += f"{kv_heads * group}x{kv_heads}x{head_dim}"
    return calibration.calibrated(
        name,
        lambda: _measure_spread(dtype, kv_heads * group, kv_heads, head_dim),
        lambda m: calibration.decide_faster(m, "spread", "whole"),
    )


def _measure_spread(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> calibration.Measured:
    """Seconds of SPREAD_CASE's decode attention over all its caches, each way."""
    gen = torch.Generator().manual_seed(0)
    seqs, ctx, total = SPREAD_CASE
    block, blocks = 16, seqs * -(-ctx // 16)
    first = torch.randn(2, kv_heads, blocks * block, head_dim, generator=gen).to(dtype)
    caches = [first] + [first.clone() for _ in range(-(-total // first.nbytes) - 1)]
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(seqs, -1)
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    starts = torch.arange(seqs, dtype=torch.int32)
    lens = torch.ones(seqs, dtype=torch.int32)
    ctxs = torch.full((seqs,), ctx, dtype=torch.int32)

    def path(spread: bool):
        def sweep() -> None:
            for cache in caches:
                torch.ops.vlmserve.paged_attention(
                    out, q, cache, tables, starts, lens, ctxs, block, head_dim**-0.5, 0, False,
                    spread,
                )  # fmt: skip

        return sweep

    paths = {"spread": path(True), "whole": path(False)}
    return [{"sequences": seqs, "context": ctx, **calibration.time_paths(paths)}]


def tile_kernel_wins(dtype: torch.dtype, num_heads: int, head_dim: int, num_patches: int) -> bool:
    """Whether a vision tower's attention within tiles of `num_patches` runs faster on the
    prefill kernel (`tile_attention`) than through torch's SDPA on this CPU, in `dtype` at
    this head shape (calibrated once per CPU; False where the kernel does not build). The
    float32 kernel was ahead of SDPA on 4,096-patch tiles and level at 729 on a Zen 5."""
    if prefill_available() is not None:
        return False
    heads = min(num_heads, 2 if num_patches <= 2048 else 1)  # a bounded measurement
    name = f"tile_attention/{str(dtype).removeprefix('torch.')}/{heads}x{head_dim}x{num_patches}"
    return calibration.calibrated(
        name,
        lambda: _measure_tile(dtype, heads, head_dim, num_patches),
        lambda m: calibration.decide_faster(m, "kernel", "sdpa"),
    )


def _measure_tile(
    dtype: torch.dtype, heads: int, head_dim: int, patches: int
) -> calibration.Measured:
    """Seconds of one tile's attention through `tile_attention` and through SDPA, as the
    tower's fused block calls them (encoders/siglip_fused.py), interleaved."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(patches, 3 * heads * head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    def sdpa() -> torch.Tensor:
        q, k, v = qkv.view(1, patches, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return out.transpose(1, 2).reshape(patches, heads * head_dim)

    paths = {"kernel": lambda: tile_attention(qkv, 1, heads, scale), "sdpa": sdpa}
    return [{"tokens": patches, **calibration.time_paths(paths)}]


def tile_attention(qkv: torch.Tensor, num_tiles: int, num_heads: int, scale: float) -> torch.Tensor:
    """Full attention within each tile of a vision tower: qkv [tiles * patches, 3 * hidden]
    (columns q|k|v, head, head_dim), float32 or bfloat16; returns [tiles * patches, hidden]
    (columns head, head_dim). Each tile is one sequence whose tokens form one bidirectional
    span, its K/V one block of a cache built for the call. Needs `prefill_available()`."""
    rows, width = qkv.shape
    patches, head_dim = rows // num_tiles, width // (3 * num_heads)
    view = qkv.view(rows, 3, num_heads, head_dim)
    cache = view[:, 1:].permute(1, 2, 0, 3).contiguous()  # [2 (k, v), heads, rows, head_dim]
    out = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype)
    lens = torch.full((num_tiles,), patches, dtype=torch.int32)
    torch.ops.vlmserve_prefill.prefill_attention(
        out, view[:, 0], cache, torch.arange(num_tiles, dtype=torch.int32)[:, None],
        torch.arange(0, rows, patches, dtype=torch.int32), lens, lens, patches, scale, 0,
        torch.full((rows,), patches, dtype=torch.int32),  # every key of its tile
    )  # fmt: skip
    return out.view(rows, num_heads * head_dim)


@dataclass
class PagedRows:
    """Sequences for one kernel: int32 on the host."""

    block_tables: torch.Tensor  # [S, max_blocks]
    query_starts: torch.Tensor  # [S] first flat token index
    query_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    block_size: int


def paged_rows(batch: AttentionBatch, starts: list[int], members: list[int]) -> PagedRows | None:
    """The kernel inputs of the sequences `members` (None when there are none)."""
    if not members:
        return None
    tables = [batch.block_tables[i] for i in members]
    width = max(map(len, tables))
    # One buffer, each table copied into its row in C: 64 tables of 80 blocks in ~60 us,
    # five times faster than torch.tensor over padded lists (a tensor per table: ~10 us each).
    padded = array.array("i", bytes(4 * width * len(tables)))
    for row, table in enumerate(tables):
        padded[row * width : row * width + len(table)] = array.array("i", table)
    return PagedRows(
        torch.frombuffer(padded, dtype=torch.int32).view(len(tables), width),
        torch.tensor([starts[i] for i in members], dtype=torch.int32),
        torch.tensor([batch.query_lens[i] for i in members], dtype=torch.int32),
        torch.tensor([batch.context_lens[i] for i in members], dtype=torch.int32),
        batch.block_size,
    )


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    paged: PagedRows | None = None  # decodes and verifications
    prefill: PagedRows | None = None  # prefills and chunks on a prefix (prefill kernel)
    window: int = 0  # > 0: the sliding window
    key_ends: torch.Tensor | None = None  # [num_tokens] int32, with spans (else empty)


def key_ends(batch: AttentionBatch, starts: list[int]) -> torch.Tensor:
    """Per flat token, the end of the keys it sees: its position + 1, or its span's end."""
    if batch.spans is None or not any(batch.spans):
        return torch.empty(0, dtype=torch.int32)
    ends = []
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        seq = list(range(ctx - q_len + 1, ctx + 1))
        for start, end in batch.seq_spans(i):
            for pos in range(max(start, ctx - q_len), min(end, ctx)):
                seq[pos - (ctx - q_len)] = end
        ends += seq
    assert len(ends) == sum(batch.query_lens) and len(starts) == len(batch.query_lens)
    return torch.tensor(ends, dtype=torch.int32)


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, prefill_kernel: bool = True) -> None:
        super().__init__()
        why = prefill_available() if prefill_kernel else None
        if why is not None:
            raise ValueError(f"the CPU prefill attention kernel did not build: {why}")
        self.prefill_kernel = prefill_kernel
        self.name = "cpu" if prefill_kernel else "cpu-sdpa"
        self.decode_amx = False  # decodes on the kernel's AMX path (`decode_amx_wins`)
        self.decode_spread = True  # its vector path's prefetch (`decode_spread_wins`)

    def use_sdpa_for_prefills(self) -> None:
        """Prefills through torch's SDPA from the next step's metadata on ("cpu-sdpa")."""
        self.prefill_kernel = False
        self.name = "cpu-sdpa"

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> CpuAttentionMetadata:
        window = batch.sliding_window or 0
        if not self.prefill_kernel:
            meta, starts, small = self._split(batch, slot_mapping, device)
            # Short chunks with spans: the torch path (the decode kernel has no spans).
            spans = [i for i in small if batch.seq_spans(i)]
            meta.groups += [_group([i], batch, starts, device) for i in spans]
            small = [i for i in small if not batch.seq_spans(i)]
            return CpuAttentionMetadata(
                meta.slot_mapping, meta.groups, meta.fresh, paged_rows(batch, starts, small),
                window=window,
            )  # fmt: skip
        starts = [0, *itertools.accumulate(batch.query_lens)][:-1]
        short = [q <= SMALL_QUERY_LEN and not batch.seq_spans(i)
                 for i, q in enumerate(batch.query_lens)]  # fmt: skip
        small = [i for i, is_short in enumerate(short) if is_short]
        large = [i for i, is_short in enumerate(short) if not is_short]
        return CpuAttentionMetadata(
            slot_mapping.to(device), [], [],
            paged_rows(batch, starts, small), paged_rows(batch, starts, large),
            window, key_ends(batch, starts),
        )  # fmt: skip

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        head_dim: int,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        scale: float,
    ) -> torch.Tensor | None:
        """Attention from the qkv projection's output [tokens, (heads + 2 kv_heads) *
        head_dim]: QK-norm (`norms`, Gemma 3), RoPE and the K/V write as one op
        (fused_ops.qkv_to_cache), then the kernels, which read K/V from the cache. At a
        decode step of a small model the separate ops cost more than the attention itself.
        None where that does not apply (torch's SDPA reads k and v, the cache's dtype
        differs, no fused kernels): the caller takes the unfused path."""
        if (
            metadata.fresh or metadata.groups or qkv.dtype != kv_cache.dtype
            or qkv.stride(-1) != 1 or not fused_ops.can_fuse(qkv)
        ):  # fmt: skip
            return None
        q = fused_ops.qkv_to_cache(
            qkv, num_heads, head_dim, norms, cos, sin, kv_cache, metadata.slot_mapping
        )
        out = torch.empty_like(q)
        self._attend(out, q, None, None, kv_cache, metadata, scale)
        return out

    def _attend(self, out, q, k, v, kv_cache, metadata: CpuAttentionMetadata, scale) -> None:
        super()._attend(out, q, k, v, kv_cache, metadata, scale)
        # Each op is looked up only when used: "cpu-sdpa" never loads the prefill kernel.
        if metadata.paged is not None:
            p = metadata.paged
            torch.ops.vlmserve.paged_attention(
                out, q, kv_cache, p.block_tables, p.query_starts, p.query_lens,
                p.context_lens, p.block_size, scale, metadata.window, self.decode_amx,
                self.decode_spread,
            )  # fmt: skip
        if metadata.prefill is not None:
            p = metadata.prefill
            ends = (
                metadata.key_ends
                if metadata.key_ends is not None and len(metadata.key_ends)
                else None
            )
            torch.ops.vlmserve_prefill.prefill_attention(
                out, q, kv_cache, p.block_tables, p.query_starts, p.query_lens,
                p.context_lens, p.block_size, scale, metadata.window, ends,
            )  # fmt: skip
