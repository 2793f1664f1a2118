"""Rendering a Jinja chat template the way transformers' `apply_chat_template` does.

The environment is transformers' (`utils/chat_template_utils.py`, 5.x): an
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` block that only renders its body, a `tojson` filter that does
not escape HTML (`json.dumps` with `ensure_ascii=False`), `raise_exception(message)`,
`strftime_now(format)`, a `dict` without attribute tricks and a `namespace` that refuses
underscore names. What the template sees is rebuilt from plain JSON types (anything else
becomes a `<TypeName>` placeholder), messages lose their None-valued keys, and a message's
reasoning is also given under `reasoning_content` and `thinking`, as there.

Used by `NativeTokenizer.apply_chat_template`, so rendering a chat does not need transformers
(whose import took 1.7 s of every start). `jinja2` is imported at the first render.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning comes under; templates read the first (gpt-oss: `thinking`)."""


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """The conversation as text; `variables` (special tokens such as `bos_token`, template
    switches) are visible to the template. Template errors raise `jinja2.TemplateError`."""
    chat = []
    for message in plain_template_data(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return compile_chat_template(template).render(
        messages=chat,
        tools=plain_template_data(tools),
        documents=plain_template_data(documents),
        add_generation_prompt=add_generation_prompt,
        **plain_template_data(variables),
    )


def plain_template_data(value: Any) -> Any:
    """`value` rebuilt from JSON types (pydantic models dumped), so the sandboxed template
    never reaches an object's methods; anything else becomes `<TypeName>`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """The compiled template (cached: a server renders one template again and again)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
        transformers): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_namespace_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_namespace_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_namespace_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: "
                f"{name!r}"
            )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)
