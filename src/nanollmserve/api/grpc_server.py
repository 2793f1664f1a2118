"""The gRPC service (`proto/nanollmserve.proto`): Generate, GenerateStream, BatchGenerate and
Health over the same AsyncEngine as the HTTP server.

`start_grpc_server(engine, host, port)` (or `bind_grpc_server` early, then `serve_grpc` once
the engine exists) runs a `grpc.aio` server on the current event loop, the one uvicorn
serves on, because the engine hands outputs to asyncio queues bound to the loop that
created them. Like the HTTP routes, the servicer only converts: proto messages in,
`SamplingParams`, then the engine's request policy (the limits and generation defaults HTTP
requests are held to: the same refusals, INVALID_ARGUMENT here), then the admission and
collection layer the HTTP routes use too (`generation.py`), proto messages out. The engine
key of a call is always the server's (`grpc-...`): a client's `request_id` is echoed in the
replies and logged quoted, never used as a key (it could collide with another request).

Errors map to status codes: a bad parameter (ParamError) -> INVALID_ARGUMENT (its message),
a full queue -> RESOURCE_EXHAUSTED, a dead or stopping engine -> UNAVAILABLE, a failed engine
step -> INTERNAL, a wrong key -> UNAUTHENTICATED. A cancelled call (client gone, stream
cancelled, deadline) cancels the handler, which aborts the request, so its KV blocks return
at once.
"""

from __future__ import annotations

import functools
import hmac
import inspect
import secrets
import time

import grpc

from nanollmserve.api.generation import (
    MAX_BATCH_PROMPTS,
    StreamTotals,
    admit,
    choice_deltas,
    collect_final,
    finish_reason,
)
from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb
from nanollmserve.api.grpc_gen import nanollmserve_pb2_grpc as pb_grpc
from nanollmserve.api.request_log import log_client_request_id
from nanollmserve.errors import ParamError, UserError
from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    OutputKind,
    RequestStream,
)
from nanollmserve.outputs import RequestOutput
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams

__all__ = ["GenerationServicer", "bind_grpc_server", "serve_grpc", "start_grpc_server"]

OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "cache_salt",
    "priority",
)


class Unauthenticated(Exception):
    pass


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, ParamError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineStepError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return None


def _rpc(method):
    """Check the API key, then run the method; our errors become status codes."""

    async def fail(context, exc: Exception) -> None:
        status = _status(exc)
        if status is None:
            raise exc
        await context.abort(*status)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                self.check_auth(context)
                async for message in method(self, request, context):
                    yield message
            except Exception as exc:
                await fail(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            self.check_auth(context)
            return await method(self, request, context)
        except Exception as exc:
            await fail(context, exc)

    return unary_wrapper


def unset_sampling_fields(message: pb.SamplingParams) -> set[str]:
    """The optional fields a call left unset: the ones the server's generation defaults
    fill (`RequestPolicy.apply`)."""
    return {name for name in OPTIONAL_SAMPLING_FIELDS if not message.HasField(name)}


def sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; bad values raise ParamError."""
    kwargs = {
        name: getattr(message, name) for name in OPTIONAL_SAMPLING_FIELDS if message.HasField(name)
    }
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_outputs(message.structured_outputs)
    return SamplingParams(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        **kwargs,
    )


def _structured_outputs(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    fields = {name: getattr(message, name) for name in ("json", "regex", "grammar")}
    return StructuredOutputsParams(
        **{name: value for name, value in fields.items() if message.HasField(name)},
        choice=list(message.choice) or None,
        json_object=message.json_object or None,
        disable_any_whitespace=message.disable_any_whitespace,
    )


def _ms(seconds: float | None) -> float:
    return round(seconds * 1000, 3) if seconds is not None else 0.0


def _response(output: RequestOutput, request_id: str | None = None) -> pb.GenerateResponse:
    """The reply to one prompt; `request_id`: the id to echo (default: the server's)."""
    choice, metrics = output.outputs[0], output.metrics
    return pb.GenerateResponse(
        request_id=request_id or output.request_id,
        text=choice.text,
        finish_reason=finish_reason(choice),
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(choice.token_ids),
        cached_tokens=output.num_cached_tokens,
        latency_ms=_ms(metrics.e2e_latency if metrics else None),
        time_to_first_token_ms=_ms(metrics.ttft if metrics else None),
    )


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        api_key: str | None = None,
        log_requests: bool = False,
    ):
        self.engine = engine
        self.model_name = model_name
        self.expected_key = f"Bearer {api_key}".encode() if api_key else None
        self.log_requests = log_requests

    def check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.expected_key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected_key):
            raise Unauthenticated("invalid or missing API key: send 'authorization: Bearer KEY'")

    def _params(self, message: pb.SamplingParams) -> SamplingParams:
        """The call's SamplingParams through the engine's request policy (defaults, limits),
        before any work."""
        return self.engine.request_policy.apply(
            sampling_params(message), unset_sampling_fields(message)
        )

    async def _add(self, request: pb.GenerateRequest, kind: OutputKind) -> RequestStream:
        if bool(request.prompt) == bool(request.messages):
            raise ParamError("give exactly one of prompt and messages", "prompt")
        limits = self.engine.request_policy.limits
        limits.check_fields(client_request_id=request.request_id or None)
        params = self._params(request.sampling)
        if request.messages:
            limits.check_messages(len(request.messages))
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt = await self.engine.chat_token_ids(messages)
        else:
            prompt = request.prompt
        request_id = f"grpc-{secrets.token_hex(12)}"
        [stream] = await admit(self.engine, [prompt], params, request_id, kind)
        if request.request_id and self.log_requests:
            log_client_request_id(request_id, request.request_id)
        return stream

    @_rpc
    async def Generate(self, request, context):
        stream = await self._add(request, OutputKind.FINAL_ONLY)
        [output] = await collect_final([stream])
        return _response(output, request.request_id)

    @_rpc
    async def GenerateStream(self, request, context):
        stream = await self._add(request, OutputKind.DELTA)
        try:
            async for message in self._stream_messages(stream, request.request_id):
                yield message
        finally:  # a cancelled call aborts the request at once
            stream.abort()

    @staticmethod
    async def _stream_messages(stream: RequestStream, client_request_id: str):
        totals = StreamTotals()
        async for step in choice_deltas([stream], totals):
            choice, metrics = step.choice, step.output.metrics
            reason = step.finish_reason or ""
            if not (choice.text or choice.token_ids or reason):
                continue
            yield pb.GenerateStreamResponse(
                request_id=client_request_id or step.output.request_id,
                text=choice.text,
                token_ids=choice.token_ids,
                finish_reason=reason,
                prompt_tokens=totals.prompt_tokens[0],
                completion_tokens=totals.completion_tokens,
                latency_ms=_ms(metrics.e2e_latency if reason and metrics else None),
            )

    @_rpc
    async def BatchGenerate(self, request, context):
        start = time.perf_counter()
        prompts = list(request.prompts)
        if not prompts or len(prompts) > MAX_BATCH_PROMPTS:
            raise ParamError(
                f"prompts must hold 1 to {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}",
                "prompts",
            )
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ParamError(f"prompts[{i}] must not be empty", "prompts")
        params = self._params(request.sampling)
        batch_id = f"grpc-batch-{secrets.token_hex(12)}"
        streams = await admit(self.engine, prompts, params, batch_id, OutputKind.FINAL_ONLY)
        outputs = await collect_final(streams)
        return pb.BatchGenerateResponse(
            results=[_response(o) for o in outputs],
            latency_ms=_ms(time.perf_counter() - start),
        )

    async def Health(self, request, context):
        engine = self.engine.stats().engine
        return pb.HealthResponse(
            healthy=self.engine.is_accepting,
            model=self.model_name,
            num_requests_running=engine.num_requests_running,
            num_requests_waiting=engine.num_requests_waiting,
            kv_cache_usage=engine.kv_cache.usage,
        )


def bind_grpc_server(
    host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to host:port (0: any free port), not started yet: binding before
    the model loads makes a busy port fail at once. With `credentials` (TLS, see
    `grpc.ssl_server_credentials`) the port is a secure one. Returns (server, bound port)."""
    # so_reuseport off: a port another process holds fails here instead of being shared.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise UserError(f"cannot listen for gRPC on {address}: {exc}") from None
    return server, bound


async def serve_grpc(
    server: grpc.aio.Server,
    engine: AsyncEngine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    log_requests: bool = False,
) -> None:
    """Add the Generation service on `engine` to a bound server and start it (on the running
    event loop). Stop it with `await server.stop(grace_seconds)`. `log_requests`: log the
    client's `request_id` of a call next to the server's."""
    servicer = GenerationServicer(engine, model_name or engine.model_name, api_key, log_requests)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    await server.start()


async def start_grpc_server(
    engine: AsyncEngine,
    host: str,
    port: int,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """bind_grpc_server + serve_grpc in one call; returns (server, bound port)."""
    server, bound = bind_grpc_server(host, port)
    await serve_grpc(server, engine, model_name=model_name, api_key=api_key)
    return server, bound
