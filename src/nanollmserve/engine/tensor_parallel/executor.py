"""Rank 0's side of tensor parallelism: it starts the other ranks, checks the model can be
split, sends each step, watches the ranks and stops them.

`--tensor-parallel-size N` makes rank 0 (the process that runs the scheduler) spawn N - 1
worker processes on this machine (`worker.run_worker`) and rendezvous with them over TCP
on 127.0.0.1. Started by `torchrun` instead (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment), rank 0 spawns nothing: the other ranks are torchrun's processes, on
this machine or others, and the rendezvous is torchrun's (`env://`).

A rank that exits while the engine runs is fatal: a monitor thread logs which rank died and
how, stops the others (so no rank waits forever in a collective) and tells the listeners
(the engine loop), and every later step raises `EngineFatalError`. A step that fails on
rank 0 is fatal too: the ranks are out of step after it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from nanollmserve.config import EngineConfig
from nanollmserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from nanollmserve.engine.errors import EngineFatalError
from nanollmserve.engine.tensor_parallel import step_channel
from nanollmserve.engine.tensor_parallel.worker import (
    COLLECTIVE_TIMEOUT_S,
    backend_for,
    rank_device,
    run_worker,
    torchrun_device,
)
from nanollmserve.errors import UserError
from nanollmserve.model.device import resolve_device
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.source import resolve_model

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_tensor_parallel(
    config: EngineConfig, model_config: ModelConfig, cuda_device_count: int
) -> None:
    """UserError unless `config.tensor_parallel_size` can split this model on this machine."""
    size = config.tensor_parallel_size
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if heads % size:
        raise UserError(
            f"tensor_parallel_size {size} must divide the model's {heads} attention heads"
        )
    if kv_heads % size and size % kv_heads:
        raise UserError(
            f"tensor_parallel_size {size} and the model's {kv_heads} KV heads: one must "
            f"divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    if model_config.intermediate_size % size:
        raise UserError(
            f"tensor_parallel_size {size} must divide the model's MLP width "
            f"{model_config.intermediate_size}"
        )
    device = config.device
    if device.startswith("cuda") and not is_torchrun():
        first = int(device.partition(":")[2] or 0)
        if first + size > cuda_device_count:
            raise UserError(
                f"tensor_parallel_size {size} needs {size} GPUs from {device}, but this "
                f"machine has {cuda_device_count} CUDA GPU(s)"
            )
    for feature, is_on in (
        ("--quantization", config.quantization not in (None, "none")),
        ("LoRA adapters", getattr(config, "enable_lora", False)),
        ("speculative decoding", getattr(config, "speculative_config", None) is not None),
    ):
        if is_on:
            raise UserError(f"tensor parallelism with {feature} is not supported yet")


def is_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    return int(os.environ["RANK"]) if is_torchrun() else None


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        """Check the model splits, start the other ranks and join the group; returns once
        every rank has joined (they load their shards while rank 0 loads its own)."""
        self.world_size = size = config.tensor_parallel_size
        device = str(resolve_device(config.device))
        if is_torchrun():
            device = torchrun_device(device)
        config = dataclasses.replace(config, device=device)
        model_config = ModelConfig.from_pretrained(resolve_model(config.model).path)
        cuda_count = torch.cuda.device_count() if device.startswith("cuda") else 0
        check_tensor_parallel(config, model_config, cuda_count)
        self.config = config
        self.failure: EngineFatalError | None = None
        self._listeners: list[Callable[[EngineFatalError], None]] = []
        self._stopping = False
        self._stopped = False
        self.processes: dict[int, multiprocessing.Process] = {}
        if is_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size:
                raise UserError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes, but "
                    f"tensor_parallel_size is {size}"
                )
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            context = multiprocessing.get_context("spawn")
            for rank in range(1, size):
                rank_config = dataclasses.replace(config, device=rank_device(device, rank))
                process = context.Process(
                    target=run_worker,
                    args=(rank_config, rank, size, init_method),
                    name=f"nanollmserve-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes[rank] = process
            self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
            self._monitor.start()
        # An LLM that is never shut down: stop the ranks before multiprocessing's own exit
        # handler kills them (atexit runs last-registered first), so no rank looks dead.
        atexit.register(self.shutdown)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        try:
            init_tensor_parallel(
                0,
                size,
                backend=backend_for(rank_device(device, 0)),
                init_method=init_method,
                timeout_s=COLLECTIVE_TIMEOUT_S,
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s)", size, init_method)

    @property
    def device(self) -> str:
        """Rank 0's device."""
        return rank_device(self.config.device, 0)

    def start_workers(self, num_kv_blocks: int) -> None:
        """Give the ranks the KV pool size (rank 0 sized it) and wait until each has its KV
        cache."""
        step_channel.broadcast_int(num_kv_blocks)
        step_channel.broadcast_int(0)

    def send_step(self, input_ids, positions, context, logits_indices) -> None:
        """The model runner's `step_sender`: broadcast this step to the other ranks."""
        self.check_alive()
        step_channel.send_step(
            step_channel.ModelStep(input_ids, positions, context, logits_indices)
        )

    def check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure

    def add_failure_listener(self, listener: Callable[[EngineFatalError], None]) -> None:
        """`listener(error)` is called (on the monitor thread) when a rank dies."""
        self._listeners.append(listener)

    def fail(self, message: str) -> EngineFatalError:
        """Record a fatal failure, log it, stop the other ranks, tell the listeners."""
        if self.failure is None:
            self.failure = EngineFatalError(message)
            logger.error("%s; stopping tensor parallelism", message)
            for process in self.processes.values():
                if process.is_alive():
                    process.kill()
            for listener in self._listeners:
                try:
                    listener(self.failure)
                except Exception:
                    logger.exception("tensor-parallel failure listener failed")
        return self.failure

    def shutdown(self) -> None:
        """Tell the ranks to stop, wait for them (kill what does not stop), leave the group."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        atexit.unregister(self.shutdown)
        alive = all(p.is_alive() for p in self.processes.values())
        if self.failure is None and alive and _in_group():
            try:
                step_channel.send_step(None)
            except Exception:
                logger.exception("could not tell the tensor-parallel ranks to stop")
        for process in self.processes.values():
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                logger.warning("tensor-parallel %s did not stop: killing it", process.name)
                process.kill()
                process.join()
        destroy_tensor_parallel()

    def _watch(self) -> None:
        """Monitor thread: wake when a rank process exits; unless stopping, that is fatal."""
        by_sentinel = {p.sentinel: (rank, p) for rank, p in self.processes.items()}
        while not self._stopping:
            ready = wait(list(by_sentinel), timeout=0.5)
            if self._stopping or not ready:
                continue
            rank, process = by_sentinel[ready[0]]
            process.join()
            self.fail(
                f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode}"
            )
            return


def _in_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
