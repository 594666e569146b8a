"""Tensor-parallel sharding without processes: which heads, KV heads and MLP rows each
rank holds, checked against the unsharded checkpoint's tensors."""

from __future__ import annotations

import pytest
import torch

from encoders.weights import load_tensors
from kernels.attention import TorchPagedAttention
from vlmserve.worker.models.decoder import DecoderConfig
from vlmserve.worker.models.loader import load_model
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint
from vlmserve.worker.models.rope import RopeConfig
from vlmserve.worker.parallel.sharding import TPShard, check_tensor_parallel, kv_replicas


def shape(heads: int, kv_heads: int, intermediate: int = 96) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=32, hidden_size=64, intermediate_size=intermediate, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-6,
        rope=RopeConfig(head_dim=8), max_position_embeddings=64,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (6, 2, 4, "does not divide the 6 attention heads"),
        (24, 8, 3, "one must divide the other"),  # 3 ranks over 8 KV heads
        (48, 8, 16, None),  # 16 = 2 x 8: each KV head on 2 ranks
        (48, 8, 12, "one must divide the other"),  # past 8 KV heads, 12 is no multiple
        (8, 8, 8, None),
        (8, 2, 8, None),  # each KV head on 4 ranks
    ],
)
def test_which_sizes_split_a_model(heads, kv_heads, size, message):
    if message is None:
        check_tensor_parallel(shape(heads, kv_heads), size)
    else:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(shape(heads, kv_heads), size)
    with pytest.raises(ValueError, match="intermediate_size=66"):
        check_tensor_parallel(shape(8, 2, intermediate=66), 4)


def test_kv_heads_split_then_replicate():
    # GQA-8 on 16 ranks: two copies of every KV head (article §16), rank r reads r // 2.
    cfg = shape(32, 8)
    assert [TPShard(r, 4).kv_head_range(8) for r in range(4)] == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)
    ]  # fmt: skip
    assert [TPShard(r, 16).kv_head_range(8).start for r in range(16)] == [r // 2 for r in range(16)]
    assert kv_replicas(8, 16) == 2 and kv_replicas(8, 4) == 1
    local = TPShard(3, 16).local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 6)
    # Its two query heads (6, 7) belong to KV head 7 // (32 // 8) = 1 = 3 // 2.
    assert TPShard(3, 16).kv_head_range(8) == range(1, 2)


@pytest.mark.parametrize(("kind", "kv_heads", "size"), [("qwen2", 2, 2), ("llama", 1, 2)])
def test_each_rank_loads_its_rows_of_the_checkpoint(tmp_path, kind, kv_heads, size):
    """Shapes and contents per rank: q/k/v (with Qwen2's biases) and gate/up by rows of
    the rank's heads / MLP rows, o_proj and down_proj by columns; embeddings, norms and
    the LM head whole. With one KV head and 2 ranks, both hold it (replication)."""
    path = make_text_checkpoint(tmp_path, kind, heads=4, kv_heads=kv_heads)
    backend = TorchPagedAttention()
    full = load_model(str(path), torch.float32, torch.device("cpu"), backend)
    tensors = load_tensors(str(path))
    cfg = full.decoder.cfg
    d, inter = cfg.head_dim, cfg.intermediate_size // size
    q_rows = cfg.num_heads // size * d
    for rank in range(size):
        shard = TPShard(rank, size)
        decoder = load_model(str(path), torch.float32, torch.device("cpu"), backend, shard).decoder
        kv = shard.kv_head_range(cfg.num_kv_heads)
        assert decoder.cfg.num_kv_heads == len(kv) == max(1, kv_heads // size)
        attn, mlp = decoder.layers[1].self_attn, decoder.layers[1].mlp
        assert attn.qkv_proj.weight.shape == (q_rows + 2 * len(kv) * d, cfg.hidden_size)
        assert attn.o_proj.weight.shape == (cfg.hidden_size, q_rows)
        assert mlp.gate_up_proj.weight.shape == (2 * inter, cfg.hidden_size)
        assert mlp.down_proj.weight.shape == (cfg.hidden_size, inter)
        base = "model.layers.1."
        q, k, v = attn.qkv_proj.weight.split([q_rows, len(kv) * d, len(kv) * d])
        heads = slice(rank * q_rows, (rank + 1) * q_rows)
        kv_rows = slice(kv.start * d, kv.stop * d)
        assert torch.equal(q, tensors[base + "self_attn.q_proj.weight"][heads])
        assert torch.equal(k, tensors[base + "self_attn.k_proj.weight"][kv_rows])
        assert torch.equal(v, tensors[base + "self_attn.v_proj.weight"][kv_rows])
        if kind == "qwen2":
            bias = tensors[base + "self_attn.k_proj.bias"][kv_rows]
            assert torch.equal(attn.qkv_proj.bias[q_rows : q_rows + len(kv) * d], bias)
        assert torch.equal(attn.o_proj.weight, tensors[base + "self_attn.o_proj.weight"][:, heads])
        rows = slice(rank * inter, (rank + 1) * inter)
        gate, up = mlp.gate_up_proj.weight.split(inter)
        assert torch.equal(gate, tensors[base + "mlp.gate_proj.weight"][rows])
        assert torch.equal(up, tensors[base + "mlp.up_proj.weight"][rows])
        assert torch.equal(mlp.down_proj.weight, tensors[base + "mlp.down_proj.weight"][:, rows])
        assert torch.equal(decoder.embed_tokens.weight, full.decoder.embed_tokens.weight)
        assert torch.equal(decoder.norm.weight, full.decoder.norm.weight)
