"""How many bytes the KV cache may take on a GPU: `--gpu-memory-utilization` arithmetic.

The engine may use `utilization * total` bytes of the device; the weights (and whatever
else this process has allocated when the KV cache is sized) come off that, and the KV cache
gets the rest, never more than is free on the device (another process may hold some). A pure
function, so it is tested without a GPU.
"""

from __future__ import annotations

from nanollmserve.errors import UserError

GiB = 1 << 30


def gpu_kv_cache_bytes(*, total: int, free: int, used_by_engine: int, utilization: float) -> int:
    """Bytes for the KV cache. `total`/`free`: the device's memory (torch.cuda.mem_get_info);
    `used_by_engine`: what this process holds already (the weights). UserError if the
    weights alone reach the budget."""
    budget = int(total * utilization)
    if used_by_engine >= budget:
        raise UserError(
            f"the model takes {used_by_engine / GiB:.2f} GiB, more than "
            f"--gpu-memory-utilization {utilization} of the device's {total / GiB:.2f} GiB "
            f"allows ({budget / GiB:.2f} GiB): raise it or use a smaller model/dtype"
        )
    return min(budget - used_by_engine, free)
