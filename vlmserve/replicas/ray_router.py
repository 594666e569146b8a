"""The replica routing policy as a Ray Serve request router (`RequestRouter`, Ray Serve's
pluggable routing API, as Ray Serve LLM's `PrefixCacheAffinityRouter` is one).

Ray Serve runs it in the process that holds the deployment handle (here the front door)
and asks `choose_replicas` for ranks of replicas per request; this one asks the pure
policy (`scheduler.routing.policy.ReplicaRouter`) with each replica's queue length
(Ray Serve's cached figure, probed where it has none), its KV use (the `kv_usage` its
`record_routing_stats` last reported) and the request's `route` keys,
and returns the choice first and the others, lightest first, as the fallback rank
(a replica at `max_ongoing_requests` refuses and the next rank is tried).
Its model of each replica's encoder cache (`RouterConfig.encoder_cache_tokens`) is sized
from the replicas' own report (`launch.start_replicas` hands it over once they run).
`on_request_routed` records where the keys went; a replica that dies or leaves the
replica set loses its entries (its restart comes back with a new id and cold caches).
A call with `target=<replica id>` goes to that replica only (the front door's /metrics).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from scheduler.routing.policy import ReplicaRouter, RouteKeys, RouterConfig
from vlmserve.replicas.launch import register_router, routing_profile

__all__ = ["CacheAwareRequestRouter"]

log = logging.getLogger(__name__)


class CacheAwareRequestRouter(RequestRouter):
    """Ray Serve's side of `ReplicaRouter`: kinds `cache_aware`, `prefix`, `pow2`."""

    def initialize_state(
        self,
        kind: str = "cache_aware",
        max_imbalance: int = 2,
        load_factor: float = 0.25,
        max_keys: int = 200_000,
        max_sessions: int = 50_000,
        seed: int | None = None,
    ) -> None:
        config = RouterConfig(
            kind, max_imbalance, load_factor, max_keys=max_keys, max_sessions=max_sessions
        )
        self.policy = ReplicaRouter(config, seed)
        self.decisions: dict[str, int] = {}
        # Ray Serve pickles this module by value: the registry lives in one it does not.
        name = self._deployment_id.name
        register_router(name, self)
        profile = routing_profile(name)  # known already when Serve makes a router anew
        if profile is not None:
            self.use_encoder_cache(profile.encoder_cache_tokens)

    def use_encoder_cache(self, tokens: int | None) -> None:
        """Model each replica's encoder cache as `tokens` visual tokens (None: no model)."""
        if self.policy.config.kind == "cache_aware":
            self.policy.set_encoder_cache_tokens(tokens)

    @property
    def replica_ids(self) -> list[str]:
        return sorted(rid.unique_id for rid in self._replica_id_set)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        loads = await self._queue_lengths(candidate_replicas)
        if not loads:  # no replica answered its probe: Ray Serve backs off and retries
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        route = kwargs.get("route")
        kv = {r.replica_id.unique_id: float(r.routing_stats.get("kv_usage", 0.0))
              for r in candidate_replicas}  # fmt: skip
        keys = route if isinstance(route, RouteKeys) else RouteKeys()
        decision = self.policy.choose(keys, loads, kv)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        # The fallback rank: the rest, lightest first, by the load the policy weighs.
        weighed = (
            self.policy.loads(loads, kv) if self.policy.config.kind == "cache_aware" else loads
        )
        rest = sorted((r for r in loads if r != decision.replica), key=weighed.__getitem__)
        return [[by_id[decision.replica]], [by_id[r] for r in rest]]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """{replica id: ongoing requests}: the cache's figure, else a probe's."""
        loads: dict[str, int] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    loads[r.replica_id.unique_id] = n
        return loads

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        route: Any = pending_request.kwargs.get("route")
        if isinstance(route, RouteKeys):
            self.policy.record(route, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Called on each new routing-stats report too: the tables are walked only when the
        # replica set changed.
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        if live != getattr(self, "_live", None):
            self._live = live
            self.policy.keep_only(live)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove_replica(replica_id.unique_id)
