"""Admitting engine requests and collecting what they produce: the one layer the HTTP routes
and the gRPC service share.

- `admit`: one engine request per prompt, all or none (a failure aborts the ones admitted),
  after the request's totals (`--max-request-prompt-tokens`, `--max-prompt-logprobs-entries`).
- `collect_final`: the one FINAL_ONLY output of each stream; returns early (aborting them
  all) if `gone` finishes first, e.g. a client that disconnected.
- `choice_deltas`: for streaming, the new text / tokens / logprobs of every choice as they
  come, from one stream or several merged, with the token totals for the final usage.
- `finish_reason`: a choice's reason, where "abort" (the server or the client went away)
  and "error" (the engine failed this request alone) become errors; streams of chat and
  completions keep "error" as the last chunk's finish reason instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    OutputKind,
    RequestStream,
)
from nanollmserve.frontend.input_processor import TokenizedPrompt
from nanollmserve.outputs import CompletionOutput, RequestOutput
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.tracing.context import record_admission

MAX_BATCH_PROMPTS = 256
"""Most prompts one request may carry (completions' prompt list, /batch_generate, gRPC)."""


async def admit(
    engine: AsyncEngine,
    prompts: list[str | list[int | str]],
    params: SamplingParams,
    request_id: str,
    output_kind: OutputKind,
    lora_name: str | None = None,
    pooling: bool = False,
    model: str | None = None,
    prompt_logprobs_copies: int | None = None,
) -> list[RequestStream]:
    """One engine request per prompt (ids `request_id`, or `request_id-i` for several), all
    or none: an error admitting one aborts the others and is raised. Every prompt is
    tokenized first and the request's totals checked as they grow (`check_prompts`: its
    prompt tokens, the prompt-logprob entries its response would hold), so a request over
    one is refused before any prompt reaches the engine. `lora_name`: the LoRA adapter they
    run with (None: the base model). `pooling`: embedding requests. `model`: the name the
    request asked for, for its trace span (with tracing on). `prompt_logprobs_copies`: how
    many times the response repeats a prompt's logprobs (default `params.n`)."""
    request_ids = (
        [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    )
    admission = engine.admission
    engine.refuse_if_full(len(prompts) * params.n)  # a full server does no work: a 503 first
    tokenized: list[TokenizedPrompt] = []
    for prompt in prompts:
        text, token_ids = await engine.tokenize(prompt)
        tokenized.append(TokenizedPrompt(text, token_ids))
        token_id_lists = [p.token_ids for p in tokenized]
        admission.check_prompts(token_id_lists, params, prompt_logprobs_copies)
    # Before adding: a request may end before its add returns (an embedding takes one step).
    record_admission(request_ids, params, model or lora_name or engine.model_name, request_id)
    streams: list[RequestStream] = []
    try:
        for rid, prompt in zip(request_ids, tokenized, strict=True):
            streams.append(
                await engine.add_request(
                    prompt, params, rid, output_kind, lora_name=lora_name, pooling=pooling
                )
            )
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


class RequestFailedError(EngineStepError):
    """The engine failed this request alone (finish reason "error": preparing or sampling
    it raised, the traceback is in the server log); the other requests went on. A 500."""


def finish_reason(choice: CompletionOutput, *, error_is_reason: bool = False) -> str | None:
    """ "stop" / "length" / None (running); an aborted choice means the client or the server
    went away, which ends the request with an error. A choice the engine failed ("error")
    raises RequestFailedError, or with `error_is_reason` (a stream already under way) is
    reported as its finish reason."""
    if choice.finish_reason == "abort":
        raise EngineDeadError("the request was aborted")
    if choice.finish_reason == "error" and not error_is_reason:
        raise RequestFailedError("the engine failed while generating this request")
    return choice.finish_reason


async def collect_final(
    streams: list[RequestStream], gone: Awaitable | None = None
) -> list[RequestOutput]:
    """The final output of every stream (FINAL_ONLY streams). If `gone` completes first,
    every stream is aborted (their KV blocks return at once) and EngineDeadError raised."""

    async def last(stream: RequestStream) -> RequestOutput:
        output = None
        async for item in stream:
            output = item
        return output

    results = asyncio.gather(*(last(s) for s in streams))
    watcher = asyncio.ensure_future(gone) if gone is not None else None
    try:
        waiting = {results} if watcher is None else {results, watcher}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            raise EngineDeadError("the client disconnected")
        return results.result()
    finally:
        if watcher is not None:
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
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
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


@dataclass
class ChoiceDelta:
    """What is new for one choice: `choice` holds only the new text, tokens and logprobs."""

    prompt_index: int
    output: RequestOutput
    """The DELTA output it came in (prompt, metrics)."""
    choice: CompletionOutput
    finish_reason: str | None
    first: bool
    """The choice's first delta."""


@dataclass
class StreamTotals:
    """Token counts of a stream so far, per prompt: what its final usage reports."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0


async def choice_deltas(
    streams: list[RequestStream],
    totals: StreamTotals | None = None,
    *,
    error_is_reason: bool = False,
) -> AsyncIterator[ChoiceDelta]:
    """Every choice's deltas from DELTA streams as they come (choices with nothing new are
    skipped); an aborted choice raises EngineDeadError, a failed one RequestFailedError or,
    with `error_is_reason`, ends with finish reason "error". Counts tokens into `totals`."""
    seen: set[tuple[int, int]] = set()
    async for prompt_index, output in merge_streams(streams):
        if totals is not None:
            totals.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
            totals.cached_tokens[prompt_index] = output.num_cached_tokens
        for choice in output.outputs:
            reason = finish_reason(choice, error_is_reason=error_is_reason)
            if totals is not None:
                totals.completion_tokens += len(choice.token_ids)
            key = (prompt_index, choice.index)
            first = key not in seen
            seen.add(key)
            yield ChoiceDelta(prompt_index, output, choice, reason, first)
