"""Continuous batching: one StepPlan per iteration.

Order within a step: running sequences that need a single token (decodes) first, then
running prefills continue their chunks (each group by arrival), then waiting sequences are
admitted while the dense token budget and the KV pool allow. When a running sequence
cannot grow, the victim is the latest-arrived running sequence this step has not visited
yet (never one already scheduled); with none left, the sequence itself. A victim loses
its KV, goes to the front of the waiting queue and is recomputed later (article §19); a
step that preempts admits no one.

With speculation on, a decode may also carry n-gram drafts (article §15): its query rows
are its last token plus the drafts, they count against the budget, and blocks are grown
for them; `update` keeps the KV of the accepted ones and rolls the rest back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from scheduler.admission import AdmissionPolicy, FcfsAdmission
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from scheduler.kv_blocks import BlockManager
from scheduler.ngram import NgramProposer
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecPolicy


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query rows this step: tokens [num_computed, num_computed + n)
    sample: bool  # the chunk reaches the last token, so a next token is sampled
    # Guessed tokens after the last one: they fill the last len(drafts) query rows and
    # join seq.token_ids only once accepted. Non-empty only for a sampling decode.
    draft_token_ids: tuple[int, ...] = ()


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
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.admission = admission or FcfsAdmission(num_blocks, cache.watermark)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.proposer: NgramProposer | None = None
        self.spec_policy: SpecPolicy | None = None
        if speculative is not None and speculative.enabled:
            self.proposer = NgramProposer(speculative.min_n, speculative.max_n)
            # The engine fills in B* for its device; without one the ridge never gates.
            ridge = speculative.ridge_batch if speculative.ridge_batch is not None else math.inf
            self.spec_policy = SpecPolicy(speculative, ridge)
        # request id -> the most tokens (prompt + output) the sequence may reach.
        self._max_num_tokens: dict[str, int] = {}

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def add(self, seq: Sequence, max_num_tokens: int | None = None) -> None:
        """Queue `seq`; `max_num_tokens` caps prompt + output (drafts never pass it)."""
        seq.status = "waiting"
        self.waiting.append(seq)
        if max_num_tokens is not None:
            self._max_num_tokens[seq.request_id] = max_num_tokens

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
        self._max_num_tokens.pop(seq.request_id, None)
        if self.proposer is not None and self.spec_policy is not None:
            self.proposer.drop(seq.request_id)
            self.spec_policy.drop(seq.request_id)

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
        step_gamma = self._step_gamma(queue, budget)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            total = seq.num_computed_tokens + num_new
            sample = total == seq.num_tokens
            drafts: tuple[int, ...] = ()
            if step_gamma and seq.num_uncomputed_tokens == 1:
                drafts = self._drafts(seq, min(step_gamma, budget - 1))
                # Speculation never preempts anyone: no room, no drafts.
                if drafts and self.block_manager.can_grow(seq, total + len(drafts)):
                    num_new, total = num_new + len(drafts), total + len(drafts)
                else:
                    drafts = ()
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
            scheduled.append(ScheduledSeq(seq, num_new, sample, drafts))
            budget -= num_new
        if not preempted:
            scheduled += self._admit(budget)
        return StepPlan(scheduled, preempted)

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        bm, scheduled = self.block_manager, []
        # Blocks that admitted prompts have yet to take are spoken for.
        # (A speculating sequence may hold more than its tokens need: that is not a credit.)
        reserved = sum(
            max(0, bm.blocks_for(s.num_tokens) - len(s.block_table)) for s in self.running
        )
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
            seq, drafts = item.seq, item.draft_token_ids
            if drafts:
                assert tokens, f"{seq.request_id}: a speculating decode must emit a token"
                # `tokens` = accepted drafts + one more, so the KV of the last real token
                # and of the accepted drafts is valid: exactly len(tokens) new slots.
                seq.num_computed_tokens += len(tokens)
                accepted = 0
                while accepted < min(len(drafts), len(tokens)) and (
                    tokens[accepted] == drafts[accepted]
                ):
                    accepted += 1
                assert self.spec_policy is not None
                self.spec_policy.record(seq.request_id, len(drafts), accepted)
            else:
                seq.num_computed_tokens += item.num_new_tokens
            seq.token_ids.extend(tokens)
            # Only accepted tokens are hashed: the hashes stop at num_computed_tokens.
            hashes = extend_block_hashes(seq, seq.num_computed_tokens, self.block_size)
            self.block_manager.register(hashes, seq.block_table)
            if drafts:  # roll back the blocks grown only for rejected drafts
                self.block_manager.shrink(seq, seq.num_computed_tokens)

    # -- speculation ----------------------------------------------------------------------

    def _step_gamma(self, queue: list[Sequence], budget: int) -> int:
        """γ allowed this step by the ridge: decodes plus the prefill rows likely to fill
        the rest of the budget must stay under B*."""
        if self.spec_policy is None:
            return 0
        num_decodes = sum(1 for s in queue if s.num_uncomputed_tokens == 1)
        backlog = sum(s.num_uncomputed_tokens for s in queue if s.num_uncomputed_tokens > 1)
        backlog += sum(s.num_tokens for s in self.waiting)
        other_rows = min(backlog, max(0, budget - num_decodes))
        return self.spec_policy.step_gamma(num_decodes, other_rows)

    def _drafts(self, seq: Sequence, max_drafts: int) -> tuple[int, ...]:
        assert self.proposer is not None and self.spec_policy is not None
        limit = self._max_num_tokens.get(seq.request_id)
        if limit is not None:  # this step emits up to drafts + 1 tokens: never overshoot
            max_drafts = min(max_drafts, limit - seq.num_tokens - 1)
        gamma = self.spec_policy.seq_gamma(seq.request_id, max(0, max_drafts))
        return self.proposer.propose(seq, gamma)
