"""SamplingParams: how one request samples and when it stops.

Validation happens at construction: a bad value raises `ParamError` (a ValueError) whose
`param` is the field, so the offline API, the HTTP server (which turns it into a 400 naming
the field) and gRPC report the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanollmserve.errors import ParamError
from nanollmserve.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions for the prompt (they share the prompt's KV blocks)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    """None: up to the model's max length."""
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the logprob of each sampled token plus this many top alternatives (0..20)."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of the
    StructuredOutputsParams fields is accepted too)."""

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ParamError(
                    "logit_bias must map token ids (integers) to numbers", param="logit_bias"
                ) from None
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ParamError(f"{name} {message}, got {getattr(self, name)!r}", param=name)

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be >= 0 or -1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0"
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}",
                param="min_tokens",
            )
        check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "must be an integer in [0, 2**63)",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        if self.logit_bias:
            check(
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            )
            check(all(k >= 0 for k in self.logit_bias), "logit_bias", "keys must be token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
