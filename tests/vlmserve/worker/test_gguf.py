"""GGUF files served directly (`--model FILE.gguf`): small files written from random HF
checkpoints as llama.cpp's converter writes them, checked against transformers' own GGUF
path (an independent name map, un-permutation and dequantization) and against the HF
checkpoint they came from. The real Gemma 3 270M file: tests/real/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoders.weights import CheckpointError, load_tensors, read_config
from tests.fixtures.gguf_files import write_gguf
from vlmserve.worker.models.gguf_checkpoint import INFO_FILE, find_gguf, resolve_model_path
from vlmserve.worker.models.gguf_weights import read_gguf_tensors
from vlmserve.worker.models.random_checkpoint import make_gemma3_checkpoint, make_text_checkpoint

pytest.importorskip("gguf")

ARCHS = ("llama", "qwen2", "gemma3")


def _hf_checkpoint(arch: str, path):
    if arch == "gemma3":  # head_dim 16: the file's 1/sqrt(head_dim) query scale, as llama.cpp
        return make_gemma3_checkpoint(path, text_only=True, query_pre_attn_scalar=16)
    return make_text_checkpoint(path, arch, hidden=64, kv_heads=2)


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    """(arch, HF checkpoint folder, GGUF file written from it)."""
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf = _hf_checkpoint(request.param, root / "hf")
    return request.param, hf, write_gguf(hf, root / "model.gguf", request.param)


def _transformers_reference(hf_dir, gguf_file) -> torch.nn.Module:
    """The HF checkpoint's model with the weights transformers' GGUF path reads from the
    file (load_gguf_checkpoint: its own name map, q/k un-permutation, norm offsets)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    loaded = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
    missing = model.load_state_dict(loaded["tensors"], strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model


def test_tensors_equal_transformers_dequantization_bit_for_bit(converted):
    arch, hf, gguf_file = converted
    ours = read_gguf_tensors(gguf_file, read_config(hf))
    reference = _transformers_reference(hf, gguf_file).state_dict()
    assert ours, "no tensors read"
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    # and every weight is the HF checkpoint's own (exact where stored as float32, within
    # the legacy blocks' rounding elsewhere): a wrong name, permutation or offset is not
    original = load_tensors(hf)
    assert set(ours) == set(original) - {"lm_head.weight"} or set(ours) == set(original)
    for name, tensor in ours.items():
        want = original[name].float()
        tol = 1e-7 if tensor.dim() == 1 else 0.15 * want.abs().max().item()
        assert (tensor - want).abs().max().item() <= tol, name


@pytest.mark.slow
def test_engine_on_the_file_is_greedy_token_exact_with_transformers(converted):
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    arch, hf, gguf_file = converted
    reference = _transformers_reference(hf, gguf_file)
    model = ModelConfig(str(gguf_file), tokenizer=str(hf), dtype="float32", quantization="none")
    engine = Engine(EngineConfig(model))
    prompts = [[5, 17, 42, 9, 33, 7], [100, 3, 64, 12]]
    requests = [
        Request(prompt_token_ids=p, sampling=SamplingParams(max_tokens=12, temperature=0.0))
        for p in prompts
    ]
    outputs = engine.generate(requests)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference.generate(
                ids, max_new_tokens=12, do_sample=False, min_new_tokens=12, eos_token_id=None
            )
        assert list(out.token_ids) == want[0, len(prompt) :].tolist(), arch


def test_sidecar_config_and_tokenizer(converted):
    arch, hf, gguf_file = converted
    folder = resolve_model_path(str(gguf_file), tokenizer=str(hf))
    config = read_config(folder)
    original = read_config(hf)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert config[key] == original[key], key
    assert config["num_key_value_heads"] == original["num_key_value_heads"]
    if arch == "gemma3":
        assert config["sliding_window"] == original["sliding_window"]
        assert config["query_pre_attn_scalar"] == 16
    info = json.loads((Path(folder) / INFO_FILE).read_text())
    assert info["architecture"] == arch
    assert set(info["tensor_types"]) == {"F32", "Q8_0", "Q4_0", "Q5_0"}
    assert resolve_model_path(str(gguf_file), tokenizer=str(hf)) == folder  # cached


def test_unsupported_architecture_and_ambiguous_folders_are_refused(tmp_path, converted):
    import gguf

    bad = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(bad), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="'phi3' is not served.*gemma3, llama, qwen2"):
        resolve_model_path(str(bad))
    twice = tmp_path / "two"
    twice.mkdir()
    (twice / "a.gguf").write_bytes(b"")
    (twice / "b.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="several GGUF files"):
        find_gguf(twice)
    _, hf, _ = converted
    with pytest.raises(ValueError, match="--tokenizer applies to GGUF files"):
        resolve_model_path(str(hf), tokenizer=str(hf))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a"):
        resolve_model_path(str(garbage))


def test_info_door_prints_what_the_file_holds(converted, capsys):
    from vlmserve.cli.main import main

    arch, hf, gguf_file = converted
    assert main(["info", "--model", str(gguf_file), "--tokenizer", str(hf), "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["gguf"] == str(Path(gguf_file).resolve())
    assert model["layers"] == read_config(hf)["num_hidden_layers"]
    counts = dict(part.split(":") for part in model["gguf_blocks"].split())
    assert sum(map(int, counts.values())) == len(read_gguf_tensors(gguf_file, read_config(hf)))
