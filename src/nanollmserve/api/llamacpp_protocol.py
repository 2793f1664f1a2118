"""Protocol models of llama.cpp's native server API (`/completion`, `/infill`, `/props`,
`/slots`, `/apply-template`), with llama.cpp's field names, defaults and response shapes.

A request field this server cannot honour is a 400 naming it, unless it is at llama.cpp's
default (then it changes nothing): `typical_p` other than 1, `repeat_last_n` other than -1
(the whole sequence) or 0 (penalties off) while a penalty is on, `n_predict` 0. Every field
has a range; NaN, infinities and out-of-range numbers are refused here or by SamplingParams
(`ServerContext.make_params` reports them under the llama.cpp name). Fields llama.cpp has
and this model does not declare (`mirostat`, `dry_*`, `samplers`, `id_slot`, ...) are a 400
like any unknown field.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import Field

from nanollmserve.api.protocol import MAX_INT32, ChatMessage, TokenId, sampling_params
from nanollmserve.api.protocol_base import OpenAIBaseModel, RequestModel
from nanollmserve.api.protocol_tools import ChatCompletionToolParam
from nanollmserve.errors import ParamError
from nanollmserve.outputs import RequestOutput
from nanollmserve.sampling_params import MAX_LOGPROBS, SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams

DEFAULTS = {
    "n_predict": -1,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": -1,
    "stop": [],
    "ignore_eos": False,
    "n_probs": 0,
    "grammar": "",
}
"""llama.cpp's defaults of the sampling fields /completion takes (its server README), which
`GET /props` reports as `default_generation_settings.params`."""

PARAM_ALIASES = {
    "max_tokens": "n_predict",
    "repetition_penalty": "repeat_penalty",
    "logprobs": "n_probs",
    "structured_outputs": "grammar",
}
"""SamplingParams field -> the /completion field, for the `param` of a 400."""

MAX_INFILL_EXTRA = 64
"""Most `input_extra` chunks one /infill request may carry."""

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(RequestModel):
    """`POST /completion`: one prompt (a string or token ids), llama.cpp's sampling fields."""

    prompt: Prompt
    model: str | None = None
    """Checked like the OpenAI routes' `model` (left out: the served model)."""
    n_predict: int = Field(default=DEFAULTS["n_predict"], ge=-1, le=MAX_INT32)
    """Most tokens to generate; -1: up to the context length. 0 (evaluate the prompt only)
    is refused."""
    temperature: FiniteFloat = DEFAULTS["temperature"]
    top_k: int = Field(default=DEFAULTS["top_k"], ge=-1, le=MAX_INT32)
    """<= 0: off."""
    top_p: FiniteFloat = DEFAULTS["top_p"]
    min_p: FiniteFloat = DEFAULTS["min_p"]
    typical_p: FiniteFloat = DEFAULTS["typical_p"]
    """Only 1 (off): this server's sampler has no locally typical sampling."""
    repeat_penalty: FiniteFloat = DEFAULTS["repeat_penalty"]
    repeat_last_n: int = Field(default=DEFAULTS["repeat_last_n"], ge=-1, le=MAX_INT32)
    """The penalties' window: while a penalty is on, -1 (the whole sequence, what this server
    does) or 0 (penalties off); other values are refused then."""
    presence_penalty: FiniteFloat = DEFAULTS["presence_penalty"]
    frequency_penalty: FiniteFloat = DEFAULTS["frequency_penalty"]
    seed: int = Field(default=DEFAULTS["seed"], ge=-1, lt=2**63)
    """-1: a random seed."""
    stop: str | list[str] = Field(default_factory=list)
    grammar: str | None = Field(default=None, max_length=1 << 20)
    """A GBNF grammar the output follows."""
    json_schema: dict | None = None
    """A JSON schema the output follows (`{}`: any JSON)."""
    n_probs: int = Field(default=DEFAULTS["n_probs"], ge=0, le=MAX_LOGPROBS)
    """Top alternatives per generated token (`completion_probabilities`); the server's
    `--max-logprobs` bounds it too."""
    cache_prompt: bool = True
    """false: this request neither reads nor leaves shareable prefix-cache blocks (a random
    cache salt); true: prefix caching as always."""
    ignore_eos: bool = DEFAULTS["ignore_eos"]
    return_tokens: bool = False
    """Put the generated token ids in `tokens` (a stream always does)."""
    stream: bool = False

    def prompt_input(self) -> str | list[int]:
        return self.prompt

    def to_sampling_params(self) -> SamplingParams:
        if self.n_predict == 0:
            raise ParamError(
                "n_predict 0 (evaluate the prompt only) is not supported: ask for >= 1 token, "
                "or -1 for up to the context length",
                param="max_tokens",
            )
        if self.typical_p != 1.0:
            raise ParamError(
                f"typical_p is not supported (this server's sampler has no locally typical "
                f"sampling): leave it out or send 1.0, got {self.typical_p!r}",
                param="typical_p",
            )
        repetition, presence, frequency = (
            self.repeat_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        )
        if self.repeat_last_n == 0:  # llama.cpp: the penalties are off
            repetition, presence, frequency = 1.0, 0.0, 0.0
        if self.grammar and self.json_schema is not None:
            raise ParamError("give grammar or json_schema, not both", param="grammar")
        constraint = None
        if self.grammar:
            constraint = StructuredOutputsParams(grammar=self.grammar)
        elif self.json_schema is not None:
            schema = self.json_schema or {"type": "object"}
            constraint = StructuredOutputsParams(json=schema)
        params = sampling_params(
            temperature=max(self.temperature, 0.0),  # llama.cpp: <= 0 is greedy
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seed=None if self.seed == -1 else self.seed,
            max_tokens=None if self.n_predict == -1 else self.n_predict,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            logprobs=self.n_probs or None,
            structured_outputs=constraint,
            cache_salt=None if self.cache_prompt else secrets.token_hex(16),
        )
        if self.repeat_last_n not in (0, -1) and params.needs_penalties:
            raise ParamError(
                f"repeat_last_n {self.repeat_last_n} is not supported: this server's "
                "penalties look at the whole sequence (repeat_penalty: prompt and output; "
                "presence/frequency_penalty: the output); send -1 for that, or 0 to turn "
                "the penalties off",
                param="repeat_last_n",
            )
        return params


class InfillExtra(OpenAIBaseModel):
    filename: str = Field(default="", max_length=4096)
    text: str = ""


class InfillRequest(CompletionRequest):
    """`POST /infill`: code between `input_prefix` and `input_suffix` (fill-in-the-middle);
    `prompt` (optional here) goes after the middle token, `input_extra` before the prefix.
    Every /completion field applies."""

    prompt: str = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillExtra] = Field(default_factory=list, max_length=MAX_INFILL_EXTRA)


class TokenProb(OpenAIBaseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class CompletionProbability(TokenProb):
    """One generated token of `completion_probabilities`, with its top `n_probs`."""

    top_logprobs: list[TokenProb]


class Timings(OpenAIBaseModel):
    """llama.cpp's `timings`: the prompt (the tokens computed, cached ones left out) and the
    generation, in ms, ms per token and tokens per second. On /completion and /infill, and
    (unless `--no-timings`) on /v1/completions and /v1/chat/completions, as llama.cpp puts
    them: the response's top level, a stream's last chunk."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float

    @classmethod
    def of(cls, outputs: list[RequestOutput], num_generated: int | None = None) -> Timings | None:
        """The timings of a response from its requests' metrics (None when an output has
        none): the prompt phase runs from the first scheduled step to the first token (that
        token's step included), generation from the first token to the last. For several
        requests (prompts of one /v1/completions call), which run together, the counts are
        totals and the phases span them all: from the earliest start to the latest first
        token, and from the earliest first token to the latest last one. `num_generated`:
        the tokens generated, as the response counts them (default: the metrics' count)."""
        metrics = [output.metrics for output in outputs]
        if not outputs or any(m is None for m in metrics):
            return None
        cached = sum(output.num_cached_tokens for output in outputs)
        prompt_n = sum(
            max(len(output.prompt_token_ids) - output.num_cached_tokens, 0) for output in outputs
        )
        if num_generated is None:
            num_generated = sum(m.num_generation_tokens for m in metrics)
        start = min(m.first_scheduled_time or m.arrival_time for m in metrics)
        firsts = [m.first_token_time for m in metrics if m.first_token_time is not None]
        lasts = [m.last_token_time for m in metrics if m.last_token_time is not None]
        prompt_ms = 1000.0 * (max(firsts) - start) if firsts else 0.0
        predicted_ms = 1000.0 * (max(lasts) - min(firsts)) if firsts and lasts else 0.0
        return cls(
            cache_n=cached,
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
            prompt_per_second=1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            predicted_n=num_generated,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / num_generated if num_generated else 0.0,
            predicted_per_second=1000.0 * num_generated / predicted_ms if predicted_ms > 0 else 0.0,
        )


StopType = Literal["none", "eos", "limit", "word"]


class CompletionResponse(OpenAIBaseModel):
    """The /completion (and /infill) answer, and with `stream` each event: `stop` false and
    only `content`, `tokens` and the counts until the last one, which has `stop` true, the
    stop type and the timings (with empty `content`)."""

    index: int = 0
    content: str
    tokens: list[int] = Field(default_factory=list)
    id_slot: int = -1
    """-1: requests are not bound to slots here (continuous batching)."""
    stop: bool
    model: str | None = None
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict | None = None
    prompt: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: StopType | None = None
    stopping_word: str | None = None
    tokens_cached: int | None = None
    timings: Timings | None = None
    completion_probabilities: list[CompletionProbability] | None = None


class ApplyTemplateRequest(RequestModel):
    messages: list[ChatMessage] = Field(min_length=1)
    """At most `--max-messages`."""
    tools: list[ChatCompletionToolParam] | None = None
    """Function tools, rendered as the chat route renders them (at most `--max-tools`,
    unique names)."""


class ApplyTemplateResponse(OpenAIBaseModel):
    prompt: str


class SlotActionRequest(OpenAIBaseModel):
    """The body of `POST /slots/{id}?action=save|restore` (erase takes none)."""

    filename: Any = None
    """A plain file name in the --slot-save-path directory (checked by the handler: a 400
    in the OpenAI shape, never a validation error)."""


class SlotState(OpenAIBaseModel):
    """One entry of `GET /slots`. The engine has `total_slots` sequence places per step,
    not slots bound to requests: `is_processing` tells how many are busy, never whose."""

    id: int
    id_task: int = -1
    n_ctx: int
    speculative: bool
    is_processing: bool
    params: dict


class PropsResponse(OpenAIBaseModel):
    default_generation_settings: dict
    total_slots: int
    model_path: str
    """The served model name (never a file-system path)."""
    chat_template: str
    modalities: dict[str, bool]
    build_info: str
    is_sleeping: bool
