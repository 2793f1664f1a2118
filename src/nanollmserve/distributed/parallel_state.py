"""This process's place in the tensor-parallel group, and the collectives the model calls.

A process that never joins a group is rank 0 of a group of one: every collective below is
then the identity, so the model code is the same with and without tensor parallelism. The
parallel layers (`layers/parallel_linear.py`) read the rank and size when they are built.

Two process groups, as in vLLM: the default group carries the model's collectives (NCCL on
CUDA, gloo on CPU); `cpu_group` (always gloo) carries the host-side step broadcast, so a
pickled step never goes through a GPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    world_size: int = 1
    cpu_group: dist.ProcessGroup | None = None


_state = TensorParallelState()


def init_tensor_parallel(
    rank: int, world_size: int, *, backend: str, init_method: str, timeout_s: float
) -> None:
    """Join the group (blocks until every rank has joined or `timeout_s` passed)."""
    global _state
    if _state.world_size != 1:
        raise RuntimeError("this process is already in a tensor-parallel group")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    _state = TensorParallelState(rank, world_size, cpu_group)


def destroy_tensor_parallel() -> None:
    """Leave the group; the process is a group of one again."""
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallelState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.world_size


def get_cpu_group() -> dist.ProcessGroup | None:
    return _state.cpu_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if _state.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Each rank's `x` [..., n] -> [..., world_size * n], rank order."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
