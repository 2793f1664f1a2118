"""The text the prefix policy places by: the start of a request's prompt.

Chat messages (`messages`, or the Responses API's `input` list) become `role: content` lines,
so a conversation and its continuation, or requests with one system prompt, share a start;
a completion's `prompt` (the first one of a list) and `/generate`'s `prompt` are used as they
are. Only the first `prefix_chars` characters count: requests that agree that far go to the
same worker, whose prefix cache then holds their shared blocks.
"""

from __future__ import annotations

DEFAULT_PREFIX_CHARS = 256


def routing_key(body: object, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The first `prefix_chars` characters of the request's prompt; None when it has none
    (the policy then places by load)."""
    if not isinstance(body, dict):
        return None
    text = None
    for field in ("messages", "input", "prompt", "prompts"):
        if field in body:
            text = _prompt_text(body[field])
            break
    return text[:prefix_chars] if text else None


def _prompt_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, dict) for item in value):
            return "".join(_message_line(item) for item in value)
        first = value[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):  # token ids
            return " ".join(str(token) for token in value)
        if isinstance(first, list):  # a list of token-id prompts
            return _prompt_text(first)
    return None


def _message_line(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return f"{message.get('role', '')}: {content or ''}\n"
