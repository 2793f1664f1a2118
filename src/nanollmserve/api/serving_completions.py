"""`POST /v1/completions`: prompts in, text (or an SSE stream of text deltas) out.

Every prompt of the request is admitted to the engine at once (continuous batching runs
them together); choice `index` is `prompt_index * n + i`. Logprobs use the legacy shape
(tokens, token_logprobs, top_logprobs, text_offset); `echo` puts the prompt in front of the
text.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanollmserve.api.errors import bad_request, from_param_error
from nanollmserve.api.generation import StreamTotals, choice_deltas, finish_reason
from nanollmserve.api.protocol_completions import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.serving import (
    ServerContext,
    final_outputs,
    random_id,
    usage_of,
    usage_of_stream,
)
from nanollmserve.api.sse import SSE_DONE, sse_error, sse_event, sse_response
from nanollmserve.errors import ParamError
from nanollmserve.outputs import Logprob, RequestOutput


async def create_completion(
    body: CompletionRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported yet (no prompt logprobs)", "echo")
    params = ctx.make_params(body.to_sampling_params)
    prompts = body.prompts()
    request_id = random_id("cmpl-")
    try:
        streams = await ctx.add_requests(
            prompts,
            params,
            request_id,
            body.stream,
            model=model,
            client_request_id=client_request_id(request.headers),
        )
    except ParamError as exc:  # e.g. a JSON schema the grammar engine cannot compile
        raise from_param_error(exc, body.structured_outputs_aliases()) from None
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(ctx, streams, body, model, request_id, created, include_usage)
        return sse_response(chunks, streams)
    outputs = await final_outputs(request, streams)
    choices = []
    for prompt_index, output in enumerate(outputs):
        echo = await _prompt_text(ctx, output) if body.echo else ""
        for choice in output.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(choice.logprobs or [], 0)
            choices.append(
                CompletionResponseChoice(
                    index=prompt_index * body.n + choice.index,
                    text=echo + choice.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(choice),
                )
            )
    response = CompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage_of(outputs)
    )
    return JSONResponse(response.model_dump())


async def _stream(ctx, streams, body: CompletionRequest, model, request_id, created, usage):
    text_offsets: dict[int, int] = {}
    totals = StreamTotals()
    try:
        async for step in choice_deltas(streams, totals, error_is_reason=True):
            choice = step.choice
            index = step.prompt_index * body.n + choice.index
            echo = await _prompt_text(ctx, step.output) if body.echo and step.first else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(choice.logprobs or [], text_offsets.get(index, 0))
                text_offsets[index] = text_offsets.get(index, 0) + sum(
                    len(t) for t in logprobs.tokens
                )
            if not (echo or choice.text or step.finish_reason or logprobs and logprobs.tokens):
                continue
            chunk_choice = CompletionResponseChoice(
                index=index,
                text=echo + choice.text,
                logprobs=logprobs,
                finish_reason=step.finish_reason,
            )
            yield sse_event(
                CompletionResponse(
                    id=request_id, created=created, model=model, choices=[chunk_choice]
                )
            )
        if usage:
            yield sse_event(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=usage_of_stream(totals),
                )
            )
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE


async def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return await ctx.engine.detokenize(output.prompt_token_ids)


def _logprobs(entries: list[dict[int, Logprob]], text_offset: int) -> CompletionLogprobs:
    """Legacy logprobs: per token its text, its logprob, the alternatives (the sampled token
    plus the top `logprobs`, by text) and where it starts in the text."""
    result = CompletionLogprobs()
    for entry in entries:
        sampled = next(iter(entry.values()))
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result
