"""What a request gives back: RequestOutput (vLLM's shape), its CompletionOutputs, metrics.

A request's outputs come in one of two kinds (`OutputKind`): FINAL_ONLY, one RequestOutput
holding everything once the request ends (the offline `LLM`, non-streaming routes), or
DELTA, one RequestOutput per step holding only what is new since the previous one (streaming).
Deltas that pile up for a slow reader are merged with `RequestOutput.add`, so a stream never
holds more than one pending output, and never a cumulative copy per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OutputKind(enum.Enum):
    FINAL_ONLY = "final_only"
    """One output, when the request ends, with the whole text and every token."""
    DELTA = "delta"
    """One output per step with only the new text, tokens and logprobs of the choices that
    changed; the last one has `finished` set and the finish reasons."""


@dataclass
class Logprob:
    logprob: float
    rank: int
    """1 = the most likely token."""
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, the sampled token first, then the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, then a dict as above (the prompt token first).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Times are `time.time()` seconds; durations are seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        end = self.last_token_time or self.first_token_time
        return (end - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; then "stop", "length", "abort", or "error" (the engine failed
    this request alone: preparing or sampling it raised; the server log has why)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, if any."""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    embedding: list[float] | None = None
    """The prompt's embedding, from a pooling engine (`runner="pooling"`), once finished."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, newer: CompletionOutput) -> None:
        """Append a newer delta of the same choice."""
        self.text += newer.text
        self.token_ids.extend(newer.token_ids)
        if newer.logprobs is not None:
            self.logprobs = (self.logprobs or []) + newer.logprobs
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason
        self.cumulative_logprob = newer.cumulative_logprob
        if newer.embedding is not None:
            self.embedding = newer.embedding


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """With `SamplingParams.prompt_logprobs`: in the final output, and in the first DELTA
    output after the prompt ran."""

    def add(self, newer: RequestOutput) -> None:
        """Merge a newer DELTA output of the same request into this one (a reader that
        lagged gets one output holding both)."""
        by_index = {c.index: c for c in self.outputs}
        for choice in newer.outputs:
            if choice.index in by_index:
                by_index[choice.index].add(choice)
            else:
                self.outputs.append(choice)
        self.outputs.sort(key=lambda c: c.index)
        self.finished = newer.finished
        self.num_cached_tokens = newer.num_cached_tokens
        self.metrics = newer.metrics
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
