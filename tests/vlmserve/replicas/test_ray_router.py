"""Ray Serve's side of the routing policy, without a cluster: what `choose_replicas` hands
the policy (queue lengths from Ray Serve's cache, KV use from the replicas' routing stats)
and the ranks it returns."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

import pytest

pytest.importorskip("ray.serve")

from scheduler.routing.policy import ReplicaRouter, RouteKeys, RouterConfig  # noqa: E402
from vlmserve.replicas.ray_router import CacheAwareRequestRouter  # noqa: E402


class Rid(NamedTuple):  # hashable, as Ray Serve's ReplicaID
    unique_id: str


def request_router(queues: dict[str, int], kv: dict[str, float]):
    """A CacheAwareRequestRouter with its Ray Serve state stood in for: replicas whose
    queue lengths Ray Serve has cached and whose routing stats report `kv`."""
    router = object.__new__(CacheAwareRequestRouter)  # Ray Serve's constructor needs a cluster
    router.policy = ReplicaRouter(RouterConfig(), seed=0)
    router.decisions = {}
    replicas = [
        SimpleNamespace(replica_id=Rid(name), routing_stats={"kv_usage": u})
        for name, u in kv.items()
    ]
    router._replica_queue_len_cache = {
        r.replica_id: queues[r.replica_id.unique_id] for r in replicas
    }
    return router, replicas


def test_the_replicas_kv_use_reaches_the_policy_and_the_fallback_rank():
    router, replicas = request_router({"a": 2, "b": 2, "c": 1}, {"a": 1.0, "b": 0.0, "c": 0.0})
    request = SimpleNamespace(kwargs={"route": RouteKeys()})
    ranks = set()
    for _ in range(30):
        chosen = asyncio.run(router.choose_replicas(replicas, request))
        ranks.add(tuple(tuple(r.replica_id.unique_id for r in rank) for rank in chosen))
    # Loads: a 2 + 4 x 1.0 (its full KV pool), b 2, c 1: power of two never picks a, and
    # the fallback rank is the rest by that load.
    assert ranks <= {(("b",), ("c", "a")), (("c",), ("b", "a"))} and len(ranks) == 2
    assert router.decisions == {"balance": 30}


def test_the_replicas_report_sizes_the_encoder_cache_model_whenever_the_router_is_made(
    monkeypatch,
):
    from vlmserve.replicas import launch
    from vlmserve.replicas.image_cost import RoutingProfile

    monkeypatch.setattr(launch, "_ROUTERS", {})
    monkeypatch.setattr(launch, "_PROFILES", {})

    def made(name: str, kind: str = "cache_aware") -> CacheAwareRequestRouter:
        router = object.__new__(CacheAwareRequestRouter)  # as Ray Serve makes it
        router._deployment_id = SimpleNamespace(name=name)
        router.initialize_state(kind=kind)
        return router

    # The usual order: the router is made by the first call, then the report arrives.
    first = made("a")
    assert first.policy.config.encoder_cache_tokens is None
    launch._use_profile("a", RoutingProfile(None, 4096))
    assert first.policy.config.encoder_cache_tokens == 4096
    # A router Ray Serve makes afresh later finds the report already there.
    assert made("a").policy.config.encoder_cache_tokens == 4096
    assert made("b").policy.config.encoder_cache_tokens is None  # another deployment's
    launch._use_profile("p", RoutingProfile(None, 4096))
    assert made("p", kind="prefix").policy.config.encoder_cache_tokens is None  # not ours
