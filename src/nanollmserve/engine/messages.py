"""The typed messages of the engine: token ids in, token ids out.

`EngineCoreRequest` and `EngineCoreOutput` cross the frontend/engine seam; `SampledToken`
(or, for a request that failed alone, `RequestFailure`) crosses the runner/scheduler one
inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanollmserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """What the frontend hands the engine: token ids and how to sample, nothing else."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora_name: str | None = None
    """The LoRA adapter to run with (None: the base model)."""
    grammar: Any = None
    """The compiled grammar of `sampling_params.structured_outputs` (an XGrammar
    CompiledGrammar, compiled by the frontend), or None."""


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: the sampled token first, then the top alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class SampledToken:
    """What the model runner sampled for one request this step (runner -> scheduler)."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class RequestFailure:
    """What the model runner gives a request whose own sampling raised this step (runner ->
    scheduler), in place of its tokens: the request ends with finish_reason "error" and the
    step goes on for the others."""

    error: str


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: a new token, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With the first token of a request that asked for them: one entry per prompt token
    after the first (the prompt token first, then the top alternatives)."""
    pooled: list[float] | None = None
    """A pooling runner's embedding of the prompt (`engine/pooling.py`), with the finish."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
