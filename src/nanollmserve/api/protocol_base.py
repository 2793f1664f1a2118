"""The two base classes of every protocol model: responses and nested objects ignore
unknown fields, request bodies forbid them (a 400 naming the field; see `protocol.py`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: an undeclared top-level field is a 400 (see `protocol.py`)."""

    model_config = ConfigDict(extra="forbid")
