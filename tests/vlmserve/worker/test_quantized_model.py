"""A decoder run from quantized weights (`--quantization`): a GGUF file's blocks as stored,
or any checkpoint quantized to int8 at load, against the same engine on the dequantized
(float32) weights."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from encoders.weights import CheckpointError
from kernels.attention import TorchPagedAttention
from kernels.malloc_tuning import thp_mode
from kernels.quant_linear import QuantLinear
from tests.fixtures.gguf_files import gguf_names, write_gguf
from tests.helpers import huge_page_bytes, make_engine
from vlmserve.config import ModelConfig
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models import quantized
from vlmserve.worker.models.gguf_file import GGUFFile
from vlmserve.worker.models.gguf_weights import _blocks_area
from vlmserve.worker.models.loader import load_model
from vlmserve.worker.models.quantized import QuantEmbedding
from vlmserve.worker.models.random_checkpoint import make_gemma3_checkpoint, make_text_checkpoint
from vlmserve.worker.parallel.sharding import TPShard

pytest.importorskip("gguf")

ARCHS = ("llama", "qwen2", "gemma3")
PROMPTS = [[5, 17, 42, 9, 33, 7, 81, 12, 64, 3, 99, 21, 8, 45, 30, 2], [100, 3, 64, 12, 7, 7, 19]]
# Teacher-forced prompt logprobs, quantized against dequantized weights (float32): the
# int-dot kernels quantize activations to int8 (about 1e-2 relative on a layer's output);
# on these random 64-wide models the largest gap measured was MEASURED_GAP.
LOGPROB_BOUND = 0.25
# The Triton GEMM (kernels/quant_gpu.py) in float32 against the dense float32 engine on the
# dequantized weights: float32 rounding only (the same weights, sums in another order).
TRITON_LOGPROB_BOUND = 1e-3
# FP8 weights (e4m3: up to 2^-4 relative a weight) against float32 on the 64-wide llama:
# measured 0.012 (weights dequantized) and 0.015 (_scaled_mm, FP8 activations, on a CPU).
FP8_LOGPROB_BOUND = 0.05


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"quant_{request.param}")
    if request.param == "gemma3":
        hf = make_gemma3_checkpoint(root / "hf", text_only=True, query_pre_attn_scalar=16)
    else:
        hf = make_text_checkpoint(root / "hf", request.param, hidden=64, kv_heads=2)
    return request.param, hf, write_gguf(hf, root / "model.gguf", request.param)


def _load(path, tokenizer, weight_format):
    sidecar = ModelConfig(str(path), tokenizer=str(tokenizer)).path
    return load_model(sidecar, torch.float32, torch.device("cpu"), TorchPagedAttention(),
                      weight_format=weight_format)  # fmt: skip


def test_the_files_blocks_are_what_runs(converted):
    arch, hf, gguf_file = converted
    decoder = _load(gguf_file, hf, "gguf").decoder
    stored = {info.name: info.qtype for info in GGUFFile(gguf_file).tensors}
    names = gguf_names(arch, decoder.cfg.num_layers)
    attn = decoder.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
    assert isinstance(decoder.layers[-1].mlp.down_proj, QuantLinear)
    assert isinstance(decoder.embed_tokens, QuantEmbedding)
    assert isinstance(decoder.lm_head, QuantLinear)
    parts = [p.qtype for p in attn.qkv_proj.parts]
    prefix = "model.layers.0.self_attn."
    want = [stored[names[f"{prefix}{p}_proj.weight"]] for p in "qkv"]
    runs = [t for i, t in enumerate(want) if i == 0 or want[i - 1] != t]
    assert parts == runs and len(set(parts)) > 1  # a part per block type (neighbours merged)
    assert decoder.embed_tokens.weight_q.qtype == stored["token_embd.weight"]
    # no dense copy of a quantized weight: the float parameters left are the norms (and
    # Qwen2's biases)
    dense = {n: p for n, p in decoder.named_parameters() if p.dim() > 1}
    assert not dense, sorted(dense)[:3]


def test_the_files_blocks_share_one_area_and_fused_parts_are_views_of_it(tmp_path):
    """Every kept block tensor is copied once into one area (on huge pages where Linux grants
    them), laid out so that the parts a layer fuses (q|k|v, gate|up, one block type here)
    join as views of it: no second copy of any weight."""
    hf = make_text_checkpoint(tmp_path / "hf", "llama", hidden=64, kv_heads=2)
    path = write_gguf(hf, tmp_path / "one_type.gguf", "llama", qtypes=("Q8_0",))
    decoder = _load(path, hf, "gguf").decoder
    weights = {id(p): p for m in decoder.modules() if isinstance(m, QuantLinear) for p in m.parts}
    weights[id(decoder.embed_tokens.weight_q)] = decoder.embed_tokens.weight_q
    blocks = sorted((w.blocks for w in weights.values()), key=lambda b: b.data_ptr())
    assert len({b.untyped_storage().data_ptr() for b in blocks}) == 1
    spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in blocks]
    assert all(end <= begin for (_, end), (begin, _) in itertools.pairwise(spans))  # disjoint
    kept = sum(i.num_bytes for i in GGUFFile(path).tensors if len(i.shape) == 2)
    assert sum(b.nbytes for b in blocks) == kept == blocks[0].untyped_storage().nbytes()
    layer = decoder.layers[0]
    assert len(layer.self_attn.qkv_proj.parts) == len(layer.mlp.gate_up_proj.parts) == 1


def test_the_blocks_area_is_on_huge_pages_where_linux_grants_them() -> None:
    if "[madvise]" not in (mode := thp_mode()):
        pytest.skip(f"transparent huge pages are {mode!r}, not on request")
    area = _blocks_area(16 << 20)
    before = huge_page_bytes(area)  # of a mapping it joined, if any
    area.fill_(1)  # written as a file's blocks are
    assert huge_page_bytes(area) - before >= 8 << 20  # most of it


def _prompt_logprobs(engine) -> list[float]:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = engine.generate([Request(prompt_token_ids=p, sampling=sampling) for p in PROMPTS])
    return [r.logprob for o in outs for r in o.prompt_logprobs if r is not None]


def _decode(engine) -> tuple[list[list[int]], list[float]]:
    """Greedy picks, each prompt alone (a decode step is one row of x), and each pick's
    logprob there."""
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [engine.generate([Request(prompt_token_ids=p, sampling=sampling)])[0] for p in PROMPTS]
    return [list(o.token_ids) for o in outs], [r.logprob for o in outs for r in o.logprobs]


def _forced(engine, picks: list[list[int]]) -> list[tuple[float, float]]:
    """(logprob, best logprob) at each pick, with the prompt and the picks before it fed."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    requests = [Request(prompt_token_ids=p + q, sampling=sampling)
                for p, q in zip(PROMPTS, picks, strict=True)]  # fmt: skip
    outs = zip(engine.generate(requests), picks, strict=True)
    records = [o.prompt_logprobs[-len(q) :] for o, q in outs]
    return [(r.logprob, r.top[0][1]) for rs in records for r in rs]


def _gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_blocks_track_the_dequantized_weights(converted):
    arch, hf, gguf_file = converted
    blocks = make_engine(gguf_file, tokenizer=str(hf), dtype="float32")
    dense = make_engine(gguf_file, tokenizer=str(hf), dtype="float32", quantization="none")
    assert blocks.config.model.weight_format == "gguf"
    assert dense.config.model.weight_format == "none"
    gap = _gap(_prompt_logprobs(blocks), _prompt_logprobs(dense))
    assert 0 < gap <= LOGPROB_BOUND, (arch, gap)  # 0: the dense path ran twice
    # Decode (one row of x: the kernels' M == 1 paths): each greedy pick's logprob against
    # the dense engine's, fed the same tokens, and each pick the dense engine's best or
    # within the bound of it. (These random models' next-token distributions are nearly
    # flat, top two often 1e-2 apart: counting identical picks measured near-ties.)
    picks, logprobs = _decode(blocks)
    forced = _forced(dense, picks)
    assert len(forced) == len(logprobs) == 8 * len(PROMPTS)
    assert _gap(logprobs, [lp for lp, _ in forced]) <= LOGPROB_BOUND, (arch, picks)
    assert all(best - lp <= LOGPROB_BOUND for lp, best in forced), (arch, picks, forced)


@pytest.mark.slow
def test_int8_quantizes_any_checkpoint_at_load(tmp_path):
    hf = make_text_checkpoint(tmp_path / "hf", "llama", hidden=64, kv_heads=2)
    int8 = make_engine(hf, dtype="float32", quantization="int8")
    dense = make_engine(hf, dtype="float32")
    decoder = int8.runner.model.decoder
    linears = [m for m in decoder.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * decoder.cfg.num_layers + 1  # + the LM head
    assert {p.qtype for m in linears for p in m.parts} == {8}  # Q8_0's layout
    assert isinstance(decoder.embed_tokens, QuantEmbedding)
    gap = _gap(_prompt_logprobs(int8), _prompt_logprobs(dense))
    assert 0 < gap <= LOGPROB_BOUND, gap


def test_quantization_choices_are_checked(tmp_path, converted):
    arch, hf, gguf_file = converted
    with pytest.raises(ValueError, match="--quantization gguf runs a GGUF file's blocks"):
        ModelConfig(str(hf), quantization="gguf")
    with pytest.raises(ValueError, match="runs on a CPU or a CUDA GPU"):
        ModelConfig(str(hf), quantization="int8", device="mps")
    with pytest.raises(ValueError, match="fp8 runs on GPUs .* use --quantization int8"):
        ModelConfig(str(hf), quantization="fp8", device="cpu")
    assert ModelConfig(str(hf), quantization="fp8", device="cuda").weight_format == "fp8"
    assert ModelConfig(str(hf), quantization="int8", device="cuda").weight_format == "int8"
    with pytest.raises(ValueError, match="not one of"):
        ModelConfig(str(hf), quantization="fp4")
    assert ModelConfig(str(hf)).weight_format == "none"  # auto: a checkpoint in its dtype
    assert ModelConfig(str(gguf_file), tokenizer=str(hf)).weight_format == "gguf"
    assert ModelConfig(str(gguf_file), tokenizer=str(hf), device="cuda").weight_format == "none"
    sidecar = ModelConfig(str(gguf_file), tokenizer=str(hf)).path
    with pytest.raises(CheckpointError, match="tensor parallelism"):
        load_model(sidecar, torch.float32, torch.device("cpu"), TorchPagedAttention(),
                   TPShard(0, 2), weight_format="gguf")  # fmt: skip


def test_info_prints_each_layers_blocks_bits_and_kernels(converted, capsys):
    from vlmserve.cli.main import main

    arch, hf, gguf_file = converted
    args = ["info", "--model", str(gguf_file), "--tokenizer", str(hf), "--json"]
    assert main(args) == 0
    shown = json.loads(capsys.readouterr().out)["quantization"]
    assert shown["weights"].startswith("gguf: ") and "bits/weight" in shown["weights"]
    lines = [v for k, v in shown.items() if k.startswith("layer")]
    assert any(line.startswith("qkv_proj: ") and "+" in line for line in lines), lines
    assert any(line.startswith("embed_tokens: ") for line in lines), lines
    assert all("bits/weight" in line for line in lines), lines
    assert shown["ridge_quantized"].endswith(" rows (its quantized linears at 1-16 rows)")
    assert main([*args, "--quantization", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"]["weights"].startswith("dense")
    if not torch.cuda.is_available():  # what `serve --quantization fp8` would answer here
        assert main([*args, "--quantization", "fp8"]) == 0
        shown = json.loads(capsys.readouterr().out)["quantization"]["weights"]
        assert shown.startswith("refused: --quantization fp8 runs on GPUs"), shown


@pytest.mark.slow
def test_the_triton_gemm_runs_the_files_blocks(converted):
    """`place(..., triton=True)`, what a CUDA device gets: every quantized linear runs the
    Triton tile GEMM and the embedding its row decode (here in Triton's interpreter),
    matching the dense engine on the dequantized weights to float32 rounding."""
    from kernels import quant_gpu

    if quant_gpu.available(torch.device("cpu")) is not None:
        pytest.skip(quant_gpu.available(torch.device("cpu")))
    arch, hf, gguf_file = converted
    blocks = make_engine(gguf_file, tokenizer=str(hf), dtype="float32")
    decoder = blocks.runner.model.decoder
    quantized.place(decoder, torch.device("cpu"), triton=True)
    assert all(m.triton for m in decoder.modules() if isinstance(m, QuantLinear | QuantEmbedding))
    assert all("Triton" in line for line in quantized.describe(decoder) if "proj" in line)
    dense = make_engine(gguf_file, tokenizer=str(hf), dtype="float32", quantization="none")
    gap = _gap(_prompt_logprobs(blocks), _prompt_logprobs(dense))
    assert gap <= TRITON_LOGPROB_BOUND, (arch, gap)
    assert _decode(blocks)[0] == _decode(dense)[0]


def test_fp8_stores_the_decoder_layers_linears_as_e4m3(tmp_path):
    """The loader's fp8 path (CUDA's; the config refuses it on a CPU, so it is called
    directly): every layer linear an Fp8Linear, embedding and head dense; then an engine's
    decoder so quantized (the dequantizing path here) tracks float32 within the bound."""
    from kernels.quant_gpu import Fp8Linear

    hf = make_text_checkpoint(tmp_path / "hf", "llama", hidden=64, kv_heads=2)
    decoder = load_model(str(hf), torch.float32, torch.device("cpu"), TorchPagedAttention(),
                         weight_format="fp8").decoder  # fmt: skip
    fp8 = [m for m in decoder.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * decoder.cfg.num_layers
    assert fp8[0].w8.dtype == torch.float8_e4m3fn
    assert isinstance(decoder.embed_tokens, torch.nn.Embedding)
    weights, size = quantized.weight_bytes(decoder)
    dense_weights, dense_size = quantized.weight_bytes(_load_dense(hf))
    assert weights == dense_weights and size < dense_size
    engine = make_engine(hf, dtype="float32", pack_weights=False)
    dense = make_engine(hf, dtype="float32")
    assert quantized.quantize_fp8_decoder(engine.runner.model.decoder) == len(fp8)
    gap = _gap(_prompt_logprobs(engine), _prompt_logprobs(dense))
    assert 0 < gap <= FP8_LOGPROB_BOUND, gap


def _load_dense(hf):
    return load_model(str(hf), torch.float32, torch.device("cpu"), TorchPagedAttention()).decoder


@pytest.mark.gpu
def test_gguf_and_fp8_engines_on_cuda(tmp_path):
    """On a GPU: `--quantization gguf` runs the file's blocks in the Triton GEMM (compiled)
    and the embedding by its row decode, within float32 rounding of the dense engine on the
    dequantized weights, greedy tokens equal; `--quantization fp8` within FP8's bound."""
    hf = make_text_checkpoint(tmp_path / "hf", "llama", hidden=64, kv_heads=2)
    gguf_file = write_gguf(hf, tmp_path / "model.gguf", "llama")
    common = {"tokenizer": str(hf), "dtype": "float32", "device": "cuda", "block_size": 16}
    blocks = make_engine(gguf_file, quantization="gguf", **common)
    decoder = blocks.runner.model.decoder
    assert isinstance(decoder.layers[0].self_attn.qkv_proj, QuantLinear)
    assert decoder.layers[0].self_attn.qkv_proj.triton and decoder.embed_tokens.triton
    assert decoder.embed_tokens.weight_q.blocks.is_cuda
    dense = make_engine(gguf_file, quantization="none", **common)
    gap = _gap(_prompt_logprobs(blocks), _prompt_logprobs(dense))
    assert gap <= TRITON_LOGPROB_BOUND, gap
    assert _decode(blocks)[0] == _decode(dense)[0]
    fp8 = make_engine(gguf_file, quantization="fp8", **common)
    assert fp8.config.model.weight_format == "fp8"
    gap = _gap(_prompt_logprobs(fp8), _prompt_logprobs(dense))
    assert 0 < gap <= FP8_LOGPROB_BOUND, gap
