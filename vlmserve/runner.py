"""The model runner: owns the device, the weights and the KV cache; turns a StepPlan
into one forward pass and returns the logits of the rows that sample.

A speculating decode's drafts are just more query rows of that sequence: they are fed
after its last token (they are not in `seq.token_ids`, which holds accepted tokens only)
and each of its 1 + len(drafts) rows returns logits, for verification."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

from encoders.cache import EncoderCache
from encoders.errors import RequestError
from encoders.stage import EncoderStage, ImageWork
from kernels.attention import AttentionBatch, select_backend
from kernels.packed_linear import pack_linears
from scheduler.config import kv_pool_num_blocks
from scheduler.planner import StepPlan
from scheduler.sequence import ImagePlaceholder, Sequence
from vlmserve.config import EngineConfig
from vlmserve.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)

# glibc mallopt parameters, and ours: a prefill step's activations (up to 32 MiB each at
# 2,048 tokens) stay in the heap between steps, and up to 512 MiB of free heap is kept.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 64 << 20, 512 << 20


@functools.cache
def keep_activations_in_heap() -> bool:
    """By default glibc serves each allocation over 32 MiB with fresh zeroed pages from the
    kernel and returns them on free: at a 2,048-token prefill step that is ~120k page
    faults (~470 MB of page zeroing) per step on this CPU, about 5% of the step. Raising
    the mmap and trim thresholds lets freed activations be reused (the fault count drops
    to ~0), as tcmalloc, which vLLM's CPU build preloads, does. Process-wide, once;
    False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt here (%s): CPU activations use the default allocator", name)
        return False


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.device = torch.device(config.model.device)
        if self.device.type == "cpu":
            keep_activations_in_heap()
        self.dtype = config.model.torch_dtype
        self.backend = select_backend(self.device, config.model.attention_backend)
        self.model: LoadedModel = load_model(
            config.model.path, self.dtype, self.device, self.backend
        )
        if config.model.pack_weights and self.device.type == "cpu":
            pack_linears(self.model.decoder)
            if self.model.vision is not None:
                self.model.vision.pack_weights()
        # The decoder takes its eager path wherever the kernels do not apply or build.
        self.model.decoder.fused = config.model.fused_ops
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or self._blocks_that_fit(config)
        cfg = self.model.decoder.cfg
        # Per layer, in the backend's layout (torch: [2, num_kv_heads, num_slots, head_dim]);
        # slot = block * size + offset.
        shape = self.backend.kv_cache_shape(
            self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)
        ]
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
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _blocks_that_fit(self, config: EngineConfig) -> int:
        """A GPU pool takes 85% of free memory; a CPU pool what `cache.memory_bytes` holds,
        but no more than max_num_seqs sequences of max_model_len tokens fill at once (a
        1 GiB pool for a model that can use 64 MiB is 1 GiB of resident memory for
        nothing)."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * 0.85) // self.block_bytes)
        context = self.model.decoder.cfg.max_position_embeddings
        max_model_len = min(config.model.max_model_len or context, context)
        return kv_pool_num_blocks(
            config.cache.memory_bytes, self.block_bytes, self.block_size,
            config.scheduler.max_num_seqs, max_model_len,
        )  # fmt: skip

    def release(self, request_id: str) -> None:
        """Forget per-request state (finished, aborted or preempted)."""
        for key in [k for k in self._image_embeds if k[0] == request_id]:
            del self._image_embeds[key]

    def preempt(self, seq: Sequence) -> None:
        """`seq` lost its KV: pin its images' encoder-cache entries to it (as a hit at
        arrival is pinned), so its recompute never runs the tower again, then forget it."""
        for image in seq.images:
            work = image.data
            if isinstance(work, ImageWork) and work.embedding is None:
                work.embedding = self.encoder_cache.peek(work.cache_key)
        self.release(seq.request_id)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run `plan` (its images already encoded by `encode_images`); returns logits
        [num_sampling_rows, vocab] in plan order: one row per sampling item,
        1 + len(draft_token_ids) rows for a speculating one."""
        token_ids, positions, slots, sample_rows = [], [], [], []
        query_lens, context_lens, block_tables = [], [], []
        image_rows: list[tuple[torch.Tensor, torch.Tensor, tuple[str, int]]] = []
        row = 0
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            token_ids += seq.token_ids[start:end]  # drafts lie past the end of token_ids
            token_ids += item.draft_token_ids
            pos = torch.arange(start, end)
            positions.append(pos)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            context_lens.append(end)
            block_tables.append(seq.block_table)
            for index, image in enumerate(seq.images):
                where = _rows_in_chunk(image, start, end)
                if where is not None:
                    offsets, chunk_pos = where
                    image_rows.append((offsets, chunk_pos - start + row, (seq.request_id, index)))
            row += n
            if item.sample:
                sample_rows.extend(range(row - 1 - len(item.draft_token_ids), row))

        decoder = self.model.decoder
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        embeds = decoder.embed(ids)  # [num_tokens, hidden]
        for offsets, rows, key in image_rows:
            embeds[rows.to(self.device)] = self._image_embeds[key][offsets.to(self.device)]
        batch = AttentionBatch(query_lens, context_lens, block_tables, self.block_size)
        slot_mapping = torch.cat(slots)
        metadata = self.backend.build_metadata(batch, slot_mapping, self.device)
        hidden = decoder(embeds, torch.cat(positions).to(self.device), metadata, self.kv_caches)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = decoder.compute_logits(hidden[rows])
        self._drop_finished_images(plan)
        return logits

    def encode_images(self, plan: StepPlan) -> dict[str, Exception]:
        """Run the vision tower once over every image this step's chunks need. Returns
        the requests whose images failed (decode error, tower error, wrong embedding
        count) by id: the engine fails those alone and runs the step without them."""
        wanted: list[tuple[tuple[str, int], ImagePlaceholder]] = []
        for item in plan.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            for index, image in enumerate(seq.images):
                key = (seq.request_id, index)
                if key not in self._image_embeds and _rows_in_chunk(image, start, end):
                    wanted.append((key, image))
        if not wanted:
            return {}
        try:
            self._encode(wanted)
            return {}
        except Exception:  # noqa: BLE001 - find the culprits: each request's images alone
            pass
        failures: dict[str, Exception] = {}
        for request_id in dict.fromkeys(key[0] for key, _ in wanted):
            try:
                self._encode([(key, image) for key, image in wanted if key[0] == request_id])
            except Exception as e:  # noqa: BLE001 - this request's failure alone
                failures[request_id] = e
        return failures

    def _encode(self, wanted: list[tuple[tuple[str, int], ImagePlaceholder]]) -> None:
        if self.encoder_stage is None:
            raise RequestError("this model is text-only and cannot take images")
        embeds = self.encoder_stage.encode([image.data for _, image in wanted])  # cache + tower
        for (_, image), emb in zip(wanted, embeds, strict=True):
            if emb.shape[0] != image.num_tokens:
                raise RuntimeError(
                    f"image gave {emb.shape[0]} embeddings for {image.num_tokens} placeholders"
                )
        for (key, _), emb in zip(wanted, embeds, strict=True):
            self._image_embeds[key] = emb.to(self.dtype)
        self.num_encoded_images += len(wanted)

    def _drop_finished_images(self, plan: StepPlan) -> None:
        for item in plan.scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            for index, image in enumerate(seq.images):
                if image.positions and image.positions[-1] < end:
                    self._image_embeds.pop((seq.request_id, index), None)


def _rows_in_chunk(
    image: ImagePlaceholder, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(offsets into the image's embeddings, prompt positions) of its placeholders inside
    [start, end), or None when the chunk holds none of them."""
    if not image.positions or image.positions[-1] < start or image.positions[0] >= end:
        return None
    positions = torch.tensor(image.positions, dtype=torch.long)
    inside = (positions >= start) & (positions < end)
    if not inside.any():
        return None
    return inside.nonzero().squeeze(1), positions[inside]
