"""StructuredOutputsParams: the grammar one request's output must follow (vLLM's names).

Exactly one constraint is set: a JSON schema (`json`), any JSON object (`json_object`), a
regular expression (`regex`), one of a list of strings (`choice`), or an EBNF / Lark grammar
(`grammar`). Construction checks the shape (one constraint, right types, a schema string
that parses as JSON) and raises `ParamError` naming the field; whether the schema, regex or
grammar compiles is checked by the grammar engine when the request is added (also a 400).

`after_thinking` (set by the server's reasoning parser, not by a request) makes the grammar
apply to the answer after a reasoning model's `</think>` token only: the thinking is free.
"""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass, fields
from typing import Any

from nanollmserve.errors import ParamError

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ThinkingSpan:
    """Where a reasoning model's thinking is, in tokens: the grammar waits while it lasts."""

    start_token_id: int
    """`<think>`: as the output's first token it opens the thinking."""
    end_token_id: int
    """`</think>`: the grammar applies from the token after it."""
    open_at_start: bool
    """The prompt opened the thinking already (the output starts inside it)."""


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) or Lark grammar the output must follow."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact output, fewer tokens)."""
    after_thinking: ThinkingSpan | None = None
    """The grammar applies only after the thinking (the server's reasoning parser sets it;
    not a request field, and not part of the grammar's `key`)."""

    def __post_init__(self) -> None:
        param = "structured_outputs"
        chosen = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ParamError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object, got {chosen or 'none'}",
                param=param,
            )
        if isinstance(self.json, str):
            try:
                self.json = json_lib.loads(self.json)
            except ValueError as e:
                raise ParamError(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ParamError("the JSON schema must be an object", param=param)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ParamError("regex must be a non-empty string", param=param)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ParamError("grammar must be a non-empty string", param=param)
        if self.choice is not None:
            if not (
                isinstance(self.choice, list | tuple)
                and self.choice
                and all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ParamError("choice must be a non-empty list of non-empty strings", param)
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ParamError("json_object must be a boolean", param=param)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the grammar: equal keys compile to the same grammar."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json_lib.dumps(value, sort_keys=True)
        return (self.kind, text, self.disable_any_whitespace)

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams:
        """From a StructuredOutputsParams or a dict of its fields (an unknown key is a 400)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ParamError("structured_outputs must be an object", param="structured_outputs")
        known = {f.name for f in fields(cls)} - {"after_thinking"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParamError(
                f"structured_outputs has unknown field(s) {unknown}; known: {sorted(known)}",
                param="structured_outputs",
            )
        return cls(**value)
