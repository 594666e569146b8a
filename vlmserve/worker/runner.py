"""The model runner: owns the device, the weights and the KV cache; turns a StepPlan
into one forward pass and returns the logits of the rows that sample. `prepare` reads the
plan into self-contained inputs on the engine thread; `run` may then go on the forward
thread (async scheduling) while the engine plans the next step.

A speculating decode's drafts are just more query rows of that sequence: they are fed
after its last token (they are not in `seq.token_ids`, which holds accepted tokens only)
and each of its 1 + len(drafts) rows returns logits, for verification."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from encoders.cache import EncoderCache
from encoders.errors import RequestError
from encoders.stage import EncoderStage, ImageWork
from kernels.attention import AttentionBatch
from kernels.backends import choose_attention_paths, select_backend
from kernels.lm_head import logits_head
from kernels.malloc_tuning import keep_freed_memory
from kernels.packed_linear import pack_linears
from kernels.quant_linear import QuantLinear
from scheduler.config import kv_pool_num_blocks, seq_peak_blocks
from scheduler.spans import image_spans
from scheduler.step_plan import StepPlan
from vlmserve.config import EngineConfig, kv_cache_torch_dtype
from vlmserve.worker.dtypes import check_dtypes
from vlmserve.worker.kv_groups import (
    GroupBatch,
    allocate_kv_caches,
    apply_delta,
    kv_layout,
    slots_of,
)
from vlmserve.worker.models.loader import LoadedModel, head_dim_of, load_model
from vlmserve.worker.parallel.layers import shard_decoder
from vlmserve.worker.parallel.sharding import TPShard

if TYPE_CHECKING:
    from vlmserve.worker.models.decoder import Decoder
    from vlmserve.worker.parallel.comm import TPGroup
from vlmserve.worker.nano_batch import NanoBatcher, NanoStep, nano_schedules
from vlmserve.worker.nano_exec import NanoExecutor

log = logging.getLogger(__name__)

# A prefill step's activations (tens of MiB at the step budget) and a decode step's float32
# logits (64 MiB at 64 rows of a 262,144-token vocabulary: at a 64 MiB threshold glibc mapped
# them fresh every step, ~60 ms of page faults and zeroing) stay in the heap between steps,
# with up to 512 MiB of freed heap kept (kernels/malloc_tuning).
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 256 << 20, 512 << 20


@functools.cache
def keep_activations_in_heap() -> int | None:
    """Freed activations are reused from the heap instead of glibc handing each large one
    fresh zeroed pages and unmapping it on free (page faults and page zeroing every
    step). Process-wide, once; the mmap threshold set, None where the C library is not
    glibc."""
    return keep_freed_memory(_MMAP_THRESHOLD, _TRIM_THRESHOLD)


@dataclass
class _RequestState:
    """What the runner keeps of a request between steps: its block tables (the plans'
    deltas applied; KV cache groups 1.. in `group_tables`), the encoder records of its
    images by index (ImageWork from encoders/stage.py, or a VisionInput), and the indices
    its chunks have reached."""

    block_table: list[int] = field(default_factory=list)
    group_tables: list[list[int]] = field(default_factory=list)
    images: list[object] = field(default_factory=list)
    reached: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class StepInputs:
    """One forward's inputs, self-contained: no scheduler object inside. Host tensors:
    `run` copies them to the device, on the forward thread in stream order, so building
    the next step's inputs never waits behind the step in flight (a copy from pageable
    memory synchronises its stream)."""

    token_ids: torch.Tensor  # [num_tokens]; `pending_rows` hold stand-ins
    # (row, item index in the step before): async scheduling, the row's token is what
    # that item sampled, known only once that step has run.
    pending_rows: list[tuple[int, int]]
    positions: torch.Tensor  # [num_tokens]
    metadata: object  # the attention backend's, for this step's layout, built on the host
    # (rows, the image's embeddings on the device, which of them go to those rows)
    image_rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    sample_rows: torch.Tensor  # [num_sampling_rows + prompt logit rows]
    nano: NanoStep | None = None  # the step's nano-batches (None: the plain path)
    # Prompt logprobs: (request id, first position, count) per item that wants them; their
    # rows follow the sampling rows in `sample_rows`, in this order.
    prompt_spans: tuple[tuple[str, int, int], ...] = ()


class ModelRunner:
    def __init__(self, config: EngineConfig, group: TPGroup | None = None) -> None:
        """`group`: this process is one rank of a tensor-parallel group (vlmserve/parallel)
        and holds that rank's shard of the decoder and of the KV cache."""
        self.device = torch.device(config.model.device)
        if self.device.type == "cpu":
            keep_activations_in_heap()
        self.dtype = config.model.torch_dtype
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.backend = select_backend(
            self.device, config.model.attention_backend, self.dtype,
            head_dim_of(config.model.path), config.cache.block_size)  # fmt: skip
        check_dtypes(config, self.dtype, self.kv_dtype, self.backend.name)
        shard = None if group is None else TPShard(group.rank, group.size)
        self.model: LoadedModel = load_model(
            config.model.path, self.dtype, self.device, self.backend, shard,
            config.model.weight_format,
        )  # fmt: skip
        if group is not None:
            shard_decoder(self.model.decoder, group)
        # The longest prompt + output served: the flag, capped by the checkpoint's context
        # (the one place this is decided; the engine reads it here).
        context = self.model.decoder.cfg.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or context, context)
        # CPU kernel choices measured on this CPU at the model's shapes (kernels/calibration)
        cfg = self.model.decoder.cfg
        choose_attention_paths(self.backend, config.model.attention_backend, self.dtype,
                               cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)  # fmt: skip
        if config.model.pack_weights and self.device.type == "cpu":
            decoder = self.model.decoder
            pack_linears(decoder, plain=config.model.plain_weights)
            if not isinstance(decoder.lm_head, QuantLinear):  # a quantized head is its own
                decoder.lm_head = logits_head(decoder.lm_head, decoder.embed_tokens.weight)
            if self.model.vision is not None:
                self.model.vision.pack_weights()
        # The decoder takes its eager path wherever the kernels do not apply or build.
        self.model.decoder.fused = config.model.fused_ops
        self.nano_batcher: NanoBatcher | None = None
        self.num_nano_steps = 0
        # KV cache groups (scheduler/kv_blocks.py): one for a model whose layers all attend
        # alike; Gemma 3's global and sliding layers in groups of one kind, each group with
        # its own block tables and metadata (LayeredMetadata), sharing one pool.
        self.kv_layout = kv_layout(cfg.layer_windows, cfg.num_layers)
        self.kv_windows = self.kv_layout.windows
        self._max_step_tokens = config.scheduler.max_num_batched_tokens
        # The nano-batched layers and the decode graphs run Llama-shaped layers only.
        llama_layers = self.model.decoder.cfg.variant == "llama"
        schedules = nano_schedules(config, self.device) if llama_layers else None
        if schedules:
            self.nano_batcher = NanoBatcher(schedules, self.backend)
            # On a CPU the streams share the cores torch was given (one each on 2 cores).
            streams = self.nano_batcher.num_streams
            threads = max(1, torch.get_num_threads() // streams)
            self.nano_executor = NanoExecutor(streams, self.device, threads)
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or self._blocks_that_fit(config)
        if group is not None:  # every rank's pool holds the same blocks
            self.num_blocks = group.min_int(self.num_blocks)
        # Per layer, in the backend's layout (torch: [2, num_kv_heads, num_slots, head_dim]);
        # slot = block * size + offset. Layers of different groups share tensors
        # (vlmserve/worker/kv_groups.py); with one group each layer has its own.
        shape = self.backend.kv_cache_shape(
            self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.kv_caches = allocate_kv_caches(self.kv_layout, shape, self.kv_dtype, self.device)
        # Per request id: the block table and images, from the plans (StepPlan deltas).
        self._requests: dict[str, _RequestState] = {}
        self.graphs = None  # CUDA graphs of the decode step (vlmserve/worker/cuda_graphs.py)
        if (
            self.device.type == "cuda" and config.model.cuda_graphs and config.model.fused_ops
            and llama_layers
        ):  # fmt: skip
            if self.backend.name == "triton":
                from vlmserve.worker.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(
                    self.model.decoder, self.kv_caches, config.scheduler.max_num_seqs,
                    self.max_model_len, self.block_size,
                )  # fmt: skip
        # Pooled image embeddings of prompts still in prefill, by (request id, image index).
        self._image_embeds: dict[tuple[str, int], torch.Tensor] = {}
        self.num_encoded_images = 0
        # Pooled image embeddings by image content + settings, across requests.
        self.encoder_cache = EncoderCache(config.encoder.cache_bytes)
        self.encoder_stage = (
            EncoderStage(self.model.vision, self.encoder_cache, self.device, self.dtype)
            if self.model.vision is not None
            else None
        )

    @property
    def block_bytes(self) -> int:
        cfg = self.model.decoder.cfg
        elem = torch.finfo(self.kv_dtype).bits // 8
        layers = self.kv_layout.layers_per_block  # all of them with one KV cache group
        return 2 * layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        """A GPU pool takes 85% of free memory; a CPU pool what `cache.memory_bytes` holds,
        but no more than max_num_seqs sequences of max_model_len tokens fill at once (a
        1 GiB pool for a model that can use 64 MiB is 1 GiB of resident memory for
        nothing)."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * 0.85) // self.block_bytes)
        per_seq = seq_peak_blocks(
            self.kv_windows, self.block_size, self.max_model_len, self._max_step_tokens
        )
        return kv_pool_num_blocks(
            config.cache.memory_bytes, self.block_bytes, self.block_size,
            config.scheduler.max_num_seqs, self.max_model_len, per_seq,
        )  # fmt: skip

    def add_request(self, request_id: str, images: Sequence[object] = ()) -> None:
        """A new request under `request_id` and the encoder records of its images, in
        order (what a plan's image chunks name by index). Whatever the runner kept of an
        earlier request under that id goes."""
        self._forget(request_id)
        self._requests[request_id] = _RequestState(images=list(images))

    def begin_step(self, plan: StepPlan) -> dict[str, Exception]:
        """Apply `plan`'s finished and preempted requests, then encode its images
        (`encode_images`: returns the requests whose images failed)."""
        for request_id in plan.finished:
            self._forget(request_id)
        for request_id in plan.preempted:
            self._preempt(request_id)
        return self.encode_images(plan)

    def _forget(self, request_id: str) -> None:
        """Drop per-request state (finished or aborted)."""
        self._requests.pop(request_id, None)
        self._drop_embeds(request_id)

    def _drop_embeds(self, request_id: str) -> None:
        for key in [k for k in self._image_embeds if k[0] == request_id]:
            del self._image_embeds[key]

    def _preempt(self, request_id: str) -> None:
        """The request lost its KV: pin the encoder-cache entries of the images it reached
        to it (as a hit at arrival is pinned), so its recompute never runs the tower again,
        and drop its block table and embeddings; its image records stay."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for index in state.reached:
            work = state.images[index]
            if isinstance(work, ImageWork) and work.embedding is None:
                work.embedding = self.encoder_cache.peek(work.cache_key)
        state.block_table.clear()
        state.group_tables.clear()
        self._drop_embeds(request_id)

    @torch.inference_mode()
    def prepare(
        self,
        plan: StepPlan,
        in_flight: Mapping[str, int] | None = None,
        prompt_logits: Mapping[str, int] | None = None,
    ) -> StepInputs:
        """The tensors of `plan`'s forward (its images already encoded by `encode_images`);
        applies the plan's block-table deltas. `in_flight` (async scheduling): the item
        index, in the step still running, of each request whose last token that step is
        sampling; its row is filled from that step's output in `run`. `prompt_logits`:
        request id -> its number of prompt tokens, for the requests that want the logits of
        every prompt position (prompt logprobs), returned after the sampling rows."""
        token_ids, positions, slots, sample_rows = [], [], [], []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        query_lens, context_lens, block_tables = [], [], []
        spans: list[list[tuple[int, int]]] = []
        image_rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        pending_rows: list[tuple[int, int]] = []
        groups = GroupBatch(self.kv_layout, self.block_size)  # KV cache groups 1..
        row = 0
        for item in plan.scheduled:
            state = self._requests.setdefault(item.request_id, _RequestState())
            table = state.block_table
            apply_delta(table, item.block_table)
            n, start, end = item.num_new_tokens, item.num_computed_tokens, item.end
            if item.group_block_tables:
                groups.add(state.group_tables, item.group_block_tables, start, end)
            token_ids += item.token_ids
            if len(item.token_ids) + len(item.draft_token_ids) < n:
                assert in_flight is not None and item.request_id in in_flight, (
                    f"{item.request_id}: no token"
                )
                assert len(item.token_ids) + 1 == n, f"{item.request_id}: more than one pending"
                pending_rows.append((row + len(item.token_ids), in_flight[item.request_id]))
                token_ids.append(0)  # a stand-in until `run`
            token_ids += item.draft_token_ids
            positions.extend(range(start, end))
            slots.extend(slots_of(table, start, end, self.block_size))
            query_lens.append(n)
            context_lens.append(end)
            block_tables.append(table)
            spans.append(list(image_spans(item.images)) if self.model.bidirectional_images else [])
            for chunk in item.images:
                embeds = self._image_embeds[(item.request_id, chunk.index)]
                rows = torch.tensor(chunk.positions, dtype=torch.long) - start + row
                offsets = torch.arange(chunk.offset_start, chunk.offset_start + len(rows))
                image_rows.append((rows, embeds, offsets))
                if chunk.is_last:  # the tensors above hold on to the embeddings
                    del self._image_embeds[(item.request_id, chunk.index)]
            num_prompt = (prompt_logits or {}).get(item.request_id)
            if num_prompt is not None and start < num_prompt - 1:
                # Rows for positions start .. num_prompt - 2: each scores the next token.
                count = min(end, num_prompt - 1) - start
                prompt_rows.extend(range(row, row + count))
                prompt_spans.append((item.request_id, start, count))
            row += n
            if item.sample:
                sample_rows.extend(range(row - 1 - len(item.draft_token_ids), row))
        batch = AttentionBatch(
            query_lens, context_lens, block_tables, self.block_size,
            spans=spans if any(spans) else None,
        )  # fmt: skip
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        metadata = groups.metadata(self.backend, batch, slot_mapping)  # per KV cache group
        nano = self.nano_batcher.plan(batch, slot_mapping) if self.nano_batcher else None
        return StepInputs(
            torch.tensor(token_ids, dtype=torch.long), pending_rows,
            torch.tensor(positions, dtype=torch.long), metadata, image_rows,
            torch.tensor(sample_rows + prompt_rows, dtype=torch.long), nano, tuple(prompt_spans),
        )  # fmt: skip

    @torch.inference_mode()
    def run(
        self,
        inputs: StepInputs,
        previous: list[list[int] | Exception] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        """The forward pass of prepared inputs; returns logits [num_sampling_rows, vocab]
        in plan order: one row per sampling item, 1 + len(draft_token_ids) rows for a
        speculating one; with `greedy`, each of those rows' argmax instead ([rows] long).
        `previous`: the tokens the step before emitted, per item (None when it failed),
        for the pending rows."""
        self._fill_pending_rows(inputs, previous)
        device, decoder = self.device, self.model.decoder
        ids = inputs.token_ids
        if (
            self.graphs is not None
            and inputs.nano is None
            and not inputs.image_rows
            and self.graphs.fits(inputs.metadata)
        ):
            hidden = self.graphs.run(ids, inputs.positions, inputs.metadata)
            return _head(decoder, hidden[inputs.sample_rows.to(device)], greedy)
        embeds = decoder.embed(ids.to(device))  # [num_tokens, hidden]
        for rows, values, offsets in inputs.image_rows:
            embeds[rows.to(device)] = values[offsets.to(device)]
        metadata = inputs.metadata if device.type == "cpu" else _to_device(inputs.metadata, device)
        nano = None
        if inputs.nano is not None:
            step = inputs.nano if device.type == "cpu" else _to_device(inputs.nano, device)
            nano = functools.partial(self.nano_executor.run_layers, step=step)
            self.num_nano_steps += 1
        hidden = decoder(embeds, inputs.positions.to(device), metadata, self.kv_caches, nano)
        return _head(decoder, hidden[inputs.sample_rows.to(device)], greedy)

    @staticmethod
    def _fill_pending_rows(
        inputs: StepInputs, previous: list[list[int] | Exception] | None
    ) -> None:
        """Write the tokens the step before sampled into `inputs`' pending rows, in place
        (async scheduling); none left pending after."""
        if not inputs.pending_rows:
            return
        rows, filled = [], []
        for row, index in inputs.pending_rows:
            tokens = previous[index] if previous is not None else None
            # No token (that step or this request's sampling failed): the request is
            # failed when the engine takes that step's output; this row is dropped.
            rows.append(row)
            filled.append(tokens[0] if isinstance(tokens, list) and tokens else 0)
        inputs.token_ids[rows] = torch.tensor(filled, dtype=torch.long)

    def close(self) -> None:
        """Release what outlives the object (tensor-parallel worker processes); no-op here."""

    def encode_images(self, plan: StepPlan) -> dict[str, Exception]:
        """Run the vision tower once over every image this step's chunks need. Returns
        the requests whose images failed (decode error, tower error, wrong embedding
        count) by id: the engine fails those alone and runs the step without them."""
        wanted: list[tuple[tuple[str, int], object, int]] = []  # key, record, num_tokens
        for item in plan.scheduled:
            for chunk in item.images:
                key = (item.request_id, chunk.index)
                if key not in self._image_embeds:
                    state = self._requests[item.request_id]
                    work = state.images[chunk.index]
                    assert not isinstance(work, ImageWork) or work.cache_key == chunk.cache_key, (
                        f"{item.request_id}: image {chunk.index} is not the plan's"
                    )
                    wanted.append((key, work, chunk.num_tokens))
                    state.reached.add(chunk.index)
        if not wanted:
            return {}
        try:
            self._encode(wanted)
            return {}
        except Exception:  # noqa: BLE001 - find the culprits: each request's images alone
            pass
        failures: dict[str, Exception] = {}
        for request_id in dict.fromkeys(key[0] for key, _, _ in wanted):
            try:
                self._encode([want for want in wanted if want[0][0] == request_id])
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                failures[request_id] = e
        return failures

    def _encode(self, wanted: list[tuple[tuple[str, int], object, int]]) -> None:
        if self.encoder_stage is None:
            raise RequestError("this model is text-only and cannot take images")
        embeds = self.encoder_stage.encode([work for _, work, _ in wanted])  # cache + tower
        for (_, _, num_tokens), emb in zip(wanted, embeds, strict=True):
            if emb.shape[0] != num_tokens:
                raise RuntimeError(
                    f"image gave {emb.shape[0]} embeddings for {num_tokens} placeholders"
                )
        for (key, _, _), emb in zip(wanted, embeds, strict=True):
            self._image_embeds[key] = emb.to(self.dtype)
        self.num_encoded_images += len(wanted)


def _head(decoder: Decoder, hidden: torch.Tensor, greedy: bool) -> torch.Tensor:
    return decoder.compute_argmax(hidden) if greedy else decoder.compute_logits(hidden)


def _to_device(value: object, device: torch.device) -> object:
    """`value` (a tensor, or lists and dataclasses holding them) with its tensors on
    `device`: attention metadata built on the host, for the forward."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **fields)
    return value
