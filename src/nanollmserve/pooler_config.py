"""PoolerConfig: how a pooling runner (`--runner pooling`) turns a prompt's hidden states
into one embedding: the `--pooler-config` JSON, vLLM's keys, parsed and checked.

    --pooler-config '{"pooling_type": "MEAN", "normalize": true}'
    LLM(runner="pooling", pooler_config={"pooling_type": "LAST"})

`LAST` takes the final normed hidden state of the last prompt token (what a causal model's
next-token logits read, vLLM's default for decoder-only embedding models), `MEAN` averages
it over every prompt token, `CLS` takes the first token's. `normalize` (default true) scales
the vector to unit L2 norm, so a dot product is a cosine similarity. No torch here: the CLI
parses it before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from nanollmserve.errors import UserError

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    """LAST | MEAN | CLS (upper case; lower case is accepted when parsing)."""
    normalize: bool = True
    """Scale each embedding to unit L2 norm."""

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig:
        """From the flag's JSON text, a dict (`LLM(pooler_config={...})`) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UserError(f"pooler_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise UserError("pooler_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise UserError(f"pooler_config has unknown keys {unknown}; known: {sorted(known)}")
        pooling_type = value.get("pooling_type", cls.pooling_type)
        if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
            raise UserError(
                f"pooler_config pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}"
            )
        normalize = value.get("normalize", cls.normalize)
        if not isinstance(normalize, bool):
            raise UserError(f"pooler_config normalize must be true or false, got {normalize!r}")
        return cls(pooling_type.upper(), normalize)
