"""`vlmserve serve --replicas N [--ray ADDRESS]`: N engine replicas on Ray Serve behind
one OpenAI door (`vlmserve.replicas`), routed by `--router`."""

from __future__ import annotations

import argparse
import logging

from vlmserve.config import EngineConfig

log = logging.getLogger("vlmserve")


def serve_replicas(args: argparse.Namespace, engine: EngineConfig, server) -> int:
    import uvicorn

    from vlmserve.replicas.front import create_front_app
    from vlmserve.replicas.launch import (
        LOCAL,
        ReplicaConfig,
        live_replica_ids,
        num_running,
        start_replicas,
        stop,
    )

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
    front = create_front_app(
        handle, num_running, live_replica_ids, server.api_key, server.max_body_bytes
    )
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
