"""`--generation-config auto|vllm|PATH`: the sampling defaults a model's creator recommends.

As in vLLM: `auto` (the default) reads the model's own `generation_config.json`, `vllm`
ignores it (the built-in defaults: temperature 1, top_p 1, ...), a PATH is a folder holding
a `generation_config.json`. The fields it may set are `DEFAULT_FIELDS`; the server applies
them to the OpenAI requests that leave a field unset (see `ServerContext.make_params`). No
torch here: the CLI checks a PATH before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanollmserve.errors import ParamError, UserError
from nanollmserve.sampling_params import SamplingParams

DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""generation_config.json keys that become request defaults (SamplingParams field names)."""


def load_generation_defaults(mode: str, model_dir: str | Path | None = None) -> dict:
    """The sampling defaults `mode` stands for ({} for `vllm`, or a file without any)."""
    if mode == "vllm":
        return {}
    folder = Path(model_dir if mode == "auto" else mode)
    path = folder / "generation_config.json"
    if not path.is_file():
        if mode == "auto":
            return {}
        raise UserError(f"--generation-config {mode}: no generation_config.json in {folder}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object")
    defaults = {k: data[k] for k in DEFAULT_FIELDS if data.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except (ParamError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: {exc}") from None
    return defaults


def describe(defaults: dict) -> str:
    """`temperature=0.6 top_p=0.9`, or `none` (the log line and the docs use this form)."""
    return " ".join(f"{k}={v}" for k, v in defaults.items()) or "none"
