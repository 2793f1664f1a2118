"""The routes of llama.cpp's native server API, for scripts and clients written against
llama.cpp's `llama-server`: `POST /completion`, `/infill`, `/apply-template`,
`/slots/{id}`, `GET /props` and `/slots`. They only dispatch to `serving_llamacpp.py`; like
every route, they need the API key when the server has one (`api/auth.py`).
`/completions` stays the OpenAI route (llama.cpp serves its native one there too);
`/tokenize` and `/detokenize` are vLLM's routes, which take llama.cpp's shapes as well
(`serving_llamacpp.tokenize`; see docs/features/coming-from-llamacpp.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanollmserve.api import serving_llamacpp
from nanollmserve.api.llamacpp_protocol import (
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    CompletionRequest,
    CompletionResponse,
    InfillRequest,
    PropsResponse,
    SlotActionRequest,
    SlotState,
)
from nanollmserve.api.routes import _ERRORS, Ctx

router = APIRouter(responses=_ERRORS, tags=["llama.cpp"])

_JSON_OR_SSE = {
    200: {
        "model": CompletionResponse,
        "description": "JSON, or with `stream` SSE `data:` events, the last with `stop: true`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@router.post("/completion", responses=_JSON_OR_SSE)
async def completion(body: CompletionRequest, request: Request, ctx: Ctx):
    """llama.cpp's native completion: one prompt (text or token ids), its sampling fields,
    `timings` and `completion_probabilities` (`n_probs`) in the answer."""
    return await serving_llamacpp.create_completion(body, request, ctx)


@router.post("/infill", responses=_JSON_OR_SSE)
async def infill(body: InfillRequest, request: Request, ctx: Ctx):
    """Fill-in-the-middle between `input_prefix` and `input_suffix` (a 400 for a model
    whose tokenizer has no FIM tokens)."""
    return await serving_llamacpp.create_infill(body, request, ctx)


@router.get("/props", response_model=PropsResponse)
async def props(ctx: Ctx) -> PropsResponse:
    """What the server runs with: default sampling, slots, the chat template, the served
    model name (`model_path`: never a file path)."""
    return serving_llamacpp.props(ctx)


@router.get("/slots", response_model=list[SlotState])
async def slots(ctx: Ctx, fail_on_no_slot: bool = False) -> list[SlotState]:
    """Per sequence place: busy or not (no prompts)."""
    return serving_llamacpp.slots(ctx, fail_on_no_slot)


@router.post(
    "/slots/{id_slot}",
    responses={501: {"description": "Slot actions off: no --slot-save-path"}},
)
async def slot_action(
    id_slot: int, ctx: Ctx, action: str | None = None, body: SlotActionRequest | None = None
):
    """save / restore / erase a sequence place's last sequence (its cached KV blocks and
    tokens) to / from `filename` in the `--slot-save-path` directory (501 without it)."""
    filename = body.filename if body is not None else None
    return await serving_llamacpp.slot_action(ctx, id_slot, action, filename)


@router.post("/apply-template", response_model=ApplyTemplateResponse)
async def apply_template(body: ApplyTemplateRequest, ctx: Ctx) -> ApplyTemplateResponse:
    """The chat template's text for `messages` and `tools` (with the generation prompt)."""
    return await serving_llamacpp.apply_template(body, ctx)
