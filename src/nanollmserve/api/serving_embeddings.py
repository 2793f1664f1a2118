"""`POST /v1/embeddings`: texts or token ids in (OpenAI's forms, and llama.cpp's: token ids
mixed with strings, `prompt_string` and `content` objects; `protocol_embeddings.py`), one
embedding per input out.

Only a server started with `--runner pooling` (or `--task embed`) embeds; any other answers
400 naming the flag. Every input is admitted to the engine at once, as one prefill-only
request each (batched by the scheduler with the others, its KV blocks freed when its prompt
has run); the engine pools the final hidden states as `--pooler-config` says. A request may
carry at most `MAX_EMBEDDING_INPUTS` inputs and no more than the server admits at once
(`--max-num-seqs` + `--max-queue-len`), each at most the model's context length in tokens
(a longer one is a 400 that says it is too large), whatever its form.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from nanollmserve.api.errors import bad_request, from_param_error
from nanollmserve.api.generation import finish_reason
from nanollmserve.api.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from nanollmserve.api.request_id import client_request_id
from nanollmserve.api.serving import ServerContext, final_outputs, random_id
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

_ALIASES = {"prompt": "input"}


async def create_embedding(
    body: EmbeddingRequest, request: Request, ctx: ServerContext
) -> JSONResponse:
    model = ctx.check_model(body.model)
    engine = ctx.engine
    if engine.info.runner != "pooling":
        raise bad_request(
            "this server generates text: /v1/embeddings needs a server started with "
            "--runner pooling (or --task embed)",
            "model",
        )
    if body.dimensions is not None:
        raise bad_request(
            "dimensions is not supported: this model's embeddings are not trained to be "
            "truncated (Matryoshka); leave it out for the full vector",
            "dimensions",
        )
    inputs = body.inputs()
    capacity = engine.max_num_seqs + engine.max_queue_len
    if len(inputs) > capacity:
        raise bad_request(
            f"input has {len(inputs)} items, more than this server admits at once "
            f"({capacity}: --max-num-seqs + --max-queue-len); send them in smaller batches",
            "input",
        )
    request_id = random_id("embd-")
    try:
        streams = await ctx.add_requests(
            inputs,
            SamplingParams(max_tokens=None, priority=body.priority or 0),
            request_id,
            model=model,
            client_request_id=client_request_id(request.headers),
            pooling=True,
        )
    except ParamError as exc:  # too long, an id outside the vocabulary
        raise from_param_error(exc, _ALIASES) from None
    outputs = await final_outputs(request, streams)
    data = []
    for index, output in enumerate(outputs):
        choice = output.outputs[0]
        finish_reason(choice)  # an aborted or failed input raises (503 / 500)
        data.append(
            EmbeddingData(embedding=_encode(choice.embedding, body.encoding_format), index=index)
        )
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    response = EmbeddingResponse(
        id=request_id,
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return JSONResponse(response.model_dump())


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
