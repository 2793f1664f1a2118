"""Protocol models shared by the endpoints: errors, usage, models, tokenize, and the
conversion of request fields into SamplingParams.

Fields follow OpenAI's names and order. A request with a field its model does not declare
is a 400 naming it, as OpenAI answers ("Unrecognized request argument supplied: foo"): an
ignored field would silently change what the client asked for (`max_tokens` sent to an API
that calls it `max_new_tokens`). Request models derive from `RequestModel` (unknown fields
forbidden); the objects inside a request (messages, content parts) and the responses ignore
unknown fields, so clients may echo back objects they received. The endpoint-specific models
live in `protocol_completions.py`, `protocol_chat.py` and `protocol_responses.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from nanollmserve.api.protocol_base import OpenAIBaseModel, RequestModel
from nanollmserve.api.protocol_tools import ChatCompletionMessageToolCall
from nanollmserve.api.response_format import GUIDED_FIELDS, requested_structured_outputs
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

MAX_INT32 = 2**31 - 1
"""Upper bound of counts and ids in requests, so no value overflows a tensor."""

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


# -- errors ----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- usage -----------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    """Send a last chunk with the usage of the whole request and no choices."""


# -- models ----------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanollmserve"
    root: str
    """The model the name serves (its source name; a LoRA adapter's directory)."""
    parent: str | None = None
    """For a LoRA adapter: the base model it runs on (None for the base model)."""
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- chat messages -----------------------------------------------------------------------------
class ChatCompletionContentPartText(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatCompletionContentPartText] | None = None
    name: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    """An assistant message's calls, sent back in the next turn."""
    tool_call_id: str | None = None
    """A `tool` message: the call it answers."""
    reasoning_content: str | None = None
    """An assistant message's thinking, sent back in a later turn (llama.cpp's and vLLM's
    name): the chat template reads it as `message.reasoning_content` (Qwen3's renders that
    of the turns after the last user query); a template that does not read it renders the
    same prompt. Left out on other roles, as vLLM does."""
    reasoning: str | None = None
    """vLLM's newer name of `reasoning_content` (both given, they must be equal)."""

    def to_dict(self) -> dict:
        """The message as the chat template reads it (`normalize_messages` of
        `frontend/tokenizer.py` keeps the reasoning of assistant messages only)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        for key in ("reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


# -- tokenize / detokenize -------------------------------------------------------------------
class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    """Text to tokenize as is (give `prompt` or `messages`)."""
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    """A chat conversation, rendered with the chat template and its generation prompt."""
    content: str | None = None
    """llama.cpp's name of `prompt`: the answer is then llama.cpp's `{"tokens": [...]}`
    (`serving_llamacpp.tokenize`)."""
    with_pieces: bool = False
    """With `content` (llama.cpp's): each token as `{"id", "piece"}`, the piece its text."""


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
    content: str | None = None
    """The same text under llama.cpp's name."""


# -- sampling ----------------------------------------------------------------------------------
CACHE_SALT_DESCRIPTION = (
    "Only requests with the same salt share prefix-cache blocks (at most 256 characters)."
)


def priority_field():
    """The `priority` field of the completions, chat, responses and embeddings requests
    (vLLM's; `/v1/messages` passes its own on to chat)."""
    return Field(
        default=None,
        strict=True,
        ge=-MAX_INT32 - 1,
        le=MAX_INT32,
        description="Lower runs first under --scheduling-policy priority (a 400 unless 0 "
        "under fcfs).",
    )


def sampling_params(
    *,
    max_tokens: int | None,
    stop: str | list[str] | None = None,
    logit_bias: dict[str, float] | None = None,
    **fields,
) -> SamplingParams:
    """SamplingParams from request fields; None means "the default", except for
    `max_tokens`, where it means "up to the context length". A bad value raises ParamError
    naming the SamplingParams field."""
    values = {k: v for k, v in fields.items() if v is not None}
    values["max_tokens"] = max_tokens
    if stop is not None:
        values["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if logit_bias:
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in logit_bias.items()}
        except ValueError:
            raise ParamError("logit_bias keys must be token ids (integers)", "logit_bias") from None
    return SamplingParams(**values)


class SamplingExtensions(OpenAIBaseModel):
    """The nanollmserve extensions (vLLM names) of the completions and chat requests, and
    the one mapping of a request's sampling fields to SamplingParams. A request class names
    it as its first base and its OpenAI fields in a second one, so the schema lists OpenAI's
    fields first, then these."""

    top_k: int | None = Field(
        default=None, ge=-1, le=MAX_INT32, description="Sample from the k most likely (0/-1: all)."
    )
    min_p: float | None = Field(default=None, description="Drop tokens below min_p * top prob.")
    repetition_penalty: float | None = Field(
        default=None, description="Divide the logits of tokens already seen (1 = off)."
    )
    min_tokens: int | None = Field(
        default=None, ge=0, le=MAX_INT32, description="Generate at least this many tokens."
    )
    ignore_eos: bool | None = Field(default=None, description="Keep going past end-of-text.")
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Token ids that end the output, like stop strings."
    )
    include_stop_str_in_output: bool | None = Field(
        default=None, description="Keep the matched stop string at the end of the text."
    )
    skip_special_tokens: bool | None = Field(
        default=None, description="Leave special tokens out of the text (default true)."
    )
    structured_outputs: dict | None = Field(
        default=None,
        description="Constrain the output to one of: json (a JSON schema), regex, choice "
        "(a list of strings), grammar (EBNF or Lark), json_object (true).",
    )
    guided_json: dict | str | None = Field(
        default=None, description="vLLM's older name for structured_outputs.json."
    )
    guided_regex: str | None = Field(
        default=None, description="vLLM's older name for structured_outputs.regex."
    )
    guided_choice: list[str] | None = Field(
        default=None, description="vLLM's older name for structured_outputs.choice."
    )
    guided_grammar: str | None = Field(
        default=None, description="vLLM's older name for structured_outputs.grammar."
    )
    cache_salt: str | None = Field(default=None, description=CACHE_SALT_DESCRIPTION)
    priority: int | None = priority_field()
    prompt_logprobs: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=MAX_INT32,
        description="Logprobs of each prompt token plus this many top alternatives "
        "(at most --max-logprobs, 20); the prompt gets no prefix-cache hit.",
    )
    return_token_ids: bool | None = Field(
        default=None, strict=True, description="Add the prompt's and each choice's token ids."
    )
    kv_transfer_params: dict | None = Field(
        default=None,
        description='Prefill/decode disaggregation (vLLM\'s name): {"do_remote_decode": true} '
        "(answer once the prompt's KV blocks are in the --kv-offload-dir store) or "
        '{"do_remote_prefill": true, "remote_tokens": N, "remote_blocks": B, '
        '"first_token_id": T} (plus phase 1\'s signed "ray_blocks" under --kv-transfer ray).',
    )

    def structured_outputs_params(self):
        """(StructuredOutputsParams or None, the request field that asked for it)."""
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        response_format = getattr(self, "response_format", None)
        return requested_structured_outputs(self.structured_outputs, guided, response_format)

    def structured_outputs_aliases(self) -> dict[str, str]:
        """Maps the `structured_outputs` param of an engine error (a schema that does not
        compile) to the request field the constraint came from."""
        _, source = self.structured_outputs_params()
        return {"structured_outputs": source} if source else {}

    def sampling_params_with(self, *, max_tokens: int | None, logprobs: int | None):
        """SamplingParams from the OpenAI sampling fields (declared by the request class)
        and the extensions; the endpoint decides max_tokens and logprobs."""
        return sampling_params(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params()[0],
            cache_salt=self.cache_salt,
            priority=self.priority,
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params,
        )


# -- server state ------------------------------------------------------------------------------
class HealthResponse(OpenAIBaseModel):
    status: Literal["ok", "sleeping"] = "ok"
    """`sleeping`: put to sleep (`POST /sleep`), generation requests get 503 until
    `POST /wake_up` (a server asleep by itself, `--sleep-idle-seconds`, is `ok`: a request
    wakes it)."""
    kv_role: Literal["prefill", "decode", "both"] = "both"
    """`--kv-role`: what the router's pd policy sends here (prefill/decode disaggregation)."""


class SpecDecodeStatsResponse(OpenAIBaseModel):
    """The `spec_decode` part of GET /stats: vLLM's `spec_decode_*` numbers."""

    num_drafts: int
    """Draft steps: one per request whose proposals the target checked in a step."""
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    """Accepted draft tokens by position in the draft (0 = first)."""
    acceptance_rate: float
    """num_accepted_tokens / num_draft_tokens."""
    mean_acceptance_length: float
    """Tokens per draft step: 1 + num_accepted_tokens / num_drafts."""


class StatsResponse(OpenAIBaseModel):
    """GET /stats: what the engine is doing now, and totals since the start."""

    is_healthy: bool
    num_requests_running: int
    num_requests_waiting: int
    num_sequences_in_flight: int
    """Admitted and not yet ended, including what the engine thread has not picked up."""
    kv_cache_usage: float
    """Fraction of KV blocks in use (0..1)."""
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_requests_finished: int
    num_requests_aborted: int
    """Requests ended early: client disconnects, cancelled consumers, shutdown."""
    num_requests_failed: int
    num_requests_rejected: int
    """Requests refused with 503 because the queue was full."""
    num_grammar_compiles_running: int = 0
    """Structured-output grammars compiling now (`--structured-outputs-workers` at most)."""
    peak_running_requests: int
    """Most requests running in one engine step (> 1 means requests were batched)."""
    spec_decode: SpecDecodeStatsResponse | None = None
    """Speculative decoding since start (null when the server does not speculate)."""
