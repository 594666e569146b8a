"""The FlashInfer attention backend: paged decode and prefill/extend through FlashInfer's
batch wrappers (`BatchDecodeWithPagedKVCacheWrapper`, `BatchPrefillWithPagedKVCacheWrapper`).

FlashInfer is GPU-only (the `gpu` extra, `flashinfer-python`): it is imported when a
backend is first planned, never at module import, so this module (its layout, its page
tables) loads and is tested on a CPU. Its cache layout is FlashInfer's HND paged one,
`[num_blocks, 2 (k, v), num_kv_heads, block_size, head_dim]`; a step's page table is
FlashInfer's CSR form (per sequence: its blocks, and how many slots of the last are used).
FlashInfer plans once per step on the host (work partitioning for its split-K) and then
runs every layer on that plan; the plan happens in the first layer's `forward`, on the
thread that runs the forward, so planning never races a step still in flight.
FlashInfer runs float16 / bfloat16 only. Sliding windows go to its `window_left`;
bidirectional spans to the prefill wrapper's `custom_mask` (the torch reference's
`allowed_keys`), each attention kind with its own wrappers and plan. GPU-only: the window
and span paths are written to FlashInfer's documented `plan` arguments, not run here.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBatch, allowed_keys, split_by_query_len

WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-K scratch (its documented example size)
DTYPES = (torch.float16, torch.bfloat16)
# The head dims FlashInfer's prefill kernels compile for (its Hopper kernels static_assert
# these; the first lent H200 failed to build them at 16).
HEAD_DIMS = (64, 128, 256)


def available(
    device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str | None:
    """None when the backend can run on `device` in `dtype` at `head_dim`; otherwise why not."""
    if device.type != "cuda":
        return f"FlashInfer runs on CUDA devices only, not {device.type}"
    if dtype is not None and dtype not in DTYPES:
        return f"FlashInfer runs float16 / bfloat16, not {dtype}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"FlashInfer's kernels take head dims {HEAD_DIMS}, not {head_dim}"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install 'vlmserve[gpu]')"
    return None


# The parameters `_plan` passes by position, in order (FlashInfer 0.5.3 to 0.7.4 take them
# so); the rest go by keyword.
DECODE_PLAN_ARGS = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads",
                    "head_dim", "page_size")  # fmt: skip
PREFILL_PLAN_ARGS = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                     "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads", "head_dim_qk",
                     "page_size")  # fmt: skip
PLAN_KEYWORDS = ("sm_scale", "q_data_type", "kv_data_type")


def api_mismatch(flashinfer) -> str | None:
    """None when the installed `flashinfer` module's wrappers take the calls this backend
    makes (checked on the host, before any kernel is built); otherwise what differs."""
    checks = [
        ("BatchDecodeWithPagedKVCacheWrapper", DECODE_PLAN_ARGS, PLAN_KEYWORDS),
        ("BatchPrefillWithPagedKVCacheWrapper", PREFILL_PLAN_ARGS, (*PLAN_KEYWORDS, "causal")),
    ]
    for name, positional, keywords in checks:
        wrapper = getattr(flashinfer, name)
        params = list(inspect.signature(wrapper.plan).parameters.values())[1:]  # past self
        names = tuple(p.name for p in params[: len(positional)])
        if names != positional:
            return f"{name}.plan takes {names}, not {positional}"
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            missing = set(keywords) - {p.name for p in params}
            if missing:
                return f"{name}.plan has no {sorted(missing)}"
        run = list(inspect.signature(wrapper.run).parameters)[1:3]
        if run != ["q", "paged_kv_cache"]:
            return f"{name}.run takes {run}, not (q, paged_kv_cache)"
    return None


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's CSR page table of some sequences, as host lists (moved at plan time)."""

    qo_indptr: list[int]  # [S + 1] query rows, prefix sums (extend only)
    kv_indptr: list[int]  # [S + 1] blocks, prefix sums into kv_indices
    kv_indices: list[int]  # the blocks, sequence after sequence
    last_page_len: list[int]  # [S] used slots of each sequence's last block, 1..block_size


@dataclass
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where the new K/V go
    decode_rows: torch.Tensor | None  # flat token index of each single-token query
    decode: PageTable | None
    extend_rows: torch.Tensor | None  # flat token indices of the longer queries, in order
    extend: PageTable | None
    # Sliding window (FlashInfer's window_left = window - 1; -1: none) and, with
    # bidirectional spans, the extend queries' mask ([q_len x ctx] per sequence, flat).
    window_left: int = -1
    custom_mask: torch.Tensor | None = None


def page_table(batch: AttentionBatch, members: list[int]) -> PageTable:
    qo, kv, indices, last = [0], [0], [], []
    for i in members:
        ctx, size = batch.context_lens[i], batch.block_size
        blocks = -(-ctx // size)
        indices += batch.block_tables[i][:blocks]
        qo.append(qo[-1] + batch.query_lens[i])
        kv.append(kv[-1] + blocks)
        last.append(ctx - (blocks - 1) * size)
    return PageTable(qo, kv, indices, last)


def write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """k, v [tokens, kv_heads, head_dim] into the HND paged cache at `slots`."""
    size = kv_cache.shape[3]
    blocks, offsets = slots // size, slots % size
    kv_cache[blocks, 0, :, offsets] = k
    kv_cache[blocks, 1, :, offsets] = v


class FlashInferPagedAttention:
    name = "flashinfer"

    def __init__(self) -> None:
        self._decode = self._prefill = None
        self._planned: FlashInferMetadata | None = None
        # Per window_left: its own wrappers and plan, so a model mixing sliding and global
        # layers plans each kind once per step (LayeredMetadata), not once per layer.
        self._kinds: dict[int, tuple] = {}

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, block_size, head_dim)

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> FlashInferMetadata:
        starts, decode, extend = split_by_query_len(batch)
        # Spans take the prefill wrapper's custom mask, a lone span token too.
        extend = sorted(extend + [i for i in decode if batch.seq_spans(i)])
        decode = [i for i in decode if not batch.seq_spans(i)]
        extend_rows = [r for i in extend for r in range(starts[i], starts[i] + batch.query_lens[i])]
        mask = None
        if extend and batch.spans is not None and any(batch.spans):
            mask = torch.cat([
                allowed_keys(
                    torch.arange(batch.query_lens[i]) + batch.context_lens[i] - batch.query_lens[i],
                    batch.context_lens[i], batch.sliding_window, batch.seq_spans(i),
                ).flatten()
                for i in extend
            ])  # fmt: skip
        window_left = -1 if batch.sliding_window is None else batch.sliding_window - 1
        return FlashInferMetadata(
            slot_mapping.to(device),
            torch.tensor([starts[i] for i in decode], device=device) if decode else None,
            page_table(batch, decode) if decode else None,
            torch.tensor(extend_rows, device=device) if extend else None,
            page_table(batch, extend) if extend else None,
            window_left, None if mask is None else mask.to(device),
        )  # fmt: skip

    def _make_wrappers(self, device: torch.device) -> None:
        import flashinfer

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")

    def _plan(self, meta: FlashInferMetadata, q: torch.Tensor, kv_cache: torch.Tensor, scale):
        if meta.window_left not in self._kinds:
            if self._decode is None or self._kinds:  # the first kind takes any given ones
                self._make_wrappers(q.device)
            self._kinds[meta.window_left] = (self._decode, self._prefill, None)
        self._decode, self._prefill, _ = self._kinds[meta.window_left]
        _, _, kv_heads, size, dim = kv_cache.shape

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        kinds = dict(sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
                     window_left=meta.window_left)  # fmt: skip
        if meta.decode is not None:
            t = meta.decode
            self._decode.plan(
                ints(t.kv_indptr), ints(t.kv_indices), ints(t.last_page_len),
                q.shape[1], kv_heads, dim, size, **kinds,
            )  # fmt: skip
        if meta.extend is not None:
            t = meta.extend
            self._prefill.plan(
                ints(t.qo_indptr), ints(t.kv_indptr), ints(t.kv_indices),
                ints(t.last_page_len), q.shape[1], kv_heads, dim, size,
                causal=meta.custom_mask is None, custom_mask=meta.custom_mask, **kinds,
            )  # fmt: skip
        self._planned = meta
        self._kinds[meta.window_left] = (self._decode, self._prefill, meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(kv_cache, metadata.slot_mapping, k, v)
        planned = self._kinds.get(metadata.window_left, (None, None, None))
        if metadata is not planned[2]:  # the step's first layer of this kind
            self._plan(metadata, q, kv_cache, scale)
        self._decode, self._prefill, _ = self._kinds[metadata.window_left]
        out = torch.empty_like(q)
        if metadata.decode_rows is not None:
            rows = metadata.decode_rows
            out[rows] = self._decode.run(q[rows], kv_cache)
        if metadata.extend_rows is not None:
            rows = metadata.extend_rows
            out[rows] = self._prefill.run(q[rows], kv_cache)
        return out
