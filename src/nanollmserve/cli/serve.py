"""`nanollmserve serve [MODEL]`: the OpenAI-compatible HTTP server (and, with `--grpc-port`,
the gRPC service on the same engine).

Binds the sockets first (a busy port fails at once), loads the model into an AsyncEngine,
then serves with uvicorn and logs one line when ready: URL, model, device, dtype, KV blocks
and time to ready. SIGINT / SIGTERM drain, then shut down: new requests get 503 (`draining`;
gRPC: UNAVAILABLE) and `/ready` a 503 at once while the server still listens, running ones
get `--shutdown-timeout` seconds to finish, the rest are aborted, and the process exits 0.
`--log-stats-interval S` logs the engine's load every S seconds.

The flags follow `vllm serve` (names and meanings; docs/cli.md) and every one can come from
the environment as `NANOLLMSERVE_<FLAG>` (flag > environment > default; `env_defaults.py`).
Bad values (a flag's or a variable's) fail as one line with exit status 2 before the model
loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import signal
import socket
import ssl
import time

from nanollmserve.cli.env_defaults import apply_env_defaults
from nanollmserve.config import add_engine_args, engine_config_from_args
from nanollmserve.errors import UserError
from nanollmserve.request_limits import add_limit_args, limits_from_args
from nanollmserve.server_settings import add_server_args, server_settings_from_args
from nanollmserve.structured_output_limits import (
    add_structured_output_args,
    structured_output_limits_from_args,
)
from nanollmserve.tracing.flags import add_tracing_args, tracer_from_args

logger = logging.getLogger("nanollmserve.serve")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/responses, /generate, ...).",
    )
    add_engine_args(parser, model_positional=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: any)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (PEFT directories), each selected by `model`=NAME "
        "(needs --enable-lora)",
    )
    group.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="requests that may wait beyond --max-num-seqs before new ones get 503 (default 256)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default %(default)s)",
    )
    group.add_argument(
        "--sleep-idle-seconds",
        type=float,
        default=None,
        metavar="S",
        help="sleep (free the KV cache and the weights, as POST /sleep?level=2) after S "
        "seconds without requests; the next request wakes the server and is served "
        "(llama-server's flag; default: off)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template (default: the model's own; for the bundled model, its "
        "template with tools, examples/tool_chat_template_smollm2.jinja)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser (default: off, auto is a 400; on with hermes for the bundled "
        "model without --chat-template)",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="template variables of every chat that does not set them in chat_template_kwargs, "
        "e.g. '{\"enable_thinking\": false}' (default: none)",
    )
    group.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve gRPC (proto/nanollmserve.proto) on this port of --host (default: off)",
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="log running/waiting, KV usage, tokens/s and prefix-cache hit rate every S "
        "seconds (default 0: off)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn (default: --log-level)",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|PATH",
        help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for "
        "requests that leave them unset: auto: the model's generation_config.json; vllm: "
        "the built-in ones; PATH: a folder with a generation_config.json (default %(default)s)",
    )
    group.add_argument(
        "--root-path", default="", help="path prefix a proxy serves this server under"
    )
    tls = parser.add_argument_group("TLS (HTTPS; the gRPC port takes the same certificate)")
    tls.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="private key (PEM)")
    tls.add_argument("--ssl-certfile", default=None, metavar="FILE", help="certificate (PEM)")
    tls.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="CA certificates to verify client certificates with",
    )
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
        help="client certificates: 0 none, 1 optional, 2 required (default %(default)s)",
    )
    add_server_args(parser, group.title)  # ServerSettings' flags (server, CORS)
    add_limit_args(parser)
    add_structured_output_args(parser)
    add_tracing_args(parser)
    env_sources, env_errors = apply_env_defaults(parser)
    parser.set_defaults(func=run, env_sources=env_sources, env_errors=env_errors)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.env_errors:
        raise UserError(args.env_errors[0])
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _start_native_build(args)
    from nanollmserve.frontend.async_engine import DEFAULT_MAX_QUEUE_LEN
    from nanollmserve.frontend.tokenizer import BUNDLED_TOOL_CALL_PARSER, load_chat_template

    max_queue_len = DEFAULT_MAX_QUEUE_LEN if args.max_queue_len is None else args.max_queue_len
    if max_queue_len < 0:
        raise UserError(f"--max-queue-len must be >= 0, got {max_queue_len}")
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.log_stats_interval < 0:
        raise UserError(f"--log-stats-interval must be >= 0, got {args.log_stats_interval}")
    idle = args.sleep_idle_seconds
    if idle is not None and not (math.isfinite(idle) and idle > 0):
        raise UserError(f"--sleep-idle-seconds must be a number of seconds > 0, got {idle}")
    if args.admin_api_key and args.admin_api_key == args.api_key:
        raise UserError("--admin-api-key must differ from --api-key: clients hold the API key")
    limits_from_args(args)  # a bad limit fails before the model loads
    structured_output_limits_from_args(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.model_pos and "model" in args.env_sources:
        args.model = None  # the positional MODEL beats NANOLLMSERVE_MODEL, as a flag would
    config = engine_config_from_args(args)
    if args.kv_role != "both" and config.kv_offload_dir is None:
        raise UserError(
            f"--kv-role {args.kv_role} needs --kv-offload-dir DIR, the store the prefill and "
            "decode workers share (the same directory for both, e.g. under /dev/shm)"
        )
    if args.kv_transfer == "ray":
        _check_ray_transfer(args, config)
    if config.runner == "pooling" and args.reasoning_parser is not None:
        raise UserError(
            "--reasoning-parser has nothing to parse with --runner pooling "
            "(it serves /v1/embeddings, no generated text)"
        )
    if args.sleep_idle_seconds is not None and config.tensor_parallel_size > 1:
        raise UserError("--sleep-idle-seconds is not supported with tensor parallelism")
    if args.slot_save_path is not None:  # refused before the model loads (and again by the app)
        from nanollmserve.kv_store_dir import open_store_dir

        open_store_dir(args.slot_save_path, "--slot-save-path")
    if config.tensor_parallel_size > 1 and int(os.environ.get("RANK", 0)) > 0:
        from nanollmserve.engine.tensor_parallel.worker import run_torchrun_worker

        run_torchrun_worker(config)  # a torchrun rank > 0 runs the model, serves nothing
        return 0
    args.lora_modules = _lora_modules(args, config)
    bundled = not config.model and not config.tokenizer
    if bundled and args.chat_template is None and args.tool_call_parser is None:
        # the bundled model's default template asks for tool calls the hermes parser reads
        # (set before the settings are read from the flags)
        args.enable_auto_tool_choice, args.tool_call_parser = True, BUNDLED_TOOL_CALL_PARSER
    settings = server_settings_from_args(args)  # a bad CORS list fails before the model loads
    args.default_chat_template_kwargs = _chat_template_kwargs(args.default_chat_template_kwargs)
    _check_tls(args)
    settings.tracer = tracer_from_args(args, "nanollmserve")  # no packages: fails before loading
    if args.generation_config not in ("auto", "vllm"):
        from nanollmserve.generation_config import load_generation_defaults

        load_generation_defaults(args.generation_config)  # a bad PATH fails here
    chat_template = load_chat_template(args.chat_template, bundled_model=bundled)
    sock = _bind(args.host, args.port)
    try:
        return asyncio.run(
            _serve(args, settings, config, chat_template, max_queue_len, sock, start)
        )
    finally:
        sock.close()


MAX_KV_TRANSFER_SECONDS = 3600
"""The longest a prefill worker holds a prompt's objects, or a decode worker waits for them:
an hour (a late block is recomputed, never waited on without end)."""


def _check_ray_transfer(args: argparse.Namespace, config) -> None:
    """`--kv-transfer ray`: its numbers, its store, then join the Ray cluster (RAY_ADDRESS,
    else the one `ray start` made here) before the model loads."""
    for flag, value in (
        ("--kv-transfer-hold-seconds", args.kv_transfer_hold_seconds),
        ("--kv-transfer-timeout", args.kv_transfer_timeout),
    ):
        if not (math.isfinite(value) and 0 <= value <= MAX_KV_TRANSFER_SECONDS):
            raise UserError(
                f"{flag} must be a number of seconds in [0, {MAX_KV_TRANSFER_SECONDS}], got {value}"
            )
    if config.kv_offload_dir is None:
        raise UserError(
            "--kv-transfer ray needs --kv-offload-dir DIR, this worker's own store (blocks "
            "are written there and read from there; Ray carries them between the workers)"
        )
    from nanollmserve.engine.kv_ray_transfer import connect

    connect(os.environ.get("RAY_ADDRESS"))


def _start_native_build(args: argparse.Namespace) -> None:
    """On a machine without the native kernels yet, compile them in the background while torch
    and the engine import (about a second of the first start), when this start may run GGUF
    blocks; the model load finds the library built or waits for that build."""
    try:
        config = engine_config_from_args(args)
    except UserError:
        return  # reported once the run gets there
    from nanollmserve.model.source import may_run_gguf_blocks

    if may_run_gguf_blocks(config, config.device):
        from nanollmserve.native.build import build_in_background

        build_in_background()


async def _serve(args, settings, config, chat_template, max_queue_len, sock, start) -> int:
    if not args.enable_auto_tool_choice:
        settings.tool_call_parser = None  # "auto" with tools is a 400
    from nanollmserve.frontend.async_engine import AsyncEngine
    from nanollmserve.frontend.request_policy import RequestPolicy

    grpc_server = grpc_port = None
    if args.grpc_port is not None:
        from nanollmserve.api.grpc_server import bind_grpc_server, serve_grpc

        grpc_server, grpc_port = bind_grpc_server(
            args.host, args.grpc_port, credentials=_grpc_credentials(args)
        )
    building = asyncio.get_running_loop().run_in_executor(  # starts the thread now
        None,
        functools.partial(
            AsyncEngine,
            config,
            max_queue_len=max_queue_len,
            chat_template=chat_template,
            structured_output_limits=structured_output_limits_from_args(args),
            sleep_idle_seconds=args.sleep_idle_seconds,
            # The limits and generation defaults of every frontend (HTTP, gRPC): the
            # engine's from the start, completed with the model's generation_config.json.
            request_policy=RequestPolicy(
                limits_from_args(args), generation_config=args.generation_config
            ),
            default_chat_template_kwargs=args.default_chat_template_kwargs,
        ),
    )
    # The server's modules (FastAPI, pydantic, uvicorn: about 0.4 s) import while the engine
    # thread loads the model, much of which runs in PyTorch without holding the GIL.
    import uvicorn

    from nanollmserve.api import create_app
    from nanollmserve.generation_config import describe
    from nanollmserve.metrics import StatsLogger

    engine = await building
    if args.kv_transfer == "ray":
        from nanollmserve.engine.kv_ray_transfer import RayKVTransfer

        engine.kv_transport = RayKVTransfer(
            engine.engine_loop.engine.kv_offload.store,
            hold_seconds=args.kv_transfer_hold_seconds,
            fetch_timeout=args.kv_transfer_timeout,
        )
    try:
        for name, path in args.lora_modules:
            await engine.load_lora(name, path)
    except UserError:
        await engine.shutdown()
        raise
    logger.info(
        "generation defaults (--generation-config %s): %s",
        args.generation_config,
        describe(dict(engine.request_policy.generation_defaults)),
    )
    app = create_app(engine, settings)
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{_url_host(host)}:{port}{args.root_path}"
    if grpc_server is not None:
        await serve_grpc(
            grpc_server,
            engine,
            model_name=app.state.ctx.model_name,
            api_key=settings.api_key,
            log_requests=settings.log_requests,
            reasoning_parser=settings.reasoning_parser,
            tracer=settings.tracer,
        )
        url += f" grpc={_url_host(host)}:{grpc_port}"
    stats_task = None
    if args.log_stats_interval > 0:
        stats_logger = StatsLogger(lambda: engine.stats().engine, args.log_stats_interval)
        stats_task = asyncio.create_task(stats_logger.run())
    info = engine.info

    def ready_line() -> str:
        return (
            f"nanollmserve ready: {url} model={app.state.ctx.model_name} "
            f"device={info.device} dtype={info.dtype} "
            f"{f'quantization={info.quantization} ' if info.quantization else ''}"
            f"kv_blocks={info.num_kv_blocks}x{info.block_size} tokens "
            f"max_model_len={info.max_model_len} ready_in={time.perf_counter() - start:.1f}s"
        )

    uvicorn_config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level or args.log_level,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        # A backstop: the engine ends what is still running at --shutdown-timeout itself,
        # so responses end cleanly (an error event, a 503) before uvicorn cancels anything.
        timeout_graceful_shutdown=int(args.shutdown_timeout) + 10,
        access_log=args.log_level == "debug",
    )
    server = _make_server(uvicorn_config, engine, ready_line, args.shutdown_timeout)
    watchdog = asyncio.create_task(_exit_when_engine_dies(engine, server))
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        if stats_task is not None:
            stats_task.cancel()
        if grpc_server is not None:  # in-flight calls get the same grace as HTTP ones
            await grpc_server.stop(args.shutdown_timeout)
        await engine.shutdown(timeout=0)
    if engine.error is not None:
        logger.error("nanollmserve stopped: the engine failed (exit status 1)")
        return 1
    logger.info("nanollmserve stopped")
    return 0


async def _exit_when_engine_dies(engine, server, interval: float = 0.5) -> None:
    """A dead engine (a step failing again and again) makes the process exit with status 1,
    so its supervisor (the cluster launcher, a restart policy, systemd) starts a fresh one
    instead of keeping a server that answers 503 forever."""
    while engine.error is None:
        await asyncio.sleep(interval)
    logger.error("the engine failed: %r; shutting down", engine.error)
    server.should_exit = True


def _make_server(config, engine, ready_line, shutdown_timeout: float):
    """A uvicorn.Server that logs the ready line and drains on the first signal: new
    requests get 503 (`draining`), `/ready` and `/health` answer 503 at once, running
    requests get `shutdown_timeout` seconds before the engine aborts them, and the server
    keeps listening meanwhile (a client or a router still reaching it is told to go
    elsewhere, not refused a connection); then uvicorn shuts down. A second signal starts
    uvicorn's shutdown at once (a second SIGINT forces the exit, as uvicorn does). It does
    not re-raise the signal (so it exits 0)."""
    import uvicorn

    loop = asyncio.get_running_loop()

    class Server(uvicorn.Server):
        draining = False

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                logger.info(ready_line())

        def handle_exit(self, sig, frame) -> None:
            if not self.draining and not self.should_exit:
                engine.stop_accepting()
                self.draining = True
                loop.call_soon_threadsafe(self._drain_engine)
                return
            self.should_exit = True  # a second signal: stop draining; SIGINT forces the exit
            super().handle_exit(sig, frame)

        def _drain_engine(self) -> None:
            logger.info("draining: %d sequence(s) in flight", engine.num_sequences_in_flight)
            self.drain_task = loop.create_task(self._drain())

        async def _drain(self) -> None:
            await engine.shutdown(timeout=shutdown_timeout)
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def _lora_modules(args: argparse.Namespace, config) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... as (name, path) pairs, checked before the model loads."""
    modules = []
    for item in args.lora_modules or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in [m[0] for m in modules] or name in (args.served_model_name or []):
            raise UserError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name, path))
    if (modules or args.allow_runtime_lora_updating) and not config.enable_lora:
        flag = "--lora-modules" if modules else "--allow-runtime-lora-updating"
        raise UserError(f"{flag} needs --enable-lora")
    return modules


def _chat_template_kwargs(raw: str | None) -> dict:
    """`--default-chat-template-kwargs`: a JSON object held to the request field's limits."""
    from nanollmserve.errors import ParamError
    from nanollmserve.frontend.chat_template_kwargs import check_chat_template_kwargs

    if raw is None:
        return {}
    flag = "--default-chat-template-kwargs"
    try:
        return check_chat_template_kwargs(json.loads(raw), flag)
    except ValueError as exc:  # ParamError is one
        message = str(exc) if isinstance(exc, ParamError) else f"{flag} must be JSON: {exc}"
        raise UserError(message) from None


def _check_tls(args: argparse.Namespace) -> None:
    """Load the key, certificate and CA files once now, so a bad one fails before the model
    loads (uvicorn loads them again when it starts)."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise UserError("give --ssl-keyfile and --ssl-certfile together")
    if args.ssl_certfile is None:
        if args.ssl_ca_certs is not None:
            raise UserError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        files = f"{args.ssl_certfile}, {args.ssl_keyfile}"
        if args.ssl_ca_certs is not None:
            files += f", {args.ssl_ca_certs}"
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UserError(f"cannot load the TLS files ({files}): {reason}") from None


def _grpc_credentials(args: argparse.Namespace):
    """The gRPC port's TLS credentials (the HTTP certificate), None without TLS."""
    if args.ssl_certfile is None:
        return None
    import grpc

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(args.ssl_ca_certs) if args.ssl_ca_certs else None
    return grpc.ssl_server_credentials(
        [(read(args.ssl_keyfile), read(args.ssl_certfile))],
        root_certificates=ca,
        require_client_auth=ca is not None and args.ssl_cert_reqs == ssl.CERT_REQUIRED,
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
