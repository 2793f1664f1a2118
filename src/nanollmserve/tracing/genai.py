"""The GenAI semantic-convention attributes and events of a request span (OpenTelemetry's
`gen_ai.*` names, as vLLM reports them, plus vLLM's `gen_ai.latency.*` ones).

- At admission (`request_attributes`): `gen_ai.request.*` from the SamplingParams,
  `gen_ai.response.id` (the server's id: `chatcmpl-...`), `gen_ai.response.model`.
- When each engine request ends (`RequestTotals.add`, on the engine thread): usage, finish
  reasons, latencies, and one event per phase at the time it happened: `queued` (the engine
  got it), `scheduled` (its prefill started), `first_token` (prefill done), `finished`.

A request with several prompts (a completions list, /batch_generate) is several engine
requests: usage and finish reasons add up over them; each event names its engine request.
Plain Python (no OpenTelemetry import): attribute values are str, int, float, or lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
PROVIDER_NAME = "nanollmserve"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E_LATENCY = "gen_ai.latency.e2e"
NUM_PREEMPTIONS = "nanollmserve.num_preemptions"
ENGINE_REQUEST_ID = "nanollmserve.request_id"

# SamplingParams field -> attribute, for the fields that are set (not None).
_SAMPLING = {
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
}

EVENTS = ("queued", "scheduled", "first_token", "finished")
"""The phase events of an engine request, in the order they happen."""


def request_attributes(params, model: str, response_id: str) -> dict:
    """The `gen_ai.request.*` attributes of a request's SamplingParams."""
    attributes = {REQUEST_MODEL: model, RESPONSE_MODEL: model, RESPONSE_ID: response_id}
    for name, key in _SAMPLING.items():
        value = getattr(params, name, None)
        if value is not None:
            attributes[key] = value
    if getattr(params, "top_k", 0) > 0:
        attributes["gen_ai.request.top_k"] = params.top_k
    if getattr(params, "n", 1) != 1:
        attributes["gen_ai.request.choice.count"] = params.n
    if getattr(params, "stop", None):
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return attributes


def phase_events(output) -> list[tuple[str, float]]:
    """(event, `time.time()` seconds) of an ended engine request's phases that happened."""
    metrics = output.metrics
    if metrics is None:
        return []
    times = (
        metrics.arrival_time,
        metrics.first_scheduled_time,
        metrics.first_token_time,
        metrics.finished_time,
    )
    return [(name, at) for name, at in zip(EVENTS, times, strict=True) if at is not None]


@dataclass
class RequestTotals:
    """What the ended engine requests of one span add up to."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    latencies: dict[str, float] = field(default_factory=dict)
    num_preemptions: int = 0

    def add(self, output) -> dict:
        """Count an ended engine request (a RequestOutput); the span's attributes now."""
        self.input_tokens += len(output.prompt_token_ids)
        self.cached_tokens += output.num_cached_tokens
        for choice in output.outputs:
            self.output_tokens += len(choice.token_ids)
            self.finish_reasons.append(choice.finish_reason or "none")
        metrics = output.metrics
        if metrics is not None:  # the slowest engine request is the span's
            self.num_preemptions += metrics.num_preemptions
            for key, value in (
                (TIME_IN_QUEUE, metrics.time_in_queue),
                (TIME_TO_FIRST_TOKEN, metrics.ttft),
                (E2E_LATENCY, metrics.e2e_latency),
            ):
                if value is not None:
                    self.latencies[key] = max(value, self.latencies.get(key, 0.0))
        return {
            INPUT_TOKENS: self.input_tokens,
            OUTPUT_TOKENS: self.output_tokens,
            CACHED_INPUT_TOKENS: self.cached_tokens,
            FINISH_REASONS: list(self.finish_reasons),
            NUM_PREEMPTIONS: self.num_preemptions,
            **self.latencies,
        }
