"""Presets, HF config.json stand-ins and the on-the-spot CPU measurement."""

import json

import pytest

from search.costmodel.presets import (
    MODELS,
    ModelShape,
    get_accelerator,
    get_cache_precision,
    get_encoder,
    get_model,
    get_weight_precision,
    gpu_preset,
    measure_cpu,
)

# Llama-3-8B's published config.json (the keys the loader reads).
LLAMA3_8B_CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_presets_named_in_the_issue_exist():
    for name in ("llama-2-7b", "llama-3-8b", "mistral-7b", "llama-3-70b", "mha-7b", "qwen2-7b"):
        assert get_model(name).name == name
    for name in ("siglip-so400m-14-384", "siglip-base-16-224", "siglip-base-16-512"):
        assert get_encoder(name).name == name
    for name in ("a100-80gb", "h100-sxm", "h200", "l40s", "b200"):
        assert get_accelerator(name).name == name
    assert [get_weight_precision(n).bytes_per_element for n in ("bf16", "fp8", "int8", "int4")] == [
        2,
        1,
        1,
        0.5,
    ]
    assert [get_cache_precision(n).bytes_per_element for n in ("bf16", "fp8")] == [2, 1]


def test_parameter_counts_match_the_article():
    # §3: Llama-3-8B "8.03×10⁹"; §8: "7B full MHA, bf16 both: 13.5 GB" (Llama-2-7B)
    assert MODELS["llama-3-8b"].num_params == pytest.approx(8.03e9, rel=0.01)
    assert 2 * MODELS["llama-2-7b"].num_params == pytest.approx(13.5e9, rel=0.01)


def test_hf_config_stands_in_for_a_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    for spec in (str(path), str(tmp_path)):  # the file or its folder
        model = get_model(spec)
        assert (model.num_layers, model.num_kv_heads, model.head_dim) == (32, 8, 128)
        assert model.num_params == pytest.approx(MODELS["llama-3-8b"].num_params)


def test_vlm_config_reads_text_config(tmp_path):
    vlm = {"model_type": "llava", "vision_config": {"hidden_size": 1152},
           "text_config": LLAMA3_8B_CONFIG}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(vlm))
    assert get_model(str(path)).hidden_size == 4096


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "cannot read"),
        (json.dumps({"hidden_size": 4096}), "lacks"),
        (json.dumps(LLAMA3_8B_CONFIG | {"num_key_value_heads": 5}), "multiple"),
    ],
)
def test_bad_hf_config_raises_value_error(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        get_model(str(path))


def test_unknown_names_raise_value_error():
    for call in (
        lambda: get_model("gpt-5"),
        lambda: get_model("/no/such/config.json"),
        lambda: get_encoder("clip"),
        lambda: get_accelerator("tpu"),
        lambda: get_weight_precision("int2"),
    ):
        with pytest.raises(ValueError):
            call()


def test_impossible_shapes_rejected():
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape("x", 0, 4096, 32, 8, 128, 14336, 32000)
    with pytest.raises(ValueError, match="multiple"):
        ModelShape("x", 32, 4096, 32, 6, 128, 14336, 32000)


def test_cpu_is_measured_on_the_spot():
    cpu = measure_cpu(budget_s=0.2)
    assert cpu.name == "cpu"
    assert cpu.flops_bf16 > 1e8 and cpu.mem_bandwidth > 1e8 and cpu.memory_bytes > 1e8
    assert cpu.peak_flops("fp8") == cpu.flops_bf16  # no fp8 units: falls back


@pytest.mark.parametrize(
    ("name", "preset"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("NVIDIA H200", "h200"), ("NVIDIA L40S", "l40s"), ("NVIDIA B200", "b200")],
)  # fmt: skip
def test_gpu_names_map_to_their_presets(name, preset):
    assert gpu_preset(name) == preset
    get_accelerator(preset)  # a preset by that name exists


def test_a_gpu_without_a_preset_is_refused_not_guessed():
    with pytest.raises(ValueError, match="GTX 1080.*presets: h200.*; do this"):
        gpu_preset("NVIDIA GeForce GTX 1080", "do this")


def test_gemma3_config_reads_its_sliding_layers(tmp_path):
    """From an HF Gemma 3 config.json: `layer_types` (or the 6-layer pattern) and window."""
    import json

    from search.costmodel.presets import get_model

    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 12,
            "intermediate_size": 128, "vocab_size": 256, "sliding_window": 64}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    model = get_model(str(path))
    assert (model.num_sliding_layers, model.sliding_window, model.head_dim) == (10, 64, 16)
    path.write_text(json.dumps({**text, "layer_types": layer_types * 2, "num_hidden_layers": 12}))
    assert get_model(str(path)).num_sliding_layers == 10
