"""Protocol models of `/v1/embeddings` (OpenAI's embeddings), in OpenAI's order.

The input may be a string, a list of strings, a list of token ids or a list of token-id
lists; each input gets one embedding, in input order. Types are strict (`true` is not a
token id, `"5"` not a dimension count): a wrong type is a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field, StrictStr

from nanollmserve.api.protocol import MAX_INT32, OpenAIBaseModel, RequestModel, priority_field

MAX_EMBEDDING_INPUTS = 256
"""Most inputs one request may carry (each is one engine request), as completions' prompts."""

EmbeddingText = Annotated[StrictStr, Field(min_length=1)]
EmbeddingTokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
EmbeddingTokenIds = Annotated[list[EmbeddingTokenId], Field(min_length=1)]
EmbeddingInput = (
    EmbeddingText
    | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    | EmbeddingTokenIds
    | Annotated[list[EmbeddingTokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
)


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

    def inputs(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per embedding, in order."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


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
