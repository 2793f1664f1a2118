"""The simple API: `POST /generate` (one prompt) and `POST /batch_generate` (many prompts,
submitted together so the engine batches them). Same engine, same sampling, no OpenAI
envelope: just the text, the token count and the latency.

`max_tokens` (OpenAI's name) is accepted as an alias of `max_new_tokens`; any other unknown
field is a 400, like on every route.
"""

from __future__ import annotations

import time

from fastapi import Request
from pydantic import Field

from nanollmserve.api.generation import MAX_BATCH_PROMPTS, finish_reason
from nanollmserve.api.protocol import MAX_INT32, OpenAIBaseModel, RequestModel, sampling_params
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.serving import ServerContext, final_outputs, random_id
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 64

_PARAM_ALIASES = {"max_tokens": "max_new_tokens"}


class SimpleSampling(RequestModel):
    max_new_tokens: int | None = Field(
        default=None, ge=1, le=MAX_INT32, description=f"default {DEFAULT_MAX_NEW_TOKENS}"
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_INT32, description="OpenAI's name of max_new_tokens"
    )
    temperature: float = Field(default=0.0, description="0 (the default) is greedy.")
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.max_tokens is not None:
            raise ParamError(
                "give max_new_tokens or its alias max_tokens, not both", param="max_new_tokens"
            )
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.max_new_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
            stop=self.stop,
        )


class GenerateRequest(SimpleSampling):
    prompt: str = Field(min_length=1)


class GenerateResponse(OpenAIBaseModel):
    generated_text: str
    tokens_generated: int
    latency_ms: float
    finish_reason: str | None = None


class BatchGenerateRequest(SimpleSampling):
    prompts: list[str] = Field(min_length=1, max_length=MAX_BATCH_PROMPTS)


class BatchGenerateResponse(OpenAIBaseModel):
    generated_texts: list[str]
    tokens_generated: list[int]
    latency_ms: float


async def generate(body: GenerateRequest, request: Request, ctx: ServerContext):
    start = time.perf_counter()
    params = ctx.make_params(body.to_sampling_params, _PARAM_ALIASES)
    streams = await ctx.add_requests(
        [body.prompt],
        params,
        random_id("gen-"),
        client_request_id=client_request_id(request.headers),
    )
    [output] = await final_outputs(request, streams)
    [choice] = output.outputs
    return GenerateResponse(
        generated_text=choice.text,
        tokens_generated=len(choice.token_ids),
        latency_ms=round((time.perf_counter() - start) * 1000, 3),
        finish_reason=finish_reason(choice),
    )


async def batch_generate(body: BatchGenerateRequest, request: Request, ctx: ServerContext):
    start = time.perf_counter()
    params = ctx.make_params(body.to_sampling_params, _PARAM_ALIASES)
    streams = await ctx.add_requests(
        list(body.prompts),
        params,
        random_id("batch-"),
        client_request_id=client_request_id(request.headers),
    )
    outputs = await final_outputs(request, streams)
    for output in outputs:
        finish_reason(output.outputs[0])
    return BatchGenerateResponse(
        generated_texts=[o.outputs[0].text for o in outputs],
        tokens_generated=[len(o.outputs[0].token_ids) for o in outputs],
        latency_ms=round((time.perf_counter() - start) * 1000, 3),
    )
