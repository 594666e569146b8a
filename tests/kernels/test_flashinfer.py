"""The FlashInfer backend. FlashInfer itself runs on a GPU only (the `gpu` tests here and
in test_gpu.py); on a CPU its page tables, HND cache layout and K/V write are checked by
running the backend's real `forward` over a plain-torch implementation of FlashInfer's
documented wrapper contract (`plan` a CSR page table, then `run(q, paged_kv_cache)`), so
a wrong indptr, block list or last-page length fails here before any GPU sees it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels import flashinfer_attention
from kernels.backends import select_backend
from tests.kernels.test_attention import check_paged_attention

NAN = float("nan")


class TorchFlashInferContract:
    """FlashInfer's batch wrapper contract in plain torch: HND pages
    [num_pages, 2, kv_heads, page_size, head_dim]; a sequence's keys are its pages in
    kv_indices order, all slots of each but the last, `last_page_len` of that; its queries
    are the last rows of its context (causal, aligned bottom-right). Decode's plan has no
    qo_indptr (one row per sequence)."""

    def plan(self, *args, causal: bool = False, sm_scale: float | None = None, **_) -> None:
        if len(args) == 7:  # decode: (indptr, indices, last_page_len, Hq, Hkv, D, page)
            args = (torch.arange(len(args[0]), dtype=torch.int32), *args)
        self.qo, self.indptr, self.indices, self.last = (a.tolist() for a in args[:4])
        self.scale = sm_scale

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(len(self.qo) - 1):
            pages = self.indices[self.indptr[i] : self.indptr[i + 1]]
            size = cache.shape[3]
            ctx = (len(pages) - 1) * size + self.last[i]
            k, v = (cache[pages, j].transpose(0, 1).flatten(1, 2)[:, :ctx] for j in (0, 1))
            rows = q[self.qo[i] : self.qo[i + 1]].transpose(0, 1)  # [H, q_len, D]
            q_len = rows.shape[1]
            allowed = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + ctx - q_len
            o = F.scaled_dot_product_attention(
                rows, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True
            )
            out[self.qo[i] : self.qo[i + 1]] = o.transpose(0, 1)
        return out


def contract_backend() -> flashinfer_attention.FlashInferPagedAttention:
    backend = flashinfer_attention.FlashInferPagedAttention()
    backend._decode, backend._prefill = TorchFlashInferContract(), TorchFlashInferContract()
    return backend


@pytest.mark.parametrize("heads, kv_heads, block", [(4, 2, 16), (8, 1, 32), (4, 4, 16)])
def test_page_tables_layout_and_kv_write_match_sdpa(heads, kv_heads, block):
    shapes = [(0, 1), (block - 1, 1), (block, 1), (70, 1), (30, 5), (40, 21), (0, 19)]
    check_paged_attention(
        torch.device("cpu"), heads, kv_heads, block, contract_backend(), shapes, 64, fill=NAN
    )


def test_page_table_last_page_lengths():
    batch = flashinfer_attention.AttentionBatch([1, 3, 16], [1, 35, 16], [[7], [2, 5, 9], [4]], 16)
    table = flashinfer_attention.page_table(batch, [0, 1, 2])
    assert table.qo_indptr == [0, 1, 4, 20]
    assert table.kv_indptr == [0, 1, 4, 5] and table.kv_indices == [7, 2, 5, 9, 4]
    assert table.last_page_len == [1, 3, 16]


def test_flashinfer_is_gpu_only_and_16_bit():
    assert "CUDA" in flashinfer_attention.available(torch.device("cpu"))
    why = flashinfer_attention.available(torch.device("cuda"), torch.float32)
    assert why is not None and "float16" in why
    why = flashinfer_attention.available(torch.device("cuda"), torch.bfloat16, head_dim=16)
    assert why is not None and "head dims" in why  # its Hopper kernels do not build at 16
    assert select_backend(torch.device("cpu")).name in ("cpu", "torch")  # never auto on CPU


def test_auto_on_a_gpu_takes_triton_where_its_blocks_fit():
    """Chosen on the host (no GPU needed): Triton under auto at a block size its kernels
    take; at 4, FlashInfer where it can run the head dim, else torch; Triton by name at 4
    is refused at start, with the reason."""
    cuda = torch.device("cuda")
    assert select_backend(cuda, "auto", torch.bfloat16, 128, 16).name == "triton"
    fallback = "flashinfer" if flashinfer_attention.available(cuda) is None else "torch"
    assert select_backend(cuda, None, torch.bfloat16, 128, 4).name == fallback
    assert select_backend(cuda, None, torch.bfloat16, 16, 4).name == "torch"  # head dim 16
    with pytest.raises(ValueError, match="power-of-two block size >= 16, not 4"):
        select_backend(cuda, "triton", torch.bfloat16, 128, 4)


def fake_flashinfer(decode_plan, prefill_plan):
    """A module with FlashInfer's two wrapper names whose `plan`s have the given bodies'
    signatures (and FlashInfer's `run(q, paged_kv_cache)`)."""

    def wrapper(plan):
        return type("Wrapper", (), {"plan": plan, "run": lambda self, q, paged_kv_cache: q})

    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=wrapper(decode_plan),
        BatchPrefillWithPagedKVCacheWrapper=wrapper(prefill_plan),
    )


def test_api_check_takes_named_or_catch_all_keywords_and_names_a_difference():
    def decode(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        q_data_type="float16",
        kv_data_type=None,
        sm_scale=None,
    ): ...

    def decode_kwargs(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *deprecated,
        **kwargs,
    ): ...

    def prefill(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
    ): ...

    def prefill_swapped(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_kv_heads,
        num_qo_heads,
        head_dim_qk,
        page_size,
        **kwargs,
    ): ...

    def decode_no_scale(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        q_data_type="float16",
        kv_data_type=None,
    ): ...

    assert flashinfer_attention.api_mismatch(fake_flashinfer(decode, prefill)) is None
    assert flashinfer_attention.api_mismatch(fake_flashinfer(decode_kwargs, prefill)) is None
    swapped = flashinfer_attention.api_mismatch(fake_flashinfer(decode, prefill_swapped))
    assert "BatchPrefillWithPagedKVCacheWrapper" in swapped and "num_kv_heads" in swapped
    no_scale = flashinfer_attention.api_mismatch(fake_flashinfer(decode_no_scale, prefill))
    assert "sm_scale" in no_scale


def test_installed_flashinfer_takes_the_backends_calls():
    """Where FlashInfer is installed (the GPU device's bundle, `pip install .[gpu]`), its
    wrappers take the calls `_plan` and `forward` make, on the host, before any build."""
    flashinfer = pytest.importorskip("flashinfer")
    assert flashinfer_attention.api_mismatch(flashinfer) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_sdpa_on_cuda(dtype):
    why = flashinfer_attention.available(torch.device("cuda"), dtype)
    if why is not None:
        pytest.skip(why)
    for heads, kv_heads, block in [(4, 2, 16), (8, 1, 32), (16, 2, 16)]:
        shapes = [(0, 1), (block - 1, 1), (3000, 1), (70, 1), (30, 5), (40, 21), (0, 300)]
        check_paged_attention(
            torch.device("cuda"), heads, kv_heads, block,
            flashinfer_attention.FlashInferPagedAttention(), shapes, 128, fill=NAN, dtype=dtype,
        )  # fmt: skip
