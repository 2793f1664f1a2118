"""`POST /v1/chat/completions`: messages rendered with the chat template, one engine request
with `n` choices, answered as a ChatCompletion or an SSE stream of chunks.

Streaming: each choice's first chunk carries `role`, then content deltas; only its last
chunk carries `finish_reason`; with `stream_options.include_usage` a final chunk has the
usage and no choices; then `data: [DONE]`. Every chunk has the same id.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanollmserve.api.errors import bad_request, from_param_error
from nanollmserve.api.generation import StreamTotals, choice_deltas, finish_reason
from nanollmserve.api.protocol_chat import (
    ChatCompletionChunk,
    ChatCompletionLogprobs,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from nanollmserve.api.serving import (
    ServerContext,
    final_outputs,
    random_id,
    usage_of,
    usage_of_stream,
)
from nanollmserve.api.sse import SSE_DONE, sse_error, sse_event, sse_response
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import RequestStream
from nanollmserve.outputs import Logprob

# SamplingParams field -> request field, for the `param` of a 400.
_PARAM_ALIASES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise bad_request(unsupported[1], unsupported[0])
    params = ctx.make_params(body.to_sampling_params, _PARAM_ALIASES)
    prompt_token_ids = await ctx.engine.chat_token_ids(body.message_dicts())
    request_id = random_id("chatcmpl-")
    try:
        [stream] = await ctx.add_requests([prompt_token_ids], params, request_id, body.stream)
    except ParamError as exc:  # e.g. the rendered conversation is too long
        raise from_param_error(exc, {"prompt": "messages", **_PARAM_ALIASES}) from None
    created = int(time.time())
    top_k = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(stream, body, model, request_id, created, include_usage)
        return sse_response(chunks, [stream])
    [output] = await final_outputs(request, [stream])
    choices = [
        ChatCompletionResponseChoice(
            index=choice.index,
            message=ChatCompletionMessage(content=choice.text),
            logprobs=_logprobs(choice.logprobs or [], top_k) if body.logprobs else None,
            finish_reason=finish_reason(choice),
        )
        for choice in output.outputs
    ]
    response = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage_of([output])
    )
    return JSONResponse(response.model_dump())


async def _stream(
    stream: RequestStream,
    body: ChatCompletionRequest,
    model: str,
    request_id: str,
    created: int,
    include_usage: bool,
):
    def chunk(choices, usage=None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    top_k = body.top_logprobs or 0
    totals = StreamTotals()
    try:
        # The role goes first, in a chunk of its own for every choice.
        yield chunk(
            [
                ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")
                )
                for i in range(body.n)
            ]
        )
        async for step in choice_deltas([stream], totals):
            choice = step.choice
            logprobs = _logprobs(choice.logprobs or [], top_k) if body.logprobs else None
            if (
                not choice.text
                and step.finish_reason is None
                and not (logprobs and logprobs.content)
            ):
                continue
            delta = DeltaMessage(content=choice.text) if choice.text else DeltaMessage()
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=choice.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=step.finish_reason,
                    )
                ]
            )
        if include_usage:
            yield chunk([], usage=usage_of_stream(totals))
    except Exception as exc:
        yield sse_error(exc)
    finally:
        stream.abort()
    yield SSE_DONE


def _logprobs(entries: list[dict[int, Logprob]], top_k: int) -> ChatCompletionLogprobs:
    """Per token: the sampled token first, then its `top_k` most likely alternatives."""
    content = []
    for entry in entries:
        sampled = next(iter(entry.values()))
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append(
            ChatCompletionTokenLogprob(
                token=sampled.decoded_token or "",
                logprob=sampled.logprob,
                bytes=list((sampled.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in top[:top_k]
                ],
            )
        )
    return ChatCompletionLogprobs(content=content)
