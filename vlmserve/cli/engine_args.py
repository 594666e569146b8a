"""Engine flags shared by the `vlmserve` subcommands that run the engine (generate, demo,
serve, caption), and the EngineConfig they build.

Every engine config knob a user can turn has its flag here, so each front door offers the
same ones. A bad value is an argparse error naming the flag (range checks) or a ValueError
naming the flags (checks across fields), which `vlmserve.cli.main.main` prints without a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses

from encoders.config import EncoderConfig
from kernels.backends import BACKENDS
from scheduler.config import (
    DEFAULT_DRAFTS,
    CacheConfig,
    SchedulerConfig,
    SloConfig,
    SpeculativeConfig,
)
from vlmserve.cli.arg_types import device, int_at_least, positive_float, ttft_targets
from vlmserve.cli.precision_args import add_dtype_arg, add_kv_cache_dtype_arg, add_warmup_arg
from vlmserve.config import QUANTIZATION_CHOICES, EngineConfig, ModelConfig, ParallelConfig
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.sample.structured import StructuredConfig

# The defaults the flags show are the config dataclasses' own (one source for each).
# ModelConfig needs a path: its other fields' defaults are read from the class.
_MODEL = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_CACHE = CacheConfig()
_SCHED = SchedulerConfig()
_SPEC = SpeculativeConfig()
_ENCODER = EncoderConfig()
_PARALLEL = ParallelConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser.add_argument_group("engine: model"))
    _add_cache_args(parser.add_argument_group("engine: KV cache and scheduling"))
    _add_speculative_args(parser.add_argument_group("engine: speculative decoding (n-gram)"))
    _add_encoder_args(parser.add_argument_group("engine: image preprocessing and encoder cache"))
    _add_structured_args(parser.add_argument_group("engine: structured outputs (xgrammar)"))


def _add_structured_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--grammar-compile-timeout", type=float, default=10.0, metavar="S",
        help="a JSON schema / regex / grammar still compiling after S seconds fails its "
        "request (400)",
    )  # fmt: skip
    group.add_argument(
        "--grammar-any-whitespace", action="store_true",
        help="let constrained JSON hold any whitespace between tokens (default: compact)",
    )  # fmt: skip


def _add_model_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        default=str(DEFAULT_MODEL_DIR),
        help="checkpoint folder, or a GGUF file (or a folder holding one; see "
        "--quantization) (default: the embedded model trained on generated scenes)",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="a GGUF model's tokenizer: a HF tokenizer folder instead of the file's vocabulary",
    )
    group.add_argument(
        "--device", type=device, default=None, help="cpu, cuda (default: $VLMSERVE_DEVICE)"
    )
    add_dtype_arg(group)
    group.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default="auto",
        help="the decoder's weights: auto (default) runs a GGUF file's quantized blocks as "
        "stored on a CPU and any other checkpoint in --dtype; none dequantizes a GGUF file "
        "to --dtype at load; gguf requires a GGUF file; int8 quantizes a checkpoint's "
        "linears, embedding and LM head to weight-only int8 at load; gguf and int8 run the "
        "C++ kernels on a CPU, a Triton GEMM on CUDA; fp8 (CUDA only) stores the decoder "
        "layers' linears as e4m3 with per-channel scales (torch._scaled_mm)",
    )
    group.add_argument(
        "--max-model-len", type=int_at_least(2), default=None, help="default: the checkpoint's"
    )
    group.add_argument(
        "--max-images-per-request",
        type=int_at_least(0),
        default=_MODEL["max_images_per_request"],
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int_at_least(1),
        default=_PARALLEL.tensor_parallel_size,
        metavar="N",
        help="split the decoder's heads and MLP over N ranks, one process each (gloo on "
        "CPU, NCCL on GPUs); the vision tower runs data-parallel over them. N must divide "
        "the attention heads; past the KV heads they are replicated (default: "
        f"{_PARALLEL.tensor_parallel_size})",
    )
    group.add_argument(
        "--eager",
        action="store_true",
        help="run the decoder's plain torch ops (unpacked linear weights, unfused "
        "RMSNorm / RoPE / SiLU-mul; on a GPU no CUDA graphs): the reference path, slower",
    )
    add_warmup_arg(group)
    group.add_argument(
        "--single-weight-copy",
        action="store_true",
        help="CPU: hold the decoder's linear weights once (oneDNN-packed), not also plain "
        "for the small-batch kernel and MKL: half the weight memory, slower decode at a few "
        "sequences and slower prefill",
    )
    group.add_argument(
        "--attention-backend",
        default="auto",
        choices=BACKENDS,
        help="auto (default): Triton on a GPU (FlashInfer there only by name, or where "
        "Triton cannot take --block-size); the C++ decode and prefill kernels on a CPU "
        "(cpu-sdpa: torch's SDPA for prefills). "
        "torch: the plain-torch reference anywhere. triton runs on a CPU only under "
        "TRITON_INTERPRET=1",
    )
    group.add_argument(
        "--nano-batch",
        default=_MODEL["nano_batch"],
        metavar="off|auto|PATH",
        help="nano-batched layers (NanoFlow): auto = the auto-search's schedules for this "
        "model and device (profiled and searched on first use, then cached), or a schedule "
        "JSON or a folder of them (one per dense batch size); steps where the schedule does "
        f"not pay run unsplit (default: {_MODEL['nano_batch']})",
    )


def _add_cache_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--kv-cache-mb",
        type=int_at_least(1),
        default=_CACHE.memory_bytes >> 20,
        metavar="MB",
        help=f"KV pool budget on CPU (default: {_CACHE.memory_bytes >> 20}); the pool is "
        "never larger than "
        "--max-num-seqs sequences of --max-model-len tokens can fill",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="KV pool size in blocks (overrides the sizing above)",
    )
    group.add_argument(
        "--block-size", type=int_at_least(1), default=_CACHE.block_size, help="a power of two"
    )
    add_kv_cache_dtype_arg(group)
    group.add_argument(
        "--max-num-batched-tokens", type=int_at_least(1), default=_SCHED.max_num_batched_tokens
    )
    group.add_argument("--max-num-seqs", type=int_at_least(1), default=_SCHED.max_num_seqs)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="a prompt longer than --max-num-batched-tokens waits for a step of its own",
    )
    sched = _SCHED
    group.add_argument(
        "--admission",
        choices=["lumpy", "fcfs"],
        default=sched.admission,
        help="lumpy (default): reserve each request's exact lump + decode growth, quick "
        "requests first with an aging bound, cheapest-recompute preemption; fcfs: arrival "
        "order with a watermark (the baseline)",
    )
    group.add_argument(
        "--max-wait-steps",
        type=int_at_least(0),
        default=sched.max_wait_steps,
        help=f"aging bound: a request waits at most this many steps behind later arrivals "
        f"(default: {sched.max_wait_steps})",
    )
    group.add_argument(
        "--encoder-tiles-per-step",
        type=int_at_least(0),
        default=sched.encoder_tiles_per_step,
        help=f"vision-tower tiles encoded per step, 0 = unlimited (default: "
        f"{sched.encoder_tiles_per_step}; an image bigger than this goes alone)",
    )
    group.add_argument(
        "--decode-reserve-tokens",
        type=int_at_least(0),
        default=sched.decode_reserve_tokens,
        help=f"decode growth reserved per request at admission: min(max_tokens, this) "
        f"(default: {sched.decode_reserve_tokens})",
    )
    group.add_argument(
        "--lump-headroom",
        type=float,
        default=sched.lump_headroom,
        help=f"share of the KV pool that requests with tower work or long prefills leave to "
        f"quick ones (default: {sched.lump_headroom})",
    )
    group.add_argument(
        "--lump-prefill-tokens",
        type=int_at_least(0),
        default=sched.lump_prefill_tokens_per_step,
        metavar="N",
        help=f"prefill tokens a step gives requests with tower work or long prefills, 0 = "
        f"no cap (default: {sched.lump_prefill_tokens_per_step})",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=sched.async_scheduling,
        help="plan the next step while the forward pass runs on its own thread; a request "
        "that stops is noticed a step late (one extra token computed, never sent); outputs "
        "are unchanged. Off by default: on a CPU the forward's Python shares the GIL with "
        "the planner's (docs/engine.md, 'Async scheduling'). Speculation always runs synchronously",
    )
    group.add_argument(
        "--slo-ttft-ms",
        type=ttft_targets,
        default=None,
        metavar="MS|text=MS,image=MS",
        help="time-to-first-token target (lumpy admission orders waiting requests by slack "
        "against it, and protects quick requests only once they have used half of it); one "
        "value for both classes or one per class (default: none)",
    )
    group.add_argument(
        "--slo-tpot-ms",
        type=positive_float,
        default=None,
        metavar="MS",
        help="time-per-output-token target: a step carrying decodes admits only the prefill "
        "its measured step-time model keeps under it (default: none)",
    )
    group.add_argument(
        "--no-lump-yield",
        action="store_true",
        help="let those requests run in a step that starts a quick request (by default "
        "they sit it out, at most every other step, so its first token comes sooner)",
    )


def _add_speculative_args(group: argparse._ArgumentGroup) -> None:
    spec = _SPEC
    group.add_argument(
        "--speculative-tokens",
        type=int_at_least(0),
        default=spec.num_speculative_tokens,
        metavar="N",
        help="draft up to N tokens per sequence per step from the sequence's own n-grams, "
        f"verified losslessly (default: {DEFAULT_DRAFTS}, or 0 with --async-scheduling; "
        "0 = off); γ adapts to the load (none past the ridge B*) and to each sequence's "
        "acceptance unless --no-adaptive-speculation",
    )
    group.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="always draft N tokens, whatever the batch size and acceptance",
    )
    group.add_argument(
        "--speculative-ngram-min",
        metavar="N",
        type=int_at_least(1),
        default=spec.min_n,
        help=f"shortest suffix the proposer matches (default: {spec.min_n})",
    )
    group.add_argument(
        "--speculative-ngram-max",
        metavar="N",
        type=int_at_least(1),
        default=spec.max_n,
        help=f"longest suffix the proposer matches (default: {spec.max_n})",
    )


def _add_encoder_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--preprocess-workers",
        type=int_at_least(0),
        default=_ENCODER.num_workers,
        metavar="N",
        help="image decode/tile worker processes; 0 decodes in the calling thread "
        "(default: one per core)",
    )
    group.add_argument(
        "--preprocess-max-pending",
        metavar="N",
        type=int_at_least(1),
        default=_ENCODER.max_pending,
        help=f"images queued or in flight before submitters wait (default: {_ENCODER.max_pending})",
    )
    group.add_argument(
        "--preprocess-timeout",
        metavar="S",
        type=positive_float,
        default=_ENCODER.submit_timeout_s,
        help="seconds a request waits for room in the pool before it fails "
        f"(default: {_ENCODER.submit_timeout_s:g})",
    )
    group.add_argument(
        "--encoder-cache-mb",
        type=int_at_least(0),
        default=_ENCODER.cache_bytes >> 20,
        metavar="MB",
        help="encoder-output cache budget, repeated images skip the vision tower; 0 turns "
        f"it off (default: {_ENCODER.cache_bytes >> 20})",
    )
    group.add_argument(
        "--max-image-pixels",
        metavar="N",
        type=int_at_least(1),
        default=_ENCODER.max_pixels,
        help=f"decompression-bomb cap, checked from the header (default: {_ENCODER.max_pixels})",
    )
    group.add_argument(
        "--max-decode-pixels",
        metavar="N",
        type=int_at_least(1),
        default=_ENCODER.max_decode_pixels,
        help="pixels being decoded at once, process-wide; an image waits for room up to "
        "--preprocess-timeout, then fails with a retryable 503 (default: 2 x --max-image-pixels)",
    )
    group.add_argument(
        "--jpeg-draft",
        action="store_true",
        help="decode large JPEGs at 1/2..1/8 scale when the tiles are that small: faster, "
        "but the pixels differ from transformers' processor, and so do outputs: 16-token "
        "greedy answers changed on 32%% of requests for Idefics3, 12%% for LLaVA-OneVision, "
        "5%% for the default model (0%% with it off; benchmarks/engine/jpeg_draft_divergence.py, "
        "100 JPEGs each). Off by default: pixels are exact",
    )
    group.add_argument(
        "--pan-and-scan",
        action="store_true",
        help="Gemma 3: an elongated image (aspect >= 1.2, crops >= 256 px) also goes in as "
        "2-4 crops along its long side, each another 256 tokens (transformers' "
        "do_pan_and_scan; off by default, as there)",
    )
    group.add_argument(
        "--hf-image-processor",
        action="store_true",
        help="preprocess with the checkpoint's HF image processor instead of the pool "
        "(slower; the reference path)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe. Raises ValueError naming the flags."""
    model = ModelConfig(
        args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_images_per_request=args.max_images_per_request,
        pack_weights=not args.eager,
        plain_weights=not args.single_weight_copy,
        fused_ops=not args.eager,
        cuda_graphs=not args.eager,
        attention_backend=args.attention_backend,
        nano_batch=args.nano_batch,
        **({"device": args.device} if args.device else {}),
    )
    scheduler = _with_flags(
        "--max-num-batched-tokens / --max-num-seqs / --admission / --lump-headroom / ...",
        SchedulerConfig,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=not args.no_chunked_prefill,
        admission=args.admission,
        max_wait_steps=args.max_wait_steps,
        encoder_tiles_per_step=args.encoder_tiles_per_step or None,
        decode_reserve_tokens=args.decode_reserve_tokens,
        lump_headroom=args.lump_headroom,
        lump_prefill_tokens_per_step=args.lump_prefill_tokens or None,
        lump_yields_to_quick=not args.no_lump_yield,
        async_scheduling=args.async_scheduling,
        slo=_with_flags(
            "--slo-ttft-ms / --slo-tpot-ms",
            SloConfig,
            ttft_s=args.slo_ttft_ms[0] if args.slo_ttft_ms else None,
            image_ttft_s=args.slo_ttft_ms[1] if args.slo_ttft_ms else None,
            tpot_s=args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None,
        ),
    )
    cache = _with_flags(
        "--block-size / --num-kv-blocks / --kv-cache-dtype",
        CacheConfig,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        num_blocks=args.num_kv_blocks,
        memory_bytes=args.kv_cache_mb << 20,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    speculative = _with_flags(
        "--speculative-ngram-min / --speculative-ngram-max",
        SpeculativeConfig,
        num_speculative_tokens=args.speculative_tokens,
        adaptive=not args.no_adaptive_speculation,
        min_n=args.speculative_ngram_min,
        max_n=args.speculative_ngram_max,
    )
    encoder = _with_flags(
        "--preprocess-* / --encoder-cache-mb / --max-image-pixels / --max-decode-pixels",
        EncoderConfig,
        num_workers=args.preprocess_workers,
        max_pending=args.preprocess_max_pending,
        submit_timeout_s=args.preprocess_timeout,
        cache_bytes=args.encoder_cache_mb << 20,
        max_pixels=args.max_image_pixels,
        max_decode_pixels=args.max_decode_pixels,
        jpeg_draft=args.jpeg_draft,
        use_pool=not args.hf_image_processor,
        pan_and_scan=args.pan_and_scan,
    )
    parallel = _with_flags(
        "--tensor-parallel-size", ParallelConfig, tensor_parallel_size=args.tensor_parallel_size
    )
    structured = _with_flags(
        "--grammar-compile-timeout",
        StructuredConfig,
        compile_timeout_s=args.grammar_compile_timeout,
        any_whitespace=args.grammar_any_whitespace,
    )
    config = EngineConfig(
        model, cache, scheduler, speculative, encoder, parallel, structured, warmup=args.warmup
    )
    if parallel.tensor_parallel_size > 1:
        from vlmserve.worker.parallel.executor import check_config

        check_config(config)  # heads vs ranks, from config.json: before any start-up
    return config


def _with_flags(flags: str, cls: type, **kwargs: object):
    """`cls(**kwargs)`, its ValueError prefixed with the flags that set it."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{flags}: {e}") from None
