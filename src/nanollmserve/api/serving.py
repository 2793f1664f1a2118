"""What every endpoint shares: the server context (engine + settings), model-name checks,
admitting requests, waiting for results while watching for a client disconnect, merging
several request streams, and turning cumulative outputs into per-choice deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from nanollmserve.api.errors import bad_request, from_param_error, not_found
from nanollmserve.api.protocol import UsageInfo
from nanollmserve.api.response_store import ResponseStore
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import AsyncEngine, EngineDeadError, RequestStream
from nanollmserve.outputs import CompletionOutput, RequestOutput
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
        """The name to report for a request's `model` (404 if it is not served here)."""
        if model is None or model == "":
            return self.model_name
        if model not in self.model_names:
            raise not_found(f"The model `{model}` does not exist.", "model_not_found", "model")
        return model

    def make_params(self, to_params: Callable[[], SamplingParams], aliases=None) -> SamplingParams:
        """The request's SamplingParams, within the server's limits. A bad value is a 400
        whose `param` is the field under the endpoint's name for it (`aliases` maps
        SamplingParams fields to those names); any other error propagates (a 500)."""
        try:
            params = to_params()
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

    def add_requests(
        self, prompts: list[str | list[int]], params: SamplingParams, request_id: str
    ) -> list[RequestStream]:
        """Admit one request per prompt, all or none (errors become APIErrors)."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request(prompt, params, rid))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


def random_id(prefix: str) -> str:
    """`prefix` + 24 hex digits, e.g. random_id("chatcmpl-")."""
    return prefix + secrets.token_hex(12)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    return UsageInfo.of(
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        completion_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
    )


def finish_reason(choice: CompletionOutput) -> str | None:
    """ "stop" / "length" / None (running); an aborted choice means the client or the server
    went away, which ends the request with an error."""
    if choice.finish_reason == "abort":
        raise EngineDeadError("the request was aborted")
    return choice.finish_reason


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The last output of every stream; a client that disconnects meanwhile aborts them all,
    so their KV blocks return at once even though no response will be sent."""

    async def last(stream: RequestStream) -> RequestOutput:
        output = None
        async for item in stream:
            output = item
        return output

    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    results = asyncio.gather(*(last(s) for s in streams))
    try:
        done, _ = await asyncio.wait({watcher, results}, return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            raise EngineDeadError("the client disconnected")
        return results.result()
    finally:
        watcher.cancel()
        if not results.done():
            results.cancel()
            with contextlib.suppress(BaseException):
                await results
        for stream in streams:
            stream.abort()


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come; closing it aborts all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


class ChoiceProgress:
    """What of one choice has been streamed: characters of text, tokens (for logprobs), and
    whether its finish chunk went out."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False

    def advance(self, choice: CompletionOutput) -> tuple[str, int, str | None] | None:
        """(new text, index of the first new token, finish_reason) or None if nothing new."""
        if self.finished:
            return None
        reason = finish_reason(choice)
        text = choice.text[self.num_chars :]
        first_token = self.num_tokens
        if not text and len(choice.token_ids) == first_token and reason is None:
            return None
        self.num_chars = max(self.num_chars, len(choice.text))
        self.num_tokens = len(choice.token_ids)
        self.finished = reason is not None
        return text, first_token, reason
