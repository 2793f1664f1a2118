"""What every HTTP endpoint shares: the server context (engine + settings), model-name
checks, admitting requests and waiting for their final outputs while watching for a client
disconnect (on top of `generation.py`, which the gRPC service shares), and usage.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from nanollmserve.api.errors import bad_request, from_param_error, not_found
from nanollmserve.api.generation import StreamTotals, admit, collect_final
from nanollmserve.api.protocol import SamplingExtensions, UsageInfo
from nanollmserve.api.protocol_responses import ResponsesRequest
from nanollmserve.api.response_store import ResponseStore
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import AsyncEngine, OutputKind, RequestStream
from nanollmserve.outputs import RequestOutput
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams

MAX_REQUEST_BYTES = 4 << 20
"""Largest request body accepted (413 beyond)."""


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)
    """Names the model answers to; the first is the one reported. Empty: the model's name."""
    api_key: str | None = None
    """When set, every route except /health (and /metrics, see below) needs
    `Authorization: Bearer <api_key>`."""
    metrics_require_auth: bool = False
    """With an api_key, /metrics needs it too; by default scrapers read /metrics freely."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    response_store_size: int = 1024
    """Responses kept for GET /v1/responses/{id} and previous_response_id (LRU)."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """Bounds on one request (`n`, logprobs, stop strings, logit_bias, messages); 400 beyond."""
    generation_defaults: dict = field(default_factory=dict)
    """Sampling defaults (`--generation-config`: temperature, top_p, ...) for the OpenAI
    requests (completions, chat, responses) that leave the field unset."""
    tool_call_parser: str | None = None
    """The parser of `tool_choice: "auto"` (`--enable-auto-tool-choice --tool-call-parser`);
    None: "auto" with tools is a 400."""
    log_requests: bool = False
    """Log one line per ended request (`nanollmserve serve` turns it on)."""
    log_prompts: bool = False
    """Put the prompt text in that line too."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: origins browsers may call from (empty: CORS off, same-origin only; `*`: any)."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allow_runtime_lora_updating: bool = False
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter work (404 otherwise)."""


class ServerContext:
    """The engine and settings the routes serve from (one per app)."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.model_names = settings.served_model_names or [engine.model_name]
        self.responses = ResponseStore(settings.response_store_size)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to report for a request's `model` (404 if it is not served here): a
        served name of the base model or a loaded LoRA adapter's name."""
        if model is None or model == "":
            return self.model_name
        if model not in self.model_names and model not in self.engine.lora_adapters():
            raise not_found(f"The model `{model}` does not exist.", "model_not_found", "model")
        return model

    def make_params(self, to_params: Callable[[], SamplingParams], aliases=None) -> SamplingParams:
        """The request's SamplingParams, within the server's limits. A bad value is a 400
        whose `param` is the field under the endpoint's name for it (`aliases` maps
        SamplingParams fields to those names); any other error propagates (a 500).
        `to_params` is the request's bound `to_sampling_params`: the fields an OpenAI request
        leaves unset (absent or null) get the server's `generation_defaults`."""
        try:
            params = to_params()
            defaults = self._unset_defaults(getattr(to_params, "__self__", None))
            if defaults:
                params = dataclasses.replace(params, **defaults)
            self.settings.limits.check_params(params)
        except ParamError as exc:
            raise from_param_error(exc, aliases) from None
        if params.n > self.engine.max_num_seqs:
            raise bad_request(
                f"n is {params.n}, more than this server runs at once "
                f"(--max-num-seqs {self.engine.max_num_seqs})",
                "n",
            )
        return params

    def _unset_defaults(self, body) -> dict:
        if not self.settings.generation_defaults or not isinstance(
            body, SamplingExtensions | ResponsesRequest
        ):
            return {}  # the simple API (/generate) keeps its own documented defaults
        return {
            name: value
            for name, value in self.settings.generation_defaults.items()
            if name in type(body).model_fields
            and (name not in body.model_fields_set or getattr(body, name) is None)
        }

    async def add_requests(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        stream: bool = False,
        model: str | None = None,
    ) -> list[RequestStream]:
        """Admit one request per prompt, all or none: DELTA streams for a streamed response,
        FINAL_ONLY ones otherwise. `model` (checked by `check_model`) naming a LoRA adapter
        runs them with it."""
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        lora_name = None if model in self.model_names else model
        return await admit(self.engine, prompts, params, request_id, kind, lora_name)


def random_id(prefix: str) -> str:
    """`prefix` + 24 hex digits, e.g. random_id("chatcmpl-")."""
    return prefix + secrets.token_hex(12)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Usage of final outputs."""
    return UsageInfo.of(
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        completion_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
    )


def usage_of_stream(totals: StreamTotals) -> UsageInfo:
    """Usage of a streamed response, from the totals its deltas added up."""
    return UsageInfo.of(
        prompt_tokens=sum(totals.prompt_tokens.values()),
        completion_tokens=totals.completion_tokens,
        cached_tokens=sum(totals.cached_tokens.values()),
    )


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every (FINAL_ONLY) stream; a client that disconnects meanwhile
    aborts them all, so their KV blocks return at once though no response will be sent."""
    return await collect_final(streams, wait_for_disconnect(request))
