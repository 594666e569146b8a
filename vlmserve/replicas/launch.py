"""Start N engine replicas as a Ray Serve deployment routed by our request router.

On a local cluster started here (no address) or on a running one (`auto`,
`HEAD_IP:6379`): each replica is a Ray actor holding the CPUs (`cpus_per_replica`, also
its torch threads, as Ray sets OMP_NUM_THREADS) or GPUs it asks for, spread by Ray over
the cluster's nodes. Ray Serve's own HTTP proxy is off: the front door
(`vlmserve.replicas.front`) is the HTTP server and holds the deployment handle, so the
request router runs in its process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from scheduler.routing.policy import ROUTERS
from vlmserve.config import EngineConfig
from vlmserve.replicas.image_cost import RoutingProfile

__all__ = [
    "APP_NAME",
    "DEPLOYMENT_NAME",
    "LOCAL",
    "ReplicaConfig",
    "live_replica_ids",
    "num_running",
    "register_router",
    "routing_profile",
    "start_replicas",
    "stop",
]

APP_NAME = "vlmserve"
DEPLOYMENT_NAME = "vlmserve-engine"
LOCAL = "local"
# Ray Serve imports the request router by name (and pickles its module by value, so the
# registry below lives here, not there).
ROUTER_CLASS = "vlmserve.replicas.ray_router.CacheAwareRequestRouter"
_ROUTERS: dict[str, Any] = {}  # deployment name -> the request router this process holds
_PROFILES: dict[str, RoutingProfile] = {}  # deployment name -> what its replicas reported


def register_router(deployment: str, router: Any) -> None:
    """Called by the request router when Ray Serve creates it (in the handle's process)."""
    _ROUTERS[deployment] = router


def routing_profile(deployment: str = DEPLOYMENT_NAME) -> RoutingProfile | None:
    """The replicas' image pricing and encoder-cache size (None before they run)."""
    return _PROFILES.get(deployment)


def _use_profile(deployment: str, profile: RoutingProfile) -> None:
    _PROFILES[deployment] = profile
    router = _ROUTERS.get(deployment)
    if router is not None:
        router.use_encoder_cache(profile.encoder_cache_tokens)


def live_replica_ids(deployment: str = DEPLOYMENT_NAME) -> list[str]:
    """The replicas this process's request router routes to ([] before its first call)."""
    router = _ROUTERS.get(deployment)
    return [] if router is None else router.replica_ids


def router_decisions(deployment: str = DEPLOYMENT_NAME) -> dict[str, int]:
    """Requests routed so far, by reason (session, image, prefix, balance)."""
    router = _ROUTERS.get(deployment)
    return {} if router is None else dict(router.decisions)


@dataclass(frozen=True)
class ReplicaConfig:
    num_replicas: int = 2
    address: str = LOCAL  # a running cluster ("auto", "HEAD_IP:6379"), or start one here
    router: str = "cache_aware"  # cache_aware | prefix | pow2 (scheduler.routing.policy)
    max_imbalance: int = 2  # prefix: requests its queue may exceed the shortest by
    load_factor: float = 0.25  # cache_aware: eps of its bounded loads
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_ongoing_requests: int = 256  # per replica; the engine queues behind its KV pool
    health_check_period_s: float = 2.0
    seed: int | None = None  # the router's power-of-two draws
    # A process keeps one request router per deployment name: a second deployment with
    # another router in the same process (the benchmark's runs) needs its own name.
    deployment_name: str = DEPLOYMENT_NAME

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--replicas {self.num_replicas}: must be >= 1")
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.max_imbalance < 0:
            raise ValueError(f"--router-max-imbalance {self.max_imbalance}: must be >= 0")
        if self.load_factor < 0:
            raise ValueError(f"--router-load-factor {self.load_factor}: must be >= 0")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ValueError("--ray-cpus-per-replica must be > 0 and GPUs >= 0")


def start_replicas(engine: EngineConfig, server: Any, config: ReplicaConfig) -> Any:
    """Connect to (or start) the cluster, deploy the replicas and return the deployment
    handle once every replica is RUNNING (engine loaded)."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from vlmserve.replicas.replica import EngineReplica

    if not ray.is_initialized():
        ray.init(**_init_kwargs(config))
    serve.start(proxy_location="Disabled")
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={
            "kind": config.router,
            "max_imbalance": config.max_imbalance,
            "load_factor": config.load_factor,
            "seed": config.seed,
        },
        # Each replica's KV use (`EngineReplica.record_routing_stats`), this often.
        request_routing_stats_period_s=1.0,
    )
    deployment = serve.deployment(
        EngineReplica,
        name=config.deployment_name,
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": config.cpus_per_replica,
            "num_gpus": config.gpus_per_replica,
        },
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=router,
    )
    handle = serve.run(deployment.bind(engine, server), name=APP_NAME, route_prefix=None)
    # One replica's report (every replica runs the same engine config); the call also
    # makes the request router here, which the report then sizes before any request.
    _use_profile(config.deployment_name, handle.routing_profile.remote().result(timeout_s=60))
    return handle


def _init_kwargs(config: ReplicaConfig) -> dict[str, Any]:
    common: dict[str, Any] = {"logging_level": "WARNING", "include_dashboard": False}
    # Replicas import this checkout: the driver's PYTHONPATH travels with them.
    env = {k: os.environ[k] for k in ("PYTHONPATH", "VLMSERVE_DEVICE") if k in os.environ}
    if env:
        common["runtime_env"] = {"env_vars": env}
    if config.address != LOCAL:
        return {"address": config.address, **common}
    need = config.num_replicas * config.cpus_per_replica
    return {"address": LOCAL, "num_cpus": max(os.cpu_count() or 1, int(need + 0.999)), **common}


def num_running(deployment: str = DEPLOYMENT_NAME) -> int:
    """Replicas Ray Serve counts RUNNING (health-checked) now."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or deployment not in app.deployments:
        return 0
    return int(app.deployments[deployment].replica_states.get("RUNNING", 0))


def stop(shutdown_ray: bool = True) -> None:
    """Tear the deployment down, and with `shutdown_ray` Serve and the cluster started
    here; on someone else's cluster only our application goes."""
    import ray
    from ray import serve

    try:
        if shutdown_ray:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        if shutdown_ray and ray.is_initialized():
            ray.shutdown()
