"""`POST /v1/chat/completions`: messages rendered with the chat template, one engine request
with `n` choices, answered as a ChatCompletion or an SSE stream of chunks.

Streaming: each choice's first chunk carries `role`, then content deltas; only its last
chunk carries `finish_reason`; with `stream_options.include_usage` a final chunk has the
usage and no choices; then `data: [DONE]`. Every chunk has the same id. A choice the engine
failed alone ends with finish_reason "error" (a non-streaming request gets a 500).

With tools (`tool_choice.py`), each choice's text goes through the tool parser: calls
become `message.tool_calls` (streamed as `delta.tool_calls`: id and name first, then
argument fragments) with finish_reason "tool_calls"; the rest stays content.

With `--reasoning-parser` (`reasoning_parsers/`), each choice's text is first split into
its thinking (`reasoning_content`, streamed as `delta.reasoning_content`) and its answer;
only the answer goes through the tool parser and is `content`, and a grammar (structured
output, a forced call) applies to the answer only.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanollmserve.api.errors import bad_request, from_param_error
from nanollmserve.api.generation import StreamTotals, choice_deltas, finish_reason
from nanollmserve.api.llamacpp_protocol import Timings
from nanollmserve.api.protocol_base import prompt_logprobs_json
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
from nanollmserve.api.protocol_kv_transfer import check_kv_transfer, kv_transfer_result
from nanollmserve.api.protocol_tools import (
    ChatCompletionMessageToolCall,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
)
from nanollmserve.api.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from nanollmserve.api.reasoning_parsers.plan import ReasoningPlan, plan_reasoning
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.serving import (
    ServerContext,
    final_outputs,
    random_id,
    usage_of,
    usage_of_stream,
)
from nanollmserve.api.sse import SSE_DONE, sse_error, sse_event, sse_response
from nanollmserve.api.tool_choice import ToolPlan, ToolStream, plan_tools, with_tool_grammar
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import RequestStream
from nanollmserve.outputs import Logprob, RequestOutput

# SamplingParams field -> request field, for the `param` of a 400.
_PARAM_ALIASES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    unsupported = body.unsupported()
    if unsupported:
        raise bad_request(unsupported[1], unsupported[0])
    plan = plan_tools(
        body.functions(),
        body.tool_choice_name(),
        tool_call_parser=ctx.settings.tool_call_parser,
        parallel_tool_calls=body.parallel_tool_calls,
    )
    aliases = {**_PARAM_ALIASES, "logprobs": "n_probs"} if body.n_probs else _PARAM_ALIASES
    params = with_tool_grammar(ctx.make_params(body.to_sampling_params, aliases), plan)
    check_kv_transfer(params, stream=body.stream)
    prompt_token_ids = await ctx.engine.chat_token_ids(
        body.message_dicts(), plan.template_tools, **body.chat_template_options()
    )
    reasoning, params = await plan_reasoning(
        ctx.engine,
        REASONING_PARSERS.get(ctx.settings.reasoning_parser),
        prompt_token_ids,
        params,
        "tool_choice" if plan.structured_outputs is not None else "response_format",
    )
    request_id = random_id("chatcmpl-")
    try:
        [stream] = await ctx.add_requests(
            [prompt_token_ids],
            params,
            request_id,
            body.stream,
            model=model,
            client_request_id=client_request_id(request.headers),
            prompt_logprobs_copies=1,  # on the response, not on each choice
        )
    except ParamError as exc:  # e.g. the rendered conversation is too long
        grammar_source = (  # the field a grammar that fails (limit, compile) came from
            {"structured_outputs": "tools"}
            if plan.structured_outputs is not None
            else body.structured_outputs_aliases()
        )
        aliases = {"prompt": "messages", **aliases, **grammar_source}
        raise from_param_error(exc, aliases) from None
    created = int(time.time())
    top_k = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(
            stream, body, plan, reasoning, model, request_id, created, include_usage, ctx
        )
        return sse_response(chunks, [stream])
    [output] = await final_outputs(request, [stream])
    choices = []
    for choice in output.outputs:
        thinking, answer = None, choice.text
        if reasoning is not None:
            thinking, answer = reasoning.parser().parse(choice.text)
        result = plan.parse(answer, finish_reason(choice))
        content = result.content if reasoning is None or result.content else None
        calls = [
            ChatCompletionMessageToolCall(
                id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)
            )
            for call in result.calls
        ]
        choices.append(
            ChatCompletionResponseChoice(
                index=choice.index,
                message=ChatCompletionMessage(
                    content=content, reasoning_content=thinking, tool_calls=calls
                ),
                logprobs=token_logprobs(choice.logprobs or [], top_k) if body.logprobs else None,
                finish_reason=result.finish_reason,
                stop_reason=choice.stop_reason,
                token_ids=list(choice.token_ids) if body.return_token_ids else None,
            )
        )
    usage = usage_of([output])
    response = ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage,
        **_prompt_token_io(body, output),
        kv_transfer_params=await kv_transfer_result(ctx, params, output, model),
        timings=Timings.of([output], usage.completion_tokens) if ctx.settings.timings else None,
    )
    return JSONResponse(response.model_dump())


async def _stream(
    stream: RequestStream,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    reasoning: ReasoningPlan | None,
    model: str,
    request_id: str,
    created: int,
    include_usage: bool,
    ctx: ServerContext,
):
    def chunk(choices, usage=None, timings=None, **prompt_token_io) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id,
                created=created,
                model=model,
                choices=choices,
                usage=usage,
                timings=timings,
                **prompt_token_io,
            )
        )

    def timings(output: RequestOutput | None) -> Timings | None:
        """llama.cpp's timings, for the stream's last chunk (None: `--no-timings`)."""
        if output is None or not ctx.settings.timings:
            return None
        return Timings.of([output], totals.completion_tokens)

    top_k = body.top_logprobs or 0
    totals = StreamTotals()
    tool_streams = {i: plan.stream() for i in range(body.n)} if plan.parses_calls else {}
    thinking = {i: reasoning.parser() for i in range(body.n)} if reasoning else {}
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
        prompt_sent = False  # the prompt's token-level fields go in the first chunk after
        num_open = body.n  # choices still running
        output = None
        async for step in choice_deltas([stream], totals, error_is_reason=True):
            choice = step.choice
            output = step.output
            num_open -= step.finish_reason is not None
            prompt_io = {} if prompt_sent else _prompt_token_io(body, step.output)
            prompt_sent = prompt_sent or bool(prompt_io)
            token_ids = list(choice.token_ids) if body.return_token_ids else None
            logprobs = token_logprobs(choice.logprobs or [], top_k) if body.logprobs else None
            delta, reason = _delta(
                thinking.get(choice.index),
                tool_streams.get(choice.index),
                choice.text,
                step.finish_reason,
            )
            news = prompt_io or token_ids or logprobs and logprobs.content
            if delta == DeltaMessage() and reason is None and not news:
                continue
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=choice.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=choice.stop_reason if reason else None,
                        token_ids=token_ids,
                    )
                ],
                # llama.cpp's timings go on the last chunk: this one, unless usage follows.
                timings=timings(output) if num_open == 0 and not include_usage else None,
                **prompt_io,
            )
        if include_usage:
            yield chunk([], usage=usage_of_stream(totals), timings=timings(output))
    except Exception as exc:
        yield sse_error(exc)
    finally:
        stream.abort()
    yield SSE_DONE


def _prompt_token_io(body: ChatCompletionRequest, output: RequestOutput) -> dict:
    """The response's (a chunk's) vLLM token-level fields about the prompt, as asked for."""
    fields = {}
    if body.return_token_ids:
        fields["prompt_token_ids"] = list(output.prompt_token_ids)
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    return fields


def _delta(
    thinking: ReasoningParser | None,
    tools: ToolStream | None,
    text: str,
    engine_reason: str | None,
) -> tuple[DeltaMessage, str | None]:
    """A choice's new text as a delta (reasoning, content, or tool-call parts) and its
    finish reason."""
    reasoning_text = ""
    if thinking is not None:
        split = thinking.feed(text)
        if engine_reason is not None:
            last = thinking.finish()
            split.reasoning += last.reasoning
            split.content += last.content
        reasoning_text, text = split.reasoning, split.content
    if tools is None:
        return DeltaMessage(
            content=text or None, reasoning_content=reasoning_text or None
        ), engine_reason
    parsed = tools.feed(text)
    reason = engine_reason
    if engine_reason is not None:
        last, reason = tools.finish(engine_reason)
        parsed.content += last.content
        parsed.tool_calls += last.tool_calls
    calls: list[DeltaToolCall] = []
    for d in parsed.tool_calls:
        if calls and calls[-1].index == d.index and d.id is None:  # one entry per call
            calls[-1].function.arguments = (calls[-1].function.arguments or "") + d.arguments
            continue
        calls.append(
            DeltaToolCall(
                index=d.index,
                id=d.id,
                type="function" if d.id else None,
                function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
            )
        )
    delta = DeltaMessage(
        content=parsed.content or None,
        reasoning_content=reasoning_text or None,
        tool_calls=calls or None,
    )
    return delta, reason


def token_logprobs(entries: list[dict[int, Logprob]], top_k: int) -> ChatCompletionLogprobs:
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
