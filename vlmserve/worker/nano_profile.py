"""Measured CPU profiles: the real decoder layer's ops timed on this machine, and the
R → P interference table measured by co-running a GEMM with a memory-bound kernel.

On a CPU the runtime runs nano-operations of different resources on two worker threads
with one intra-op thread each, so that is how everything here is timed: one thread,
per-thread CPU time (`time.thread_time`), the best of a few repeats. CPU time of one
thread is what the op costs that worker; it does not count time the thread sat
descheduled on a loaded host, which wall time would. Memory stalls do count.

The interference table keeps NanoFlow's meaning (§4.1.1): R is the share of the compute
resource the GEMM does not get (1 - its achieved fraction of solo speed), P the fraction
of its solo speed the memory-bound kernel reaches beside it. The GEMM's pressure is
varied by a duty cycle (it runs a fraction of each period and sleeps the rest). With two
cores each thread has its own core, so the table measures what they share: memory
bandwidth and the last-level cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from search.costmodel.presets import ModelShape
from search.nanoflow.op_graph import BatchMix
from search.nanoflow.profiles import CPU_GRANULARITY, OpProfile, Profiles

GEMMS = ("qkv", "o_proj", "gate_up", "down")
DUTY_CYCLES = (1.0, 0.6, 0.3)  # fractions of each period the GEMM thread computes
MAX_LAYER_PARAMS = 40e6  # one layer's weights; beyond this a CPU profile takes minutes


def _cpu_time_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocations and first-touch page faults out of the timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        fn()
        best = min(best, time.thread_time_ns() - t0)
    return best / 1e3


def _layer_and_inputs(model: ModelShape, max_tokens: int, mix: BatchMix, seed: int = 0):
    import torch

    from kernels.attention import AttentionBatch, TorchPagedAttention
    from vlmserve.worker.models.decoder import DecoderConfig, DecoderLayer
    from vlmserve.worker.models.rope import RopeConfig

    torch.manual_seed(seed)
    rope = RopeConfig(head_dim=model.head_dim)
    cfg = DecoderConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=1,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        rms_norm_eps=1e-6,
        rope=rope,
        max_position_embeddings=1 << 16,
        qkv_bias=model.attention_bias,
    )
    backend = TorchPagedAttention()
    layer = DecoderLayer(cfg, backend).eval()
    for p in layer.parameters():  # random weights at the scale of a trained layer
        torch.nn.init.normal_(p, std=0.02)
    context = mix.decode_context or 512
    block = 16

    def batch(rows: int):
        """An attention batch of `rows` query rows in the mix: decodes at `context`, and
        one prefill chunk of the rest on a prefix of `prefill_context` keys."""
        num_decodes = round(rows * mix.decode_fraction)
        query = [1] * num_decodes
        keys = [context] * num_decodes
        if rows > num_decodes:
            query.append(rows - num_decodes)
            keys.append(max(mix.prefill_context, rows - num_decodes))
        tables, slots, next_block = [], [], 0
        for q, c in zip(query, keys, strict=True):
            blocks = list(range(next_block, next_block + -(-c // block)))
            next_block += len(blocks)
            tables.append(blocks)
            slots += [blocks[p // block] * block + p % block for p in range(c - q, c)]
        meta = backend.build_metadata(
            AttentionBatch(query, keys, tables, block), torch.tensor(slots), torch.device("cpu")
        )
        cache = torch.randn(
            backend.kv_cache_shape(next_block, block, cfg.num_kv_heads, cfg.head_dim)
        )
        return meta, cache

    return layer, cfg, batch


def _op_calls(layer, cfg, batch, rows: int) -> dict[str, Callable[[], object]]:
    """One closure per LAYER_OPS op over `rows` rows, each calling the layer's own code."""
    import torch

    from kernels import fused_ops

    attn, mlp = layer.self_attn, layer.mlp
    q_size, kv_size = attn.q_size, attn.kv_size
    x = torch.randn(rows, cfg.hidden_size)
    residual = torch.randn(rows, cfg.hidden_size)
    positions = torch.arange(rows) % 512
    inv = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    freqs = torch.outer(positions.float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    qkv = attn.qkv_proj(x)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(rows, cfg.num_heads, cfg.head_dim)
    k = k.reshape(rows, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(rows, cfg.num_kv_heads, cfg.head_dim)
    meta, cache = batch(rows)
    attn_out = torch.randn(rows, q_size)
    gate_up = mlp.gate_up_proj(x)
    act = fused_ops.silu_and_mul(gate_up, False)
    return {
        "input_norm": lambda: layer.input_layernorm.add_forward(x.clone(), residual.clone(), False),
        "qkv": lambda: attn.qkv_proj(x),
        "rope_kv_write": lambda: fused_ops.rope(q.clone(), k.clone(), cos, sin, False),
        "attention": lambda: attn.backend.forward(q, k, v, cache, meta, attn.scale),
        "o_proj": lambda: attn.o_proj(attn_out),
        "post_norm": lambda: layer.post_attention_layernorm.add_forward(
            x.clone(), residual.clone(), False
        ),
        "gate_up": lambda: mlp.gate_up_proj(x),
        "silu_mul": lambda: fused_ops.silu_and_mul(gate_up, False),
        "down": lambda: mlp.down_proj(act),
    }


def measure_cpu_profiles(
    model: ModelShape,
    max_tokens: int = 256,
    mix: BatchMix | None = None,
    repeats: int = 3,
    interference_s: float = 0.4,
) -> Profiles:
    """Each op of one layer of `model` (random weights) at 16, 32, …, `max_tokens` rows,
    and the measured R → P table; single-threaded, well under a minute for a small model."""
    import torch

    mix = mix or BatchMix(decode_context=512)
    if max_tokens < CPU_GRANULARITY or max_tokens % CPU_GRANULARITY:
        raise ValueError(f"max tokens {max_tokens} is not a multiple of {CPU_GRANULARITY}")
    per_layer = (model.num_params - model.vocab_size * model.hidden_size * 2) / model.num_layers
    if per_layer > MAX_LAYER_PARAMS:
        raise ValueError(
            f"{model.name}: {per_layer / 1e6:.0f}M parameters a layer is too big to profile "
            f"on a CPU (limit {MAX_LAYER_PARAMS / 1e6:.0f}M): give a small checkpoint's config"
        )
    counts = tuple(range(CPU_GRANULARITY, max_tokens + 1, CPU_GRANULARITY))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the runtime's workers each run one intra-op thread
    t0 = time.perf_counter()
    try:
        layer, cfg, batch = _layer_and_inputs(model, max_tokens, mix)
        times: dict[str, list[float]] = {}
        with torch.inference_mode():
            for rows in counts:
                for op, fn in _op_calls(layer, cfg, batch, rows).items():
                    times.setdefault(op, []).append(_cpu_time_us(fn, repeats))
        knots, raw = measure_interference(interference_s)
    finally:
        torch.set_num_threads(threads)
    # GEMMs are the compute resource; norms, RoPE and attention stream memory (decode
    # attention's intensity is the GQA group size, far under any CPU's ridge).
    ops = tuple(
        OpProfile(op, "compute" if op in GEMMS else "memory", counts, tuple(_monotone(ts)))
        for op, ts in times.items()
    )
    notes = {"mix": mix.__dict__, "measure_s": time.perf_counter() - t0, "interference": raw}
    return Profiles(model.name, "cpu", CPU_GRANULARITY, ops, {"memory": knots}, "measured", notes)


def _monotone(times: list[float]) -> list[float]:
    """Running maximum: more rows never take less time (noise on a shared host aside)."""
    out, top = [], 0.0
    for t in times:
        top = max(top, t)
        out.append(top)
    return out


def measure_interference(
    seconds: float = 0.4,
) -> tuple[tuple[tuple[float, float], ...], list[dict[str, float]]]:
    """(R, P) knots for memory-bound kernels beside a GEMM, and the raw measurements.

    The GEMM (192² fp32, in cache) and the GEMV (a 32 MiB matrix: from DRAM) each run on
    their own thread, each alone and then together at each duty cycle for `seconds`.
    """
    import torch

    a, b = torch.randn(192, 192), torch.randn(192, 192)
    m, v = torch.randn(4096, 2048), torch.randn(2048)

    def rate(fn, stop: threading.Event, duty: float, out: list[float]) -> None:
        torch.set_num_threads(1)  # per thread: the setting is thread-local in OpenMP
        done, cpu0, period = 0, time.thread_time(), 2e-3
        while not stop.is_set():
            burst = time.thread_time()
            while time.thread_time() - burst < duty * period:
                fn()
                done += 1
            if duty < 1:
                time.sleep((1 - duty) * period)
        out.append(done / max(time.thread_time() - cpu0, 1e-9))  # per CPU second

    def run(jobs: list[tuple[Callable[[], object], float]]) -> list[float]:
        stop, outs = threading.Event(), [[] for _ in jobs]
        workers = [
            threading.Thread(target=rate, args=(fn, stop, duty, out))
            for (fn, duty), out in zip(jobs, outs, strict=True)
        ]
        for w in workers:
            w.start()
        time.sleep(seconds)
        stop.set()
        for w in workers:
            w.join()
        return [out[0] for out in outs]

    def gemm():
        return a @ b

    def gemv():
        return m @ v

    (gemm_solo,) = run([(gemm, 1.0)])
    (gemv_solo,) = run([(gemv, 1.0)])
    points, raw = [(0.0, 0.0), (1.0, 1.0)], []
    for duty in DUTY_CYCLES:
        gemm_rate, gemv_rate = run([(gemm, duty), (gemv, 1.0)])
        r_gemm = min(1.0, duty * gemm_rate / gemm_solo)
        p_mem = min(1.0, gemv_rate / gemv_solo)
        raw.append({"duty": duty, "gemm_fraction": r_gemm, "gemv_fraction": p_mem})
        points.append((max(0.01, 1.0 - r_gemm), p_mem))
    return _concave_envelope(points), raw


def _concave_envelope(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The upper concave hull through (0, 0) and (1, 1): P concave in R keeps Stage II's
    D/P(R) convex (a measured dip from noise is bridged, never followed)."""
    hull: list[tuple[float, float]] = []
    for p in sorted(set(points)):
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (p[1] - y0) - (y1 - y0) * (p[0] - x0) >= 0:  # hull[-1] under
                hull.pop()
            else:
                break
        hull.append(p)
    return tuple(hull)
