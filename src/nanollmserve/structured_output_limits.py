"""StructuredOutputLimits: bounds on the grammar one request may ask for, and on the time its
compilation may take, so no client can hold the grammar compiler (and the requests waiting
for it) for half a minute with a huge or deeply nested JSON schema.

The size limits are checked by `check` before anything compiles, by a walk of the schema that
stops as soon as one is passed (cheap even for a 4 MB body), and a request over one gets a 400
naming its structured-output field. `structured_outputs_timeout` bounds a compile that passes
them yet runs long (`frontend/grammar_pool.py`). Each field is a `nanollmserve serve` flag
(`max_schema_bytes` is `--max-schema-bytes`). No torch or FastAPI here: the CLI builds its
flags from this module before loading anything.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from nanollmserve.errors import ParamError, UserError
from nanollmserve.structured_outputs import StructuredOutputsParams

_HELP = {
    "structured_outputs_timeout": "seconds one grammar may compile, and wait for a free "
    "compile worker, before its request gets a 400 (503 while waiting)",
    "structured_outputs_workers": "grammars compiled at once, each on its own thread",
    "max_schema_bytes": "largest JSON schema, in bytes of its JSON text",
    "max_schema_depth": "deepest nesting of a JSON schema, counted in JSON objects and arrays "
    "(a nested object schema under `properties` adds 2)",
    "max_schema_properties": "most `properties` in a JSON schema, all levels together",
    "max_enum_entries": "most `enum` values in a JSON schema (all levels together), or "
    "`choice` entries",
    "max_grammar_bytes": "longest regex, EBNF/Lark grammar or `choice` list, in bytes",
}


@dataclass(frozen=True)
class StructuredOutputLimits:
    structured_outputs_timeout: float = 10.0
    structured_outputs_workers: int = 2
    max_schema_bytes: int = 64 << 10
    max_schema_depth: int = 64
    max_schema_properties: int = 1000
    max_enum_entries: int = 1000
    max_grammar_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if not self.structured_outputs_timeout > 0:
            raise UserError(
                f"--structured-outputs-timeout must be > 0, got {self.structured_outputs_timeout}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise UserError(f"{flag(f.name)} must be an integer >= 1, got {value!r}")

    def check(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Raise ParamError naming `param` if the constraint passes a limit."""
        kind = params.kind
        if kind == "json" and isinstance(params.json, dict):
            _SchemaWalk(self, param).walk(params.json)
        elif kind == "choice":
            self._check_count(len(params.choice), "max_enum_entries", param, "choice entries")
            size = sum(len(c.encode()) + 3 for c in params.choice)
            self._check_count(size, "max_grammar_bytes", param, "bytes of choices")
        elif kind in ("regex", "grammar"):
            size = len(getattr(params, kind).encode())
            self._check_count(size, "max_grammar_bytes", param, f"bytes of {kind}")

    def _check_count(self, count: int, name: str, param: str, what: str) -> None:
        limit = getattr(self, name)
        if count > limit:
            raise ParamError(
                f"the structured output has {'over ' * (name == 'max_schema_bytes')}{count} "
                f"{what}, more than this server allows ({flag(name)} {limit})",
                param=param,
            )


class _SchemaWalk:
    """One pass over a JSON schema's objects and arrays, counting what the limits bound and
    raising at the first limit passed (so the walk's cost is bounded by the limits, not by the
    schema). The byte count is the length of its compact JSON text, summed piece by piece."""

    def __init__(self, limits: StructuredOutputLimits, param: str) -> None:
        self.limits = limits
        self.param = param
        self.counts = {"max_schema_bytes": 0, "max_schema_properties": 0, "max_enum_entries": 0}

    def walk(self, schema: dict) -> None:
        stack: list[tuple[object, int]] = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, dict):
                self._count_container(depth, len(node))
                for key, value in node.items():
                    self._add("max_schema_bytes", len(str(key).encode()) + 4, "bytes")
                    if key == "properties" and isinstance(value, dict):
                        self._add("max_schema_properties", len(value), "properties")
                    elif key == "enum" and isinstance(value, list):
                        self._add("max_enum_entries", len(value), "enum values")
                    stack.append((value, depth + 1))
            elif isinstance(node, list):
                self._count_container(depth, len(node))
                stack.extend((value, depth + 1) for value in node)
            elif isinstance(node, str):
                self._add("max_schema_bytes", len(node.encode()) + 2, "bytes")
            else:
                self._add("max_schema_bytes", len(json.dumps(node)), "bytes")

    def _count_container(self, depth: int, size: int) -> None:
        if depth > self.limits.max_schema_depth:
            raise ParamError(
                "the structured output's JSON schema is nested deeper than this server allows "
                f"({flag('max_schema_depth')} {self.limits.max_schema_depth})",
                param=self.param,
            )
        self._add("max_schema_bytes", 2 + max(size - 1, 0), "bytes")

    def _add(self, name: str, count: int, what: str) -> None:
        self.counts[name] += count
        self.limits._check_count(self.counts[name], name, self.param, f"JSON schema {what}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """One flag per StructuredOutputLimits field, in an argument group of its own."""
    group = parser.add_argument_group(
        "structured output limits (a grammar over one gets a 400 before it compiles)"
    )
    for f in fields(StructuredOutputLimits):
        is_float = f.type == "float"
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=float if is_float else int,
            default=f.default,
            metavar="S" if is_float else "N",
            help=f"{_HELP[f.name]} (default %(default)s)",
        )


def structured_output_limits_from_args(args: argparse.Namespace) -> StructuredOutputLimits:
    names = [f.name for f in fields(StructuredOutputLimits)]
    return StructuredOutputLimits(**{name: getattr(args, name) for name in names})
