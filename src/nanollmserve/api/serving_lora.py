"""Loading and unloading LoRA adapters at run time: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`, vLLM's bodies and plain-text answers.

Both are off unless the server runs with `--allow-runtime-lora-updating` (a 404 then, as
vLLM, which does not mount them). An adapter that cannot be served (LoRA off, name taken,
rank above `--max-lora-rank`, unsupported targets, another base model, a missing directory)
is a 400 naming `lora_path` or `lora_name`; unloading an unknown name is a 404.
"""

from __future__ import annotations

from pydantic import Field

from nanollmserve.api.errors import bad_request, not_found
from nanollmserve.api.protocol import RequestModel
from nanollmserve.api.serving import ServerContext
from nanollmserve.errors import UserError


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    """A PEFT adapter directory on the server's machine."""


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    """Accepted for vLLM compatibility; the name identifies the adapter."""


def _check_allowed(ctx: ServerContext) -> None:
    if not ctx.settings.allow_runtime_lora_updating:
        raise not_found(
            "loading LoRA adapters at run time is off (start the server with "
            "--enable-lora --allow-runtime-lora-updating)"
        )


async def load_lora_adapter(body: LoadLoRAAdapterRequest, ctx: ServerContext) -> str:
    _check_allowed(ctx)
    if body.lora_name in ctx.model_names:
        raise bad_request(f"{body.lora_name!r} is the base model's name", "lora_name")
    if body.lora_name in ctx.engine.lora_adapters():
        raise bad_request(f"LoRA adapter {body.lora_name!r} is already loaded", "lora_name")
    try:
        await ctx.engine.load_lora(body.lora_name, body.lora_path)
    except UserError as exc:
        raise bad_request(str(exc), "lora_path") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


def unload_lora_adapter(body: UnloadLoRAAdapterRequest, ctx: ServerContext) -> str:
    _check_allowed(ctx)
    if not ctx.engine.unload_lora(body.lora_name):
        raise not_found(
            f"The lora adapter '{body.lora_name}' cannot be found.", "lora_not_found", "lora_name"
        )
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
