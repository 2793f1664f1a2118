"""Loading the tokenizer and turning chat messages into prompt token ids."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from nanollmserve.errors import ParamError, UserError

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer: a NativeTokenizer (the `tokenizers` library alone, no
    transformers import) where it gives the same results, else transformers' AutoTokenizer."""
    from nanollmserve.frontend.native_tokenizer import load_native_tokenizer

    start = time.perf_counter()
    tokenizer = load_native_tokenizer(model_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    logger.info(
        "loaded the tokenizer (%s) in %.1f s", type(tokenizer).__name__, time.perf_counter() - start
    )
    return tokenizer


BUNDLED_TOOL_CHAT_TEMPLATE = Path(__file__).with_name("smollm2_tool_chat_template.jinja")
"""The bundled model's default chat template: its GGUF's own template renders no tools; this one
renders every chat without tools the same and writes tools in SmolLM2's trained format."""
BUNDLED_TOOL_CALL_PARSER = "hermes"
"""The parser that reads the calls the bundled model writes under that template."""


def load_chat_template(path: str | None, *, bundled_model: bool = False) -> str | None:
    """Read a `--chat-template FILE` override (a Jinja template). Without one: the bundled
    model's tool template when serving the bundled model, else None (the model's own)."""
    if path is None:
        return BUNDLED_TOOL_CHAT_TEMPLATE.read_text() if bundled_model else None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read chat template {path}: {exc.strerror}") from exc


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Turn OpenAI-style content (a string or a list of text parts) into plain strings;
    `developer` is the newer name of `system`. An assistant message's earlier thinking
    (`reasoning_content`, or vLLM's `reasoning`) is kept as `reasoning_content`."""
    normalized = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ParamError("messages: each message needs a role", "messages")
        role = message["role"]
        if role == "developer":
            role = "system"
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                    raise ParamError("messages: only text content parts are supported", "messages")
                parts.append(part.get("text", ""))
            content = "".join(parts)
        if not isinstance(content, str):
            raise ParamError(
                "messages: content must be a string or a list of text parts", "messages"
            )
        entry = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id"):  # assistant calls and tool results
            if message.get(key) is not None:
                entry[key] = message[key]
        reasoning = _reasoning(message) if role == "assistant" else None
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        normalized.append(entry)
    return normalized


def _reasoning(message: dict) -> str | None:
    """An assistant message's thinking sent back: `reasoning_content` (llama.cpp's and
    vLLM's name) or `reasoning` (vLLM's newer one); the two given must agree."""
    names = ("reasoning_content", "reasoning")
    given = {name: message[name] for name in names if message.get(name) is not None}
    for value in given.values():
        if not isinstance(value, str):
            raise ParamError("messages: reasoning_content must be a string", "messages")
    if len(set(given.values())) > 1:
        raise ParamError(
            "messages: an assistant message's reasoning and reasoning_content differ "
            "(reasoning is vLLM's name of reasoning_content): send one of them",
            "messages",
        )
    return next(iter(given.values()), None)


def chat_prompt_token_ids(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Render the conversation with the chat template (plus the assistant prefix) and
    tokenize it; the template already writes the special tokens it needs. `tools` (OpenAI
    function tools) go to the template as `tools=`; a template that never reads `tools`
    would drop them silently, so that is a ParamError instead.

    `continue_final_message`: the last message (an assistant's) is left open, so the model
    continues it (the rendered text is cut right after its content, as transformers does).
    `template_kwargs`: more variables for the template (`enable_thinking`, ...)."""
    if not messages:
        raise ParamError("messages must hold at least one message", "messages")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ParamError("this model has no chat template; pass --chat-template FILE", "messages")
    if tools and "tools" not in template:
        raise ParamError(
            "this model's chat template does not render tools; serve it with "
            "--chat-template FILE of one that does (examples/tool_chat_template_smollm2.jinja "
            "for ChatML models such as the bundled SmolLM2)",
            "tools",
        )
    normalized = normalize_messages(messages)
    if continue_final_message and normalized[-1]["role"] != "assistant":
        raise ParamError(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    text = tokenizer.apply_chat_template(
        normalized,
        tools=tools or None,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )
    if continue_final_message:
        text = _open_final_message(text, normalized[-1]["content"])
    return tokenizer.encode(text, add_special_tokens=False)


def _open_final_message(text: str, final_content: str) -> str:
    """`text` cut right after the final message's content (what closes it is dropped)."""
    final = final_content.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ParamError(
            "continue_final_message: the chat template did not render the final message's "
            "content as is",
            "continue_final_message",
        )
    return text[: at + len(final)]
