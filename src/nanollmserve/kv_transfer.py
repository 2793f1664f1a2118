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
        recomputed); the numbers only feed the remote-prefill counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanollmserve.errors import ParamError

PARAM = "kv_transfer_params"
MAX_REMOTE_TOKENS = 1 << 24
"""More prompt tokens than any context a server here holds: past it a value is hostile."""
MAX_TOKEN_ID = 2**31 - 1
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
            if set(value) != expected:
                raise _error(
                    f"do_remote_prefill needs exactly the keys {sorted(expected)}, "
                    f"got {sorted(value)}"
                )
            tokens = _integer(value, "remote_tokens", MAX_REMOTE_TOKENS)
            blocks = _integer(value, "remote_blocks", tokens)
            first = _integer(value, "first_token_id", MAX_TOKEN_ID)
            if (tokens % blocks if blocks else tokens) != 0:
                raise _error(
                    f"remote_tokens must be remote_blocks times the block size, got "
                    f"{tokens} tokens in {blocks} blocks"
                )
            return cls(
                do_remote_prefill=True,
                remote_tokens=tokens,
                remote_blocks=blocks,
                first_token_id=first,
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
