"""RequestLimits: bounds on what one request may ask for, so no client can make the server
do unbounded work per token (thousands of stop strings to match, a huge logit_bias to apply).

Each field is a `nanollmserve serve` flag (`max_stop_strings` is `--max-stop-strings`) and a
request over a limit gets a 400 (gRPC: INVALID_ARGUMENT) naming the parameter. The sampling
limits are checked below every frontend, by the engine's `RequestPolicy`
(`frontend/request_policy.py`, applied by `frontend/admission.py`), so HTTP, gRPC and the
offline `LLM` (its `request_limits`) refuse the same requests; the frontends
check the fields only they have (messages, tools, user, metadata, a client's request id)
with `check_fields` before any work. No torch or FastAPI here: the CLI builds its flags from
this module before loading anything.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from nanollmserve.errors import ParamError, UserError
from nanollmserve.sampling_params import MAX_LOGPROBS, SamplingParams

_HELP = {
    "max_n": "most choices one request may ask for (`n`; OpenAI's limit is 128)",
    "max_logprobs": f"most top alternatives per token (`logprobs` / `top_logprobs` / "
    "`prompt_logprobs`), as vLLM's "
    f"flag; at most {MAX_LOGPROBS}, what -1 (vLLM: no cap) means here",
    "max_stop_strings": "most `stop` strings per request (OpenAI allows 4)",
    "max_stop_string_length": "longest `stop` string, in characters",
    "max_stop_token_ids": "most `stop_token_ids` per request",
    "max_logit_bias": "most `logit_bias` entries per request",
    "max_messages": "most messages per request (chat `messages`, responses `input`)",
    "max_tools": "most function `tools` per request (chat, responses; OpenAI allows 128)",
    "max_user_length": "longest `user` string, in characters",
    "max_metadata_pairs": "most `metadata` key-value pairs (OpenAI allows 16)",
    "max_metadata_key_length": "longest `metadata` key, in characters (OpenAI: 64)",
    "max_metadata_value_length": "longest `metadata` value, in characters (OpenAI: 512)",
    "max_request_id_length": "longest client request id (HTTP `X-Request-Id`, gRPC "
    "`request_id`), in characters",
    "max_prompt_logprobs_entries": "most prompt-logprob entries one response may carry: "
    "prompt tokens x (`prompt_logprobs` + 1) x the copies the response holds (completions: "
    "one per choice, chat and gRPC: one), over all its prompts; about 70 bytes of JSON each",
    "max_request_prompt_tokens": "most prompt tokens one request may carry over all its "
    "prompts or embedding inputs (default: 8 x the context length, --max-model-len)",
}

REQUEST_PROMPT_CONTEXTS = 8
"""`max_request_prompt_tokens` left unset: this many full contexts (`max_model_len`)."""


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128
    max_logprobs: int = MAX_LOGPROBS
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    max_messages: int = 1024
    max_tools: int = 128
    max_user_length: int = 256
    max_metadata_pairs: int = 16
    max_metadata_key_length: int = 64
    max_metadata_value_length: int = 512
    max_request_id_length: int = 256
    max_prompt_logprobs_entries: int = 1 << 18
    max_request_prompt_tokens: int | None = None
    """None: REQUEST_PROMPT_CONTEXTS x the engine's context length (`prompt_tokens_limit`)."""

    def __post_init__(self) -> None:
        if self.max_logprobs == -1:  # vLLM's "no cap": the most the engine returns
            object.__setattr__(self, "max_logprobs", MAX_LOGPROBS)
        for f in fields(self):
            value, lowest = getattr(self, f.name), 1 if f.name in _AT_LEAST_ONE else 0
            if value is None and f.name == "max_request_prompt_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise UserError(f"{_flag(f.name)} must be an integer >= {lowest}, got {value!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise UserError(f"--max-logprobs must be <= {MAX_LOGPROBS}, got {self.max_logprobs}")

    def check_params(self, params: SamplingParams) -> None:
        """Raise ParamError (param: the SamplingParams field) if `params` passes a limit."""
        _check(len(params.stop), self.max_stop_strings, "max_stop_strings", "stop", "strings")
        longest = max(params.stop, key=len, default=None)
        _check_length(longest, self.max_stop_string_length, "max_stop_string_length", "stop")
        limit = self.max_stop_token_ids
        _check(len(params.stop_token_ids), limit, "max_stop_token_ids", "stop_token_ids", "ids")
        limit = self.max_logit_bias
        _check(len(params.logit_bias or {}), limit, "max_logit_bias", "logit_bias", "entries")
        if params.n > self.max_n:
            raise ParamError(
                f"n is {params.n}, more than this server allows (--max-n {self.max_n})", param="n"
            )
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.max_logprobs:
                raise ParamError(
                    f"{name} asks for {wanted} alternatives per token, more than this "
                    f"server allows (--max-logprobs {self.max_logprobs})",
                    param=name,
                )

    def prompt_tokens_limit(self, max_model_len: int) -> int:
        """`max_request_prompt_tokens`, or when unset REQUEST_PROMPT_CONTEXTS full contexts."""
        if self.max_request_prompt_tokens is not None:
            return self.max_request_prompt_tokens
        return REQUEST_PROMPT_CONTEXTS * max_model_len

    def check_prompts(
        self,
        prompt_lengths: list[int],
        params: SamplingParams,
        max_model_len: int,
        prompt_logprobs_copies: int | None = None,
    ) -> None:
        """Raise ParamError if a request's prompts (their token counts, all of them or the
        ones tokenized so far) pass a per-request total: `max_request_prompt_tokens`
        (param `prompt`) or, with prompt logprobs, `max_prompt_logprobs_entries` (param
        `prompt_logprobs`). `prompt_logprobs_copies`: how many times the response holds a
        prompt's logprobs (default `params.n`, one per choice)."""
        total = sum(prompt_lengths)
        limit = self.prompt_tokens_limit(max_model_len)
        if total > limit:
            raise ParamError(
                f"the request's prompts have {total} tokens in all, more than this server "
                f"allows in one request (--max-request-prompt-tokens {limit}); send fewer or "
                f"shorter prompts, or several requests",
                param="prompt",
            )
        if params.prompt_logprobs is None:
            return
        copies = params.n if prompt_logprobs_copies is None else prompt_logprobs_copies
        per_token = params.prompt_logprobs + 1
        entries = total * per_token * copies
        if entries > self.max_prompt_logprobs_entries:
            raise ParamError(
                f"prompt_logprobs would return {entries} entries ({total} prompt tokens x "
                f"{per_token} per token x {copies} "
                f"{'copy' if copies == 1 else 'copies'} in the response), more than this "
                f"server allows (--max-prompt-logprobs-entries "
                f"{self.max_prompt_logprobs_entries}); ask for fewer alternatives, choices or "
                f"prompt tokens",
                param="prompt_logprobs",
            )

    def check_messages(self, count: int, param: str = "messages") -> None:
        _check(count, self.max_messages, "max_messages", param, "messages")

    def check_fields(
        self,
        *,
        tools: list | None = None,
        user: str | None = None,
        metadata: dict[str, str] | None = None,
        client_request_id: str | None = None,
        request_id_param: str = "request_id",
    ) -> None:
        """Raise ParamError (naming the field) if a request field outside its sampling
        parameters passes a limit; None means the request has no such field."""
        _check(len(tools or ()), self.max_tools, "max_tools", "tools", "tools")
        _check_length(user, self.max_user_length, "max_user_length", "user")
        metadata = metadata or {}
        limit = self.max_metadata_pairs
        _check(len(metadata), limit, "max_metadata_pairs", "metadata", "key-value pairs")
        for key, value in metadata.items():
            _check_length(key, self.max_metadata_key_length, "max_metadata_key_length", "metadata")
            limit = self.max_metadata_value_length
            _check_length(value, limit, "max_metadata_value_length", "metadata")
        limit = self.max_request_id_length
        _check_length(client_request_id, limit, "max_request_id_length", request_id_param)


_AT_LEAST_ONE = ("max_n", "max_messages", "max_request_prompt_tokens")


def _check(count: int, limit: int, flag: str, param: str, what: str) -> None:
    if count > limit:
        raise ParamError(
            f"{param} has {count} {what}, more than this server allows ({_flag(flag)} {limit})",
            param=param,
        )


def _check_length(text: str | None, limit: int, flag: str, param: str) -> None:
    if text is not None and len(text) > limit:
        raise ParamError(
            f"{param} has a string of {len(text)} characters, longer than this server allows "
            f"({_flag(flag)} {limit})",
            param=param,
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One `--max-...` flag per RequestLimits field, in an argument group of its own."""
    group = parser.add_argument_group("request limits (a request over one gets a 400)")
    for f in fields(RequestLimits):
        group.add_argument(
            _flag(f.name),
            dest=f.name,
            type=int,
            default=f.default,
            metavar="N",
            help=_HELP[f.name] + ("" if f.default is None else " (default %(default)s)"),
        )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
