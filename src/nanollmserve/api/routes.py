"""The HTTP routes. Each one only dispatches: protocol model in, serving function, JSON or
SSE out. The ServerContext (engine + settings) comes from `app.state`. The limits on the
fields outside sampling (`--max-messages`, `--max-tools`, `--max-user-length`,
`--max-metadata-*`) are checked here, before any work; the sampling limits by the engine's
request policy (`ServerContext.make_params`). Every `/v1/...` route also answers without the prefix
(`/chat/completions`, `/models`, ...): an alias left out of /openapi.json.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from nanollmserve.api import (
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_llamacpp,
    serving_lora,
    serving_messages,
    serving_responses,
    simple_api,
)
from nanollmserve.api.errors import APIError, bad_request, error_response
from nanollmserve.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    SpecDecodeStatsResponse,
    StatsResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from nanollmserve.api.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from nanollmserve.api.protocol_completions import CompletionRequest, CompletionResponse
from nanollmserve.api.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from nanollmserve.api.protocol_messages import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
)
from nanollmserve.api.protocol_responses import ResponseDeleted, ResponseObject, ResponsesRequest
from nanollmserve.api.serving import ServerContext
from nanollmserve.errors import ParamError
from nanollmserve.metrics import CONTENT_TYPE_LATEST

_ERRORS = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model or object"),
        (413, "Request body too large"),
        (503, "Overloaded (see Retry-After) or shutting down"),
    ]
}


def _json_or_sse(model) -> dict:
    return {
        200: {
            "model": model,
            "description": "JSON, or with `stream` an SSE stream ending in `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


router = APIRouter(responses=_ERRORS)


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(get_context)]


@router.get("/health", response_model=HealthResponse, tags=["server"])
async def health(ctx: Ctx):
    """200 while the engine loop is alive and accepting requests, 503 otherwise; `status` is
    `sleeping` (still a 200: the server is up) while `POST /sleep` holds, when requests get
    a 503 until `POST /wake_up`: a router sends such a worker nothing."""
    if ctx.engine.is_draining:  # a router takes it out of its rotation at once
        return error_response(503, "the server is draining (shutting down)", code="draining")
    if not ctx.engine.is_accepting:
        return error_response(503, "engine is not available", code="engine_unavailable")
    status = "sleeping" if ctx.engine.sleep_requested else "ok"
    return HealthResponse(status=status, kv_role=ctx.settings.kv_role)


@router.get("/ready", response_model=HealthResponse, tags=["server"])
async def ready(ctx: Ctx):
    """The readiness probe: 200 when the model is loaded (the server only listens after
    that) and the server is neither draining (SIGTERM) nor put to sleep (`POST /sleep`);
    else 503 with the reason as the error's `code` (`draining`, `engine_sleeping`,
    `engine_unavailable`)."""
    reason = ctx.engine.not_ready_reason()
    if reason is not None:
        message, code = reason
        return error_response(503, message, code=code)
    return HealthResponse(status="ok", kv_role=ctx.settings.kv_role)


@router.get("/live", tags=["server"])
async def live() -> dict:
    """The liveness probe: 200 while the process serves HTTP, draining and asleep included
    (a dead engine makes the process exit, so a restart is the supervisor's, not a probe's)."""
    return {"status": "ok"}


@router.get(
    "/metrics",
    tags=["server"],
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics in the text format (open to scrapers unless --metrics-require-auth)."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats", response_model=StatsResponse, tags=["server"])
async def stats(ctx: Ctx) -> StatsResponse:
    snapshot = ctx.engine.stats()
    engine, kv = snapshot.engine, snapshot.engine.kv_cache
    return StatsResponse(
        is_healthy=snapshot.is_healthy,
        num_requests_running=engine.num_requests_running,
        num_requests_waiting=engine.num_requests_waiting,
        num_sequences_in_flight=ctx.engine.num_sequences_in_flight,
        kv_cache_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        block_size=kv.block_size,
        prefix_cache_queries=engine.prefix_cache_queries,
        prefix_cache_hits=engine.prefix_cache_hits,
        prefix_cache_hit_rate=engine.prefix_cache_hit_rate,
        num_preemptions=engine.num_preemptions,
        num_steps=engine.num_steps,
        num_prompt_tokens=engine.num_prompt_tokens,
        num_generation_tokens=engine.num_generation_tokens,
        num_requests_finished=snapshot.num_requests_finished,
        num_requests_aborted=snapshot.num_requests_aborted,
        num_requests_failed=snapshot.num_requests_failed,
        num_requests_rejected=ctx.engine.num_requests_rejected,
        num_grammar_compiles_running=ctx.engine.num_grammar_compiles_running,
        peak_running_requests=snapshot.peak_running_requests,
        spec_decode=_spec_decode_stats(engine.spec_decode),
    )


def _spec_decode_stats(spec) -> SpecDecodeStatsResponse | None:
    if spec is None:
        return None
    return SpecDecodeStatsResponse(
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
        acceptance_rate=spec.acceptance_rate,
        mean_acceptance_length=spec.mean_acceptance_length,
    )


def _model_card(ctx: ServerContext, name: str) -> ModelCard:
    return ModelCard(id=name, root=ctx.engine.model_name, max_model_len=ctx.engine.max_model_len)


def _lora_card(ctx: ServerContext, name: str, path: str) -> ModelCard:
    return ModelCard(
        id=name, root=path, parent=ctx.model_name, max_model_len=ctx.engine.max_model_len
    )


@router.get("/v1/models", response_model=ModelList, tags=["openai"])
async def list_models(ctx: Ctx) -> ModelList:
    """The base model's names, then the LoRA adapters (`parent`: the base model)."""
    cards = [_model_card(ctx, name) for name in ctx.model_names]
    cards += [_lora_card(ctx, name, path) for name, path in ctx.engine.lora_adapters().items()]
    return ModelList(data=cards)


@router.get("/v1/models/{model:path}", response_model=ModelCard, tags=["openai"])
async def retrieve_model(model: str, ctx: Ctx) -> ModelCard:
    name = ctx.check_model(model)
    adapters = ctx.engine.lora_adapters()
    if name in adapters and name not in ctx.model_names:
        return _lora_card(ctx, name, adapters[name])
    return _model_card(ctx, name)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, tags=["lora"])
async def load_lora_adapter(body: serving_lora.LoadLoRAAdapterRequest, ctx: Ctx):
    """Load a PEFT adapter directory under a name (needs --allow-runtime-lora-updating)."""
    return await serving_lora.load_lora_adapter(body, ctx)


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, tags=["lora"])
async def unload_lora_adapter(body: serving_lora.UnloadLoRAAdapterRequest, ctx: Ctx):
    """Forget an adapter (needs --allow-runtime-lora-updating); running requests finish."""
    return serving_lora.unload_lora_adapter(body, ctx)


@router.post("/v1/completions", responses=_json_or_sse(CompletionResponse), tags=["openai"])
async def create_completion(body: CompletionRequest, request: Request, ctx: Ctx):
    ctx.limits.check_fields(user=body.user)
    return await serving_completions.create_completion(body, request, ctx)


@router.post(
    "/v1/chat/completions", responses=_json_or_sse(ChatCompletionResponse), tags=["openai"]
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: Ctx):
    ctx.limits.check_messages(len(body.messages))
    ctx.limits.check_fields(tools=body.tools, user=body.user, metadata=body.metadata)
    return await serving_chat.create_chat_completion(body, request, ctx)


@router.post("/v1/responses", responses=_json_or_sse(ResponseObject), tags=["openai"])
async def create_response(body: ResponsesRequest, request: Request, ctx: Ctx):
    if isinstance(body.input, list):
        ctx.limits.check_messages(len(body.input), "input")
    ctx.limits.check_fields(tools=body.tools, user=body.user, metadata=body.metadata)
    return await serving_responses.create_response(body, request, ctx)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, tags=["openai"])
async def create_embedding(body: EmbeddingRequest, request: Request, ctx: Ctx):
    """One embedding per input (needs a server started with --runner pooling)."""
    ctx.limits.check_fields(user=body.user)
    return await serving_embeddings.create_embedding(body, request, ctx)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, tags=["openai"])
async def retrieve_response(response_id: str, ctx: Ctx):
    return serving_responses.retrieve_response(response_id, ctx)


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, tags=["openai"])
async def delete_response(response_id: str, ctx: Ctx):
    return serving_responses.delete_response(response_id, ctx)


@router.post("/v1/messages", responses=_json_or_sse(Message), tags=["anthropic"])
async def create_message(body: MessagesRequest, request: Request, ctx: Ctx):
    """Anthropic's Messages API (errors in Anthropic's shape; SSE events with `stream`)."""
    return await serving_messages.create_message(body, request, ctx)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, tags=["anthropic"])
async def count_message_tokens(body: CountTokensRequest, ctx: Ctx) -> CountTokensResponse:
    """The prompt tokens /v1/messages would run for this request."""
    return await serving_messages.count_tokens(body, ctx)


@router.post("/tokenize", response_model=TokenizeResponse, tags=["tokenizer"])
async def tokenize(body: TokenizeRequest, ctx: Ctx) -> TokenizeResponse:
    ctx.check_model(body.model)
    if body.content is not None or body.with_pieces:  # llama.cpp's request and answer
        return await serving_llamacpp.tokenize(body, ctx)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ctx.limits.check_messages(len(body.messages))
        tokens = await ctx.engine.chat_token_ids([m.to_dict() for m in body.messages])
    else:
        _, tokens = await ctx.engine.tokenize(body.prompt) if body.prompt else (None, [])
    return TokenizeResponse(
        count=len(tokens), max_model_len=ctx.engine.max_model_len, tokens=tokens
    )


@router.post("/detokenize", response_model=DetokenizeResponse, tags=["tokenizer"])
async def detokenize(body: DetokenizeRequest, ctx: Ctx) -> DetokenizeResponse:
    ctx.check_model(body.model)
    try:
        text = await ctx.engine.detokenize(body.tokens) if body.tokens else ""
    except ParamError as exc:  # an id outside the vocabulary
        raise bad_request(str(exc), "tokens") from None
    return DetokenizeResponse(prompt=text, content=text)


@router.post("/generate", response_model=simple_api.GenerateResponse, tags=["simple"])
async def generate(body: simple_api.GenerateRequest, request: Request, ctx: Ctx):
    return await simple_api.generate(body, request, ctx)


@router.post("/batch_generate", response_model=simple_api.BatchGenerateResponse, tags=["simple"])
async def batch_generate(body: simple_api.BatchGenerateRequest, request: Request, ctx: Ctx):
    return await simple_api.batch_generate(body, request, ctx)


# Aliases without the /v1 prefix, for clients whose base URL lacks it (llama.cpp's server
# takes both): the same handlers (so the same auth and limits), kept out of the schema.
for _route in list(router.routes):
    if _route.path.startswith("/v1/"):
        router.add_api_route(
            _route.path.removeprefix("/v1"),
            _route.endpoint,
            methods=sorted(_route.methods),
            response_model=_route.response_model,
            include_in_schema=False,
        )
