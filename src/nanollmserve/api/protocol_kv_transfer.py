"""The API side of `kv_transfer_params` (prefill/decode disaggregation, `kv_transfer.py`):
phase 1's response field, what a request carrying the field may not combine with, and
phase 1's answer, built once the prompt's blocks are durable in the shared store."""

from __future__ import annotations

from nanollmserve.api.errors import bad_request
from nanollmserve.api.protocol_base import OpenAIBaseModel
from nanollmserve.kv_transfer import PARAM
from nanollmserve.sampling_params import SamplingParams


class KVTransferResultJSON(OpenAIBaseModel):
    """Phase 1's answer: the prompt's first `remote_blocks` full blocks are in the store
    (`remote_tokens` = remote_blocks * block size), and the token this worker sampled.
    The router sends it back, with `"do_remote_prefill": true`, to a decode worker."""

    remote_tokens: int
    remote_blocks: int
    first_token_id: int
    ray_blocks: dict | None = None
    """Under `serve --kv-transfer ray`: the signed list of the blocks' objects in Ray's
    object store (null with the shared store)."""


def check_kv_transfer(params: SamplingParams, *, stream: bool, num_prompts: int = 1) -> None:
    """A 400 for phase 1 in a shape it cannot answer: a stream, or several prompts."""
    transfer = params.kv_transfer_params
    if transfer is None or not transfer.do_remote_decode:
        return
    if stream:
        raise bad_request(
            f"{PARAM}: do_remote_decode answers in one JSON response once the prompt's KV "
            "blocks are stored: stream must be false",
            PARAM,
        )
    if num_prompts != 1:
        raise bad_request(
            f"{PARAM}: do_remote_decode hands on one prompt's blocks, got {num_prompts} prompts",
            PARAM,
        )


async def kv_transfer_result(ctx, params: SamplingParams, output, model: str):
    """Phase 1's response field for a finished request (None when it is not phase 1 or
    sampled nothing); waits for the prompt's blocks to be durable. `ctx`: the ServerContext;
    `model`: the request's checked model name (a LoRA adapter's names its blocks)."""
    transfer = params.kv_transfer_params
    if transfer is None or not transfer.do_remote_decode:
        return None
    lora_name = ctx.lora_name_of(model)
    result = await ctx.engine.hand_off_kv(output, params, lora_name)
    if result is None:
        return None
    return KVTransferResultJSON(
        remote_tokens=result.remote_tokens,
        remote_blocks=result.remote_blocks,
        first_token_id=result.first_token_id,
        ray_blocks=result.ray_blocks,
    )
