"""What every HTTP endpoint shares: the server context (engine + settings), model-name
checks, admitting requests and waiting for their final outputs while watching for a client
disconnect (on top of `generation.py`, which the gRPC service shares), and usage.

The request limits and generation defaults are the engine's `RequestPolicy`, given to the
AsyncEngine when it is built (`cli/serve.py`), so the gRPC service and the offline `LLM` are
held to the same ones; `make_params` applies it early (`Admission.check_params`), with the
HTTP names of the fields in its 400s.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

from fastapi import Request

from nanollmserve.api.errors import from_param_error, not_found
from nanollmserve.api.generation import StreamTotals, admit, collect_final
from nanollmserve.api.protocol import SamplingExtensions, UsageInfo
from nanollmserve.api.protocol_responses import ResponsesRequest
from nanollmserve.api.request_log import REQUEST_ID_HEADER, log_client_request_id
from nanollmserve.api.response_store import ResponseStore
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import AsyncEngine, OutputKind, RequestStream
from nanollmserve.kv_store_dir import open_store_dir, store_key
from nanollmserve.outputs import RequestOutput
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.server_settings import ServerSettings

SLOT_SAVE_FLAG = "--slot-save-path"

ANY_MODEL_NAME = "*"
"""`--served-model-name '*'`: accept any model name."""


class ServerContext:
    """The engine and settings the routes serve from (one per app). The request limits and
    generation defaults are the engine's (`engine.request_policy`), never set here."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        names = [name for name in settings.served_model_names if name != ANY_MODEL_NAME]
        self.any_model_name = len(names) < len(settings.served_model_names)
        """`--served-model-name '*'`: any `model` is accepted (llama.cpp's way); the
        model's own names are still the reported ones."""
        self.model_names = names or [engine.model_name]
        self.responses = ResponseStore(
            settings.response_store_size, settings.response_store_max_bytes
        )
        self.slot_dir: tuple[Path, bytes] | None = None
        """`--slot-save-path` opened (private, marked) and its MAC key; None: off."""
        if settings.slot_save_path is not None:
            engine.enable_slot_save()
            path = open_store_dir(settings.slot_save_path, SLOT_SAVE_FLAG)
            self.slot_dir = (path, store_key(path, SLOT_SAVE_FLAG))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def limits(self) -> RequestLimits:
        return self.engine.request_policy.limits

    def check_model(self, model: str | None) -> str:
        """The name to report for a request's `model` (404 if it is not served here): a
        served name of the base model or a loaded LoRA adapter's name; with
        `--served-model-name '*'` any other name too (the base model runs it)."""
        if model is None or model == "":
            return self.model_name
        known = model in self.model_names or model in self.engine.lora_adapters()
        if not known and not self.any_model_name:
            raise not_found(f"The model `{model}` does not exist.", "model_not_found", "model")
        return model

    def lora_name_of(self, model: str | None) -> str | None:
        """The LoRA adapter a checked `model` runs with (None: the base model, which also
        runs any other name under `--served-model-name '*'`)."""
        if model in self.model_names:
            return None
        if self.any_model_name and model not in self.engine.lora_adapters():
            return None
        return model

    def make_params(self, to_params: Callable[[], SamplingParams], aliases=None) -> SamplingParams:
        """The request's SamplingParams, through the engine's request policy: the fields an
        OpenAI request leaves unset (absent or null) get the server's generation defaults,
        then the limits apply. A bad value is a 400 whose `param` is the field under the
        endpoint's name for it (`aliases` maps SamplingParams fields to those names); any
        other error propagates (a 500). `to_params` is the request's bound
        `to_sampling_params`."""
        try:
            params = to_params()
            unset = _unset_fields(getattr(to_params, "__self__", None))
            return self.engine.admission.check_params(params, unset)
        except ParamError as exc:
            raise from_param_error(exc, aliases) from None

    async def add_requests(
        self,
        prompts: list[str | list[int | str]],
        params: SamplingParams,
        request_id: str,
        stream: bool = False,
        model: str | None = None,
        client_request_id: str | None = None,
        pooling: bool = False,
        prompt_logprobs_copies: int | None = None,
    ) -> list[RequestStream]:
        """Admit one request per prompt, all or none: DELTA streams for a streamed response,
        FINAL_ONLY ones otherwise. `model` (checked by `check_model`) naming a LoRA adapter
        runs them with it. `request_id` is the server's; `client_request_id` (the client's
        `X-Request-Id`) is only logged next to it, quoted. `pooling`: embedding requests.
        `prompt_logprobs_copies`: how many times the response holds a prompt's logprobs
        (default `n`: once per choice), for `--max-prompt-logprobs-entries`."""
        self.limits.check_fields(
            client_request_id=client_request_id, request_id_param=REQUEST_ID_HEADER
        )
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        lora_name = self.lora_name_of(model)
        streams = await admit(
            self.engine,
            prompts,
            params,
            request_id,
            kind,
            lora_name,
            pooling=pooling,
            model=model or self.model_name,
            prompt_logprobs_copies=prompt_logprobs_copies,
        )
        if client_request_id is not None and self.settings.log_requests:
            log_client_request_id(request_id, client_request_id)
        return streams


def _unset_fields(body) -> set[str]:
    """The fields of an OpenAI request body left unset (absent or null): the ones the
    generation defaults fill. None for the simple API (/generate), which keeps its own
    documented defaults."""
    if not isinstance(body, SamplingExtensions | ResponsesRequest):
        return set()
    return {
        name
        for name in type(body).model_fields
        if name not in body.model_fields_set or getattr(body, name) is None
    }


def random_id(prefix: str) -> str:
    """`prefix` + 24 hex digits, e.g. random_id("chatcmpl-")."""
    return prefix + secrets.token_hex(12)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Usage of final outputs."""
    return UsageInfo.of(
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        completion_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
    )


def usage_of_stream(totals: StreamTotals) -> UsageInfo:
    """Usage of a streamed response, from the totals its deltas added up."""
    return UsageInfo.of(
        prompt_tokens=sum(totals.prompt_tokens.values()),
        completion_tokens=totals.completion_tokens,
        cached_tokens=sum(totals.cached_tokens.values()),
    )


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every (FINAL_ONLY) stream; a client that disconnects meanwhile
    aborts them all, so their KV blocks return at once though no response will be sent."""
    return await collect_final(streams, wait_for_disconnect(request))
