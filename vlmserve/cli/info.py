"""What `vlmserve info` reports: versions, the PIL build, the device, the attention
backend that would serve, which implementation each decoder op uses, and on a CPU every
kernel choice calibrated on it (kernels/calibration.py) with the measurements behind it."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import platform
import sys
from pathlib import Path

import torch

from kernels import ISA_TARGETS, isa_target
from kernels.backends import choose_attention_paths, select_backend
from kernels.cpu_attention import CpuPagedAttention
from kernels.cpu_build import cpu_flags, native_bf16
from kernels.fused_ops import op_backends
from vlmserve.config import checkpoint_dtype, choose_dtype, default_device
from vlmserve.worker.models.gguf_weights import ARCHITECTURES as GGUF_ARCHITECTURES
from vlmserve.worker.models.loader import SUPPORTED_FAMILIES


def isa_line() -> str:
    """The instruction sets this process compiles and runs for (VLMSERVE_ISA)."""
    target = isa_target()
    if target is None:
        return "native (all this CPU has; VLMSERVE_ISA=avx2 runs as on an AVX2-only CPU)"
    return f"{target} (VLMSERVE_ISA: -march={ISA_TARGETS[target]['march']} on this CPU)"


def amx_kernels() -> str:
    """Which of our kernels run on AMX tiles here (the calibration still decides, per shape,
    whether they are taken: see `calibration`)."""
    if "amx_bf16" not in cpu_flags():
        return "none (this CPU has no amx_bf16)"
    from kernels.cpu_attention import amx_available
    from kernels.packed_linear import amx_head_available

    kernels = [name for name, ok in (
        ("prefill and decode attention (bfloat16, head dims a multiple of 32)",
         amx_available()),
        ("LM head GEMM (bfloat16: float32 logits, or greedy argmaxes)",
         amx_head_available(torch.bfloat16, 32, 16)),
    ) if ok]  # fmt: skip
    return "; ".join(kernels) or "none (the kernels did not build or Linux refused the tiles)"


def dist_version(dist: str) -> str | None:
    """The installed version of a distribution, None where it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pil_variant() -> dict[str, object]:
    """Which distribution owns the importable PIL, and whether its SIMD paths can run."""
    import PIL
    from PIL import features

    owner = "pillow"
    simd_version = dist_version("pillow-simd")
    if simd_version is not None:
        dist = metadata.distribution("pillow-simd")
        init = Path(PIL.__file__).resolve()
        files = {Path(dist.locate_file(f)).resolve() for f in dist.files or []}
        if init in files:
            owner = "pillow-simd"
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "variant": owner,
        "version": PIL.__version__,
        # pillow-simd is built with -mavx2 by ./dev; its SIMD paths run where the CPU has it.
        "simd": owner == "pillow-simd" and " avx2" in cpu_flags,
        "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")),
    }


def tensor_parallel(model_path: str, size: int) -> dict[str, object]:
    """How `size` ranks would split the checkpoint at `model_path`: heads and KV heads per
    rank, and the KV heads' replication past n_kv (article §16), with the KV bytes per
    token each rank holds in the dtype the engine would use here."""
    from encoders.weights import read_config
    from vlmserve.config import ModelConfig
    from vlmserve.worker.models.loader import decoder_config
    from vlmserve.worker.parallel.sharding import (
        check_tensor_parallel,
        kv_heads_per_rank,
        kv_replicas,
    )

    cfg = decoder_config(read_config(model_path))
    check_tensor_parallel(cfg, size)
    elem = torch.finfo(ModelConfig(model_path).torch_dtype).bits // 8
    local_kv = kv_heads_per_rank(cfg.num_kv_heads, size)
    replicas = kv_replicas(cfg.num_kv_heads, size)
    return {
        "size": size,
        "heads_per_rank": cfg.num_heads // size,
        "kv_heads": cfg.num_kv_heads,
        "kv_heads_per_rank": local_kv,
        "kv_replicas": replicas,
        "kv_bytes_per_token_per_rank": 2 * cfg.num_layers * local_kv * cfg.head_dim * elem,
        "kv_bytes_per_token_all_ranks": 2 * cfg.num_layers * local_kv * cfg.head_dim * elem * size,
        "kv": f"replicated {replicas}x (tp {size} > {cfg.num_kv_heads} KV heads)"
        if replicas > 1
        else "sharded by KV head",
    }


def build_kernels() -> tuple[dict[str, str], bool]:
    """Build every C++ CPU kernel ahead (kernels/cpu_build.py), saying so on stderr while it
    happens: per kernel "built in N s", "already built" or why it is unavailable; and
    whether all of them are available."""
    from kernels import cpu_build

    print(
        f"building the C++ CPU kernels ({', '.join(cpu_build.KERNELS)}): once per "
        "environment and kernel source, a minute or two",
        file=sys.stderr,
        flush=True,
    )
    report = {}
    results = cpu_build.build_all()
    for name, done in results.items():
        if done["error"]:
            report[name] = f"unavailable ({done['error']})"
        elif done["already_built"]:
            report[name] = "already built"
        else:
            report[name] = f"built in {done['seconds']} s"
    return report, not any(done["error"] for done in results.values())


# The shapes calibrated without a model: a 1B-class decoder's (Llama 3.2 1B: hidden 2048,
# 32 query / 8 KV heads of 64, intermediate 8192, 128k vocabulary).
REPRESENTATIVE = {"hidden_size": 2048, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
                  "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip


def model_shapes(model_path: str | None) -> dict[str, int]:
    """The decoder shape the calibration is run at: the model's, else REPRESENTATIVE."""
    if model_path is None:
        return dict(REPRESENTATIVE)
    from encoders.weights import read_config
    from vlmserve.worker.models.loader import decoder_config

    cfg = decoder_config(read_config(model_path))
    return {key: getattr(cfg, key) for key in REPRESENTATIVE}


def calibrate(shapes: dict[str, int], dtype: torch.dtype) -> dict[str, object]:
    """Every CPU kernel choice a decoder of `shapes` in `dtype` takes on this CPU, measured
    now where this machine has none cached (kernels/calibration.py): the skinny kernel's
    rows per linear layer, float32 MKL, the LM head's paths (greedy's too), prefill
    attention, adaptive speculation's ridge B*; the cache file, its key and each choice
    with its measurements."""
    import time

    from kernels import calibration, cpu_attention, lm_head, packed_linear
    from vlmserve.sample.verify import ridge_batch_for

    start = time.perf_counter()
    hidden, heads, kv_heads = shapes["hidden_size"], shapes["num_heads"], shapes["num_kv_heads"]
    head_dim, inter = shapes["head_dim"], shapes["intermediate_size"]
    layers = [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
              (hidden, 2 * inter), (inter, hidden)]  # fmt: skip
    if packed_linear.skinny_available() is None and dtype in packed_linear.PACKED_DTYPES:
        for shape in layers:
            packed_linear.plain_rows(dtype, shape)
        head = lm_head.head_choice(dtype, hidden, shapes["vocab_size"])
        lm_head.greedy_rows(dtype, hidden, shapes["vocab_size"], head)
    cpu_attention.prefill_kernel_wins(dtype, heads, kv_heads, head_dim)
    cpu_attention.decode_amx_wins(dtype, heads, kv_heads, head_dim)
    cpu_attention.decode_spread_wins(dtype, heads, kv_heads, head_dim)
    ridge_batch_for(torch.device("cpu"), dtype)
    report = calibration.report(asked_only=True)
    return {**report, "seconds_now": round(time.perf_counter() - start, 2)}


def model_summary(model_path: str) -> dict[str, object]:
    """The decoder's shape and, for a GGUF file, what the file holds (its sidecar's record)."""
    from encoders.weights import read_config
    from vlmserve.worker.models.gguf_checkpoint import INFO_FILE, weights_file
    from vlmserve.worker.models.loader import decoder_config, family_of

    config = read_config(model_path)
    cfg = decoder_config(config)
    summary: dict[str, object] = {
        "family": family_of(config).family,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab": cfg.vocab_size,
    }
    if weights_file(model_path) is not None:
        gguf = json.loads((Path(model_path) / INFO_FILE).read_text())
        summary["gguf"] = gguf["source"]
        summary["gguf_blocks"] = " ".join(f"{k}:{v}" for k, v in gguf["tensor_types"].items())
        summary["gguf_tokenizer"] = gguf["tokenizer"]
        summary["chat_template"] = gguf["chat_template"]
        summary["eos_token_ids"] = gguf["eos_token_ids"]
        summary["sidecar"] = model_path
    return summary


def quantization_summary(model_path: str, quantization: str, dtype: torch.dtype) -> dict:
    """What `--quantization` resolves to for the model here and, when quantized, each kind
    of layer's block types, bits per weight and kernel paths (the model is loaded), and the
    decoder's weight bytes."""
    from kernels.attention import TorchPagedAttention
    from vlmserve.config import ModelConfig
    from vlmserve.worker.models import quantized
    from vlmserve.worker.models.loader import load_model

    try:
        config = ModelConfig(model_path, quantization=quantization, device=default_device())
    except ValueError as e:  # e.g. fp8 on a CPU: what `serve` would say
        return {"weights": f"refused: {e}"}
    fmt = config.weight_format
    if fmt == "none":
        return {"weights": f"dense {str(dtype).removeprefix('torch.')} (--quantization "
                           f"{quantization})"}  # fmt: skip
    device = torch.device("cpu")
    decoder = load_model(model_path, dtype, device, TorchPagedAttention(), None, fmt).decoder
    weights, size = quantized.weight_bytes(decoder)
    summary: dict[str, object] = {
        "weights": f"{fmt}: {size / 2**20:.1f} MiB for {weights / 1e6:.1f}M weights "
        f"({8 * size / weights:.2f} bits/weight)",
    }
    for i, line in enumerate(quantized.describe(decoder, dtype)):
        summary[f"layer{i}"] = line
    if device.type == "cpu":  # what adaptive γ takes where it is below the dtype's B*
        from vlmserve.sample.verify import quantized_ridge

        ridge = quantized_ridge(decoder, dtype)
        summary["ridge_quantized"] = f"{ridge:.1f} rows (its quantized linears at 1-16 rows)"
    return summary


def collect(
    model_path: str | None = None,
    tp: int = 1,
    tokenizer: str | None = None,
    recalibrate: bool = False,
    quantization: str = "auto",
) -> dict[str, object]:
    """`recalibrate`: drop this machine's calibration and measure every choice anew;
    `quantization`: how the model's weights would run (`ModelConfig.quantization`)."""
    from vlmserve.worker.models.gguf_checkpoint import resolve_model_path

    device = default_device()
    if model_path is not None:
        model_path = resolve_model_path(model_path, tokenizer)
    # --dtype auto for the model (without one: for a 16-bit checkpoint)
    marked = checkpoint_dtype(model_path) if model_path is not None else "bfloat16"
    choice = choose_dtype("auto", torch.device(device).type, marked, native_bf16())
    backend = select_backend(torch.device(device), None, choice.dtype)
    calibrated = None
    if device == "cpu":
        if recalibrate:
            from kernels import calibration

            calibration.forget()
        shapes = model_shapes(model_path)
        calibrated = calibrate(shapes, choice.dtype)
        if model_path is not None:  # the prefill path this model would take here
            choose_attention_paths(backend, None, choice.dtype, shapes["num_heads"],
                                   shapes["num_kv_heads"], shapes["head_dim"])  # fmt: skip
    attention = backend.name
    info: dict[str, object] = {
        "python": platform.python_version(),
        **{name: dist_version(name) for name in ("vlmserve", "torch", "transformers", "timm")},
        "pil": pil_variant(),
        "device": device,
        "isa": isa_line(),
        "native_bf16": native_bf16() or "none (bfloat16 emulated: slower than float32)",
        "amx": amx_kernels() if device == "cpu" else "not on this device",
        "dtype": f"{str(choice.dtype).removeprefix('torch.')} ({choice.reason}"
        + ("" if model_path is not None else "; a 16-bit checkpoint, no --model given")
        + ")",
        "attention_backend": attention,
        **(
            {
                "decode_attention": f"{'amx tiles' if backend.decode_amx else 'vector'}, the next "
                f"block prefetched {'by lines' if backend.decode_spread else 'whole'}"
            }
            if isinstance(backend, CpuPagedAttention)
            else {}
        ),
        "ops": op_backends(torch.device(device), attention, dtype=choice.dtype),
        "threads": torch.get_num_threads(),
        "model_families": ", ".join(SUPPORTED_FAMILIES)
        + f"; GGUF files of {', '.join(sorted(GGUF_ARCHITECTURES))}",
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    if model_path is not None:
        info["model"] = model_summary(model_path)
        info["tensor_parallel"] = tensor_parallel(model_path, tp)
        info["quantization"] = quantization_summary(model_path, quantization, choice.dtype)
    if calibrated is not None:
        info["calibration"] = calibrated
    return info


def render(info: dict[str, object]) -> str:
    lines = []
    for key, value in info.items():
        if key == "calibration":
            lines += render_calibration(value)
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        lines.append(f"{key:<18} {value}")
    return "\n".join(lines)


def render_calibration(report: dict) -> list[str]:
    """Each calibrated choice, then its measurements (milliseconds a call per path)."""
    key = report["key"]
    lines = [f"{'calibration':<18} {report['cache']} ({key['cpu']}; torch {key['torch']}, "
             f"{key['threads']} threads; {report['seconds_now']} s now)"]  # fmt: skip
    for name, entry in sorted(report["choices"].items()):
        took = f"measured in {entry.get('seconds')} s, load {entry.get('load_average')}"
        lines.append(f"  {name}: {entry.get('choice')} ({took})")
        for record in entry.get("measured", []):
            lines.append("      " + " ".join(_cell(k, v) for k, v in record.items()))
    return lines


def _cell(key: str, value: float) -> str:
    """One measurement: a count, a rate (the ridge's), else seconds a call shown in ms."""
    if key in ("rows", "cached", "tokens", "sequences", "context"):
        return f"{key}={value}"
    if key.endswith("_flops"):
        return f"{key}={value / 1e9:.0f}G"
    if key.endswith("_bytes_per_s"):
        return f"{key}={value / 1e9:.1f}G"
    return f"{key}={value * 1e3:.3f}ms"
