"""KVTransferParams: the `kv_transfer_params` request field of prefill/decode disaggregation
(vLLM's name), checked here once for every frontend that takes it.

Two shapes, nothing else (any other is a ParamError naming `kv_transfer_params`):

    {"do_remote_decode": true}
        phase 1, sent to a prefill worker: run the prompt as usual, then answer only once
        every full block of the prompt is durable in the shared `--kv-offload-dir` store;
        the response carries `KVTransferResult` (what the decode worker will find there).
    {"do_remote_prefill": true, "remote_tokens": N, "remote_blocks": B, "first_token_id": T}
        phase 2, sent to a decode worker with phase 1's result: the request runs as usual
        (its prefix lookup reads the blocks from the store, a missing or corrupt one is
        recomputed); the numbers only feed the remote-prefill counters. With
        `"ray_blocks": {...}` too (phase 1's, under `serve --kv-transfer ray`), the blocks are
        first fetched from Ray's object store (`engine/kv_ray_transfer.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanollmserve.errors import ParamError

PARAM = "kv_transfer_params"
MAX_REMOTE_TOKENS = 1 << 24
"""More prompt tokens than any context a server here holds: past it a value is hostile."""
MAX_TOKEN_ID = 2**31 - 1
MAX_RAY_BLOCKS = 1 << 16
"""More blocks than one prompt of any context served here: a longer list is refused."""
_PHASE_2_NUMBERS = ("remote_tokens", "remote_blocks", "first_token_id")


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    """Phase 1: hand the prompt's KV blocks on (answer once they are durable)."""
    do_remote_prefill: bool = False
    """Phase 2: a prefill worker computed the prompt's blocks into the shared store."""
    remote_tokens: int = 0
    """Phase 2: prompt tokens whose KV the prefill worker stored (remote_blocks * block size)."""
    remote_blocks: int = 0
    first_token_id: int | None = None
    """Phase 2: the token the prefill worker sampled (this worker samples its own)."""
    ray_blocks: dict | None = None
    """Phase 2 over Ray: the prefill worker's signed list of the blocks' objects."""

    @classmethod
    def from_value(cls, value) -> KVTransferParams | None:
        """The field's value (a dict from JSON, or a KVTransferParams) checked; None: absent."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _error(f"must be an object, got {type(value).__name__}")
        if value.get("do_remote_decode") is True:
            if set(value) != {"do_remote_decode"}:
                extra = sorted(set(value) - {"do_remote_decode"})
                raise _error(f'{{"do_remote_decode": true}} takes no other key, got {extra}')
            return cls(do_remote_decode=True)
        if value.get("do_remote_prefill") is True:
            expected = {"do_remote_prefill", *_PHASE_2_NUMBERS}
            if set(value) - {"ray_blocks"} != expected:
                raise _error(
                    f"do_remote_prefill needs exactly the keys {sorted(expected)} "
                    f"(and optionally ray_blocks), got {sorted(value)}"
                )
            tokens = _integer(value, "remote_tokens", MAX_REMOTE_TOKENS)
            blocks = _integer(value, "remote_blocks", tokens)
            first = _integer(value, "first_token_id", MAX_TOKEN_ID)
            if (tokens % blocks if blocks else tokens) != 0:
                raise _error(
                    f"remote_tokens must be remote_blocks times the block size, got "
                    f"{tokens} tokens in {blocks} blocks"
                )
            ray_blocks = value.get("ray_blocks")
            if ray_blocks is not None:
                try:
                    ray_blocks = check_handle(ray_blocks)
                except ValueError as exc:
                    raise _error(str(exc)) from None
                if len(ray_blocks["blocks"]) > blocks:
                    raise _error("ray_blocks names more blocks than remote_blocks")
            return cls(
                do_remote_prefill=True,
                remote_tokens=tokens,
                remote_blocks=blocks,
                first_token_id=first,
                ray_blocks=ray_blocks,
            )
        raise _error(
            'must be {"do_remote_decode": true} or {"do_remote_prefill": true, '
            '"remote_tokens": N, "remote_blocks": B, "first_token_id": T}'
        )


@dataclass(frozen=True)
class KVTransferResult:
    """Phase 1's answer (the response's `kv_transfer_params`): the prompt's first
    `remote_blocks` blocks are durable in the store, `remote_tokens` tokens in all."""

    remote_tokens: int
    remote_blocks: int
    first_token_id: int
    ray_blocks: dict | None = None
    """Under `--kv-transfer ray`: the signed list of the blocks' objects in Ray's store."""


def check_handle(value) -> dict:
    """The `ray_blocks` of a phase-2 `kv_transfer_params`, checked for shape (ValueError):
    {"blocks": [[name, object id hex, owner base64], ...], "mac": hex}. Its MAC is checked
    by the worker that fetches (`receive`), which holds the key."""
    if not isinstance(value, dict) or set(value) != {"blocks", "mac"}:
        raise ValueError('ray_blocks must be {"blocks": [...], "mac": "..."}')
    blocks, mac = value["blocks"], value["mac"]
    if not isinstance(mac, str) or len(mac) != 64:
        raise ValueError("ray_blocks.mac must be 64 hex digits")
    if not isinstance(blocks, list) or len(blocks) > MAX_RAY_BLOCKS:
        raise ValueError(f"ray_blocks.blocks must be a list of at most {MAX_RAY_BLOCKS}")
    for entry in blocks:
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not all(isinstance(part, str) and 0 < len(part) <= 512 for part in entry)
        ):
            raise ValueError("each of ray_blocks.blocks is [name, object id, owner] (strings)")
    return value


def _integer(value: dict, key: str, high: int) -> int:
    number = value[key]
    if isinstance(number, bool) or not isinstance(number, int):
        shown = repr(number) if isinstance(number, float) else type(number).__name__
        raise _error(f"{key} must be an integer, got {shown}")
    if not 0 <= number <= high:
        raise _error(f"{key} must be in [0, {high}], got {number}")
    return number


def _error(message: str) -> ParamError:
    return ParamError(f"{PARAM}: {message}", param=PARAM)
