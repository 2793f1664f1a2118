"""The gRPC service (`proto/nanollmserve.proto`): Generate, GenerateStream, BatchGenerate and
Health over the same AsyncEngine as the HTTP server.

`start_grpc_server(engine, host, port)` (or `bind_grpc_server` early, then `serve_grpc` once
the engine exists) runs a `grpc.aio` server on the current event loop, the one uvicorn
serves on, because the engine hands outputs to asyncio queues bound to the loop that
created them. Like the HTTP routes, the servicer only converts: proto messages in,
`SamplingParams` and `AsyncEngine.add_request`, proto messages out. Errors map to status
codes: ValueError -> INVALID_ARGUMENT (its message), a full queue -> RESOURCE_EXHAUSTED, a
dead or stopping engine -> UNAVAILABLE, a wrong key -> UNAUTHENTICATED. A cancelled call
(client gone, stream cancelled, deadline) cancels the handler, which aborts the request, so
its KV blocks return at once.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import secrets
import time

import grpc

from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb
from nanollmserve.api.grpc_gen import nanollmserve_pb2_grpc as pb_grpc
from nanollmserve.errors import UserError
from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from nanollmserve.outputs import RequestOutput
from nanollmserve.sampling_params import SamplingParams

__all__ = ["GenerationServicer", "bind_grpc_server", "serve_grpc", "start_grpc_server"]

MAX_BATCH_PROMPTS = 256
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
)


class Unauthenticated(Exception):
    pass


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
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


def sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; bad values raise ValueError."""
    kwargs = {
        name: getattr(message, name) for name in OPTIONAL_SAMPLING_FIELDS if message.HasField(name)
    }
    return SamplingParams(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        **kwargs,
    )


def _ms(seconds: float | None) -> float:
    return round(seconds * 1000, 3) if seconds is not None else 0.0


def _finish_reason(output: RequestOutput) -> str:
    reason = output.outputs[0].finish_reason
    if reason == "abort":
        raise EngineDeadError("the request was aborted")
    return reason or ""


def _response(output: RequestOutput) -> pb.GenerateResponse:
    choice, metrics = output.outputs[0], output.metrics
    return pb.GenerateResponse(
        request_id=output.request_id,
        text=choice.text,
        finish_reason=_finish_reason(output),
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(choice.token_ids),
        cached_tokens=output.num_cached_tokens,
        latency_ms=_ms(metrics.e2e_latency if metrics else None),
        time_to_first_token_ms=_ms(metrics.ttft if metrics else None),
    )


async def _last(stream: RequestStream) -> RequestOutput:
    output = None
    try:
        async for item in stream:
            output = item  # cumulative: the last one holds everything
    finally:
        stream.abort()
    return output


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.expected_key = f"Bearer {api_key}".encode() if api_key else None

    def check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.expected_key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected_key):
            raise Unauthenticated("invalid or missing API key: send 'authorization: Bearer KEY'")

    def _add(self, request: pb.GenerateRequest) -> RequestStream:
        if bool(request.prompt) == bool(request.messages):
            raise ValueError("give exactly one of prompt and messages")
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt = self.engine.chat_token_ids(messages)
        else:
            prompt = request.prompt
        params = sampling_params(request.sampling)
        request_id = request.request_id or f"grpc-{secrets.token_hex(12)}"
        return self.engine.add_request(prompt, params, request_id)

    @_rpc
    async def Generate(self, request, context):
        return _response(await _last(self._add(request)))

    @_rpc
    async def GenerateStream(self, request, context):
        stream = self._add(request)
        num_chars = num_tokens = 0
        try:
            async for output in stream:
                choice = output.outputs[0]
                reason = _finish_reason(output) if output.finished else ""
                text, token_ids = choice.text[num_chars:], choice.token_ids[num_tokens:]
                if not (text or token_ids or reason):
                    continue
                num_chars, num_tokens = len(choice.text), len(choice.token_ids)
                metrics = output.metrics
                yield pb.GenerateStreamResponse(
                    request_id=output.request_id,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=reason,
                    prompt_tokens=len(output.prompt_token_ids),
                    completion_tokens=num_tokens,
                    latency_ms=_ms(metrics.e2e_latency if reason and metrics else None),
                )
        finally:
            stream.abort()

    @_rpc
    async def BatchGenerate(self, request, context):
        start = time.perf_counter()
        prompts = list(request.prompts)
        if not prompts or len(prompts) > MAX_BATCH_PROMPTS:
            raise ValueError(
                f"prompts must hold 1 to {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}"
            )
        params = sampling_params(request.sampling)
        batch_id = f"grpc-batch-{secrets.token_hex(12)}"
        streams: list[RequestStream] = []
        try:  # all or none
            for i, prompt in enumerate(prompts):
                if not prompt:
                    raise ValueError(f"prompts[{i}] must not be empty")
                streams.append(self.engine.add_request(prompt, params, f"{batch_id}-{i}"))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        outputs = await asyncio.gather(*(_last(s) for s in streams))
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


def bind_grpc_server(host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to host:port (0: any free port), not started yet: binding before
    the model loads makes a busy port fail at once. Returns (server, bound port)."""
    # so_reuseport off: a port another process holds fails here instead of being shared.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise UserError(f"cannot listen for gRPC on {address}: {exc}") from None
    return server, bound


async def serve_grpc(
    server: grpc.aio.Server,
    engine: AsyncEngine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
) -> None:
    """Add the Generation service on `engine` to a bound server and start it (on the running
    event loop). Stop it with `await server.stop(grace_seconds)`."""
    servicer = GenerationServicer(engine, model_name or engine.model_name, api_key)
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
