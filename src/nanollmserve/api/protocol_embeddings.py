"""Protocol models of `/v1/embeddings` (OpenAI's embeddings), in OpenAI's order.

`input` takes OpenAI's forms (a string, a list of strings, a list of token ids, a list of
token-id lists) and llama.cpp's (its server's `tokenize_input_prompts`): a list holding
token ids and strings is one prompt, each string's tokens in its place; a
`{"prompt_string": ...}` object (a string, or token ids and strings) or a
`{"content": [text parts]}` object is one prompt; a list of any of these is several. Each
prompt gets one embedding, in input order. The JSON shape picks the form, as llama.cpp reads
it (a list with a token id in it is one prompt, any other list several), so a refusal says
what is wrong with that form. Types are strict (`true` is not a token id, `"5"` not a
dimension count): a wrong type is a 400 naming the field. An empty string is refused: it has
no tokens on a model whose tokenizer adds no BOS, as the bundled one. A mixed prompt's
pieces are bounded by the context length (`InputProcessor.tokenize`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, StrictStr, Tag, field_validator

from nanollmserve.api.protocol import (
    MAX_INT32,
    ChatCompletionContentPartText,
    OpenAIBaseModel,
    RequestModel,
    priority_field,
)

MAX_EMBEDDING_INPUTS = 256
"""Most inputs one request may carry (each is one engine request), as completions' prompts."""

EmbeddingText = Annotated[StrictStr, Field(min_length=1)]
EmbeddingTokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
PromptPieces = Annotated[list[EmbeddingTokenId | StrictStr], Field(min_length=1)]
"""Token ids (OpenAI's form), or llama.cpp's mixed prompt: token ids and strings."""


class PromptString(OpenAIBaseModel):
    """llama.cpp's `{"prompt_string": ...}`: one prompt, a string or token ids and strings."""

    model_config = ConfigDict(extra="forbid")

    prompt_string: EmbeddingText | PromptPieces
    multimodal_data: Any = None
    """llama.cpp's images or audio for a multimodal model: refused (text-only models)."""

    @field_validator("multimodal_data")
    @classmethod
    def _text_only(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("this model takes text only: leave multimodal_data out")
        return None


class ContentPrompt(OpenAIBaseModel):
    """llama.cpp's `{"content": [parts]}`: one prompt, its text parts joined with nothing
    between them (so the same embedding as that string); any other part type is refused."""

    model_config = ConfigDict(extra="forbid")

    content: Annotated[list[ChatCompletionContentPartText], Field(min_length=1)]


def _form(value: Any) -> str | None:
    """Which form an `input` value is, by its JSON type (None: none). A list with a token id
    (an int, not a bool) in it is one prompt, any other list several; an object with
    `content` is a ContentPrompt (llama.cpp looks for it first), any other a PromptString."""
    if isinstance(value, str):
        return "input-text"
    if isinstance(value, dict):
        return "content-object" if "content" in value else "prompt_string-object"
    if isinstance(value, list):
        has_id = any(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return "input-pieces" if has_id else "input-list"
    return None


_FORMS = (
    "a non-empty string, a list of token ids (llama.cpp's: strings may be among them), or "
    "an object with prompt_string or content (llama.cpp's)"
)
# The tags hold a '-', so the location of a validation error (its `param`) leaves them out.
_ONE_PROMPT_FORMS = (
    Annotated[EmbeddingText, Tag("input-text")],
    Annotated[PromptPieces, Tag("input-pieces")],
    Annotated[PromptString, Tag("prompt_string-object")],
    Annotated[ContentPrompt, Tag("content-object")],
)
OnePrompt = Annotated[
    Union[_ONE_PROMPT_FORMS],  # noqa: UP007 (a union built from the tuple)
    Discriminator(
        _form,
        custom_error_type="invalid_input",
        custom_error_message=f"each input must be {_FORMS}",
    ),
]
EmbeddingInput = Annotated[
    Union[  # noqa: UP007 (a union built from the tuple)
        (
            *_ONE_PROMPT_FORMS,
            Annotated[
                list[OnePrompt],
                Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
                Tag("input-list"),
            ],
        )
    ],
    Discriminator(
        _form,
        custom_error_type="invalid_input",
        custom_error_message=f"input must be {_FORMS}, or a list of them",
    ),
]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput
    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    dimensions: Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)] | None = None
    """Truncating embeddings (Matryoshka) is not supported: any value is a 400."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: the float32 little-endian bytes of each vector, base64-encoded."""
    user: str | None = None
    priority: int | None = priority_field()
    """vLLM's: every input of the request is scheduled at this priority."""

    def inputs(self) -> list[str | list[int | str]]:
        """One prompt per embedding, in order: text, or token ids (with strings among them:
        llama.cpp's mixed prompt, which `InputProcessor.tokenize` reads)."""
        prompts = self.input if _form(self.input) == "input-list" else [self.input]
        return [_prompt(p) for p in prompts]


def _prompt(value: str | list[int | str] | PromptString | ContentPrompt) -> str | list[int | str]:
    if isinstance(value, PromptString):
        return value.prompt_string
    if isinstance(value, ContentPrompt):
        return "".join(part.text for part in value.content)
    return value


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    """The vector, or with `encoding_format: "base64"` its float32 bytes in base64."""
    index: int


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
