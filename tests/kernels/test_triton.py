"""The Triton kernels against their plain-torch references. Without a GPU they run in
Triton's interpreter (numpy on the CPU tensors), so the shapes are few and small but cover
the space the kernels branch on: ragged contexts from 1 to 4,000 tokens, GQA ratios
1/2/4/8, head dims 64/128, block sizes 16/32. Every unwritten cache slot holds NaN, so a
read outside a sequence's block table and context poisons its output."""

from __future__ import annotations

import pytest
import torch

# Without a GPU: TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported.
from kernels import triton_attention, triton_ops
from kernels.attention import TorchPagedAttention
from kernels.cpu_attention import PagedRows
from kernels.fused_ops import rms_norm_eager, rope_eager
from tests.kernels.test_attention import check_paged_attention, run_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if triton_attention.available(DEVICE) is not None:
    pytest.skip(triton_attention.available(DEVICE), allow_module_level=True)
NAN = float("nan")


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, seed",
    [
        pytest.param(4, 4, 64, 16, 0, marks=pytest.mark.slow),
        (4, 2, 128, 32, 1),  # the fast lane's case (Triton's interpreter on a CPU)
        pytest.param(8, 2, 64, 32, 2, marks=pytest.mark.slow),
        pytest.param(8, 1, 128, 16, 3, marks=pytest.mark.slow),
    ],
)  # GQA ratios 1, 2, 4, 8
def test_paged_attention_matches_sdpa(heads, kv_heads, dim, block, seed):
    """Two steps over scattered blocks: decodes over ragged contexts (1 token, a block
    boundary, a few hundred), a 5-row verification, a chunk on a prefix, a fresh prefill."""
    gen = torch.Generator().manual_seed(seed)
    ctx = int(torch.randint(block + 1, 400, (1,), generator=gen))
    shapes = [(0, 1), (block - 1, 1), (ctx, 1), (ctx // 3, 5), (40, 21), (0, 19)]
    check_paged_attention(
        DEVICE, heads, kv_heads, block, triton_attention.TritonPagedAttention(), shapes, dim,
        seed, fill=NAN,
    )  # fmt: skip


@pytest.mark.slow
def test_long_context_decode_splits_and_merges():
    """One sequence decoding at 4,000 tokens: split-K over the context, then the merge. The
    prefix is written by hand (a 4,000-row prefill is slow in the interpreter)."""
    heads, kv_heads, dim, block, context = 8, 2, 64, 16, 4000
    gen = torch.Generator().manual_seed(4)
    backend = triton_attention.TritonPagedAttention()
    num_blocks = -(-(context + 1) // block) + 4
    cache = torch.full(backend.kv_cache_shape(num_blocks, block, kv_heads, dim), NAN)
    table = torch.randperm(num_blocks, generator=gen)[: -(-(context + 1) // block)]
    q, k, v = (torch.randn(context + 1, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    pos = torch.arange(context)
    slots = table[pos // block] * block + pos % block
    cache[0].index_copy_(1, slots, k[:context].transpose(0, 1))
    cache[1].index_copy_(1, slots, v[:context].transpose(0, 1))
    batch = triton_attention.AttentionBatch([1], [context + 1], [table.tolist()], block)
    assert backend.build_metadata(batch, torch.zeros(1), DEVICE).num_splits > 1
    run_step(backend, cache.to(DEVICE), [table.tolist()], [(context, context + 1)], [(q, k, v)],
             block)  # fmt: skip


def test_decode_splits_cover_the_context_in_whole_blocks():
    for ctx, seqs, block in [(1, 1, 16), (4000, 1, 16), (4000, 64, 32), (32768, 1, 16)]:
        splits, split_len = triton_attention.decode_splits(ctx, seqs, 2, block)
        assert split_len % block == 0 and splits * split_len >= ctx
        assert (splits - 1) * split_len < ctx  # no split starts past the end
        assert split_len >= min(ctx, triton_attention.MIN_SPLIT_TOKENS) or splits == 1


def test_empty_context_row_gives_zeros():
    """A padded CUDA-graph row (context 0, block table of block 0) reads nothing and
    outputs zeros beside a real row; the real row equals the torch backend's."""
    heads, kv_heads, dim, block = 4, 2, 64, 16
    cache = torch.full((2, kv_heads, 4 * block, dim), NAN)
    cache[:, :, block : 2 * block] = torch.randn(2, kv_heads, block, dim)
    q = torch.randn(2, heads, dim)
    rows = PagedRows(
        torch.tensor([[1], [0]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.ones(2, dtype=torch.int32), torch.tensor([block, 0], dtype=torch.int32), block,
    )  # fmt: skip
    out = torch.full_like(q, NAN)
    triton_attention.paged_decode(out, q, cache.to(DEVICE), rows, 3, block, dim**-0.5)
    torch.testing.assert_close(out[1], torch.zeros(heads, dim))
    torch_backend = TorchPagedAttention()
    batch = triton_attention.AttentionBatch([1], [block], [[1]], block)
    meta = torch_backend.build_metadata(batch, torch.tensor([2 * block - 1]), DEVICE)
    k, v = cache[0, :, 2 * block - 1][None], cache[1, :, 2 * block - 1][None]
    expected = torch_backend.forward(q[:1], k, v, cache.clone(), meta, dim**-0.5)
    torch.testing.assert_close(out[:1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_matches_eager(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(2, 5, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    expected_sum = x + residual
    expected = rms_norm_eager(expected_sum, weight, 1e-6)
    out, summed = triton_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(summed, expected_sum)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (4, 4, 128)])
def test_rope_and_cache_write_match_eager(heads, kv_heads, dim):
    """q and k as views into one qkv row (the decoder's layout), written through the slot
    mapping; a negative slot writes nothing; q and k are rotated in place."""
    gen = torch.Generator().manual_seed(dim)
    tokens, slots_total = 5, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    angles = torch.randn(tokens, dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([7, 0, -1, 31, 12])
    exp_q, exp_k = rope_eager(q, cos, sin), rope_eager(k, cos, sin)
    expected = torch.full((2, kv_heads, slots_total, dim), NAN)
    keep = slots >= 0
    expected[0].index_copy_(1, slots[keep], exp_k[keep].transpose(0, 1))
    expected[1].index_copy_(1, slots[keep], v[keep].transpose(0, 1))
    cache = torch.full((2, kv_heads, slots_total, dim), NAN)
    triton_ops.rope_and_cache_write(q, k, v, cos, sin, slots, cache)
    torch.testing.assert_close(q, exp_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, exp_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.slow
def test_engine_with_the_triton_backend_gives_the_torch_tokens(llava_ov_path, random_image):
    """The whole runner path on the Triton backend (fused RoPE + K/V write, decode and
    extend kernels; in the interpreter on a CPU): greedy tokens equal the torch backend's
    for two image requests batched together."""
    from tests.helpers import chat, greedy, make_engine

    texts = [(3, "where is the star"), (4, "count")]
    requests = [chat([random_image(seed, 70, 40)], text, greedy(4)) for seed, text in texts]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            llava_ov_path, num_blocks=32, block_size=16, budget=512, max_num_seqs=4,
            device=DEVICE.type, dtype="float32", attention_backend=backend,
        )  # fmt: skip
        assert engine.runner.backend.name == backend
        tokens[backend] = [out.token_ids for out in engine.generate(requests)]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.slow
def test_decode_graph_buffers_and_padding_give_the_unpadded_logits(llava_ov_path):
    """The CUDA-graph decode path minus the capture (vlmserve/worker/cuda_graphs.py with
    capture=False): a 3-sequence decode step copied into the persistent buffers of the
    4-row bucket, the 4th row padded (slot -1, context 0), gives the logits of the plain
    step; the padded row wrote no K/V."""
    from tests.helpers import make_engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams
    from vlmserve.worker.cuda_graphs import DecodeGraphs

    engine = make_engine(
        llava_ov_path, num_blocks=16, block_size=16, budget=64, max_num_seqs=4,
        device=DEVICE.type, dtype="float32", attention_backend="triton",
    )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for ids in ([5, 6, 7], [8, 9, 10, 11, 12], list(range(20, 39))):
        engine.add_request(Request(prompt_token_ids=ids, sampling=params))
    engine.step()  # the prefills
    engine.step()  # a first decode
    plan = engine.scheduler.schedule()
    runner = engine.runner
    inputs = runner.prepare(plan)
    assert inputs.metadata.extend is None and inputs.metadata.decode is not None
    caches = [c.clone() for c in runner.kv_caches]
    expected = runner.run(inputs)
    written = [c.clone() for c in runner.kv_caches]
    for c, saved in zip(runner.kv_caches, caches, strict=True):
        c.copy_(saved)
    graphs = DecodeGraphs(runner.model.decoder, runner.kv_caches, 4, 64, 16, capture=False)
    assert graphs.fits(inputs.metadata)
    hidden = graphs.run(inputs.token_ids, inputs.positions, inputs.metadata)
    logits = runner.model.decoder.compute_logits(hidden[inputs.sample_rows])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for c, w in zip(runner.kv_caches, written, strict=True):
        assert torch.equal(c, w)  # the same K/V, and nothing for the padded row
