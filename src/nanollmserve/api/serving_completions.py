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

from nanollmserve.api.errors import bad_request
from nanollmserve.api.protocol_completions import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from nanollmserve.api.serving import (
    ChoiceProgress,
    ServerContext,
    final_outputs,
    finish_reason,
    merge_streams,
    random_id,
    usage_of,
)
from nanollmserve.api.sse import SSE_DONE, sse_error, sse_event, sse_response
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
    streams = ctx.add_requests(prompts, params, request_id)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(ctx, streams, body, model, request_id, created, include_usage)
        return sse_response(chunks, streams)
    outputs = await final_outputs(request, streams)
    choices = []
    for prompt_index, output in enumerate(outputs):
        echo = _prompt_text(ctx, output) if body.echo else ""
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
    progress: dict[int, ChoiceProgress] = {}
    text_offsets: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, output in merge_streams(streams):
            last[prompt_index] = output
            for choice in output.outputs:
                index = prompt_index * body.n + choice.index
                state = progress.setdefault(index, ChoiceProgress())
                echo = ""
                if body.echo and index not in text_offsets:
                    echo = _prompt_text(ctx, output)
                step = state.advance(choice)
                if step is None:
                    continue
                text, first_token, reason = step
                logprobs = None
                if body.logprobs is not None:
                    entries = (choice.logprobs or [])[first_token : state.num_tokens]
                    logprobs = _logprobs(entries, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + sum(
                        len(t) for t in logprobs.tokens
                    )
                else:
                    text_offsets.setdefault(index, 0)
                if not (echo or text or reason or logprobs and logprobs.tokens):
                    continue
                chunk_choice = CompletionResponseChoice(
                    index=index, text=echo + text, logprobs=logprobs, finish_reason=reason
                )
                yield sse_event(
                    CompletionResponse(
                        id=request_id, created=created, model=model, choices=[chunk_choice]
                    )
                )
        if usage:
            outputs = [last[i] for i in sorted(last)]
            yield sse_event(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=usage_of(outputs),
                )
            )
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return ctx.engine.detokenize(output.prompt_token_ids)


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
