"""OpenAI `response_format` (chat, completions) and `text.format` (responses) ->
StructuredOutputsParams.

The shapes OpenAI defines:

- `{"type": "text"}`: no constraint (None);
- `{"type": "json_object"}`: any JSON object;
- chat / completions: `{"type": "json_schema", "json_schema": {"name", "description",
  "schema", "strict"}}`;
- responses (`text.format`): the same fields flat, `{"type": "json_schema", "name",
  "description", "schema", "strict"}`.

Both json_schema shapes are accepted wherever either is. The output is always held to the
schema (as if `strict` were true). A bad shape raises ParamError naming `param`.
"""

from __future__ import annotations

from typing import Any

from nanollmserve.errors import ParamError
from nanollmserve.structured_outputs import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs_from_response_format(
    response_format: Any, *, param: str = "response_format"
) -> StructuredOutputsParams | None:
    """The StructuredOutputsParams of an OpenAI response_format (a dict or a pydantic model),
    None for `text` or None. `param` names the field in errors ("text.format" for responses).
    """
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump(exclude_none=True)
    if not isinstance(response_format, dict):
        raise ParamError(f"{param} must be an object", param=param)
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ParamError(
            f"{param}.type must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}", param=param
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.get("json_schema", response_format)
    if not isinstance(spec, dict):
        raise ParamError(f"{param}.json_schema must be an object", param=param)
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's `schema` is optional; without one any JSON object is valid.
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict | str):
        raise ParamError(f"{param} schema must be a JSON schema object", param=param)
    try:
        return StructuredOutputsParams(json=schema)
    except ParamError as e:
        raise ParamError(e.message, param=param) from None
