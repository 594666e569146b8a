"""`vlmserve serve`: the OpenAI-compatible HTTP server on uvicorn. If the engine fails to
load or dies, the server stops and the command exits 1."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from scheduler.routing.policy import ROUTERS
from vlmserve.cli.engine_args import add_engine_args, engine_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` command."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible chat completions HTTP server", description=__doc__
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLMSERVE_API_KEY"),
        help="bearer token required on /v1 routes (default: $VLMSERVE_API_KEY, else none)",
    )
    p.add_argument("--max-pending-requests", type=int, default=256, help="over it: 429")
    p.add_argument("--max-body-mb", type=int, default=64)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.set_defaults(warmup=True)  # --no-warmup: /health turns 200 without it
    media = p.add_argument_group("media (image_url)")
    media.add_argument("--allowed-local-media-path", default=None, help="file:// root")
    media.add_argument(
        "--allowed-media-domains", nargs="*", default=[], help="host allow-list (and subdomains)"
    )
    media.add_argument(
        "--allowed-media-networks",
        nargs="*",
        default=[],
        help="CIDRs exempt from the no-private-address rule, e.g. 10.0.0.0/8",
    )
    media.add_argument("--allow-http-media", action="store_true", help="plain http:// too")
    media.add_argument("--media-timeout", type=float, default=10.0, help="seconds per fetch")
    media.add_argument("--max-media-mb", type=int, default=20)
    replicas = p.add_argument_group("replicas on Ray Serve (pip install -e '.[serve]')")
    replicas.add_argument(
        "--replicas", type=int, default=1, metavar="N",
        help="N engine replicas as a Ray Serve deployment behind this one HTTP door",
    )  # fmt: skip
    replicas.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="run the replicas on Ray: a cluster started here, or the running cluster at "
        "ADDRESS ('auto' or HEAD_IP:6379)",
    )  # fmt: skip
    replicas.add_argument(
        "--router", choices=ROUTERS, default="cache_aware",
        help="which replica serves a request: cache_aware (image content, prompt prefix, "
        "session, bounded by load), prefix (text prefix only), pow2 (Ray Serve's default)",
    )  # fmt: skip
    replicas.add_argument(
        "--router-max-imbalance", type=int, default=2, metavar="N",
        help="prefix router: affinity yields when its replica's queue exceeds the shortest "
        "by more than N",
    )  # fmt: skip
    replicas.add_argument(
        "--router-load-factor", type=float, default=0.25, metavar="EPS",
        help="cache_aware router: affinity only while the replica's load (queue + KV use) "
        "and its share of recent requests stay within (1 + EPS) x the mean",
    )  # fmt: skip
    replicas.add_argument("--ray-cpus-per-replica", type=float, default=1.0, metavar="N")
    replicas.add_argument("--ray-gpus-per-replica", type=float, default=0.0, metavar="N")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from vlmserve.engine.core import Engine
    from vlmserve.server.app import ServerConfig, create_app
    from vlmserve.server.media import MediaPolicy

    engine_config = engine_config_from_args(args)  # ValueError here: a message, exit 2
    media = MediaPolicy(
        timeout_s=args.media_timeout,
        max_bytes=args.max_media_mb << 20,
        allowed_domains=tuple(args.allowed_media_domains),
        allowed_networks=tuple(args.allowed_media_networks),
        allow_http=args.allow_http_media,
        allowed_local_dir=args.allowed_local_media_path,
        max_image_pixels=args.max_image_pixels,  # the engine flag: one cap for both
    )
    config = ServerConfig(
        model_name=args.served_model_name or Path(args.model).resolve().name,
        api_key=args.api_key or None,
        media=media,
        max_images_per_request=args.max_images_per_request,
        max_pending_requests=args.max_pending_requests,
        max_body_bytes=args.max_body_mb << 20,
        default_max_tokens=args.default_max_tokens,
    )
    if args.replicas > 1 or args.ray is not None:
        from vlmserve.cli.serve_replicas import serve_replicas

        return serve_replicas(args, engine_config, config)
    # A dead engine stops the server, which exits non-zero (never a live port in front
    # of a dead engine): a supervisor (systemd, Kubernetes) restarts it.
    deaths: list[BaseException] = []

    def on_engine_death(cause: BaseException) -> None:
        deaths.append(cause)
        server.should_exit = True

    _log_engine_info()
    app = create_app(lambda: Engine(engine_config), config, on_engine_death)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C during the graceful shutdown
        pass
    if deaths:
        print(f"error: the engine failed ({type(deaths[0]).__name__}: {deaths[0]}); "
              "see the log above", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _log_engine_info() -> None:
    """The engine's start-up lines (dtype and why, the warm-up's duration) beside
    uvicorn's own, at INFO (Python's default shows warnings only)."""
    logger = logging.getLogger("vlmserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
