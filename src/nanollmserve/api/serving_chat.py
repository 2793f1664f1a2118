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

from nanollmserve.api.errors import bad_request
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
    ChoiceProgress,
    ServerContext,
    final_outputs,
    finish_reason,
    random_id,
    usage_of,
)
from nanollmserve.api.sse import SSE_DONE, sse_error, sse_event, sse_response
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
    try:
        prompt_token_ids = ctx.engine.chat_token_ids(body.message_dicts())
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    request_id = random_id("chatcmpl-")
    [stream] = ctx.add_requests([prompt_token_ids], params, request_id)
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
    progress = [ChoiceProgress() for _ in range(body.n)]
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
        output = None
        async for output in stream:
            for choice in output.outputs:
                step = progress[choice.index].advance(choice)
                if step is None:
                    continue
                text, first_token, reason = step
                logprobs = None
                if body.logprobs:
                    entries = (choice.logprobs or [])[first_token : len(choice.token_ids)]
                    logprobs = _logprobs(entries, top_k)
                if not text and reason is None and not (logprobs and logprobs.content):
                    continue
                delta = DeltaMessage(content=text) if text else DeltaMessage()
                yield chunk(
                    [
                        ChatCompletionStreamChoice(
                            index=choice.index, delta=delta, logprobs=logprobs, finish_reason=reason
                        )
                    ]
                )
        if include_usage and output is not None:
            yield chunk([], usage=usage_of([output]))
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
