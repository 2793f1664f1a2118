"""The base classes of every protocol model: responses and nested objects ignore unknown
fields, request bodies forbid them (a 400 naming the field; see `protocol.py`); and the
token-level outputs (vLLM's `return_token_ids`, `prompt_logprobs`) that response objects
carry only when a request asked for them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_serializer

from nanollmserve.outputs import PromptLogprobs


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: an undeclared top-level field is a 400 (see `protocol.py`)."""

    model_config = ConfigDict(extra="forbid")


class LogprobInfo(OpenAIBaseModel):
    """One token's entry in `prompt_logprobs` (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token."""
    decoded_token: str | None = None


PromptLogprobsJSON = list[dict[str, LogprobInfo] | None]
"""`prompt_logprobs` in a response: None for the first prompt token, then token id (a string,
as JSON keys are) -> its entry, the prompt token first, then the top alternatives."""

TOKEN_IO_FIELDS = (
    "prompt_token_ids",
    "token_ids",
    "prompt_logprobs",
    "kv_transfer_params",
    "timings",
)
"""Also `kv_transfer_params`, phase 1's answer in prefill/decode disaggregation, and
llama.cpp's `timings` (left out under `--no-timings` and on all but a stream's last chunk)."""


class TokenIOModel(OpenAIBaseModel):
    """A response object that may carry token-level outputs: each of `TOKEN_IO_FIELDS` it
    declares is left out of the JSON while None (not asked for)."""

    @model_serializer(mode="wrap")
    def _drop_unasked_token_io(self, handler):
        data = handler(self)
        for name in TOKEN_IO_FIELDS:
            if name in data and data[name] is None:
                del data[name]
        return data


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """A RequestOutput's prompt logprobs in the response's shape."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): LogprobInfo(
                logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
