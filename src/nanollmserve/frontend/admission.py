"""Admission: the one gate every request passes, whichever frontend sent it (HTTP, gRPC, the
offline `LLM`, a flight-record replay), and the `AdmittedRequest` it lets through.

Every user-facing check of a request lives here, in the order a frontend can afford them:

1. `check_params`: the server's `RequestPolicy` (generation defaults for the fields the
   client left unset, the `--max-*` request limits, `n <= --max-num-seqs`), before any work;
2. `check_prompts`: the request's totals once its prompts are tokenized
   (`--max-request-prompt-tokens`, `--max-prompt-logprobs-entries`);
3. `check_prompt`: the model's limits on the token ids (context length, vocabulary,
   `priority` under the engine's scheduling policy and `--max-client-priority`);
4. `admit_checked`: the typed `AdmittedRequest` with its `n` engine requests.

`admit` runs the four for a one-prompt request (the offline `LLM`, a replay). The HTTP and
gRPC frontends run steps 1 and 2 first, before any work (`api/generation.py`), then
`AsyncEngine.add_request` runs 1 (again: it is idempotent, and so no frontend can skip it),
3 as it tokenizes (before a grammar compiles) and 4.

Each raises `ParamError` (a ValueError naming the parameter): HTTP answers 400, gRPC
INVALID_ARGUMENT, the offline `LLM` raises it as is, so the three refuse a hostile request
with the same message. What is admitted travels as one `AdmittedRequest` through the
engine loop, the driver and the output processor, never as loose positional fields. No torch
here.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.errors import ParamError
from nanollmserve.frontend.input_processor import InputProcessor
from nanollmserve.frontend.request_policy import RequestPolicy
from nanollmserve.outputs import OutputKind
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams

__all__ = ["Admission", "AdmittedRequest"]


@dataclass(frozen=True)
class AdmittedRequest:
    """One request that passed every check: what the engine loop, the driver and the output
    processor need of it, in one typed value."""

    request_id: str
    """The engine's key (the server's id; a client's id is only echoed)."""
    prompt: str | None
    """The prompt text (None: the client sent token ids or chat messages)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    """The sampling parameters after the policy: generation defaults filled, limits checked
    (`priority`, `cache_salt`, `structured_outputs` ... travel here)."""
    children: list[EngineCoreRequest]
    """One engine request per choice (`n`), ids `request_id#i` when `n > 1`."""
    output_kind: OutputKind = OutputKind.FINAL_ONLY
    lora_name: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    grammar: Any = None
    """`params.structured_outputs` compiled (None without one)."""
    arrival_time: float = 0.0

    @property
    def num_seqs(self) -> int:
        return len(self.children)

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]


class Admission:
    def __init__(self, policy: RequestPolicy, input_processor: InputProcessor) -> None:
        self.policy = policy
        self.input_processor = input_processor

    @property
    def limits(self) -> RequestLimits:
        return self.policy.limits

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    def check_params(self, params: SamplingParams, unset: Collection[str] = ()) -> SamplingParams:
        """Step 1: `params` with the generation defaults of the `unset` fields, held to the
        request limits (ParamError naming the field beyond one)."""
        return self.policy.apply(params, unset)

    def check_prompts(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_logprobs_copies: int | None = None,
    ) -> None:
        """Step 2, as a request's prompts are tokenized (`prompts`: the token ids of all of
        them, or of the ones tokenized so far, the newest last): a newest prompt too long
        for the context gets the context error, then the request's totals are checked
        (`--max-request-prompt-tokens`, `--max-prompt-logprobs-entries`; the copies of a
        prompt's logprobs the response holds, default `n`)."""
        if prompts and len(prompts[-1]) >= self.max_model_len:
            self.check_prompt(prompts[-1], params)
        lengths = [len(token_ids) for token_ids in prompts]
        self.limits.check_prompts(lengths, params, self.max_model_len, prompt_logprobs_copies)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The model's limits on one prompt: room for it and `max_tokens` in the context,
        token ids inside the vocabulary, a `priority` the server allows."""
        processor = self.input_processor
        policy = processor.scheduling_policy
        if params.priority != 0 and policy != "priority":
            raise ParamError(
                f"priority is {params.priority}, but this server schedules {policy}: start "
                f"it with --scheduling-policy priority",
                "priority",
            )
        limit = processor.max_client_priority
        if limit is not None and params.priority < limit:
            raise ParamError(
                f"priority is {params.priority}, more urgent than this server allows: "
                f"--max-client-priority is {limit} (lower is more urgent)",
                "priority",
            )
        max_model_len, num_prompt = self.max_model_len, len(prompt_token_ids)
        if num_prompt >= max_model_len + processor.pooling:
            raise ParamError(
                f"This model's maximum context length is {max_model_len} tokens, and the "
                f"prompt has {num_prompt} tokens"
                + (
                    ": too large to embed."
                    if processor.pooling
                    else ", leaving no room for output."
                ),
                "prompt",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
            raise ParamError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the prompt or "
                f"max_tokens.",
                "max_tokens",
            )
        vocab_size = processor.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise ParamError(
                f"logit_bias has token id {bad[0]} outside the vocabulary", "logit_bias"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ParamError(
                f"stop_token_ids has token id {bad[0]} outside the vocabulary", "stop_token_ids"
            )

    def admit(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        lora_name: str | None = None,
        grammar: Any = None,
        arrival_time: float | None = None,
    ) -> AdmittedRequest:
        """A one-prompt request admitted whole, every check in the server's order: the
        policy (`check_params`), the request's totals (`check_prompts`), the model's limits
        (`check_prompt`), then the AdmittedRequest (`admit_checked`). What the offline `LLM`
        and a replay run; `params` fresh from the caller (defaults are the server's only for
        fields the caller left unset, here none)."""
        params = self.check_params(params)
        self.check_prompts([prompt_token_ids], params)
        self.check_prompt(prompt_token_ids, params)
        return self.admit_checked(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            output_kind=output_kind,
            lora_name=lora_name,
            grammar=grammar,
            arrival_time=arrival_time,
        )

    def admit_checked(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        lora_name: str | None = None,
        grammar: Any = None,
        arrival_time: float | None = None,
    ) -> AdmittedRequest:
        """The AdmittedRequest of a request whose `params` came out of `check_params` and
        whose prompt passed `check_prompt` already (the AsyncEngine runs those as it
        prepares the request, before its grammar compiles): `admit` without checking
        twice."""
        if grammar is None:
            grammar = self.input_processor.compile_grammar(params)
        arrival_time = time.time() if arrival_time is None else arrival_time
        children = self.input_processor.make_requests(
            request_id, prompt_token_ids, params, arrival_time, lora_name, grammar
        )
        return AdmittedRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            children=children,
            output_kind=output_kind,
            lora_name=lora_name,
            grammar=grammar,
            arrival_time=arrival_time,
        )
