"""Continuous batching: one StepPlan per iteration.

Order within a step: sequences that need a single token (decodes) first, then running
prefills continue their chunks, then waiting sequences are admitted while the dense
token budget and the KV pool allow. When a running sequence cannot grow, the most
recently arrived running sequence is preempted and later recomputed (article §19).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.admission import AdmissionPolicy, FcfsAdmission
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.kv_blocks import BlockManager
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query rows this step: tokens [num_computed, num_computed + n)
    sample: bool  # the chunk reaches the last token, so a next token is sampled


@dataclass(frozen=True)
class StepPlan:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.config = config
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.admission = admission or FcfsAdmission(num_blocks, cache.watermark)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Retire `seq` (done, aborted or failed): its blocks return to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = "finished"

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = "waiting"
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        queue = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival))
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            total = seq.num_computed_tokens + num_new
            while not self.block_manager.can_grow(seq, total):
                victim = max(queue, key=lambda s: s.arrival) if queue else seq
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            self.block_manager.grow(seq, total)
            scheduled.append(ScheduledSeq(seq, num_new, total == seq.num_tokens))
            budget -= num_new
        if not preempted:
            scheduled += self._admit(budget)
        return StepPlan(scheduled, preempted)

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        bm, scheduled = self.block_manager, []
        # Blocks that admitted prompts have yet to take are spoken for.
        reserved = sum(bm.blocks_for(s.num_tokens) - len(s.block_table) for s in self.running)
        available = bm.num_free_blocks - reserved
        for seq in list(self.admission.candidates(self.waiting)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hashes = extend_block_hashes(seq, seq.num_tokens, self.block_size)
            # Keep at least one token to compute: its logits give the next token.
            matched = bm.match_prefix(hashes)[: (seq.num_tokens - 1) // self.block_size]
            cost = bm.cost_of(matched, seq.num_tokens)
            num_cached = len(matched) * self.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if num_new < seq.num_tokens - num_cached and not self.config.enable_chunked_prefill:
                break
            if not self.admission.can_admit(seq, cost, available):
                break
            bm.take(seq, matched)
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            bm.grow(seq, num_cached + num_new)
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = "running"
            scheduled.append(ScheduledSeq(seq, num_new, num_cached + num_new == seq.num_tokens))
            budget -= num_new
            available -= cost
        return scheduled

    def update(self, plan: StepPlan, sampled: list[list[int]]) -> None:
        """Advance after the runner executed `plan`: `sampled[i]` are the tokens accepted
        for `plan.scheduled[i]` (empty for a prefill chunk that does not sample)."""
        for item, tokens in zip(plan.scheduled, sampled, strict=True):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            hashes = extend_block_hashes(seq, seq.num_computed_tokens, self.block_size)
            self.block_manager.register(hashes, seq.block_table)
            seq.token_ids.extend(tokens)
