"""GrammarCompiler: StructuredOutputsParams -> a grammar compiled over the model's vocabulary
by XGrammar, cached per grammar.

Compiling is the only place a schema, regex or grammar is checked, so every failure becomes
a `ParamError` (a 400 naming `structured_outputs`, or the API's name for it) carrying the
engine's message. JSON-schema keywords XGrammar would silently ignore are refused by name
(`UNSUPPORTED_SCHEMA_KEYWORDS`): an output that looks constrained but is not is worse than a
400. Before anything compiles, the server's `StructuredOutputLimits` (schema bytes, depth,
properties, enum entries, grammar bytes) are checked: a 400 too. It runs on the frontend's
grammar workers (`frontend/grammar_pool.py`; the caller's thread, offline), never on the
engine thread, and XGrammar releases the GIL while it compiles (measured: the event loop of a
server compiling a 35 KB schema for 6 s kept its 10 ms ticks), so a long compile costs a core,
not the server's responsiveness. A compiled grammar is immutable and shared by every request
that asks for it (an LRU cache keyed by the grammar's text).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from nanollmserve.errors import ParamError
from nanollmserve.structured_output_limits import StructuredOutputLimits
from nanollmserve.structured_outputs import StructuredOutputsParams

UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedItems",
        "unevaluatedProperties",
        "minProperties",
        "maxProperties",
        "not",
        "if",
        "then",
        "else",
    }
)
"""Keywords the compiled grammar would not enforce (checked against XGrammar's output)."""

# Keywords whose value is a map of names to subschemas / a list of subschemas / a subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")

MAX_JSON_WHITESPACE = 12
"""Whitespace characters allowed between JSON elements: room for pretty-printing (a newline
and indentation), not for the whitespace runs a sampled model can fall into at temperature
1.0, which would fill max_tokens and cut the JSON."""

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


def unsupported_keyword(schema: Any, path: str = "") -> str | None:
    """The first keyword of UNSUPPORTED_SCHEMA_KEYWORDS in the schema, with its JSON path."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            return f"{path}/{key}" if path else key
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            if (found := unsupported_keyword(sub, f"{path}/{key}/{name}")) is not None:
                return found
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            if (found := unsupported_keyword(sub, f"{path}/{key}/{i}")) is not None:
                return found
    for key in _SCHEMA_VALUES:
        if (found := unsupported_keyword(schema.get(key), f"{path}/{key}")) is not None:
            return found
    return None


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        limits: StructuredOutputLimits | None = None,
    ) -> None:
        """`limits`: the size limits every grammar is checked against (None: none, the
        offline default, where the caller owns the process)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits
        self._compiler = None  # built on first use: a server without grammars pays nothing
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Raise ParamError naming `param` if `params` passes a size limit (cheap)."""
        if self.limits is not None:
            self.limits.check(params, param)

    def cached(self, key: tuple) -> Any | None:
        """The compiled grammar of `key` (a `StructuredOutputsParams.key`) if it is cached."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return None

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs"):
        """The xgrammar CompiledGrammar of `params` (from the cache when compiled before)."""
        self.check(params, param)
        key = params.key
        compiled = self.cached(key)
        if compiled is not None:
            return compiled
        compiled = self._compile(params, param)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams, param: str):
        import json

        compiler = self._xgrammar_compiler()
        any_whitespace = not params.disable_any_whitespace
        kind = params.kind
        if kind == "json":
            found = unsupported_keyword(params.json)
            if found is not None:
                raise ParamError(
                    f"JSON schema keyword {found!r} is not supported by structured output "
                    f"(unsupported: {sorted(UNSUPPORTED_SCHEMA_KEYWORDS)})",
                    param=param,
                )
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    json.dumps(params.json),
                    any_whitespace=any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE,
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE,
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                literals = (json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar("root ::= " + " | ".join(literals))
            if "::=" in params.grammar:
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_lark(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ParamError(f"invalid {_KIND_NAMES[kind]}: {_engine_message(e)}", param) from None

    @property
    def is_ready(self) -> bool:
        """The tokenizer's grammar tables are built (the first compile builds them)."""
        return self._compiler is not None

    def warm_up(self) -> None:
        """Build the tokenizer's grammar tables now, if not yet (seconds, once)."""
        self._xgrammar_compiler()

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                # A NativeTokenizer hands over transformers' tokenizer of the same files.
                hf_tokenizer = getattr(self.tokenizer, "hf_tokenizer", self.tokenizer)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _engine_message(error: Exception) -> str:
    """XGrammar's message without its "[time] file.cc:line: " prefix."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", text.splitlines()[0])
