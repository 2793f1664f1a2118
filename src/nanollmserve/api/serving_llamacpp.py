"""The handlers of llama.cpp's native endpoints (`llamacpp_routes.py`), on the same
admission path as the OpenAI routes (`ServerContext.make_params` -> `add_requests` ->
`final_outputs` or the DELTA streams), so the same limits, queue and aborts apply.

- `/completion`: one prompt; the answer in llama.cpp's shape with its `timings`; a stream is
  `data:` events with `content` and `tokens`, then one with `stop: true` and the totals (no
  `[DONE]`, as llama.cpp's native endpoint).
- `/infill`: the fill-in-the-middle prompt built from the tokenizer's FIM tokens, then as
  `/completion`; a tokenizer without them is a 400 that says so.
- `/props`, `/slots`: what the server runs with and how many sequence places are busy (no
  prompts, no file paths). Slot actions (save/restore/erase, `--slot-save-path`) save a
  place's last sequence (its cached KV blocks and tokens) to a file, restore one into the
  prefix cache, or drop it (`frontend/async_engine.slot_action`, `engine/slot_save.py`).
- `/apply-template`: the chat template's text for some messages (and function `tools`,
  rendered as the chat route renders them).
- `/tokenize` with llama.cpp's `content` (and `with_pieces`): handed over by the vLLM route.
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse

from nanollmserve import __version__
from nanollmserve.api.errors import APIError, bad_request
from nanollmserve.api.generation import choice_deltas, finish_reason
from nanollmserve.api.llamacpp_protocol import (
    DEFAULTS,
    PARAM_ALIASES,
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    CompletionProbability,
    CompletionRequest,
    CompletionResponse,
    InfillRequest,
    PropsResponse,
    SlotState,
    Timings,
    TokenProb,
)
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.serving import ServerContext, final_outputs, random_id
from nanollmserve.api.sse import sse_error, sse_event, sse_response
from nanollmserve.api.tool_choice import template_tools
from nanollmserve.outputs import CompletionOutput, RequestOutput
from nanollmserve.sampling_params import SamplingParams

FIM_TOKEN_SETS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM, Granite
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<PRE>", "<SUF>", "<MID>"),  # CodeLlama
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
"""(prefix, suffix, middle) tokens a tokenizer may have for fill-in-the-middle."""

SLOT_ACTIONS = ("save", "restore", "erase")
SLOT_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""The engine checks it again (`engine/slot_save.FILENAME`)."""


# -- /completion and /infill -----------------------------------------------------------------
async def create_completion(
    body: CompletionRequest, request: Request, ctx: ServerContext, prompt=None
):
    """`prompt`: what runs instead of `body.prompt` (the /infill prompt)."""
    model = ctx.check_model(body.model)
    params = ctx.make_params(body.to_sampling_params, PARAM_ALIASES)
    streams = await ctx.add_requests(
        [body.prompt if prompt is None else prompt],
        params,
        random_id("cmpl-"),
        stream=body.stream,
        model=model,
        client_request_id=client_request_id(request.headers),
    )
    if body.stream:
        return sse_response(_stream(ctx, streams, body, params, model), streams)
    [output] = await final_outputs(request, streams)
    [choice] = output.outputs
    finish_reason(choice)
    response = await _final(ctx, body, params, model, output, choice, choice.text)
    if body.n_probs:
        response.completion_probabilities = _probabilities(choice, body.n_probs)
    if body.return_tokens:
        response.tokens = list(choice.token_ids)
    return JSONResponse(response.model_dump(exclude_none=True))


async def create_infill(body: InfillRequest, request: Request, ctx: ServerContext):
    prefix, suffix, middle = _fim_tokens(ctx)
    extra = "".join(f"{chunk.filename}\n{chunk.text}\n" for chunk in body.input_extra)
    prompt = f"{extra}{prefix}{body.input_prefix}{suffix}{body.input_suffix}{middle}{body.prompt}"
    return await create_completion(body, request, ctx, prompt=prompt)


def _fim_tokens(ctx: ServerContext) -> tuple[str, str, str]:
    vocab = ctx.engine.tokenizer.get_vocab()
    for tokens in FIM_TOKEN_SETS:
        if all(token in vocab for token in tokens):
            return tokens
    known = "; ".join(" ".join(tokens) for tokens in FIM_TOKEN_SETS)
    raise bad_request(
        f"/infill needs a model whose tokenizer has fill-in-the-middle tokens, and "
        f"`{ctx.model_name}` has none (looked for: {known}); use /completion with the prompt "
        "you want instead",
        "input_prefix",
    )


async def _stream(ctx, streams, body: CompletionRequest, params, model):
    num_tokens = 0
    try:
        async for step in choice_deltas(streams, error_is_reason=True):
            choice = step.choice
            num_tokens += len(choice.token_ids)
            if choice.text or choice.token_ids:
                yield sse_event(
                    CompletionResponse(
                        content=choice.text,
                        tokens=list(choice.token_ids),
                        stop=False,
                        tokens_predicted=num_tokens,
                        tokens_evaluated=len(step.output.prompt_token_ids),
                        completion_probabilities=(
                            _probabilities(choice, body.n_probs) if body.n_probs else None
                        ),
                    ).model_dump_json(exclude_none=True)
                )
            if step.finish_reason == "error":
                raise APIError(500, "the engine failed while generating this request")
            if step.finish_reason is not None:
                final = CompletionOutput(
                    0, "", [], step.finish_reason, choice.stop_reason, None, None
                )
                response = await _final(ctx, body, params, model, step.output, final, None)
                response.tokens_predicted = num_tokens
                yield sse_event(response.model_dump_json(exclude_none=True))
    except Exception as exc:
        yield sse_error(exc)


async def _final(
    ctx: ServerContext,
    body: CompletionRequest,
    params: SamplingParams,
    model: str,
    output: RequestOutput,
    choice: CompletionOutput,
    text: str | None,
) -> CompletionResponse:
    """The answer's closing fields; `choice` holds the text (empty in a stream's last event)
    and the stop reason; `text`: the whole text (None in a stream: `has_new_line` is left
    out)."""
    stop_type, stopping_word = _stop_type(choice)
    prompt = output.prompt
    if prompt is None:
        prompt = await ctx.engine.detokenize(output.prompt_token_ids)
    return CompletionResponse(
        content=choice.text,
        stop=True,
        model=model,
        tokens_predicted=len(choice.token_ids),
        tokens_evaluated=len(output.prompt_token_ids),
        generation_settings=generation_settings(ctx, body, params),
        prompt=prompt,
        has_new_line=None if text is None else "\n" in text,
        truncated=choice.finish_reason == "length" and params.max_tokens is None,
        stop_type=stop_type,
        stopping_word=stopping_word,
        tokens_cached=output.num_cached_tokens,
        timings=Timings.of([output], len(choice.token_ids) if text is not None else None),
    )


def _stop_type(choice: CompletionOutput) -> tuple[str, str]:
    """llama.cpp's `stop_type` and `stopping_word`: a stop string is "word", the length
    limit "limit", an end-of-text or stop token "eos"."""
    if choice.finish_reason == "length":
        return "limit", ""
    if isinstance(choice.stop_reason, str):
        return "word", choice.stop_reason
    return "eos", ""


def _probabilities(choice: CompletionOutput, n_probs: int) -> list[CompletionProbability]:
    """`completion_probabilities`: per generated token its logprob and the `n_probs` most
    likely tokens (the sampled one among them when it ranks that high)."""
    result = []
    for entry in choice.logprobs or []:
        sampled_id, sampled = next(iter(entry.items()))
        top = sorted(
            ((token_id, lp) for token_id, lp in entry.items() if lp.rank <= n_probs),
            key=lambda item: item[1].rank,
        )
        result.append(
            CompletionProbability(
                **_token_prob(sampled_id, sampled).model_dump(),
                top_logprobs=[_token_prob(token_id, lp) for token_id, lp in top],
            )
        )
    return result


def _token_prob(token_id: int, logprob) -> TokenProb:
    text = logprob.decoded_token or ""
    return TokenProb(
        id=token_id, token=text, bytes=list(text.encode("utf-8")), logprob=logprob.logprob
    )


def generation_settings(
    ctx: ServerContext, body: CompletionRequest | None, params: SamplingParams | None
) -> dict:
    """llama.cpp's `generation_settings`: the request's sampling fields (llama.cpp's
    defaults when there is no request) plus `n_ctx` and `model`."""
    settings = dict(DEFAULTS)
    if body is not None:
        settings.update(body.model_dump(include=set(DEFAULTS)))
        settings["stop"] = list(params.stop)
        settings["grammar"] = body.grammar or ""
    settings["n_ctx"] = ctx.engine.max_model_len
    settings["model"] = ctx.model_name
    return settings


# -- /props and /slots -----------------------------------------------------------------------
def props(ctx: ServerContext) -> PropsResponse:
    engine = ctx.engine
    template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None) or ""
    return PropsResponse(
        default_generation_settings={
            "id": 0,
            "id_task": -1,
            "n_ctx": engine.max_model_len,
            "speculative": engine.config.speculative_config is not None,
            "is_processing": False,
            "params": {k: v for k, v in DEFAULTS.items()},
        },
        total_slots=engine.max_num_seqs,
        model_path=ctx.model_name,
        chat_template=template if isinstance(template, str) else "",
        modalities={"vision": False, "audio": False},
        build_info=f"nanollmserve-{__version__}",
        is_sleeping=engine.sleep_requested,
    )


def slots(ctx: ServerContext, fail_on_no_slot: bool) -> list[SlotState]:
    """One entry per sequence place (`--max-num-seqs`), busy while a request holds it (the
    place a finished request leaves is the one its slot actions act on). 503 with
    `fail_on_no_slot` when none is free."""
    engine = ctx.engine
    busy = engine.busy_slots()
    if fail_on_no_slot and all(busy):
        raise APIError(503, "no slot available", code="unavailable_error")
    speculative = engine.config.speculative_config is not None
    return [
        SlotState(
            id=i,
            n_ctx=engine.max_model_len,
            speculative=speculative,
            is_processing=busy[i],
            params=dict(DEFAULTS),
        )
        for i in range(engine.max_num_seqs)
    ]


async def slot_action(
    ctx: ServerContext, id_slot: int, action: str | None, filename: str | None
) -> JSONResponse:
    """save / restore / erase on sequence place `id_slot` (`engine/slot_save.py`): a 400 for
    a bad action, slot or file name, a 501 without --slot-save-path (as llama.cpp)."""
    if action not in SLOT_ACTIONS:
        raise bad_request(f"action must be one of {', '.join(SLOT_ACTIONS)}, got {action!r}")
    if not 0 <= id_slot < ctx.engine.max_num_seqs:
        raise bad_request(
            f"id_slot must be in [0, {ctx.engine.max_num_seqs}), got {id_slot}", "id_slot"
        )
    if ctx.slot_dir is None:
        raise APIError(
            501,
            f"slot {action} is off on this server: start it with --slot-save-path DIR (a "
            "private directory for the saved slot files), as llama.cpp's server needs too",
            code="not_supported_error",
        )
    if action != "erase":
        filename = check_slot_filename(filename)
    directory, key = ctx.slot_dir
    return JSONResponse(await ctx.engine.slot_action(action, id_slot, filename, directory, key))


def check_slot_filename(filename: object) -> str:
    """A plain file name (400 on `filename` otherwise): letters, digits, '.', '_', '-', at
    most 128, not starting with '.' (no path, no '..', no hidden file, no NUL)."""
    if not isinstance(filename, str) or not SLOT_FILENAME.fullmatch(filename):
        raise bad_request(
            "filename must be a plain file name in the --slot-save-path directory (letters, "
            "digits, '.', '_', '-'; at most 128; not starting with '.'; no path), got "
            f"{repr(filename)[:80]}",
            "filename",
        )
    return filename


# -- /apply-template -------------------------------------------------------------------------
async def apply_template(body: ApplyTemplateRequest, ctx: ServerContext) -> ApplyTemplateResponse:
    ctx.limits.check_messages(len(body.messages))
    ctx.limits.check_fields(tools=body.tools)
    tools = template_tools([tool.function for tool in body.tools]) if body.tools else None
    token_ids = await ctx.engine.chat_token_ids([m.to_dict() for m in body.messages], tools)
    return ApplyTemplateResponse(prompt=await ctx.engine.detokenize(token_ids))


# -- /tokenize in llama.cpp's shape ----------------------------------------------------------
async def tokenize(body, ctx: ServerContext) -> JSONResponse:
    """`POST /tokenize` with llama.cpp's `content` (the vLLM route hands it over): the text's
    tokens as `{"tokens": [...]}`, with `with_pieces` each as `{"id", "piece"}` (a piece
    that is not whole UTF-8 by itself shows U+FFFD where llama.cpp lists its bytes)."""
    if body.content is None or body.prompt is not None or body.messages is not None:
        raise bad_request("llama.cpp's tokenize takes content alone (vLLM's: prompt or messages)")
    _, token_ids = await ctx.engine.tokenize(body.content) if body.content else (None, [])
    if not body.with_pieces:
        return JSONResponse({"tokens": token_ids})
    pieces = [await ctx.engine.detokenize([token_id]) for token_id in token_ids]
    return JSONResponse(
        {"tokens": [{"id": t, "piece": p} for t, p in zip(token_ids, pieces, strict=True)]}
    )
