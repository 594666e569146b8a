"""Loading HF checkpoint folders: families, shards, tied embeddings, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoders.weights import CheckpointError, load_tensors
from kernels.attention import TorchPagedAttention
from tests.helpers import make_engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.loader import load_model
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint


def load(path):
    return load_model(str(path), torch.float32, torch.device("cpu"), TorchPagedAttention())


def test_unsupported_architecture_is_named(tmp_path):
    config = {"model_type": "mamba", "architectures": ["MambaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture.*MambaForCausalLM"):
        load(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)


def test_missing_and_mismatched_weights_name_tensor_and_shapes(tmp_path):
    path = make_text_checkpoint(tmp_path / "m", "llama")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    good = tensors[name]
    tensors[name] = torch.zeros(good.shape[0] + 1, good.shape[1])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name}.*\(129, 64\).*\(128, 64\)"):
        load(path)
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"missing weight '{name}'"):
        load(path)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    single = make_text_checkpoint(tmp_path / "single", "qwen2", seed=3)
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(load_tensors(tmp_path / "sharded")) == len(load_tensors(single))
    a, b = load(single).decoder, load(tmp_path / "sharded").decoder
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.slow
def test_tied_qwen2_embeddings_serve_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_text_checkpoint(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    loaded = load(path)
    assert loaded.decoder.lm_head is None
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)("how many circles are there", return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(ids.input_ids, max_new_tokens=16, do_sample=False)[0, -16:].tolist()
    engine = make_engine(path, num_blocks=32, block_size=8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([Request(prompt="how many circles are there", sampling=params)])
    assert out.token_ids == ref
