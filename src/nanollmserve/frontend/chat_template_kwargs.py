"""`chat_template_kwargs`: extra variables a chat request (or `--default-chat-template-kwargs`)
hands the chat template, such as Qwen3's `{"enable_thinking": false}`.

They are checked before any rendering: an object of at most `MAX_KEYS` keys that are plain
identifiers (no `_` prefix, none of the names the renderer sets itself), holding JSON values
(finite numbers) nested at most `MAX_DEPTH` deep and `MAX_BYTES` long as JSON. Anything else
is a ParamError naming the field (a 400).
"""

from __future__ import annotations

import json
import math
import re

from nanollmserve.errors import ParamError

MAX_KEYS = 32
MAX_DEPTH = 4
MAX_BYTES = 4096

RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
    }
)
"""Names the renderer or its caller set: a request cannot override them this way."""

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")


def check_chat_template_kwargs(value: object, param: str = "chat_template_kwargs") -> dict:
    """`value` if it is a valid set of template variables, else ParamError naming `param`."""
    if not isinstance(value, dict):
        raise ParamError(f"{param} must be a JSON object", param)
    if len(value) > MAX_KEYS:
        raise ParamError(f"{param} has {len(value)} keys, more than {MAX_KEYS}", param)
    for key in value:
        if not isinstance(key, str) or not _IDENTIFIER.match(key):
            raise ParamError(
                f"{param}: key {str(key)[:64]!r} is not a plain identifier (a letter, then "
                "letters, digits or _; at most 64 characters)",
                param,
            )
        if key in RESERVED:
            raise ParamError(f"{param}: {key!r} cannot be set here", param)
    _check_value(value, 0, param)
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_BYTES:
        raise ParamError(f"{param} is {size} bytes as JSON, more than {MAX_BYTES}", param)
    return value


def _check_value(value: object, depth: int, param: str) -> None:
    if depth > MAX_DEPTH:
        raise ParamError(f"{param} is nested more than {MAX_DEPTH} levels deep", param)
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ParamError(f"{param}: numbers must be finite", param)
        return
    if isinstance(value, list):
        for item in value:
            _check_value(item, depth + 1, param)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ParamError(f"{param}: object keys must be strings", param)
            _check_value(item, depth + 1, param)
        return
    raise ParamError(f"{param}: values must be JSON", param)
