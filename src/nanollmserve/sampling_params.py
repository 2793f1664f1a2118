"""SamplingParams: how one request samples and when it stops.

Validation happens at construction: a bad value raises `ParamError` (a ValueError) whose
`param` is the field, so the offline API, the HTTP server (which turns it into a 400 naming
the field) and gRPC report the same message. Every float field must be a finite number in
its range (NaN and infinities are refused), and the ranges keep the logits finite: a
temperature below `SAMPLING_EPS` samples greedily (dividing by ~0 would overflow float32),
`repetition_penalty` lies in [0.01, 10], penalties in [-2, 2], logit_bias values in
[-100, 100].
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from nanollmserve.errors import ParamError
from nanollmserve.kv_transfer import KVTransferParams
from nanollmserve.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (vLLM's `_SAMPLING_EPS`)."""
MIN_REPETITION_PENALTY = 0.01
"""Lower would scale a seen token's logit by up to 1 / penalty, past float32's range."""
MAX_REPETITION_PENALTY = 10.0
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 2**31 - 1
"""`priority` is an int32: [-MAX_PRIORITY - 1, MAX_PRIORITY]."""


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions for the prompt (they share the prompt's KV blocks)."""
    temperature: float = 1.0
    """0 (or anything below SAMPLING_EPS, 1e-5) means greedy."""
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
    prompt_logprobs: int | None = None
    """Return the logprob of each prompt token (None for the first) plus this many top
    alternatives (0..20). Such a request computes its whole prompt: no prefix-cache hit."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of the
    StructuredOutputsParams fields is accepted too)."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (None: the unsalted
    pool), so one user cannot tell from timing or `cached_tokens` what another sent."""
    priority: int = 0
    """Under `--scheduling-policy priority`: lower runs first, and may preempt a running
    request of a higher value when the KV pool is full. Must be 0 under fcfs."""
    kv_transfer_params: KVTransferParams | None = None
    """Prefill/decode disaggregation (`kv_transfer.py`; a dict of its fields is accepted
    too): phase 1 hands the prompt's KV blocks on through the `--kv-offload-dir` store."""

    def __post_init__(self) -> None:
        self.kv_transfer_params = KVTransferParams.from_value(self.kv_transfer_params)
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

        def in_range(name: str, low: float, high: float, *, low_open: bool = False) -> None:
            value = getattr(self, name)
            above_low = _is_number(value) and (value > low if low_open else value >= low)
            ok = above_low and value <= high
            opening = "(" if low_open else "["
            check(ok, name, f"must be in {opening}{low:g}, {high:g}]")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        in_range("temperature", 0.0, 100.0)
        in_range("top_p", 0.0, 1.0, low_open=True)
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be >= 0 or -1")
        in_range("min_p", 0.0, 1.0)
        in_range("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        in_range("presence_penalty", -2.0, 2.0)
        in_range("frequency_penalty", -2.0, 2.0)
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
            self.prompt_logprobs is None or _is_int(self.prompt_logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        check(
            _is_int(self.priority, -MAX_PRIORITY - 1, MAX_PRIORITY),
            "priority",
            f"must be an integer in [{-MAX_PRIORITY - 1}, {MAX_PRIORITY}]",
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
        salt = self.cache_salt
        if salt is not None and not (
            isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS
        ):
            length = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
            raise ParamError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                f"characters, got {length}",
                param="cache_salt",
            )
        transfer = self.kv_transfer_params
        if transfer is not None and transfer.do_remote_decode and self.n != 1:
            raise ParamError(
                f"kv_transfer_params: do_remote_decode hands on one sequence: n must be 1, "
                f"got {self.n}",
                param="kv_transfer_params",
            )
        if self.logit_bias:
            check(
                all(_is_number(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            )
            check(all(k >= 0 for k in self.logit_bias), "logit_bias", "keys must be token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value, low: int, high: int) -> bool:
    """An integer (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value) -> bool:
    """A real, finite number (NaN and infinities fail every range check anyway; a bool or a
    string would raise TypeError in a comparison instead of a ParamError)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
