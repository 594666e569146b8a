"""The shared engine flags: each one reaches its EngineConfig field through every front
door's parser, bad values are CLI errors naming the flag, and the CPU KV pool is sized to
what the model can use."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from encoders.config import EncoderConfig
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig, kv_pool_num_blocks
from vlmserve.cli.engine_args import engine_config_from_args
from vlmserve.cli.main import build_parser, main
from vlmserve.config import ModelConfig, ParallelConfig
from vlmserve.worker.runner import ModelRunner

# How each front door is reached on the command line (its own required arguments).
DOORS = {
    "generate": ["generate", "--prompt", "x"],
    "demo": ["demo"],
    "serve": ["serve"],
    "caption": ["caption", "in", "--output", "out.jsonl"],
}

# flag arguments -> (EngineConfig path, expected value)
FLAGS = [
    (["--max-model-len", "128"], "model.max_model_len", 128),
    (["--max-images-per-request", "3"], "model.max_images_per_request", 3),
    (["--dtype", "bfloat16"], "model.dtype", "bfloat16"),
    (["--device", "cuda:1"], "model.device", "cuda:1"),
    (["--num-kv-blocks", "77"], "cache.num_blocks", 77),
    (["--block-size", "8"], "cache.block_size", 8),
    (["--kv-cache-dtype", "bfloat16"], "cache.kv_cache_dtype", "bfloat16"),
    (["--kv-cache-mb", "3"], "cache.memory_bytes", 3 << 20),
    (["--no-prefix-caching"], "cache.enable_prefix_caching", False),
    (["--max-num-batched-tokens", "300"], "scheduler.max_num_batched_tokens", 300),
    (["--max-num-seqs", "5"], "scheduler.max_num_seqs", 5),
    (["--no-chunked-prefill"], "scheduler.enable_chunked_prefill", False),
    (["--admission", "fcfs"], "scheduler.admission", "fcfs"),
    (["--max-wait-steps", "5"], "scheduler.max_wait_steps", 5),
    (["--encoder-tiles-per-step", "3"], "scheduler.encoder_tiles_per_step", 3),
    (["--encoder-tiles-per-step", "0"], "scheduler.encoder_tiles_per_step", None),
    (["--decode-reserve-tokens", "64"], "scheduler.decode_reserve_tokens", 64),
    (["--lump-headroom", "0.1"], "scheduler.lump_headroom", 0.1),
    (["--lump-prefill-tokens", "64"], "scheduler.lump_prefill_tokens_per_step", 64),
    (["--lump-prefill-tokens", "0"], "scheduler.lump_prefill_tokens_per_step", None),
    (["--no-lump-yield"], "scheduler.lump_yields_to_quick", False),
    (["--async-scheduling"], "scheduler.async_scheduling", True),
    (["--slo-ttft-ms", "1500"], "scheduler.slo.ttft_s", 1.5),
    (["--slo-ttft-ms", "text=500,image=3000"], "scheduler.slo.image_ttft_s", 3.0),
    (["--slo-tpot-ms", "80"], "scheduler.slo.tpot_s", 0.08),
    (["--speculative-tokens", "4"], "speculative.num_speculative_tokens", 4),
    (["--no-adaptive-speculation"], "speculative.adaptive", False),
    (["--speculative-ngram-min", "1"], "speculative.min_n", 1),
    (["--speculative-ngram-max", "6"], "speculative.max_n", 6),
    (["--preprocess-workers", "0"], "encoder.num_workers", 0),
    (["--preprocess-workers", "3"], "encoder.num_workers", 3),
    (["--preprocess-max-pending", "9"], "encoder.max_pending", 9),
    (["--preprocess-timeout", "2.5"], "encoder.submit_timeout_s", 2.5),
    (["--encoder-cache-mb", "0"], "encoder.cache_bytes", 0),
    (["--encoder-cache-mb", "32"], "encoder.cache_bytes", 32 << 20),
    (["--max-image-pixels", "1000000"], "encoder.max_pixels", 1_000_000),
    (["--max-decode-pixels", "99000000"], "encoder.max_decode_pixels", 99_000_000),
    (["--jpeg-draft"], "encoder.jpeg_draft", True),
    (["--hf-image-processor"], "encoder.use_pool", False),
    (["--tensor-parallel-size", "2"], "parallel.tensor_parallel_size", 2),
]


def config_for(door: str, *flags: str):
    return engine_config_from_args(build_parser().parse_args([*DOORS[door], *flags]))


def field(config, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("flags", "path", "value"), FLAGS, ids=lambda x: str(x))
def test_each_flag_reaches_the_engine_config_from_each_door(door, flags, path, value):
    default = field(config_for(door), path)
    assert default != value, "pick a value that differs from the default"
    assert field(config_for(door, *flags), path) == value


def test_defaults_speculation_adaptive_pool_per_core_cache_on_exact_jpeg():
    config = config_for("serve")
    # The engine's default (adaptive γ up to DEFAULT_DRAFTS; off under --async-scheduling).
    assert config.speculative.num_speculative_tokens is None
    assert config.speculative.enabled and config.speculative.adaptive
    assert config.encoder.num_workers is None  # one worker per core
    assert config.encoder.cache_bytes == 256 << 20
    assert config.encoder.jpeg_draft is False  # pixels as transformers makes them
    assert config.scheduler.enable_chunked_prefill and config.cache.enable_prefix_caching
    on = config_for("serve", "--speculative-tokens", "4").speculative
    assert on.enabled and on.adaptive  # adaptive wherever speculation is on
    assert not config_for("serve", "--speculative-tokens", "0").speculative.enabled


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-tokens", "-1"], "argument --speculative-tokens: must be >= 0, got -1"),
        (["--preprocess-workers", "two"], "argument --preprocess-workers: 'two' is not an"),
        (["--encoder-cache-mb", "-5"], "argument --encoder-cache-mb: must be >= 0"),
        (["--preprocess-timeout", "0"], "argument --preprocess-timeout: must be > 0"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1"),
        (["--device", "tpu:x"], "argument --device: 'tpu:x' is not a device"),
        (["--slo-ttft-ms", "text=500"], "argument --slo-ttft-ms: 'text=500': give both"),
        (["--slo-tpot-ms", "-3"], "argument --slo-tpot-ms: must be > 0"),
    ],
)
def test_a_bad_value_is_an_argparse_error_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*DOORS["generate"], *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-ngram-min", "5"], "--speculative-ngram-min / --speculative-ngram-max:"),
        (
            ["--block-size", "12"],
            "--block-size / --num-kv-blocks / --kv-cache-dtype: block_size=12",
        ),
        (["--max-decode-pixels", "10", "--max-image-pixels", "20"], "--max-decode-pixels: max_"),
        # The default model has 6 attention heads.
        (["--tensor-parallel-size", "4"], "--tensor-parallel-size: tensor_parallel_size=4 does"),
        # FP8 weights run on GPUs: on a CPU the message names the CPU's format.
        (["--quantization", "fp8", "--device", "cpu"], "--quantization fp8 runs on GPUs (CUDA)"),
        (["--quantization", "fp8", "--device", "cpu"], "on a CPU use --quantization int8"),
    ],
)
def test_a_bad_combination_is_a_message_naming_the_flags(flags, message, capsys):
    assert main([*DOORS["generate"], *flags]) == 2  # before any model is loaded
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


# -- the CPU KV pool -----------------------------------------------------------------------


def test_kv_pool_is_what_the_budget_holds_capped_by_what_sequences_fill():
    # 4 sequences of 100 tokens in blocks of 16: 4 x 7 blocks (the last one partial).
    assert kv_pool_num_blocks(1 << 30, 1024, 16, 4, 100) == 28
    assert kv_pool_num_blocks(10 * 1024, 1024, 16, 4, 100) == 10  # the budget binds
    assert kv_pool_num_blocks(100, 1024, 16, 4, 100) == 1  # never empty


@pytest.mark.slow
def test_kv_flags_size_the_cpu_pool_of_the_default_model_through_a_door():
    def num_blocks(*flags: str) -> int:
        config = config_for("serve", "--device", "cpu", *flags)
        return ModelRunner(config).num_blocks

    # The embedded model: 4 layers, 2 KV heads of 32, float32, context 512 ->
    # 2 * 4 * 16 * 2 * 32 * 4 = 32 KiB a block; 64 sequences of 512 tokens = 2048 blocks.
    assert num_blocks() == 2048
    assert num_blocks("--kv-cache-mb", "1") == 32  # the budget binds
    assert num_blocks("--max-num-seqs", "2", "--max-model-len", "64") == 8
    assert num_blocks("--num-kv-blocks", "5000") == 5000


@pytest.mark.parametrize("door", list(DOORS))
def test_flag_defaults_are_the_config_dataclasses_defaults(door):
    """No flag retypes a default: with no flags, each sub-config is its dataclass's own."""
    config = config_for(door)
    assert config.cache == CacheConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.speculative == SpeculativeConfig()
    assert config.encoder == EncoderConfig()
    assert config.parallel == ParallelConfig()
    model_defaults = ModelConfig(config.model.path, device=config.model.device)
    assert config.model == dataclasses.replace(model_defaults, attention_backend="auto")


def _docs_flag_defaults() -> dict[str, str]:
    """`--flag` N pairs docs/engine.md's "Engine flags" section states (`--a/-b` x/y: both)."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "engine.md").read_text()
    section = text.split("## Engine flags", 1)[1].split("\n## ", 1)[0]
    stated = {}
    for flags, value in re.findall(r"`(--[a-z-/]+)(?: N)?`,? \(?(\d+(?:/\d+)?)\b", section):
        if "/" in flags:  # `--speculative-ngram-min/-max` 2/4
            first, second = flags.split("/")
            prefix = first.rsplit("-", 1)[0]
            values = value.split("/")
            stated[first], stated[f"{prefix}-{second.lstrip('-')}"] = values
        else:
            stated[flags] = value
    return stated


def test_the_docs_state_the_flags_real_defaults():
    stated = _docs_flag_defaults()
    assert {"--kv-cache-mb", "--block-size", "--max-num-seqs", "--encoder-cache-mb"} <= set(stated)
    parser = build_parser()
    serve = parser.parse_args(DOORS["serve"])
    for flag, value in stated.items():
        assert str(getattr(serve, flag[2:].replace("-", "_"))) == value, flag


def test_warmup_is_on_for_serve_and_on_request_elsewhere():
    assert config_for("serve").warmup is True
    assert config_for("serve", "--no-warmup").warmup is False
    assert config_for("generate").warmup is False
    assert config_for("generate", "--warmup").warmup is True
