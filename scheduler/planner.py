"""Continuous batching: one StepPlan per iteration.

Order within a step: running sequences that need a single token (decodes) first, then
running prefills continue their chunks (each group by arrival), then waiting sequences are
admitted while the dense token budget, the encoder tile budget and the KV pool allow, in
the order and with the reservation the admission policy gives (`scheduler.admission`).
A sequence whose images are still being decoded (`ready` False) is never admitted.
When a running sequence cannot grow, the policy picks a victim among the running
sequences this step has not visited yet and the sequence itself (lumpy: the least
recompute; fcfs: the newest). A victim loses its KV, goes to the front of the waiting
queue and is recomputed later (article §19); a step that preempts admits no one.

Prefill chunks stop before an image that would pass the step's tile budget
(`scheduler.encoder_budget`). Under lumpy admission, sequences not admitted as quick
share the step's lump allowance (`scheduler.lump_budget`, `scheduler.step_room`), quick
ones may use the KV headroom lumps must leave, and a step that carries a quick request's
first token leaves the lumps out (`scheduler.admission`): it plans the running non-lumps,
then starts quick requests, and only when none needs its first token does it go on to the
lumps and the other admissions.

With speculation on, a decode may also carry n-gram drafts (article §15): its query rows
are its last token plus the drafts, they count against the budget, and blocks are grown
for them; `update` keeps the KV of the accepted ones and rolls the rest back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from scheduler import step_room
from scheduler.admission import AdmissionPolicy, FcfsAdmission, LumpyAdmission
from scheduler.admit_waiting import WaitingAdmission
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from scheduler.encoder_budget import cut_chunk
from scheduler.in_flight import LaunchedStep, advance, resolve
from scheduler.kv_blocks import BlockManager
from scheduler.lump_budget import StepCost, StepShape, plan_shape, sliding_window
from scheduler.ngram import NgramProposer
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import span_safe_end
from scheduler.spec_policy import SpecMetrics, SpecPolicy, SpeedupFn
from scheduler.step_plan import ScheduledSeq, StepPlan, schedule_item
from scheduler.step_room import Room


def make_admission(config: SchedulerConfig, cache: CacheConfig, num_blocks: int) -> AdmissionPolicy:
    """The policy `config.admission` names."""
    if config.admission == "fcfs":
        return FcfsAdmission(num_blocks, cache.watermark)
    lump_prefill = config.lump_prefill_tokens_per_step if config.enable_chunked_prefill else None
    return LumpyAdmission(
        num_blocks, cache.block_size, cache.watermark, config.decode_reserve_tokens,
        config.lump_headroom, lump_prefill, config.lump_yields_to_quick,
    )  # fmt: skip


class Scheduler(WaitingAdmission):
    """Plans each step over the waiting and running sequences; owns the block manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        admission: AdmissionPolicy | None = None,
        speculative: SpeculativeConfig | None = None,
        encoder_cached: Callable[[bytes], bool] | None = None,
        spec_speedup: SpeedupFn | None = None,
        step_cost: StepCost | None = None,
        clock: Callable[[], float] | None = None,
        kv_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """`kv_windows`: each KV cache group's sliding window (None: full attention), as
        `config.kv_cache_groups` groups the model's layers; one group by default."""
        self.config = config
        # Seconds a step of a given shape takes (TPOT guard) and the time now (slack
        # against TTFT targets): injected by the engine and the simulator.
        self.step_cost, self.clock = step_cost, clock
        self.block_manager = BlockManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, kv_windows,
            config.max_num_batched_tokens,
        )  # fmt: skip
        bm = self.block_manager
        # The blocks sequences can hold: a hybrid pool's null block is never free, and a
        # policy counting it would ask a lump that fills the pool for one block too many.
        self.admission = admission or make_admission(config, cache, bm.num_usable_blocks)
        if isinstance(self.admission, LumpyAdmission) and bm.null_block is not None:
            # Hybrid KV: the longest sequence whose blocks over every group can be reserved.
            usable = bm.num_usable_blocks - self.admission.watermark_blocks
            self.admission.max_reservable_tokens = bm.max_tokens_within(usable)
        # Whether the encoder cache holds an image (by ImagePlaceholder.content_hash).
        self.encoder_cached = encoder_cached or (lambda _: False)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Every unfinished sequence by request id: a StepPlan names them by id.
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed KV thrown away by preemption
        # Finished since the last plan, for the next one (`StepPlan.finished`); in order.
        self._finished_ids: dict[str, None] = {}
        self.proposer: NgramProposer | None = None
        self.spec_policy: SpecPolicy | None = None
        self.max_drafts = 0
        if speculative is not None and speculative.enabled:
            drafts = speculative.num_speculative_tokens
            assert drafts is not None, "the default γ is settled by resolve_speculation first"
            self.max_drafts = drafts
            self.proposer = NgramProposer(speculative.min_n, speculative.max_n)
            # The engine fills in B* for its device; without one the ridge never gates.
            ridge = speculative.ridge_batch if speculative.ridge_batch is not None else math.inf
            self.spec_policy = SpecPolicy(speculative, ridge, spec_speedup)
        # request id -> the most tokens (prompt + output) the sequence may reach.
        self._max_num_tokens: dict[str, int] = {}
        # request id -> the position its current admission started computing at.
        self._admitted_at: dict[str, int] = {}
        # Running sequences admitted as quick: they may use the lump headroom and their
        # prefill is not capped.
        self._quick_ids: set[str] = set()
        # Waiting requests the last admission held back for KV (the pool or the head's
        # reservation), not for room in the step: short steps would not start them sooner.
        self._kv_blocked: set[str] = set()
        self._yielded = False  # the previous step held lumps back for a quick request
        self.lump_budget = step_room.make_lump_budget(config, self.admission.lump_prefill_tokens)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size can never be served here (None: it can): its whole
        length over the KV pool, its prompt (the lump admission must reserve at once)
        over the pool less the watermark, or a prompt over the step budget with chunked
        prefill off. Pure: the engine refuses with it at arrival (400), the simulator the
        same way."""
        bm = self.block_manager
        needed = bm.footprint(num_prompt_tokens + max_tokens)
        if needed > bm.num_usable_blocks:
            return (
                f"request needs {needed} KV blocks ({num_prompt_tokens} prompt + {max_tokens} "
                f"output tokens), the KV pool holds {bm.num_usable_blocks}"
            )
        lump = bm.footprint(num_prompt_tokens)
        usable = bm.num_usable_blocks - self.admission.watermark_blocks
        if lump > usable:
            return (
                f"prompt needs {lump} KV blocks at once ({num_prompt_tokens} tokens), the KV "
                f"pool holds {bm.num_usable_blocks} of which {usable} can be reserved (the "
                "rest is the watermark)"
            )
        sched = self.config
        if not sched.enable_chunked_prefill and num_prompt_tokens > sched.max_num_batched_tokens:
            return (
                f"prompt is {num_prompt_tokens} tokens, over max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} with chunked prefill off"
            )
        return None

    def add(self, seq: Sequence, max_num_tokens: int | None = None) -> None:
        """Queue `seq`; `max_num_tokens` caps prompt + output (drafts never pass it)."""
        seq.status = "waiting"
        seq.num_waiting_steps = 0
        if seq.arrival_time is None and self.clock is not None:
            seq.arrival_time = self.clock()
        self.waiting.append(seq)
        self.seqs[seq.request_id] = seq
        self._finished_ids.pop(seq.request_id, None)  # a new request under a finished id
        if max_num_tokens is not None:
            self._max_num_tokens[seq.request_id] = max_num_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Async scheduling: `plan`'s step goes in flight (`in_flight.advance`)."""
        return advance(plan, self.seqs)

    def land(self, step: LaunchedStep, sampled: list[list[int]]) -> None:
        """A launched step came back with `sampled` per item (`in_flight.resolve`)."""
        resolve(step, sampled, self.seqs, self.block_manager)

    def stats(self) -> dict[str, float]:
        """Queue and KV-pool gauges, preemption counters (the engine's `stats()`)."""
        bm = self.block_manager
        used = bm.num_usable_blocks - bm.num_free_blocks
        stats = {
            "waiting": float(len(self.waiting)), "running": float(len(self.running)),
            "num_blocks": float(bm.num_usable_blocks), "free_blocks": float(bm.num_free_blocks),
            "used_blocks": float(used), "kv_usage": used / bm.num_usable_blocks,
            "num_preemptions": float(self.num_preemptions),
            "recomputed_tokens_total": float(self.num_recomputed_tokens),
        }  # fmt: skip
        if bm.null_block is not None:  # hybrid KV: held per kind of group, now and at most
            for kind, held in bm.in_use_by_kind().items():
                stats[f"kv_blocks_in_use_{kind}"] = float(held)
                stats[f"kv_blocks_peak_{kind}"] = float(bm.peak_by_kind[kind])
        return stats

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Speculation counters; None when off."""
        return self.spec_policy.metrics if self.spec_policy is not None else None

    def finish(self, seq: Sequence) -> None:
        """Retire `seq` (done, aborted or failed): its blocks return to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = "finished"
        self.seqs.pop(seq.request_id, None)
        self._finished_ids[seq.request_id] = None
        self._max_num_tokens.pop(seq.request_id, None)
        self._admitted_at.pop(seq.request_id, None)
        self._quick_ids.discard(seq.request_id)
        if self.proposer is not None and self.spec_policy is not None:
            self.proposer.drop(seq.request_id)
            self.spec_policy.drop(seq.request_id)

    def recompute_cost(self, seq: Sequence) -> int:
        """Computed tokens of `seq` that preempting it would throw away: all of them but
        the leading blocks another live sequence also holds (those stay cached)."""
        shared = self._shared_leading_blocks(seq) * self.block_size
        return max(0, seq.num_computed_tokens - shared)

    def _preempt(self, seq: Sequence) -> None:
        self.num_recomputed_tokens += self.recompute_cost(seq)
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._admitted_at.pop(seq.request_id, None)
        self._quick_ids.discard(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = "waiting"
        seq.num_waiting_steps = 0
        self.waiting.appendleft(seq)

    def _is_cached(self, image: ImagePlaceholder) -> bool:
        return self.encoder_cached(image.content_hash)

    def _chunk(self, seq: Sequence, start: int, room: Room, lump: bool) -> tuple[int, int] | None:
        """(tokens, tiles) of `seq`'s chunk from `start` this step, or None: none fits."""
        admitted_at = self._admitted_at.get(seq.request_id, start)

        def cut(n: int) -> tuple[int, int]:  # stop before an image past the tile budget
            if not seq.images or n == 0:
                return n, 0
            end, tiles = cut_chunk(
                seq.images, start, start + n, admitted_at, self._is_cached,
                room.tiles_used, room.tile_budget,
            )  # fmt: skip
            if seq.spans:  # never half an image (scheduler/spans.py)
                end = span_safe_end(seq.spans, start, end)
            return end - start, tiles

        todo, chunked = seq.num_tokens - start, self.config.enable_chunked_prefill
        return step_room.size_chunk(start, todo, room.room_for(lump), chunked, cut, room, lump)

    def step_shape(self, plan: StepPlan) -> StepShape:
        """The shape of `plan` (call before `update`): what a step-cost model prices."""
        return plan_shape(plan, self.seqs, sliding_window(self.block_manager.windows))

    def schedule(self) -> StepPlan:
        cap, cost = self.admission.lump_prefill_tokens, self.step_cost
        room = step_room.new_room(
            self.config, self.lump_budget, cap, cost, self._caps_wanted,
            step_room.tpot_limit_s(self.running, self.config.slo.tpot_s, self.clock),
            sliding_window(self.block_manager.windows),
        )  # fmt: skip
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        queue = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival))
        step_gamma = self._step_gamma(queue, room.tokens)
        # Lumps may sit this step out for a quick request's first token, never two running.
        may_yield = self.admission.yields_to_quick and not self._yielded and room.capped
        lumps = [s for s in queue if may_yield and self._is_lump(s)]
        queue = [s for s in queue if s not in lumps] if lumps else queue
        self._run(queue, lumps, room, step_gamma, scheduled, preempted)
        yielded = False
        if may_yield:
            if not preempted:
                scheduled += self._admit(room, quick_only=True)
            first_tokens = any(
                item.request_id in self._quick_ids
                and self.seqs[item.request_id].num_output_tokens == 0
                for item in scheduled
            )
            yielded = first_tokens and (
                bool(lumps) or any(not c.quick for c, _ in self._candidates())
            )
            if not yielded:
                self._run(lumps, [], room, step_gamma, scheduled, preempted)
        self._yielded = yielded
        if not preempted and not yielded:
            scheduled += self._admit(room)
        now = self.clock() if self.clock is not None else None
        for seq in (s for s in self.waiting if s.ready):
            # With a TTFT target the aging clock starts at the deadline: before it, the
            # slack order serves the request (an earlier deadline always goes first).
            if (slack := step_room.slack_s(seq, self.config.slo, now)) is None or slack < 0:
                seq.num_waiting_steps += 1
        if self.block_manager.null_block is not None:
            self.block_manager.note_peak()  # hybrid KV: the step's blocks, before releases
        finished, self._finished_ids = tuple(self._finished_ids), {}
        return StepPlan(scheduled, tuple(seq.request_id for seq in preempted), finished)

    def _caps_wanted(self, guarded: bool) -> tuple[bool, bool]:
        """(needed, suspended). Needed: a quick request waits ready to start (and was not
        held back for KV last step) or runs without its first token yet, and is urgent
        (`step_room.is_urgent`); or one decodes with no TPOT guard to keep its steps short
        (`guarded`: there is one). Suspended: this step goes without the caps, since they
        would hold back a lump with less slack than every quick request they serve
        (`step_room.caps_suspended`); the hysteresis still counts the need."""
        slo, now = self.config.slo, self.clock() if self.clock is not None else None
        wanting: list[float | None] = []  # the slack of each quick request needing them
        for s in self.running:
            if s.request_id not in self._quick_ids:
                continue
            if not guarded:
                return True, False
            if s.num_output_tokens == 0 and step_room.is_urgent(s, slo, now):
                wanting.append(step_room.slack_s(s, slo, now))
        found = self._candidates()
        wanting += [
            c.slack_s for c, _ in found
            if c.quick and c.seq.request_id not in self._kv_blocked
            and step_room.is_urgent(c.seq, slo, now)
        ]  # fmt: skip
        prefill_time = self._prefill_time()
        lumps = [c.slack_s for c, _ in found if not c.quick] + [
            step_room.slack_s(
                s, slo, now, prefill_time(s.num_computed_tokens, s.num_uncomputed_tokens)
            )
            for s in self.running
            if self._is_lump(s)
        ]
        return bool(wanting), step_room.caps_suspended(wanting, lumps)

    def _is_lump(self, seq: Sequence) -> bool:
        """A running prefill not admitted as quick (its chunks share the lump cap)."""
        return seq.num_uncomputed_tokens > 1 and seq.request_id not in self._quick_ids

    def _run(
        self,
        queue: list[Sequence],
        spare: list[Sequence],
        room: Room,
        step_gamma: int,
        scheduled: list[ScheduledSeq],
        preempted: list[Sequence],
    ) -> None:
        """Schedule the running sequences of `queue` in order. A sequence that cannot grow
        preempts a victim among those not visited yet, in `queue` or `spare` (running
        sequences this pass leaves for later), or itself."""
        while queue and room.tokens > 0:
            seq = queue.pop(0)
            if seq.num_pending_tokens and seq.num_tokens >= self._max_num_tokens.get(
                seq.request_id, math.inf
            ):
                continue  # async: its last token is in flight, it finishes when that lands
            lump, start = self._is_lump(seq), seq.num_computed_tokens
            # Blocks that fell out of a sliding group's window go back before it grows.
            self.block_manager.release_skipped(seq)
            chunk = self._chunk(seq, start, room, lump)
            if chunk is None:
                continue  # chunking off, or its next image waits for a step with tower room
            num_new, tiles = chunk
            room.tiles_used += tiles
            total = seq.num_computed_tokens + num_new
            sample = total == seq.num_tokens
            drafts: tuple[int, ...] = ()
            if step_gamma and seq.num_uncomputed_tokens == 1:
                drafts = self._drafts(seq, min(step_gamma, room.tokens - 1))
                # Speculation never preempts anyone: no room, no drafts.
                if drafts and self.block_manager.can_grow(seq, total + len(drafts)):
                    num_new, total = num_new + len(drafts), total + len(drafts)
                else:
                    drafts = ()
            while not self.block_manager.can_grow(seq, total):
                victim = self.admission.victim([*queue, *spare], seq, self.recompute_cost)
                if victim is not seq:
                    (queue if victim in queue else spare).remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            self.block_manager.grow(seq, total)
            scheduled.append(schedule_item(seq, num_new, sample, drafts))
            room.spend(start, num_new, tiles, lump, decode=seq.num_uncomputed_tokens <= 1)

    def update(self, plan: StepPlan, sampled: list[list[int]]) -> None:
        """Advance after the runner executed `plan`: `sampled[i]` are the tokens accepted
        for `plan.scheduled[i]` (empty for a prefill chunk that does not sample)."""
        for item, tokens in zip(plan.scheduled, sampled, strict=True):
            seq, drafts = self.seqs[item.request_id], item.draft_token_ids
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
            if tokens and seq.first_token_time is None and self.clock is not None:
                seq.first_token_time = self.clock()
            # Only accepted tokens are hashed: the hashes stop at num_computed_tokens.
            hashes = extend_block_hashes(seq, seq.num_computed_tokens, self.block_size)
            self.block_manager.register_seq(hashes, seq)
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
        if not seq.may_draft:
            return ()
        limit = self._max_num_tokens.get(seq.request_id)
        if limit is not None:  # this step emits up to drafts + 1 tokens: never overshoot
            max_drafts = min(max_drafts, limit - seq.num_tokens - 1)
        gamma = self.spec_policy.seq_gamma(seq.request_id, max(0, max_drafts))
        return self.proposer.propose(seq, gamma)
