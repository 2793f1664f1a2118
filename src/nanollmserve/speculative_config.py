"""SpeculativeConfig: the `--speculative-config` JSON (vLLM's keys), parsed and checked.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    --speculative-config '{"method": "draft_model", "model": "PATH", "num_speculative_tokens": 3}'
    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})

`ngram` proposes the tokens that followed the latest earlier occurrence of the sequence's last
n tokens (prompt lookup: no extra model). `draft_model` runs a smaller model with the same
tokenizer, in its own paged KV cache. A `model` without a `method` means `draft_model`, as in
vLLM. No torch here: the CLI parses it before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from nanollmserve.errors import UserError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    """K: tokens proposed per request per step; the target model checks them in one forward."""
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the shortest suffix (in tokens) that must match earlier in the sequence."""
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the longest suffix tried first."""
    model: str | None = None
    """draft_model: a local HF directory or a *.gguf file with the target's vocabulary."""

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (`LLM(speculative_config={...})`) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UserError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise UserError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise UserError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        values = dict(value)
        if values.get("method") is None and values.get("model"):
            values["method"] = "draft_model"
        method = values.get("method")
        if method not in METHODS:
            raise UserError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        if "num_speculative_tokens" not in values:
            raise UserError("speculative_config needs num_speculative_tokens")
        lookup_min, lookup_max = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        values["prompt_lookup_min"] = lookup_min if lookup_min is not None else lookup_max
        values["prompt_lookup_max"] = lookup_max if lookup_max is not None else lookup_min
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise UserError(
                f"speculative_config num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not (
                1 <= lo <= hi
            ):
                raise UserError(
                    "speculative_config needs integers 1 <= prompt_lookup_min <= "
                    f"prompt_lookup_max, got {lo!r} and {hi!r}"
                )
            if self.model is not None:
                raise UserError("speculative_config method ngram takes no model")
        elif not isinstance(self.model, str) or not self.model:
            raise UserError("speculative_config method draft_model needs a model path")
