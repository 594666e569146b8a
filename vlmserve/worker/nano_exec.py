"""Runs a step's nano-batched decoder layers (vlmserve/worker/nano_batch.py made the plan).

Each decoder op is split into its nano-operations' row ranges. An op's output is kept as
the pieces its nano-operations produced (`_Rows`): a consumer whose rows one piece covers
reads a view of it, and only where the schedule cuts an op differently from its producer
(four nano-batches before the MLP, two in it) are pieces joined by a copy. In-place ops
(the fused residual add + RMSNorm, RoPE) write into the pieces they read.

On a CPU each stream is a worker thread with its own intra-op thread count (OpenMP's is
per thread: set in one thread it leaves the others' alone); torch drops the GIL inside
ops, so one thread's GEMM runs while the other's attention does. A task waits for the
tasks it depends on by per-stream completion counts under one condition variable. On a
GPU each stream is a CUDA stream (attention's at high priority), a task waits on CUDA
events recorded after the tasks it depends on, and the host issues everything in order.

The KV write of a nano-batch's new tokens happens inside its attention task (the
backends write and attend in one call), not in "rope_kv_write", which only rotates: both
touch only the task's own sequences, so the schedule's dependencies still hold.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kernels import fused_ops
from vlmserve.worker.models.decoder import DecoderLayer, StepContext
from vlmserve.worker.nano_batch import NanoStep, NanoTask

_ACTIVATIONS = ("hidden", "residual", "normed", "qkv", "q", "k", "v", "attn", "o", "mlp_in",
                "gate_up", "act")  # fmt: skip


class _Rows:
    """One activation of the step, as row pieces [start, end) -> tensor."""

    def __init__(self, record_stream: bool) -> None:
        self._pieces: list[tuple[int, int, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._record_stream = record_stream

    def put(self, start: int, end: int, value: torch.Tensor) -> None:
        with self._lock:
            keep = []
            for s, e, x in self._pieces:
                if e <= start or s >= end:
                    keep.append((s, e, x))
                    continue
                if s < start:  # a piece cut by the new one keeps its rows outside it
                    keep.append((s, start, x[: start - s]))
                if e > end:
                    keep.append((end, e, x[end - s :]))
            keep.append((start, end, value))
            self._pieces = keep

    def get(self, start: int, end: int) -> torch.Tensor:
        with self._lock:
            parts = sorted((s, e, x) for s, e, x in self._pieces if s < end and e > start)
        views = [x[max(start, s) - s : min(end, e) - s] for s, e, x in parts]
        assert sum(v.shape[0] for v in views) == end - start, f"rows [{start}, {end}) missing"
        if self._record_stream:  # used on this stream: not freed before it is done
            for v in views:
                v.record_stream(torch.cuda.current_stream(v.device))
        return views[0] if len(views) == 1 else torch.cat(views)


class _StepState:
    def __init__(self, ctx: StepContext, step: NanoStep, on_cuda: bool) -> None:
        self.ctx, self.step = ctx, step
        self.rows = {name: _Rows(on_cuda) for name in _ACTIVATIONS}


def _run_task(layer: DecoderLayer, index: int, task: NanoTask, st: _StepState) -> None:
    """One nano-operation: the decoder layer's op `task.op` on rows [start, end), with
    the same calls as DecoderLayer.forward (so the result is the unsplit one's)."""
    a, b, ctx, rows = task.start, task.end, st.ctx, st.rows
    attn, fused = layer.self_attn, ctx.fused
    op = task.op
    if op == "input_norm":
        x = rows["hidden"].get(a, b)
        if index == 0:
            rows["residual"].put(a, b, x)
            rows["normed"].put(a, b, layer.input_layernorm(x, fused))
        else:
            x, residual = layer.input_layernorm.add_forward(x, rows["residual"].get(a, b), fused)
            rows["residual"].put(a, b, residual)
            rows["normed"].put(a, b, x)
    elif op == "qkv":
        rows["qkv"].put(a, b, attn.qkv_proj(rows["normed"].get(a, b)))
    elif op == "rope_kv_write":
        c, n = attn.cfg, b - a
        q, k, v = rows["qkv"].get(a, b).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q, k = fused_ops.rope(
            q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim),
            ctx.cos[a:b], ctx.sin[a:b], fused,
        )  # fmt: skip
        rows["q"].put(a, b, q)
        rows["k"].put(a, b, k)
        rows["v"].put(a, b, v.view(n, c.num_kv_heads, c.head_dim))
    elif op == "attention":
        q, k, v = (rows[name].get(a, b) for name in "qkv")
        meta = st.step.metadata[task.meta_index]
        out = attn.backend.forward(q, k, v, ctx.kv_caches[index], meta, attn.scale)
        rows["attn"].put(a, b, out.reshape(b - a, -1))
    elif op == "o_proj":
        rows["o"].put(a, b, attn.o_proj(rows["attn"].get(a, b)))
    elif op == "post_norm":
        norm = layer.post_attention_layernorm
        x, residual = norm.add_forward(rows["o"].get(a, b), rows["residual"].get(a, b), fused)
        rows["residual"].put(a, b, residual)
        rows["mlp_in"].put(a, b, x)
    elif op == "gate_up":
        rows["gate_up"].put(a, b, layer.mlp.gate_up_proj(rows["mlp_in"].get(a, b)))
    elif op == "silu_mul":
        rows["act"].put(a, b, fused_ops.silu_and_mul(rows["gate_up"].get(a, b), fused))
    elif op == "down":
        rows["hidden"].put(a, b, layer.mlp.down_proj(rows["act"].get(a, b)))
    else:
        raise AssertionError(f"no nano-operation {op!r}")


class _Progress:
    """Per-stream completion counts of a step, and the first failure (which releases
    every waiter, so a failing task never leaves the other streams blocked)."""

    def __init__(self, num_streams: int) -> None:
        self.done = [0] * num_streams
        self.failed: BaseException | None = None
        self.cond = threading.Condition()

    def wait(self, needs: tuple[tuple[int, int], ...], offset: list[int] | None) -> None:
        with self.cond:
            for stream, count in needs:
                target = count + (offset[stream] if offset is not None else 0)
                while self.done[stream] < target and self.failed is None:
                    self.cond.wait()
            if self.failed is not None:
                raise _Aborted

    def finish(self, stream: int) -> None:
        with self.cond:
            self.done[stream] += 1
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = error
            self.cond.notify_all()


class _Aborted(Exception):
    """Another stream failed first."""


class NanoExecutor:
    """Runs nano-batched layers: CPU worker threads, or CUDA streams."""

    def __init__(self, num_streams: int, device: torch.device, threads_per_stream: int) -> None:
        self.device = device
        self.num_streams = num_streams
        self._pools: list[ThreadPoolExecutor] = []
        self._cuda_streams: list[torch.cuda.Stream] = []  # made at the first step
        if device.type == "cpu":
            self._pools = [
                ThreadPoolExecutor(1, f"vlmserve-nano-{s}", initializer=torch.set_num_threads,
                                   initargs=(threads_per_stream,))
                for s in range(num_streams)
            ]  # fmt: skip

    def run_layers(
        self,
        layers: list[DecoderLayer],
        hidden: torch.Tensor,
        ctx: StepContext,
        step: NanoStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step's nano-batches: (last MLP output, residual before it),
        as DecoderLayer.forward returns them for the unsplit batch."""
        st = _StepState(ctx, step, self.device.type == "cuda")
        st.rows["hidden"].put(0, hidden.shape[0], hidden)
        if self.device.type == "cuda":
            self._run_cuda(layers, st)
        else:
            self._run_threads(layers, st)
        n = hidden.shape[0]
        return st.rows["hidden"].get(0, n), st.rows["residual"].get(0, n)

    def _run_threads(self, layers: list[DecoderLayer], st: _StepState) -> None:
        progress = _Progress(len(st.step.streams))
        futures: list[Future] = [
            self._pools[s].submit(self._stream, s, order, layers, st, progress)
            for s, order in enumerate(st.step.streams)
            if order
        ]
        errors = []
        for future in futures:
            try:
                future.result()
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised below, first one wins
                errors.append(e)
        if progress.failed is not None:
            raise progress.failed
        if errors:
            raise errors[0]

    @staticmethod
    def _stream(
        stream: int, order: list[int], layers: list[DecoderLayer], st: _StepState,
        progress: _Progress,
    ) -> None:  # fmt: skip
        per_layer = [len(o) for o in st.step.streams]
        try:
            # Grad mode and inference mode are per thread: set them here too.
            with torch.inference_mode():
                for index, layer in enumerate(layers):
                    this = [index * c for c in per_layer]
                    before = [(index - 1) * c for c in per_layer]
                    for i in order:
                        task = st.step.tasks[i]
                        progress.wait(task.waits, this)
                        if index > 0:
                            progress.wait(task.prev_waits, before)
                        _run_task(layer, index, task, st)
                        progress.finish(stream)
        except _Aborted:
            raise
        except BaseException as e:
            progress.fail(e)
            raise

    def _run_cuda(self, layers: list[DecoderLayer], st: _StepState) -> None:
        main = torch.cuda.current_stream(self.device)
        if not self._cuda_streams:
            # Attention (memory-bound) at high priority, so the GEMMs fill in around it.
            attention = {t.stream for t in st.step.tasks if t.op == "attention"}
            low, high = torch.cuda.Stream.priority_range()
            self._cuda_streams = [
                torch.cuda.Stream(self.device, priority=high if s in attention else low)
                for s in range(self.num_streams)
            ]
        streams = self._cuda_streams
        for s in streams:
            s.wait_stream(main)
        # events[stream][k]: recorded after that stream's k-th task of the step.
        events: list[list[torch.cuda.Event]] = [[] for _ in streams]
        per_layer = [len(o) for o in st.step.streams]
        for index, layer in enumerate(layers):
            for task in st.step.tasks:
                stream = streams[task.stream]
                needs = [(s, index * per_layer[s] + c) for s, c in task.waits]
                if index > 0:
                    needs += [(s, (index - 1) * per_layer[s] + c) for s, c in task.prev_waits]
                with torch.cuda.stream(stream):
                    for s, count in needs:
                        stream.wait_event(events[s][count - 1])
                    _run_task(layer, index, task, st)
                    event = torch.cuda.Event()
                    event.record(stream)
                    events[task.stream].append(event)
        for s in streams:
            main.wait_stream(s)

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
