"""`POST /v1/completions`: prompts in, text (or an SSE stream of text deltas) out.

Every prompt of the request is admitted to the engine at once (continuous batching runs
them together); choice `index` is `prompt_index * n + i`. Logprobs use the legacy shape
(tokens, token_logprobs, top_logprobs, text_offset); `echo` puts the prompt in front of the
text, and with `logprobs` its tokens in front of the logprobs (scored by the engine's prompt
logprobs). `return_token_ids` and `prompt_logprobs` add vLLM's token-level fields to each
choice (a stream: the prompt's in a choice's first chunk).
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanollmserve.api.errors import bad_request, from_param_error
from nanollmserve.api.generation import StreamTotals, choice_deltas, finish_reason
from nanollmserve.api.llamacpp_protocol import Timings
from nanollmserve.api.protocol_base import prompt_logprobs_json
from nanollmserve.api.protocol_completions import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from nanollmserve.api.protocol_kv_transfer import check_kv_transfer, kv_transfer_result
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
    params = ctx.make_params(body.to_sampling_params, _param_aliases(body))
    prompts = body.prompts()
    check_kv_transfer(params, stream=body.stream, num_prompts=len(prompts))
    request_id = random_id("cmpl-")
    try:
        streams = await ctx.add_requests(
            prompts,
            params,
            request_id,
            body.stream,
            model=model,
            client_request_id=client_request_id(request.headers),
            prompt_logprobs_copies=_prompt_logprobs_copies(body),
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
        prompt_json = _prompt_logprobs_json(body, output)  # built once, shared by the choices
        for choice in output.outputs:
            logprobs = None
            if body.logprobs is not None:
                entries = await _echoed(ctx, body, output) + (choice.logprobs or [])
                logprobs = _logprobs(entries, 0)
            choices.append(
                CompletionResponseChoice(
                    index=prompt_index * body.n + choice.index,
                    text=echo + choice.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(choice),
                    **_token_io(body, output, choice.token_ids, True, prompt_json),
                )
            )
    usage = usage_of(outputs)
    response = CompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage,
        kv_transfer_params=await kv_transfer_result(ctx, params, outputs[0], model),
        timings=Timings.of(outputs, usage.completion_tokens) if ctx.settings.timings else None,
    )
    return JSONResponse(response.model_dump())


async def _stream(ctx, streams, body: CompletionRequest, model, request_id, created, usage):
    text_offsets: dict[int, int] = {}
    # Per prompt, the output that brought its prompt logprobs (a DELTA output has them once;
    # each choice's first chunk needs them).
    prompt_outputs: dict[int, RequestOutput] = {}
    prompt_jsons: dict[int, object] = {}  # their prompt_logprobs JSON, built once
    totals = StreamTotals()
    last_outputs: dict[int, RequestOutput] = {}  # per prompt, for the timings
    num_open = len(streams) * body.n  # choices still running
    try:
        async for step in choice_deltas(streams, totals, error_is_reason=True):
            choice = step.choice
            last_outputs[step.prompt_index] = step.output
            num_open -= step.finish_reason is not None
            index = step.prompt_index * body.n + choice.index
            echo = await _prompt_text(ctx, step.output) if body.echo and step.first else ""
            new_prompt = step.prompt_index not in prompt_outputs
            if step.output.prompt_logprobs is not None and new_prompt:
                prompt_outputs[step.prompt_index] = step.output
                prompt_jsons[step.prompt_index] = _prompt_logprobs_json(body, step.output)
            prompt_output = prompt_outputs.get(step.prompt_index, step.output)
            logprobs = None
            if body.logprobs is not None:
                entries = await _echoed(ctx, body, prompt_output) if step.first else []
                logprobs = _logprobs(entries + (choice.logprobs or []), text_offsets.get(index, 0))
                text_offsets[index] = text_offsets.get(index, 0) + sum(
                    len(t) for t in logprobs.tokens
                )
            prompt_json = prompt_jsons.get(step.prompt_index)
            token_io = _token_io(body, prompt_output, choice.token_ids, step.first, prompt_json)
            news = echo or choice.text or step.finish_reason or any(token_io.values())
            if not (news or logprobs and logprobs.tokens):
                continue
            chunk_choice = CompletionResponseChoice(
                index=index,
                text=echo + choice.text,
                logprobs=logprobs,
                finish_reason=step.finish_reason,
                **token_io,
            )
            # llama.cpp's timings go on the last chunk: this one, unless usage follows.
            last = num_open == 0 and not usage
            yield sse_event(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[chunk_choice],
                    timings=_stream_timings(ctx, last_outputs, totals) if last else None,
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
                    timings=_stream_timings(ctx, last_outputs, totals),
                )
            )
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _param_aliases(body: CompletionRequest) -> dict[str, str] | None:
    """The request field a SamplingParams field's 400 names: `n_probs` when it was sent."""
    return {"logprobs": "n_probs"} if body.n_probs else None


def _stream_timings(
    ctx: ServerContext, last_outputs: dict[int, RequestOutput], totals: StreamTotals
) -> Timings | None:
    """The timings of a stream's last chunk (None under `--no-timings`)."""
    if not ctx.settings.timings:
        return None
    return Timings.of(list(last_outputs.values()), totals.completion_tokens)


def _prompt_logprobs_copies(body: CompletionRequest) -> int:
    """How many times the response holds a prompt's logprobs: in each choice, as
    `prompt_logprobs` and, with `echo` and `logprobs`, in front of its legacy logprobs."""
    places = (body.prompt_logprobs is not None) + (body.echo and body.logprobs is not None)
    return body.n * max(places, 1)


async def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return await ctx.engine.detokenize(output.prompt_token_ids)


async def _echoed(
    ctx: ServerContext, body: CompletionRequest, output: RequestOutput
) -> list[dict[int, Logprob] | str]:
    """With `echo` and `logprobs`: the prompt's entries, to go before the choice's; the
    first prompt token, which nothing predicts, is only its text."""
    if not (body.echo and body.logprobs is not None) or output.prompt_logprobs is None:
        return []
    first_token = await ctx.engine.detokenize(output.prompt_token_ids[:1])
    return [first_token, *output.prompt_logprobs[1:]]


def _prompt_logprobs_json(body: CompletionRequest, output: RequestOutput):
    """The prompt's `prompt_logprobs` field (None unless asked for), built once per prompt:
    every choice of the prompt carries the same."""
    if body.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(output.prompt_logprobs)


def _token_io(
    body: CompletionRequest, output: RequestOutput, token_ids, first: bool, prompt_json=None
) -> dict:
    """The choice's vLLM token-level fields (the prompt's only in its first chunk);
    `prompt_json`: the prompt's `prompt_logprobs` field (`_prompt_logprobs_json`)."""
    fields = {}
    if body.return_token_ids:
        fields["token_ids"] = list(token_ids)
        if first:
            fields["prompt_token_ids"] = list(output.prompt_token_ids)
    if body.prompt_logprobs is not None and first:
        fields["prompt_logprobs"] = prompt_json
    return fields


def _logprobs(entries: list[dict[int, Logprob] | str], text_offset: int) -> CompletionLogprobs:
    """Legacy logprobs: per token its text, its logprob, the alternatives (the scored token
    plus the top `logprobs`, by text) and where it starts in the text. A bare text (the
    echoed prompt's first token) has a null logprob and alternatives."""
    result = CompletionLogprobs()
    for entry in entries:
        if isinstance(entry, str):
            result.tokens.append(entry)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(text_offset)
            text_offset += len(entry)
            continue
        sampled = next(iter(entry.values()))
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result
