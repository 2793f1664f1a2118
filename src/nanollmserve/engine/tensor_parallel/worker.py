"""A tensor-parallel rank other than 0: it holds its shard of the model and of the KV cache
and runs the forward pass of every step rank 0 broadcasts, until rank 0 says stop.

It has no scheduler, no requests and no sampler: rank 0 decides everything and sends the
model inputs it built (`step_channel.py`). Rank 0 spawns these processes on its machine
(`executor.py`), or `torchrun` starts them on several machines (env rendezvous).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from nanollmserve.config import EngineConfig
from nanollmserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from nanollmserve.engine.model_loading import load_engine_model
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.tensor_parallel.step_channel import broadcast_int, receive_step
from nanollmserve.layers.attention_context import set_context
from nanollmserve.layers.kv_quant import resolve_kv_cache_dtype

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits in one collective (a rank that hangs, not one that dies)."""


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: `cuda:(N + rank)` for `--device cuda[:N]`, else the CPU."""
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + rank}"
    return device


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def torchrun_device(device: str) -> str:
    """A torchrun rank's device: `cuda:LOCAL_RANK` on a GPU machine, else the CPU."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def run_torchrun_worker(config: EngineConfig) -> None:
    """`torchrun ... nanollmserve serve --tensor-parallel-size N` on a rank > 0: be that rank
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun) instead of a server."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torchrun_device(config.device)
    run_worker(dataclasses.replace(config, device=device), rank, world_size, "env://")


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
    """The main function of rank `rank` (> 0) on `config.device` (this rank's own); returns
    when rank 0 sends stop."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    device = config.device
    if device == "cpu":
        # The ranks of one machine share its cores: oversubscribed OpenMP pools thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    init_tensor_parallel(
        rank,
        world_size,
        backend=backend_for(device),
        init_method=init_method,
        timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    try:
        loaded = load_engine_model(config)
        num_kv_blocks = broadcast_int(None)
        if num_kv_blocks is None:  # rank 0 failed to start and sent stop instead
            return
        runner = ModelRunner(
            loaded.model,
            num_blocks=num_kv_blocks,
            block_size=config.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            # each rank quantizes its own KV heads
            kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.quantization),
        )
        broadcast_int(None)  # ready: rank 0 serves once every rank has its KV cache
        logger.info(
            "rank %d of %d (pid %d) ready on %s", rank, world_size, os.getpid(), loaded.device
        )
        while (step := receive_step()) is not None:
            step = step.to(loaded.device)
            set_context(step.context)
            runner.run_model(step.input_ids, step.positions, step.logits_indices)
    finally:
        destroy_tensor_parallel()
