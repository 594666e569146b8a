"""N engine replicas behind a request router, on simulated time.

Each replica is the one-engine trace simulator (`search.sim.trace_sim`: the real
scheduler, its prefix cache, an encoder-cache LRU, a preprocessing queue) with its own
clock; the router is `scheduler.routing.policy.ReplicaRouter`, the class Ray Serve's
request router runs in `vlmserve serve --replicas N`. Requests are routed in arrival
order: every replica first runs up to the arrival (its step in flight then counts as
done), the router sees each replica's queue (requests routed to it and not finished,
Ray Serve's "ongoing requests") and the keys the front door would see, and the request
joins the chosen replica's arrivals. The encoder cache is counted where the engine
counts it: a hit is an image found in the chosen replica's cache when it arrives.

`oracle=True` is the ceiling no router reaches: a request with images goes to a replica
whose encoder cache holds them now (it peeks into the caches, ignoring load), else to
the router's choice.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from scheduler.routing.policy import Decision, ReplicaRouter, RouterConfig
from scheduler.routing.route_keys import keys_from_sequence
from search.sim.step_time import StepHardware
from search.sim.trace_sim import SimConfig, SimResult, _Sim, make_sequence
from search.sim.traces import TraceRequest

__all__ = ["ClusterResult", "simulate_cluster"]


@dataclass
class ClusterResult:
    replicas: list[SimResult]
    num_routed: list[int]  # requests each replica was sent
    reasons: dict[str, int]  # routing decisions by reason (session, image, prefix, balance)
    num_image_lookups: int = 0
    num_image_hits: int = 0
    hang: bool = False
    records: list = field(default_factory=list)
    # (image lookups, hits) per request in arrival order: the steady state is the later half
    image_hits_by_request: list[tuple[int, int]] = field(default_factory=list)

    def merged(self) -> SimResult:
        """The replicas as one SimResult (records of all, counts summed, the KV pool and
        timeline of replica 0) for `search.sim.capacity.summarize`."""
        first = self.replicas[0]
        return SimResult(
            records=self.records,
            num_blocks=first.num_blocks,
            num_steps=sum(r.num_steps for r in self.replicas),
            end_s=max(r.end_s for r in self.replicas),
            num_preemptions=sum(r.num_preemptions for r in self.replicas),
            num_recomputed_tokens=sum(r.num_recomputed_tokens for r in self.replicas),
            num_tiles_encoded=sum(r.num_tiles_encoded for r in self.replicas),
            hang=self.hang,
            timeline=first.timeline,
        )

    def summary(self) -> dict:
        """The benchmark's figures: cache hit rates, TTFT p50/p99 (s), throughput
        (output tokens/s over the run), load imbalance (max / mean requests a replica)."""
        done = [r for r in self.records if r.finish_s is not None]
        ttfts = sorted(r.ttft_s for r in done)
        prompt = sum(r.num_prompt_tokens for r in done)
        end = max(s.end_s for s in self.replicas)
        start = min(r.arrival_s for r in self.records)
        mean = sum(self.num_routed) / len(self.num_routed)
        half = len(self.image_hits_by_request) // 2  # past the caches' cold start
        return {
            "num_replicas": len(self.replicas),
            "num_requests": len(self.records),
            "num_finished": len(done),
            "encoder_cache_hit_rate": self.num_image_hits / max(1, self.num_image_lookups),
            "encoder_cache_hit_rate_2nd_half": _rate(self.image_hits_by_request[half:]),
            "prefix_cache_hit_rate": sum(r.num_cached_tokens for r in done) / max(1, prompt),
            "ttft_p50_s": _quantile(ttfts, 0.50),
            "ttft_p99_s": _quantile(ttfts, 0.99),
            "throughput_tok_s": sum(r.num_output_tokens for r in done) / max(1e-9, end - start),
            "imbalance": max(self.num_routed) / mean if mean else math.nan,
            "requests_per_replica": list(self.num_routed),
            "reasons": dict(self.reasons),
            "tiles_encoded": sum(s.num_tiles_encoded for s in self.replicas),
            "hang": self.hang,
        }


def _rate(lookups_hits: list[tuple[int, int]]) -> float:
    return sum(h for _, h in lookups_hits) / max(1, sum(n for n, _ in lookups_hits))


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=1000, method="inclusive")[round(q * 1000) - 1]


def simulate_cluster(
    trace: list[TraceRequest],
    hw: StepHardware,
    num_replicas: int,
    router: RouterConfig | None = None,
    config: SimConfig | None = None,
    seed: int = 0,
    oracle: bool = False,
) -> ClusterResult:
    """Route `trace` over `num_replicas` simulated engines with `router` (default: ours)."""
    router = RouterConfig() if router is None else router
    config = SimConfig() if config is None else config
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be >= 1")
    if not trace:
        raise ValueError("the trace holds no requests")
    sims = [_Sim([], hw, config) for _ in range(num_replicas)]
    for sim in sims:
        sim.pending = []  # arrivals, latest first (the one-engine loop pops the earliest)
    policy = ReplicaRouter(router, seed=seed)
    routed = [0] * num_replicas
    reasons: dict[str, int] = {}
    lookups = hits = 0
    by_request: list[tuple[int, int]] = []
    hang = False
    for index, req in enumerate(sorted(trace, key=lambda r: r.arrival_s)):
        for sim in sims:
            hang |= sim.advance(req.arrival_s)
        seq = make_sequence(req, hw, config.pooling_ratio, index)
        keys = keys_from_sequence(seq, config.block_size, session=req.session_id)
        queues = {i: _queue(s) for i, s in enumerate(sims)}
        decision = policy.choose(keys, queues, {i: _kv_usage(s) for i, s in enumerate(sims)})
        if oracle and seq.images:
            decision = _oracle(sims, seq, queues) or decision
        policy.record(keys, decision.replica)
        chosen = sims[decision.replica]
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        routed[decision.replica] += 1
        found = sum(chosen.encoder_cache.contains(img.content_hash) for img in seq.images)
        lookups, hits = lookups + len(seq.images), hits + found
        by_request.append((len(seq.images), found))
        chosen.pending.insert(0, req)
    results = []
    for sim in sims:
        hang |= sim.advance(math.inf)
        results.append(sim.result(hang))
    records = [r for res in results for r in res.records]
    return ClusterResult(results, routed, reasons, lookups, hits, hang, records, by_request)


def _oracle(sims: list[_Sim], seq, queues: dict[int, int]) -> Decision | None:
    """The replica whose encoder cache holds most of `seq`'s images now (the shorter
    queue among equals), if any holds one."""
    held = {
        i: sum(sim.encoder_cache.contains(img.content_hash) for img in seq.images)
        for i, sim in enumerate(sims)
    }
    best = max(held, key=lambda i: (held[i], -queues[i]))
    return Decision(best, "image") if held[best] else None


def _kv_usage(sim: _Sim) -> float:
    """The share of the replica's KV pool held by requests now."""
    bm = sim.scheduler.block_manager
    return (bm.num_usable_blocks - bm.num_free_blocks) / max(1, bm.num_usable_blocks)


def _queue(sim: _Sim) -> int:
    """Requests at the replica and not finished (arrived, preparing, waiting, running)."""
    sched = sim.scheduler
    preparing = 0 if sim.honours_ready else len(sim.preparing)
    return len(sim.pending) + preparing + len(sched.waiting) + len(sched.running)
