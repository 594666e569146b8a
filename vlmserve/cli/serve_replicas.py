"""`vlmserve serve --replicas N [--ray ADDRESS]`: N engine replicas on Ray Serve behind
one OpenAI door (`vlmserve.replicas`), routed by `--router`."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from vlmserve.config import EngineConfig

log = logging.getLogger("vlmserve")


def front_door(handle: Any, server: Any, deployment: str | None = None) -> Any:
    """The front door over a started deployment (`launch.start_replicas`): its replica
    counts, and each upload priced in visual tokens as its replicas' engine counts them."""
    from vlmserve.replicas import launch
    from vlmserve.replicas.front import create_front_app

    name = deployment or launch.DEPLOYMENT_NAME
    profile = launch.routing_profile(name)
    return create_front_app(
        handle, lambda: launch.num_running(name), lambda: launch.live_replica_ids(name),
        server.api_key, server.max_body_bytes,
        image_tokens=profile.image_tokens if profile is not None else None,
    )  # fmt: skip


def serve_replicas(args: argparse.Namespace, engine: EngineConfig, server) -> int:
    import uvicorn

    from vlmserve.replicas.launch import LOCAL, ReplicaConfig, start_replicas, stop

    config = ReplicaConfig(
        num_replicas=args.replicas,
        address=args.ray or LOCAL,
        router=args.router,
        max_imbalance=args.router_max_imbalance,
        load_factor=args.router_load_factor,
        cpus_per_replica=args.ray_cpus_per_replica,
        gpus_per_replica=args.ray_gpus_per_replica,
    )  # ValueError: a message, exit 2
    log.info("starting %d replicas on Ray (%s), router %s", config.num_replicas,
             config.address, config.router)  # fmt: skip
    handle = start_replicas(engine, server, config)
    front = front_door(handle, server, config.deployment_name)
    uvicorn_server = uvicorn.Server(
        uvicorn.Config(front, host=args.host, port=args.port, log_level="info")
    )
    try:
        uvicorn_server.run()
    except KeyboardInterrupt:
        pass
    finally:
        stop(shutdown_ray=config.address == LOCAL)
    return 0
