"""`nanollmserve router --worker URL [--worker URL ...]`: one OpenAI-compatible endpoint in
front of several `nanollmserve serve` workers (`nanollmserve.router`).

It binds its port first (a busy port fails at once with one line), checks every worker's
/health once, then serves; workers that are not up yet join when they answer. SIGINT /
SIGTERM drain it (`--shutdown-timeout`), then stop it. The API keys can come from the
environment (`NANOLLMSERVE_API_KEY`, `NANOLLMSERVE_WORKER_API_KEY`,
`NANOLLMSERVE_ADMIN_API_KEY`, `NANOLLMSERVE_WORKER_ADMIN_API_KEY`), which keeps them off the
command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from nanollmserve.errors import UserError
from nanollmserve.sizes import parse_size
from nanollmserve.tracing.flags import add_tracing_args, tracer_from_args

API_KEY_ENV = "NANOLLMSERVE_API_KEY"
WORKER_API_KEY_ENV = "NANOLLMSERVE_WORKER_API_KEY"
ADMIN_API_KEY_ENV = "NANOLLMSERVE_ADMIN_API_KEY"
WORKER_ADMIN_API_KEY_ENV = "NANOLLMSERVE_WORKER_ADMIN_API_KEY"
POLICY_CHOICES = ("round_robin", "least_load", "prefix", "pd")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests over several nanollmserve servers",
        description="One OpenAI-compatible endpoint in front of several `nanollmserve serve` "
        "workers: health checks, failover, cache-aware placement, streaming passthrough.",
    )
    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="URL",
        help="a worker's root URL (http://host:port); repeat for each worker",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port (default %(default)s)")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds the requests in flight get to finish while new ones "
        "and /ready answer 503 (default %(default)s)",
    )
    add_router_args(parser)
    parser.set_defaults(func=run)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The router flags `router` and `cluster` share."""
    group = parser.add_argument_group("routing")
    group.add_argument(
        "--policy",
        choices=POLICY_CHOICES,
        default=None,
        help="round_robin: in turn; least_load: fewest requests in flight; prefix: requests "
        "sharing a prompt prefix go to the same worker, bounded by load; pd: prefill/decode "
        "disaggregation, a completion's prefill on a `--kv-role prefill` worker (by prefix), "
        "the rest on the least loaded `--kv-role decode` one (default: least_load; `cluster "
        "--prefill-workers`: pd)",
    )
    group.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between health checks of each worker (default %(default)s)",
    )
    group.add_argument(
        "--health-failures",
        type=int,
        default=3,
        metavar="K",
        help="failed checks in a row that take a worker out (a refused connection: at once) "
        "(default %(default)s)",
    )
    group.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        metavar="N",
        help="prefix policy: the first N characters of the prompt place a request "
        "(default %(default)s)",
    )
    group.add_argument(
        "--load-bound-factor",
        type=float,
        default=1.25,
        metavar="C",
        help="prefix and pd policies: consistent hashing with bounded load; a worker takes at "
        "most C x the mean requests in flight (the new one counted), past it the prefix goes "
        "to its next worker in hash order; from 1 (strict balance) to 100 (default "
        "%(default)s)",
    )
    group.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="pd policy: seconds a prefill worker gets for a request's prefill before another "
        "one tries (none left: the decode worker prefills it) (default %(default)s)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' from clients on every route but /health "
        f"and /metrics (default: ${API_KEY_ENV})",
    )
    group.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_API_KEY_ENV) or None,
        help="the operator's key for the router's admin routes (/admin/workers: sleep, wake, "
        "drain a named worker), never the API key; without it they are off (404) "
        f"(default: ${ADMIN_API_KEY_ENV})",
    )
    group.add_argument(
        "--metrics-require-auth",
        action="store_true",
        help="with --api-key, require the key on /metrics too (default: open to scrapers; "
        "`cluster` passes it to the workers as well)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="largest request body forwarded, as bytes or with a suffix (1MiB); a larger one "
        "answers 413 before it is read whole (default: 4MiB, the workers' own cap)",
    )
    group.add_argument(
        "--worker-api-key",
        default=os.environ.get(WORKER_API_KEY_ENV) or None,
        help=f"the key sent to the workers (default: ${WORKER_API_KEY_ENV}, else the "
        "client's Authorization header is passed on)",
    )
    group.add_argument(
        "--worker-admin-api-key",
        default=os.environ.get(WORKER_ADMIN_API_KEY_ENV) or None,
        help="the key the router sends to a worker's admin routes (its --admin-api-key) when "
        f"the admin surface sleeps or wakes it (default: ${WORKER_ADMIN_API_KEY_ENV}, else "
        "--admin-api-key; `cluster` makes one for its workers)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )
    add_tracing_args(parser)


def router_settings(args: argparse.Namespace):
    from nanollmserve.router import RouterSettings
    from nanollmserve.router.policies import check_load_bound_factor

    if args.health_interval <= 0:
        raise UserError(f"--health-interval must be > 0, got {args.health_interval}")
    if args.health_failures < 1:
        raise UserError(f"--health-failures must be >= 1, got {args.health_failures}")
    if args.prefix_chars < 1:
        raise UserError(f"--prefix-chars must be >= 1, got {args.prefix_chars}")
    try:
        check_load_bound_factor(args.load_bound_factor, "--load-bound-factor")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not 0 < args.prefill_timeout < float("inf"):
        raise UserError(f"--prefill-timeout must be > 0 seconds, got {args.prefill_timeout}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    sizes = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    if args.admin_api_key and args.admin_api_key == args.api_key:
        raise UserError("--admin-api-key must differ from --api-key: clients hold the API key")
    return RouterSettings(
        policy=args.policy or "least_load",
        api_key=args.api_key,
        worker_api_key=args.worker_api_key,
        health_interval=args.health_interval,
        health_failures=args.health_failures,
        prefix_chars=args.prefix_chars,
        load_bound_factor=args.load_bound_factor,
        prefill_timeout=args.prefill_timeout,
        metrics_require_auth=args.metrics_require_auth,
        admin_api_key=args.admin_api_key,
        worker_admin_api_key=args.worker_admin_api_key or args.admin_api_key,
        tracer=tracer_from_args(args, "nanollmserve-router"),
        **sizes,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if level != "debug":  # not a line per health check
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    from nanollmserve.cli.serve import _bind
    from nanollmserve.router import WorkerPool, create_router_app
    from nanollmserve.router.server import serve_router

    setup_logging(args.log_level)
    settings = router_settings(args)
    for url in args.worker:
        if not url.strip():
            raise UserError("--worker needs a URL, got an empty one")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise UserError(
            f"--shutdown-timeout must be a finite number >= 0, got {args.shutdown_timeout}"
        )
    sock = _bind(args.host, args.port)
    try:
        app = create_router_app(WorkerPool(args.worker), settings)
        asyncio.run(serve_router(app, sock, args.log_level, shutdown_timeout=args.shutdown_timeout))
    finally:
        sock.close()
    logging.getLogger("nanollmserve.router").info("nanollmserve router stopped")
    return 0
