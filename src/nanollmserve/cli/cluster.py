"""`nanollmserve cluster --workers N [serve flags...]`: N `serve` workers plus the router.
`--prefill-workers P --decode-workers D` instead: prefill/decode disaggregation, P workers
with `--kv-role prefill` then D with `--kv-role decode` sharing one `--kv-offload-dir` (a
fresh directory under /dev/shm, removed at exit, unless one is given) or, with
`--kv-transfer ray` (`auto`: on a Ray cluster of several hosts), each with its own store and
the blocks moved through Ray's object store, behind the router's `--policy pd`
(`nanollmserve.cluster.pd_roles`). `--workers-per-node N` places Ray actors by node
affinity.

Locally (the default) the workers are processes on ports `--base-port`, `--base-port`+1, ...
of `--worker-host`, one GPU each where there are several, restarted with backoff when they
die; with `--ray-address` they are Ray actors placed by Ray (`local`: a private Ray on this
machine) and restarted by Ray. The router listens on `--host`:`--router-port` with the
`router` command's flags. Every flag this command does not know is a `serve` flag, passed to
each worker (checked before anything starts), except `--grpc-port P`: worker i serves gRPC
on P + i. Busy ports fail at once with one line. SIGINT / SIGTERM stop the router and every
worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket

from nanollmserve.cli.env_defaults import env_name
from nanollmserve.cli.router import add_router_args, router_settings, setup_logging
from nanollmserve.errors import UserError

MANAGED_SERVE_FLAGS = ("--host", "--port", "--api-key", "--admin-api-key")
GRPC_PORT_ENV = env_name("--grpc-port")
DEFAULT_WORKERS = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="run N serve workers and a router (locally or on Ray)",
        description="Run N `nanollmserve serve` workers and a router in front of them. "
        "Flags not listed here are serve flags, given to every worker.",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help=f"workers (default {DEFAULT_WORKERS})"
    )
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=None,
        metavar="P",
        help="prefill/decode disaggregation: P workers with --kv-role prefill (with "
        "--decode-workers; not with --workers); the router then runs --policy pd",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=None,
        metavar="D",
        help="prefill/decode disaggregation: D workers with --kv-role decode (with "
        "--prefill-workers); they get the prefill workers' blocks by --kv-transfer (store: "
        "one shared --kv-offload-dir, default a fresh directory under /dev/shm removed at "
        "exit)",
    )
    parser.add_argument(
        "--kv-transfer",
        choices=("auto", "store", "ray"),
        default="auto",
        help="with --prefill-workers: how the KV blocks go from prefill to decode workers: "
        "store = one --kv-offload-dir every worker sees (default: a fresh one under "
        "/dev/shm); ray = Ray's object store, each worker with its own store (needs "
        "--ray-address); auto = store on one host (local workers, a Ray cluster on one "
        "host, or a --kv-offload-dir given), ray across hosts (default %(default)s)",
    )
    parser.add_argument(
        "--worker-cpus",
        choices=("split", "shared"),
        default="split",
        help="local workers on the CPU: split = each pinned to its own share of this "
        "process's CPUs with as many threads (default); shared = every worker on every CPU "
        "with torch's default thread count",
    )
    parser.add_argument(
        "--base-port", type=int, default=8001, help="first worker's port (default %(default)s)"
    )
    parser.add_argument(
        "--router-port", type=int, default=8080, help="router's port (default %(default)s)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the router binds (default %(default)s)"
    )
    parser.add_argument(
        "--worker-host",
        default=None,
        help="address the workers bind and the router calls (default: 127.0.0.1; with "
        "--ray-address HOST:PORT or auto, each worker's node address)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=-1,
        metavar="N",
        help="restarts of one worker before it is given up (default %(default)s: always)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds workers get to finish on SIGINT/SIGTERM (default %(default)s)",
    )
    ray_group = parser.add_argument_group("Ray (pip install 'nanollmserve[cluster]')")
    ray_group.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|HOST:PORT|local",
        help="run the workers as Ray actors on this Ray cluster (auto: the one `ray start` "
        "made here; local: a private one on this machine) (default: local processes)",
    )
    ray_group.add_argument(
        "--workers-per-node",
        type=int,
        default=None,
        metavar="N",
        help="place N workers on each node, by node affinity: worker i on the (i // N)-th "
        "node with room for N (ordered by address; prefill workers first) (default: where "
        "Ray's resources put them)",
    )
    ray_group.add_argument(
        "--worker-num-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs each worker actor takes (default %(default)s)",
    )
    ray_group.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="Ray GPUs each worker actor takes (default: 1 where the cluster has GPUs, else 0)",
    )
    add_router_args(parser)
    parser.set_defaults(func=run, takes_extra_args=True)


def check_serve_args(serve_args: list[str], role_args: list[str] | None = None) -> None:
    """The workers' flags must be valid `serve` flags; the cluster sets the managed ones
    (with `role_args`, a disaggregated worker's own flags: its --kv-role too)."""
    from nanollmserve.cli import serve

    for arg in serve_args:
        name = arg.split("=", 1)[0]
        if name in MANAGED_SERVE_FLAGS or (role_args and name == "--kv-role"):
            raise UserError(
                f"{name} is set by the cluster (--host/--router-port for the router, "
                "--worker-host/--base-port for the workers, --api-key and --admin-api-key for "
                "both, --kv-role "
                "with --prefill-workers/--decode-workers)"
            )
    serve_args = serve_args + (role_args or [])
    parser = argparse.ArgumentParser(prog="nanollmserve cluster")
    serve.register(parser.add_subparsers())
    namespace = parser.parse_args(["serve", *serve_args])  # exits 2 with argparse's line
    if namespace.env_errors:
        raise UserError(namespace.env_errors[0])


def spread_grpc_ports(
    serve_args: list[str], worker_args: list[list[str]] | None, num_workers: int
) -> tuple[list[str], list[list[str]] | None]:
    """`--grpc-port P` given to the cluster (or NANOLLMSERVE_GRPC_PORT, which every worker
    would inherit): worker i serves gRPC on P + i, since the workers of one host cannot share
    a port -> (the common serve flags without it, each worker's own flags with its port)."""
    from nanollmserve.cluster.pd_roles import serve_flag_value

    value = serve_flag_value(serve_args, "--grpc-port") or os.environ.get(GRPC_PORT_ENV)
    if value is None:
        return serve_args, worker_args
    first = int(value)  # check_serve_args has parsed it
    if not 0 < first <= 65536 - num_workers:
        raise UserError(
            f"--grpc-port {first}: worker i serves gRPC on {first} + i, so it must be in "
            f"[1, {65536 - num_workers}] for {num_workers} workers"
        )
    common, skip = [], False
    for i, arg in enumerate(serve_args):
        if skip:
            skip = False
        elif arg == "--grpc-port" and i + 1 < len(serve_args):
            skip = True
        elif not arg.startswith("--grpc-port="):
            common.append(arg)
    own = worker_args or [[] for _ in range(num_workers)]
    return common, [[*own[i], "--grpc-port", str(first + i)] for i in range(num_workers)]


def check_port_free(host: str, port: int, what: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} ({what}): {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from nanollmserve.cli.serve import _bind
    from nanollmserve.cluster.pd_roles import disaggregated_roles

    setup_logging(args.log_level)
    serve_args = list(args.extra_args)
    roles = disaggregated_roles(args, serve_args)
    if roles is not None:
        args.workers, args.policy = roles.num_workers, "pd"
    elif args.workers is None:
        args.workers = DEFAULT_WORKERS
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    # One admin key for the workers' admin routes, made here and known to the router only
    # (with --admin-api-key, that key: an operator may also call a worker's port with it).
    args.worker_admin_api_key = (
        args.worker_admin_api_key or args.admin_api_key or secrets.token_urlsafe(32)
    )
    if args.workers_per_node is not None and args.ray_address is None:
        raise UserError("--workers-per-node places Ray actors: it needs --ray-address")
    if args.kv_transfer != "auto" and roles is None:
        raise UserError("--kv-transfer is for --prefill-workers/--decode-workers")
    settings = router_settings(args)
    if roles is not None:
        hosts = None
        if roles.transfer == "auto" and args.ray_address not in (None, "local"):
            from nanollmserve.cluster.ray_workers import init_ray, ray_hosts

            hosts = ray_hosts(init_ray(args.ray_address, args.workers, args.worker_num_cpus))
        roles.resolve(hosts)
    store = roles.shared_store() if roles is not None else contextlib.nullcontext()
    with store as worker_args:
        check_serve_args(serve_args, worker_args[0] if worker_args else None)
        serve_args, worker_args = spread_grpc_ports(serve_args, worker_args, args.workers)
        serve_args += ["--log-level", args.log_level]
        serve_args += ["--shutdown-timeout", str(args.shutdown_timeout)]
        if args.metrics_require_auth:  # a router flag that the workers have too
            serve_args.append("--metrics-require-auth")
        if args.otlp_traces_endpoint:  # so is this one: both ends of each trace
            serve_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        worker_key = args.worker_api_key or args.api_key
        ports = [args.base_port + i for i in range(args.workers)]
        router_sock = _bind(args.host, args.router_port)
        try:
            if args.ray_address is None:
                workers = _local_workers(args, serve_args, worker_key, ports, worker_args)
            else:
                workers = _ray_workers(args, serve_args, worker_key, worker_args, roles)
            from nanollmserve.cluster.launcher import run_cluster

            asyncio.run(run_cluster(workers, router_sock, settings, args.log_level))
        finally:
            router_sock.close()
    return 0


def _local_workers(args, serve_args, worker_key, ports, worker_args):
    from nanollmserve.cluster.devices import cpus_of_worker, devices_of_worker, visible_gpus
    from nanollmserve.cluster.local_workers import LocalWorkers
    from nanollmserve.cluster.worker_process import worker_env

    host = args.worker_host or "127.0.0.1"
    for i, port in enumerate(ports):
        check_port_free(host, port, f"worker {i}")
    from nanollmserve.cluster.pd_roles import serve_flag_value

    for i, own in enumerate(worker_args or []):
        grpc_port = serve_flag_value(own, "--grpc-port")
        if grpc_port is not None:
            check_port_free(host, int(grpc_port), f"worker {i}'s --grpc-port")
    gpus = visible_gpus()
    per_worker = _tensor_parallel_size(serve_args)
    devices = [devices_of_worker(i, gpus, per_worker) for i in range(len(ports))]
    cpus: list[list[int] | None] = [None] * len(ports)
    threads: list[int | None] = [None] * len(ports)
    if args.worker_cpus == "split" and not any(devices):  # the workers compute on the CPU
        allowed = sorted(os.sched_getaffinity(0))
        cpus = [cpus_of_worker(i, len(ports), allowed) for i in range(len(ports))]
        threads = [len(share) if share else 1 for share in cpus]
    admin_key = args.worker_admin_api_key
    envs = [worker_env(worker_key, devices[i], threads[i], admin_key) for i in range(len(ports))]
    workers = LocalWorkers(
        host, ports, serve_args, envs, args.max_restarts, args.shutdown_timeout, worker_args, cpus
    )
    workers.start()
    return workers


def _ray_workers(args, serve_args, worker_key, worker_args, roles=None):
    from nanollmserve.cluster.ray_workers import RayWorkers

    host = args.worker_host or ("127.0.0.1" if args.ray_address == "local" else None)
    return RayWorkers(
        args.ray_address,
        args.workers,
        args.base_port,
        serve_args,
        worker_key,
        host,
        args.max_restarts,
        args.worker_num_cpus,
        args.worker_num_gpus,
        args.shutdown_timeout,
        worker_args,
        admin_api_key=args.worker_admin_api_key,
        workers_per_node=args.workers_per_node,
        kv_key=roles.ray_key if roles is not None else None,
    )


def _tensor_parallel_size(serve_args: list[str]) -> int:
    """Devices one worker needs: its --tensor-parallel-size (1 without it)."""
    from nanollmserve.cluster.pd_roles import serve_flag_value

    value = serve_flag_value(serve_args, "--tensor-parallel-size")
    return 1 if value is None else max(1, int(value))
