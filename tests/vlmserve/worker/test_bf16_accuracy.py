"""The whole engine in bfloat16 against transformers run in bfloat16 (eager attention) on
bfloat16 copies of the random checkpoints, images included (on the default device:
`benchmarks/gpu_check.py` runs this file with VLMSERVE_DEVICE=cuda, transformers staying
on the CPU): bfloat16 is not token-exact
with float32 (nor with transformers' own op order), so the test states its bounds on the
logits of every generated position (transformers teacher-forced on our tokens).

The bounds: the random models' logits are within about +-0.7, where a bfloat16 ulp is
2^-8 = 0.0039; both sides round to bfloat16 after every op, in different orders and
places (fused kernels round once), so the logits may differ by a few ulps: the bound is
0.02 (measured on this CPU: 0.0029-0.0039, top-1 agreement 100% on all three families).
A kernel bug (a dropped block, a wrong head) moves them by far more and flips the argmax.
Top-1 must agree wherever transformers' own top two are further apart than twice the
bound, and at 90% of all positions.

That bound cannot tell a bfloat16 engine from a float32 one: the same engine computing in
float32 on the bfloat16 weights is as close to transformers' bfloat16 logits (0.0027-0.0032)
as the bfloat16 engine is, the output's own rounding (an ulp) dominating both; and K/V
kept in float32 beside bfloat16 weights change nothing (they are bfloat16 values already).
So two more checks pin the element types: every KV cache tensor is read for its dtype,
and the logits must be at least `MIN_BF16_MEAN_DIFF` (mean over every position and the
whole vocabulary) away from transformers' float32 logits on the same bfloat16 weights
(measured: the bfloat16 engine 0.00049-0.00062 on every family and path; float32
compute 0.0000-0.00005, and 0.00003-0.00012 with the KV cache kept bfloat16).
"""

from __future__ import annotations

import pytest
import torch

from kernels.packed_linear import PackedLinear
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tests.helpers import chat
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint, to_bfloat16_checkpoint

MAX_ABS_LOGIT_DIFF = 0.02  # the bound on |ours - transformers| over every position
# The bfloat16 engine's mean |ours - transformers in float32| is at least this: its own
# rounding (float32 compute on the same weights: at most 0.00012; bfloat16: over 0.00049).
MIN_BF16_MEAN_DIFF = 0.0002
# A bfloat16 KV cache under float32 weights against transformers in float32 with K and V
# rounded to bfloat16 where the cache stores them (after RoPE): float32 op order alone
# (measured 2e-7 fused, 7e-6 eager); the rounding itself moves the logits by 5.7e-4.
MAX_ROUNDED_KV_DIFF = 5e-5
NUM_TOKENS = 16
TEXT = "what colour is the star on the left"


def engine_logits(  # noqa: PLR0913
    path, family: str, images, text: str, max_tokens: int, dtype: str,
    kv_cache_dtype: str = "auto", *, cache_dtype: torch.dtype, **model,
):  # fmt: skip
    """Greedy tokens and the float32 logits each was sampled from ([tokens, vocab]).
    `cache_dtype`: the element type every KV cache tensor must have (read off the
    tensors, which must also have been written)."""
    engine = Engine(
        EngineConfig(
            ModelConfig(str(path), dtype=dtype, **model),
            CacheConfig(num_blocks=128, block_size=16, kv_cache_dtype=kv_cache_dtype),
            SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=4),
            speculative=SpeculativeConfig(num_speculative_tokens=0),  # a logits row a step
        )
    )
    recorded: list[torch.Tensor] = []
    run = engine.runner.run

    def recording_run(inputs, previous=None, greedy=False):  # the real forward; logits kept
        logits = run(inputs, previous)
        recorded.append(logits.float().cpu())  # on the GPU under gpu_check: compared on CPU
        return logits.argmax(-1) if greedy else logits

    engine.runner.run = recording_run
    caches = engine.runner.kv_caches
    dtypes = {t.dtype for t in caches}
    assert caches and dtypes == {cache_dtype}, f"KV cache tensors in {dtypes}, not {cache_dtype}"
    cpu = engine.runner.device.type == "cpu"
    if cpu and model.get("pack_weights", True) and torch.backends.mkldnn.is_available():
        # the bf16 hot path really runs: packed oneDNN linears (and the skinny kernel)
        assert isinstance(engine.runner.model.decoder.layers[0].mlp.down_proj, PackedLinear)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = (
        chat(images, text, params) if family != "llama" else Request(prompt=text, sampling=params)
    )
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished
    assert all(t.count_nonzero() > 0 for t in caches)  # the K/V went into these tensors
    tokens = outputs[-1].token_ids
    return tokens, torch.cat([r for r in recorded if r.shape[0]])[: len(tokens)]


def _attention_with_bf16_kv(module, query, key, value, *args, **kwargs):
    """transformers' eager attention with K and V rounded to bfloat16 first: where the
    engine's bfloat16 KV cache rounds them (after RoPE, before the scores)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    key, value = key.bfloat16().to(key.dtype), value.bfloat16().to(value.dtype)
    return eager_attention_forward(module, query, key, value, *args, **kwargs)


def hf_logits(  # noqa: PLR0913
    path, family: str, images, text: str, tokens: list[int], dtype=torch.bfloat16,
    round_kv: bool = False,
) -> torch.Tensor:  # fmt: skip
    """transformers in `dtype` (eager attention; `round_kv`: K and V rounded to bfloat16),
    teacher-forced on `tokens`: the float32 logits at each generated position
    ([tokens, vocab])."""
    import transformers as tf
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    attention = "eager"
    if round_kv:
        attention = "vlmserve_bf16_kv"
        tf.AttentionInterface.register(attention, _attention_with_bf16_kv)
        AttentionMaskInterface.register(attention, eager_mask)

    cls = {
        "llama": tf.AutoModelForCausalLM,
        "llava_onevision": tf.LlavaOnevisionForConditionalGeneration,
        "idefics3": tf.Idefics3ForConditionalGeneration,
    }[family]
    model = cls.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()
    if family == "llama":
        inputs = dict(tf.AutoTokenizer.from_pretrained(path)(text, return_tensors="pt"))
    else:
        processor = tf.AutoProcessor.from_pretrained(path)
        messages = [{"role": "user", "content": [{"type": "image"}] * len(images)
                     + [{"type": "text", "text": text}]}]  # fmt: skip
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = [images] if family == "idefics3" else images
        inputs = dict(processor(text=[prompt], images=batch, return_tensors="pt",
                                add_special_tokens=False))  # fmt: skip
    num_prompt = inputs["input_ids"].shape[1]
    extra = torch.tensor([tokens[:-1]])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    return logits[num_prompt - 1 : num_prompt - 1 + len(tokens)]


@pytest.fixture(scope="module")
def bf16_paths(llama_path, llava_ov_path, idefics3_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    sources = {"llama": llama_path, "llava_onevision": llava_ov_path, "idefics3": idefics3_path}
    # head dims of 16 (tower and decoder): the sizes the AVX-512 BF16 attention path takes
    sources["llava_onevision_d16"] = make_vlm_checkpoint(
        root / "d16_source", "llava_onevision", vision_hidden=64, vision_heads=4
    )
    return {name: to_bfloat16_checkpoint(src, root / name) for name, src in sources.items()}


def check_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= MAX_ABS_LOGIT_DIFF, f"logits differ by {diff:.4f} > {MAX_ABS_LOGIT_DIFF}"
    top2 = ref.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * MAX_ABS_LOGIT_DIFF  # no near-tie at that position
    # Our top-1 is one of transformers' (its logits are rounded to bfloat16, and the
    # random models' top two often round to the same value: an exact tie, which our float32
    # logits break one way or the other; argmax alone would pick the lower id).
    agree = ref.gather(1, ours.argmax(-1, keepdim=True)).squeeze(1) == ref.max(-1).values
    assert agree[clear].all(), f"top-1 differs at clear positions {(~agree & clear).nonzero()}"
    assert agree.float().mean() >= 0.9, f"top-1 agreement {agree.float().mean():.2f}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("llama", []),
        ("llava_onevision", [(90, 50)]),
        ("llava_onevision_d16", [(90, 50)]),
        ("idefics3", [(70, 45)]),
    ],
)
@pytest.mark.parametrize("eager", [False, True], ids=["fused-packed", "eager"])
def test_bf16_engine_logits_match_transformers_in_bf16(name, sizes, eager, bf16_paths,
                                                      random_image):  # fmt: skip
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    path, family = bf16_paths[name], name.removesuffix("_d16")
    tokens, ours = engine_logits(
        path, family, images, TEXT, NUM_TOKENS, "bfloat16", cache_dtype=torch.bfloat16,
        pack_weights=not eager, fused_ops=not eager,
    )  # fmt: skip
    assert len(tokens) == NUM_TOKENS
    check_close(ours, hf_logits(path, family, images, TEXT, tokens))
    # bfloat16 compute, not float32 on bfloat16 weights: its rounding shows against
    # transformers in float32 on the same weights (see the module docstring).
    exact = hf_logits(path, family, images, TEXT, tokens, dtype=torch.float32)
    mean = (ours - exact).abs().mean().item()
    assert mean >= MIN_BF16_MEAN_DIFF, f"mean |ours - float32| {mean:.6f}: float32 compute?"


def test_auto_dtype_picks_bf16_for_a_bf16_checkpoint_only_on_native_bf16(bf16_paths, llama_path):
    from kernels.cpu_build import native_bf16

    assert ModelConfig(str(llama_path), device="cpu").torch_dtype == torch.float32
    want = torch.bfloat16 if native_bf16() else torch.float32
    assert ModelConfig(str(bf16_paths["llama"]), device="cpu").torch_dtype == want
    assert ModelConfig(str(bf16_paths["llama"]), device="cuda").torch_dtype == torch.bfloat16


@pytest.mark.slow
def test_a_bf16_kv_cache_under_float32_weights_stays_close_to_float32(llama_path):
    """--kv-cache-dtype bfloat16 with float32 weights: K/V rounded once into the cache,
    everything else float32. The cache tensors are bfloat16; the logits are transformers'
    float32 ones with K and V rounded to bfloat16 after RoPE (to float32 op order), not the
    unrounded ones (the rounding moves them by about 10x that bound; at least 4x is asked);
    and they stay within the bfloat16 bound of transformers' float32 logits."""
    tokens, ours = engine_logits(
        llama_path, "llama", [], TEXT, NUM_TOKENS, "float32", kv_cache_dtype="bfloat16",
        cache_dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    rounded = hf_logits(llama_path, "llama", [], TEXT, tokens, torch.float32, round_kv=True)
    exact = hf_logits(llama_path, "llama", [], TEXT, tokens, torch.float32)
    near, far = (ours - rounded).abs().max().item(), (ours - exact).abs().max().item()
    assert near <= MAX_ROUNDED_KV_DIFF, f"{near:.2e} from float32 with K/V rounded"
    assert far >= 4 * MAX_ROUNDED_KV_DIFF, f"{far:.2e} from unrounded float32: K/V not rounded"
    assert far <= MAX_ABS_LOGIT_DIFF
