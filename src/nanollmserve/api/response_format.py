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


GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older request fields and the StructuredOutputsParams field each one sets."""


def requested_structured_outputs(
    structured_outputs: dict | None, guided: dict[str, Any], response_format: Any
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one constraint a completions or chat request asks for, from its vLLM block
    (`structured_outputs`), vLLM's older `guided_*` fields (`guided` maps each field name to
    its value, None when unset) or OpenAI's `response_format`, and the request field it came
    from (to name in a 400). Asking in two of those ways is a 400."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if structured_outputs is not None:
        found.append((_params(structured_outputs, "structured_outputs"), "structured_outputs"))
    guided_set = {name: value for name, value in guided.items() if value is not None}
    if guided_set:
        param = next(iter(guided_set))
        fields = {GUIDED_FIELDS[name]: value for name, value in guided_set.items()}
        found.append((_params(fields, param), param))
    from_format = structured_outputs_from_response_format(response_format)
    if from_format is not None:
        found.append((from_format, "response_format"))
    if len(found) > 1:
        names = [param for _, param in found]
        raise ParamError(
            f"give one output constraint, got {' and '.join(names)}", param=found[1][1]
        )
    return found[0] if found else (None, None)


def _params(fields: Any, param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_value(fields)
    except ParamError as e:
        raise ParamError(e.message, param=param) from None
