"""`/v1/responses`: create (JSON or an SSE event stream), retrieve and delete.

The conversation is `instructions` (as a system message), the stored conversation of
`previous_response_id` if given, then `input`; it is rendered with the chat template and
runs as one engine request. With `store` (the default) the result is kept in the bounded
in-memory ResponseStore for GET and for later `previous_response_id`s.
"""

from __future__ import annotations

import dataclasses
import json

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanollmserve.api.errors import (
    bad_request,
    error_from_exception,
    from_param_error,
    not_found,
)
from nanollmserve.api.generation import choice_deltas, finish_reason
from nanollmserve.api.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from nanollmserve.api.serving import ServerContext, final_outputs, random_id
from nanollmserve.api.sse import sse_event, sse_response
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import RequestStream
from nanollmserve.outputs import RequestOutput

_PARAM_ALIASES = {"max_tokens": "max_output_tokens"}


async def create_response(
    body: ResponsesRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise bad_request(unsupported[1], unsupported[0])
    history: list[dict] = []
    if body.previous_response_id:
        previous = ctx.responses.get(body.previous_response_id)
        if previous is None:
            raise not_found(
                f"Response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
            )
        history = previous.messages
    conversation = history + body.input_messages()
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    params = ctx.make_params(body.to_sampling_params, _PARAM_ALIASES)
    try:
        prompt_token_ids = await ctx.engine.chat_token_ids(system + conversation)
    except ParamError as exc:
        raise bad_request(str(exc), "input") from None
    response_id = random_id("resp_")
    try:
        [stream] = await ctx.add_requests([prompt_token_ids], params, response_id, body.stream)
    except ParamError as exc:  # e.g. the rendered conversation is too long
        raise from_param_error(exc, {"prompt": "input", **_PARAM_ALIASES}) from None
    template = ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model,
        previous_response_id=body.previous_response_id,
        store=body.store,
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        metadata=body.metadata or {},
    )
    message_id = random_id("msg_")
    if body.stream:
        body = _stream(ctx, stream, template, message_id, conversation)
        return sse_response(body, [stream])
    [output] = await final_outputs(request, [stream])
    response = _finish(ctx, template, message_id, output, conversation)
    return JSONResponse(response.model_dump())


def retrieve_response(response_id: str, ctx: ServerContext) -> JSONResponse:
    entry = ctx.responses.get(response_id)
    if entry is None:
        raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
    return JSONResponse(entry.response.model_dump())


def delete_response(response_id: str, ctx: ServerContext) -> JSONResponse:
    if not ctx.responses.delete(response_id):
        raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


def _finish(
    ctx: ServerContext,
    template: ResponseObject,
    message_id: str,
    output: RequestOutput,
    conversation: list[dict],
) -> ResponseObject:
    """The completed response object (stored when asked to) of a final output."""
    [choice] = output.outputs
    reason = finish_reason(choice)
    incomplete = reason == "length"
    response = template.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            "output": [_message(message_id, choice.text, "completed")],
            "usage": ResponseUsage(
                input_tokens=len(output.prompt_token_ids),
                input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens),
                output_tokens=len(choice.token_ids),
                total_tokens=len(output.prompt_token_ids) + len(choice.token_ids),
            ),
        }
    )
    if template.store:
        answer = {"role": "assistant", "content": choice.text}
        ctx.responses.put(response, conversation + [answer])
    return response


def _message(message_id: str, text: str | None, status: str) -> OutputMessage:
    content = [] if text is None else [OutputText(text=text)]
    return OutputMessage(id=message_id, status=status, content=content)


async def _stream(
    ctx: ServerContext,
    stream: RequestStream,
    template: ResponseObject,
    message_id: str,
    conversation: list[dict],
):
    sequence_number = 0

    def event(kind: str, **fields) -> str:
        nonlocal sequence_number
        payload = {"type": kind, "sequence_number": sequence_number}
        for key, value in fields.items():
            payload[key] = value.model_dump() if hasattr(value, "model_dump") else value
        sequence_number += 1
        return sse_event(json.dumps(payload), kind)

    part = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=template)
        yield event("response.in_progress", response=template)
        item = _message(message_id, None, "in_progress")
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.content_part.added", **part, part=OutputText(text=""))
        final = None
        async for step in choice_deltas([stream]):
            delta = step.choice.text
            if delta:
                yield event("response.output_text.delta", **part, delta=delta, logprobs=[])
            final = _accumulate(final, step.output)
        response = _finish(ctx, template, message_id, final, conversation)
        text = response.output[0].content[0].text
        yield event("response.output_text.done", **part, text=text, logprobs=[])
        yield event("response.content_part.done", **part, part=OutputText(text=text))
        yield event("response.output_item.done", output_index=0, item=response.output[0])
        yield event("response.completed", response=response)
    except Exception as exc:
        err = error_from_exception(exc)
        yield event("error", code=err.code, message=err.message, param=err.param)
    finally:
        stream.abort()


def _accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The stream's deltas added up: the final output `_finish` needs (the answer is stored
    for `previous_response_id`, so the text is kept anyway)."""
    if total is None:
        return RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[dataclasses.replace(c, token_ids=list(c.token_ids)) for c in delta.outputs],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
        )
    total.add(delta)
    return total
