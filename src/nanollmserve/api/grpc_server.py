"""The gRPC service (`proto/nanollmserve.proto`): Generate, GenerateStream, BatchGenerate and
Health over the same AsyncEngine as the HTTP server.

`start_grpc_server(engine, host, port)` (or `bind_grpc_server` early, then `serve_grpc` once
the engine exists) runs a `grpc.aio` server on the current event loop, the one uvicorn
serves on, because the engine hands outputs to asyncio queues bound to the loop that
created them. Like the HTTP routes, the servicer only converts: proto messages in,
`SamplingParams`, then the engine's admission (`frontend/admission.py`: the request policy
the engine was built with, the limits and generation defaults HTTP requests and the offline
`LLM` are held to: the same refusals, INVALID_ARGUMENT here), then the admission and
collection layer the HTTP routes use too (`generation.py`), proto messages out. With the
server's `--reasoning-parser`, a chat (`messages`) is split as on HTTP chat: the thinking in
`reasoning_content`, the answer in `text`, and a grammar applies after the thinking
(`reasoning_parsers/plan.py`). Token-level output as on HTTP: `return_token_ids` and
`sampling.prompt_logprobs`. The engine
key of a call is always the server's (`grpc-...`): a client's `request_id` is echoed in the
replies and logged quoted, never used as a key (it could collide with another request).

Errors map to status codes: a bad parameter (ParamError) -> INVALID_ARGUMENT (its message),
a full queue -> RESOURCE_EXHAUSTED, a dead, stopping or sleeping engine -> UNAVAILABLE, a
failed engine step -> INTERNAL, a wrong key -> UNAUTHENTICATED. A cancelled call (client
gone, stream cancelled, deadline) cancels the handler, which aborts the request, so its KV
blocks return at once.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import inspect
import secrets
import time

import grpc

from nanollmserve.api.errors import APIError
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
from nanollmserve.api.reasoning_parsers import REASONING_PARSERS
from nanollmserve.api.reasoning_parsers.plan import ReasoningPlan, plan_reasoning
from nanollmserve.api.request_log import log_client_request_id
from nanollmserve.errors import ParamError, UserError
from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineSleepingError,
    EngineStepError,
    OutputKind,
    RequestStream,
)
from nanollmserve.outputs import RequestOutput
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams
from nanollmserve.tracing import genai
from nanollmserve.tracing.context import current_request_span, server_span

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
    "prompt_logprobs",
)


class Unauthenticated(Exception):
    pass


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, ParamError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, APIError) and exc.status_code == 400:  # a refusal shared with HTTP
        return grpc.StatusCode.INVALID_ARGUMENT, exc.message
    if isinstance(exc, EngineStepError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineDeadError | EngineSleepingError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return None


def _rpc(method):
    """Check the API key, then run the method (in a trace span with tracing on); our errors
    become status codes."""

    async def fail(context, exc: Exception) -> None:
        status = _status(exc)
        if status is None:
            raise exc
        span = current_request_span()
        if span is not None:
            span.set_attributes({"rpc.grpc.status_code": status[0].value[0]})
        await context.abort(*status)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            with self.traced(method.__name__, request, context):
                try:
                    self.check_auth(context)
                    async for message in method(self, request, context):
                        yield message
                except Exception as exc:
                    await fail(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        with self.traced(method.__name__, request, context):
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


def _prompt_logprobs(output: RequestOutput) -> list[pb.PromptTokenLogprobs]:
    """vLLM's prompt_logprobs as messages: none for the first position, then the prompt's
    token and the top-k per position (empty without `sampling.prompt_logprobs`)."""
    return [
        pb.PromptTokenLogprobs(
            logprobs=[
                pb.TokenLogprob(
                    token_id=token_id,
                    logprob=entry.logprob,
                    rank=entry.rank,
                    decoded_token=entry.decoded_token or "",
                )
                for token_id, entry in (position or {}).items()
            ]
        )
        for position in output.prompt_logprobs or ()
    ]


def _response(
    output: RequestOutput,
    request_id: str | None = None,
    reasoning: ReasoningPlan | None = None,
    return_token_ids: bool = False,
) -> pb.GenerateResponse:
    """The reply to one prompt; `request_id`: the id to echo (default: the server's);
    `reasoning`: the plan that splits a chat's thinking from its answer."""
    choice, metrics = output.outputs[0], output.metrics
    thinking, text = reasoning.parser().parse(choice.text) if reasoning else (None, choice.text)
    return pb.GenerateResponse(
        request_id=request_id or output.request_id,
        text=text,
        reasoning_content=thinking or "",
        prompt_token_ids=output.prompt_token_ids if return_token_ids else (),
        token_ids=choice.token_ids if return_token_ids else (),
        prompt_logprobs=_prompt_logprobs(output),
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
        reasoning_parser: str | None = None,
        tracer=None,
    ):
        self.engine = engine
        self.tracer = tracer
        """`--otlp-traces-endpoint`'s Tracer: a span per call (None: off)."""
        if tracer is not None:
            tracer.observe(engine)
        self.reasoning_parser = REASONING_PARSERS.get(reasoning_parser)
        self.model_name = model_name
        self.expected_key = f"Bearer {api_key}".encode() if api_key else None
        self.log_requests = log_requests

    def traced(self, method_name: str, request, context: grpc.aio.ServicerContext):
        """The call's span (a no-op without a tracer): `text_completion` or, for messages,
        `chat`, renamed `{operation} {model}` at admission."""
        if self.tracer is None:
            return contextlib.nullcontext()
        operation = "chat" if getattr(request, "messages", None) else "text_completion"
        attributes = {
            genai.OPERATION: operation,
            genai.PROVIDER: genai.PROVIDER_NAME,
            "rpc.system": "grpc",
            "rpc.method": method_name,
        }
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        return server_span(self.tracer, operation, metadata, attributes)

    def check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.expected_key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected_key):
            raise Unauthenticated("invalid or missing API key: send 'authorization: Bearer KEY'")

    def _params(self, message: pb.SamplingParams) -> SamplingParams:
        """The call's SamplingParams through the engine's request policy (defaults, limits),
        before any work."""
        return self.engine.admission.check_params(
            sampling_params(message), unset_sampling_fields(message)
        )

    async def _add(
        self, request: pb.GenerateRequest, kind: OutputKind
    ) -> tuple[RequestStream, ReasoningPlan | None]:
        """The admitted request, and the reasoning plan of a chat (None: no splitting)."""
        if bool(request.prompt) == bool(request.messages):
            raise ParamError("give exactly one of prompt and messages", "prompt")
        limits = self.engine.admission.limits
        limits.check_fields(client_request_id=request.request_id or None)
        params = self._params(request.sampling)
        if request.messages:
            limits.check_messages(len(request.messages))
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt = await self.engine.chat_token_ids(messages)
            reasoning, params = await plan_reasoning(
                self.engine, self.reasoning_parser, prompt, params, param="structured_outputs"
            )
        else:
            prompt, reasoning = request.prompt, None
        request_id = f"grpc-{secrets.token_hex(12)}"
        [stream] = await admit(
            self.engine, [prompt], params, request_id, kind, model=self.model_name
        )
        if request.request_id and self.log_requests:
            log_client_request_id(request_id, request.request_id)
        return stream, reasoning

    @_rpc
    async def Generate(self, request, context):
        stream, reasoning = await self._add(request, OutputKind.FINAL_ONLY)
        [output] = await collect_final([stream])
        return _response(output, request.request_id, reasoning, request.return_token_ids)

    @_rpc
    async def GenerateStream(self, request, context):
        stream, reasoning = await self._add(request, OutputKind.DELTA)
        try:
            async for message in self._stream_messages(stream, request, reasoning):
                yield message
        finally:  # a cancelled call aborts the request at once
            stream.abort()

    @staticmethod
    async def _stream_messages(
        stream: RequestStream, request: pb.GenerateRequest, reasoning: ReasoningPlan | None
    ):
        totals = StreamTotals()
        thinking = reasoning.parser() if reasoning else None
        first = True
        async for step in choice_deltas([stream], totals):
            choice, metrics = step.choice, step.output.metrics
            reason = step.finish_reason or ""
            if not (choice.text or choice.token_ids or reason):
                continue
            text, reasoning_text = choice.text, ""
            if thinking is not None:
                split = thinking.feed(text)
                if reason:
                    last = thinking.finish()
                    split.reasoning += last.reasoning
                    split.content += last.content
                reasoning_text, text = split.reasoning, split.content
            head = {}
            if first:
                head["prompt_logprobs"] = _prompt_logprobs(step.output)
                if request.return_token_ids:
                    head["prompt_token_ids"] = step.output.prompt_token_ids
                first = False
            yield pb.GenerateStreamResponse(
                request_id=request.request_id or step.output.request_id,
                text=text,
                reasoning_content=reasoning_text,
                token_ids=choice.token_ids,
                **head,
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
        streams = await admit(
            self.engine, prompts, params, batch_id, OutputKind.FINAL_ONLY, model=self.model_name
        )
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
    reasoning_parser: str | None = None,
    tracer=None,
) -> None:
    """Add the Generation service on `engine` to a bound server and start it (on the running
    event loop). Stop it with `await server.stop(grace_seconds)`. `log_requests`: log the
    client's `request_id` of a call next to the server's; `reasoning_parser`: the server's
    `--reasoning-parser` (chats get `reasoning_content`); `tracer`: a span per call
    (`--otlp-traces-endpoint`), the child of the call's `traceparent` metadata."""
    servicer = GenerationServicer(
        engine, model_name or engine.model_name, api_key, log_requests, reasoning_parser, tracer
    )
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    await server.start()


async def start_grpc_server(
    engine: AsyncEngine,
    host: str,
    port: int,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    tracer=None,
) -> tuple[grpc.aio.Server, int]:
    """bind_grpc_server + serve_grpc in one call; returns (server, bound port)."""
    server, bound = bind_grpc_server(host, port)
    await serve_grpc(server, engine, model_name=model_name, api_key=api_key, tracer=tracer)
    return server, bound
