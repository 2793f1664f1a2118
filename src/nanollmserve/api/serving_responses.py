"""`/v1/responses`: create (JSON or an SSE event stream), retrieve and delete.

The conversation is `instructions` (as a system message), the stored conversation of
`previous_response_id` if given, then `input` (messages, function calls and their outputs);
it is rendered with the chat template (with the function `tools` the plan renders) and runs
as one engine request. `text.format` becomes the request's grammar, as `response_format`
does on chat; `truncation: "auto"` drops the oldest turns until the conversation fits. The
output is a message item and/or `function_call` items (`tool_choice.py` reads the calls);
streamed, the events of `responses_stream.py`. With `store` (the default) the result is kept
in the in-memory ResponseStore (bounded by count and by `--responses-store-max-bytes`) for GET
and for later `previous_response_id`s. With `--reasoning-parser` a reasoning model's thinking
comes first as a `reasoning` item (not stored in the conversation: templates drop it), and
the grammar of `text.format` or a forced call applies to the answer after it.
"""

from __future__ import annotations

import dataclasses

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from nanollmserve.api.errors import (
    bad_request,
    error_from_exception,
    from_param_error,
    not_found,
)
from nanollmserve.api.generation import choice_deltas, finish_reason
from nanollmserve.api.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TokenLogprob,
)
from nanollmserve.api.protocol_tools import ChatCompletionMessageToolCall, FunctionCall
from nanollmserve.api.reasoning_parsers import REASONING_PARSERS
from nanollmserve.api.reasoning_parsers.plan import ReasoningPlan, plan_reasoning
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.response_format import structured_outputs_from_response_format
from nanollmserve.api.responses_stream import (
    ResponseEvents,
    function_call_item_id,
    message_id,
    reasoning_item_id,
)
from nanollmserve.api.serving import ServerContext, final_outputs, random_id
from nanollmserve.api.serving_chat import token_logprobs
from nanollmserve.api.sse import sse_response
from nanollmserve.api.tool_choice import ToolPlan, plan_tools, with_tool_grammar
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import RequestStream
from nanollmserve.outputs import CompletionOutput, RequestOutput

_PARAM_ALIASES = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}


async def create_response(
    body: ResponsesRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise bad_request(unsupported[1], unsupported[0])
    plan = _plan(body, ctx)
    history: list[dict] = []
    if body.previous_response_id:
        previous = ctx.responses.get(body.previous_response_id)
        if previous is None:
            raise not_found(
                f"Response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
            )
        history = previous.messages()
    conversation = history + body.input_messages()
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    params = with_tool_grammar(_with_text_format(ctx, body), plan)
    prompt_token_ids = await _render(ctx, body, system, conversation, plan, params)
    reasoning, params = await plan_reasoning(
        ctx.engine,
        REASONING_PARSERS.get(ctx.settings.reasoning_parser),
        prompt_token_ids,
        params,
        "tools" if plan.structured_outputs is not None else "text.format",
    )
    response_id = random_id("resp_")
    try:
        [stream] = await ctx.add_requests(
            [prompt_token_ids],
            params,
            response_id,
            body.stream,
            model=model,
            client_request_id=client_request_id(request.headers),
        )
    except ParamError as exc:  # e.g. the rendered conversation is too long
        grammar_source = "tools" if plan.structured_outputs is not None else "text.format"
        aliases = {"prompt": "input", "structured_outputs": grammar_source, **_PARAM_ALIASES}
        raise from_param_error(exc, aliases) from None
    template = ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        store=body.store,
        temperature=body.temperature,
        text={"format": body.text.format.to_dict()} if body.text else {"format": {"type": "text"}},
        tool_choice=_tool_choice_echo(body),
        tools=[{**tool, "strict": tool.get("strict")} for tool in body.tools or []],
        top_logprobs=body.top_logprobs,
        top_p=body.top_p,
        truncation=body.truncation or "disabled",
        user=body.user,
        metadata=body.metadata or {},
    )
    if body.stream:
        events = _stream(
            ctx, stream, template, plan, reasoning, body.wants_logprobs(), conversation
        )
        return sse_response(events, [stream])
    [output] = await final_outputs(request, [stream])
    [choice] = output.outputs
    reason = finish_reason(choice)
    thinking, answer = None, choice.text
    if reasoning is not None:
        thinking, answer = reasoning.parser().parse(choice.text)
    result = plan.parse(answer, reason)
    items: list[OutputItem] = []
    if thinking is not None:
        content = [ReasoningText(text=thinking)]
        item = ReasoningItem(
            type="reasoning", id=reasoning_item_id(), status="completed", content=content
        )
        items.append(item)
    if result.content or not result.calls:
        logprobs = _logprobs(choice, body.wants_logprobs(), body.top_logprobs)
        text = OutputText(text=result.content or "", logprobs=logprobs)
        items.append(OutputMessage(id=message_id(), status="completed", content=[text]))
    for call in result.calls:
        items.append(
            FunctionCallItem(
                id=function_call_item_id(),
                call_id=call.id,
                name=call.name,
                arguments=call.arguments,
                status="completed",
            )
        )
    response = _finish(ctx, template, items, output, reason, conversation)
    return JSONResponse(response.model_dump())


def retrieve_response(response_id: str, ctx: ServerContext) -> Response:
    entry = ctx.responses.get(response_id)
    if entry is None:
        raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
    return Response(entry.response_json, media_type="application/json")


def delete_response(response_id: str, ctx: ServerContext) -> JSONResponse:
    if not ctx.responses.delete(response_id):
        raise not_found(f"Response with id '{response_id}' not found.", param="response_id")
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


def _plan(body: ResponsesRequest, ctx: ServerContext) -> ToolPlan:
    try:
        functions = body.functions()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"tools: {where}: {first['msg']}", "tools") from None
    return plan_tools(
        functions,
        body.tool_choice_name(),
        tool_call_parser=ctx.settings.tool_call_parser,
        parallel_tool_calls=body.parallel_tool_calls,
    )


def _tool_choice_echo(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _with_text_format(ctx: ServerContext, body: ResponsesRequest):
    """The request's SamplingParams, with the grammar of `text.format` if it asks for JSON."""
    params = ctx.make_params(body.to_sampling_params, _PARAM_ALIASES)
    if body.text is None or body.text.format.type == "text":
        return params
    try:
        constraint = structured_outputs_from_response_format(
            body.text.format.to_dict(), param="text.format"
        )
    except ParamError as exc:
        raise from_param_error(exc) from None
    return dataclasses.replace(params, structured_outputs=constraint)


async def _render(ctx, body, system, conversation, plan, params) -> list[int]:
    """The prompt's token ids. With `truncation: "auto"` the oldest turns of `conversation`
    are dropped (never the instructions nor the last turn) until the prompt leaves room for
    the output; otherwise a prompt that does not fit is a 400 when it is admitted."""
    aliases = {"messages": "input"}
    while True:
        try:
            ids = await ctx.engine.chat_token_ids(system + conversation, plan.template_tools)
        except ParamError as exc:
            raise from_param_error(exc, aliases) from None
        room = ctx.engine.max_model_len - len(ids)
        fits = room > 0 and (params.max_tokens is None or params.max_tokens <= room)
        if body.truncation != "auto" or fits:
            return ids
        shorter = _drop_oldest_turn(conversation)
        if shorter is conversation:
            return ids  # the last turn alone does not fit: admission says so
        conversation = shorter


def _drop_oldest_turn(conversation: list[dict]) -> list[dict]:
    """The conversation without its first turn: the first message and what follows it up to
    the next user message. The same list when only one turn is left."""
    for i in range(1, len(conversation)):
        if conversation[i]["role"] == "user":
            return conversation[i:]
    return conversation


def _logprobs(choice: CompletionOutput, wanted: bool, top_k: int | None) -> list[TokenLogprob]:
    if not wanted or not choice.logprobs:
        return []
    content = token_logprobs(choice.logprobs, top_k or 0).content or []
    return [TokenLogprob.model_validate(entry.model_dump()) for entry in content]


def _finish(
    ctx: ServerContext,
    template: ResponseObject,
    items: list[OutputItem],
    output: RequestOutput,
    reason: str | None,
    conversation: list[dict],
) -> ResponseObject:
    """The finished response object (stored when asked to): completed, or incomplete when
    max_output_tokens cut it."""
    incomplete = reason == "length"
    if incomplete:
        for item in items:
            item.status = "incomplete"
    [choice] = output.outputs
    response = template.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            "output": items,
            "usage": ResponseUsage(
                input_tokens=len(output.prompt_token_ids),
                input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens),
                output_tokens=len(choice.token_ids),
                total_tokens=len(output.prompt_token_ids) + len(choice.token_ids),
            ),
        }
    )
    if template.store:
        ctx.responses.put(response, conversation + [_answer(items)])
    return response


def _answer(items: list[OutputItem]) -> dict:
    """The response's output as the assistant message of the stored conversation."""
    text = "".join(
        part.text for item in items if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        ChatCompletionMessageToolCall(
            id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
        ).template_dict()
        for item in items
        if isinstance(item, FunctionCallItem)
    ]
    answer = {"role": "assistant", "content": text}
    if calls:
        answer["tool_calls"] = calls
    return answer


async def _stream(
    ctx: ServerContext,
    stream: RequestStream,
    template: ResponseObject,
    plan: ToolPlan,
    reasoning: ReasoningPlan | None,
    wants_logprobs: bool,
    conversation: list[dict],
):
    events = ResponseEvents()
    tools = plan.stream() if plan.parses_calls else None
    thinking = reasoning.parser() if reasoning is not None else None
    try:
        for event in events.start(template):
            yield event
        if tools is None and thinking is None:  # plain text: the message item opens at once
            for event in events.open_message():
                yield event
        final = None
        reason = None
        async for step in choice_deltas([stream]):
            final = _accumulate(final, step.output)
            reason = step.finish_reason
            text = step.choice.text
            if thinking is not None:
                split = thinking.feed(text)
                if reason is not None:
                    last = thinking.finish()
                    split.reasoning += last.reasoning
                    split.content += last.content
                if split.reasoning:
                    for event in events.reasoning(split.reasoning):
                        yield event
                text = split.content
            if tools is None:
                logprobs = _logprobs(step.choice, wants_logprobs, template.top_logprobs)
                if thinking is not None and not text:
                    logprobs = []  # the tokens of the thinking: no message item for them
                if text or logprobs:
                    for event in events.text(text, logprobs):
                        yield event
                continue
            parsed = tools.feed(text)
            if reason is not None:
                last, reason = tools.finish(reason)
                parsed.content += last.content
                parsed.tool_calls += last.tool_calls
            for event in _parsed_events(events, parsed):
                yield event
        answered = (OutputMessage, FunctionCallItem)
        if not any(isinstance(item, answered) for item in events.items):
            # no answer at all: an empty message, as without tools
            for event in events.open_message():
                yield event
        status = "incomplete" if reason == "length" else "completed"
        for event in events.close(status):
            yield event
        response = _finish(ctx, template, events.items, final, reason, conversation)
        yield events.end(response)
    except Exception as exc:
        err = error_from_exception(exc)
        error = ResponseError(code=err.code or "server_error", message=err.message)
        failed = template.model_copy(update={"status": "failed", "error": error})
        yield events.end(failed)
    finally:
        stream.abort()


def _parsed_events(events: ResponseEvents, parsed) -> list[str]:
    out = []
    if parsed.content:
        out += events.text(parsed.content, [])
    for delta in parsed.tool_calls:
        out += events.tool_call(delta)
    return out


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
