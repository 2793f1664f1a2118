"""Protocol models of `/v1/completions` (OpenAI's legacy completions), in OpenAI's order.

The prompt may be a string, a list of strings, a list of token ids or a list of token-id
lists; each prompt gets `n` choices, numbered prompt-major (`index = prompt * n + i`).
vLLM's token-level extras: `return_token_ids` puts `prompt_token_ids` and `token_ids` on each
choice, `prompt_logprobs` its prompt's logprobs; `echo` with `logprobs` scores the prompt's
tokens too (its first token's logprob is null). `use_beam_search` is refused.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field, model_validator

from nanollmserve.api.llamacpp_protocol import Timings
from nanollmserve.api.protocol import (
    MAX_INT32,
    OpenAIBaseModel,
    RequestModel,
    SamplingExtensions,
    StreamOptions,
    TokenId,
    UsageInfo,
)
from nanollmserve.api.protocol_base import PromptLogprobsJSON, TokenIOModel
from nanollmserve.api.protocol_chat import ResponseFormat
from nanollmserve.api.protocol_kv_transfer import KVTransferResultJSON
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

MAX_COMPLETION_LOGPROBS = 5
"""The legacy API allows 0..5 alternatives per token."""

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class _CompletionFields(RequestModel):
    """The OpenAI fields of CompletionRequest, in OpenAI's order. The last base's config
    wins, so CompletionRequest forbids unknown fields like this class."""

    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    prompt: Prompt
    best_of: int | None = Field(default=None, ge=1, le=MAX_INT32)
    """Accepted when it equals `n` (or is left out); more is not supported."""
    echo: bool = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_INT32)
    n: int = Field(default=1, ge=1, le=MAX_INT32)
    """At most `--max-n` (128) and `--max-num-seqs`."""
    presence_penalty: float | None = 0.0
    response_format: ResponseFormat | None = None
    """An extension (vLLM): `json_object` or `json_schema`, as on chat completions."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    user: str | None = None
    """Accepted and ignored."""


class CompletionRequest(SamplingExtensions, _CompletionFields):
    use_beam_search: bool | None = Field(default=None, strict=True)
    """vLLM's beam search: refused (a 400); sample `n` choices instead."""
    n_probs: int | None = Field(default=None, strict=True, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """llama.cpp's name for `logprobs`, with its limits (0, llama.cpp's default: none);
    given with `logprobs`, the two must be equal (a 400 otherwise)."""

    @model_validator(mode="after")
    def _n_probs_alias(self) -> CompletionRequest:
        """`n_probs` N > 0 is `logprobs` N (unless they disagree: `to_sampling_params`
        refuses that)."""
        if self.n_probs and self.logprobs is None:
            self.logprobs = self.n_probs
        return self

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(
                f"best_of must be left out or equal n ({self.n}): choosing the best of "
                f"several candidates is not supported, got {self.best_of}",
                param="best_of",
            )
        if self.use_beam_search:
            raise ParamError(
                "use_beam_search is not supported: this server has no beam search (it is out "
                "of scope); sample several choices with n instead",
                param="use_beam_search",
            )
        if self.n_probs is not None and self.logprobs is not None and self.n_probs != self.logprobs:
            raise ParamError(
                f"n_probs is llama.cpp's name for logprobs and the two disagree (n_probs "
                f"{self.n_probs}, logprobs {self.logprobs}): send one of them",
                param="n_probs",
            )
        params = self.sampling_params_with(max_tokens=self.max_tokens, logprobs=self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt is scored too
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    """With `echo`, the prompt's first token has null (nothing comes before it)."""
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(TokenIOModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "error"] | None = None
    """"error" (streams only): the engine failed this request alone."""
    prompt_logprobs: PromptLogprobsJSON | None = None
    """With `prompt_logprobs` (vLLM's shape); in a stream, in the choice's first chunk."""
    prompt_token_ids: list[int] | None = None
    """With `return_token_ids`; in a stream, in the choice's first chunk."""
    token_ids: list[int] | None = None
    """With `return_token_ids`: this choice's (a stream chunk's) new token ids."""


class CompletionResponse(TokenIOModel):
    """Both the response and, with `stream`, each chunk (finish_reason None until the end)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: KVTransferResultJSON | None = None
    """With `kv_transfer_params` {"do_remote_decode": true}: what the store now holds."""
    timings: Timings | None = None
    """llama.cpp's timings of the whole response (unless `--no-timings`); in a stream, on
    its last chunk only."""
