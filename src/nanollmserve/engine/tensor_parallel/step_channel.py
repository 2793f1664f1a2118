"""The step broadcast of a tensor-parallel group: rank 0 sends each step's model inputs, the
other ranks receive them, over the gloo `cpu_group`.

A step is what the model runner built for its forward pass: the flat input ids and
positions, the attention context (slot mapping, block tables, masks, prefill spans) and the
rows whose logits are wanted (None: the step samples nothing). The scheduler's decisions are
already in it, so the other ranks need no scheduler, no requests and no sampler. `None`
tells them to stop. Tensors travel on the CPU and each rank moves them to its device.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanollmserve.distributed.parallel_state import get_cpu_group
from nanollmserve.layers.attention_context import AttentionContext


class ModelStep(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: AttentionContext
    logits_indices: torch.Tensor | None

    def to(self, device: torch.device) -> ModelStep:
        return ModelStep(
            self.input_ids.to(device),
            self.positions.to(device),
            _context_to(self.context, device),
            None if self.logits_indices is None else self.logits_indices.to(device),
        )


def send_step(step: ModelStep | None) -> None:
    """Rank 0: broadcast a step (None: stop) to every other rank."""
    message = None if step is None else step.to(torch.device("cpu"))
    dist.broadcast_object_list([message], src=0, group=get_cpu_group())


def receive_step() -> ModelStep | None:
    """Ranks > 0: the next step rank 0 sent (None: stop)."""
    box: list[ModelStep | None] = [None]
    dist.broadcast_object_list(box, src=0, group=get_cpu_group())
    return box[0]


def broadcast_int(value: int | None) -> int:
    """Rank 0 gives `value`, every rank gets it (the KV pool size all ranks must share)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=get_cpu_group())
    return box[0]


def _context_to(context: AttentionContext, device: torch.device) -> AttentionContext:
    def move(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    prefills = [
        dataclasses.replace(span, block_ids=move(span.block_ids), attn_mask=move(span.attn_mask))
        for span in context.prefills
    ]
    return dataclasses.replace(
        context,
        slot_mapping=move(context.slot_mapping),
        decode_block_tables=move(context.decode_block_tables),
        decode_mask=move(context.decode_mask),
        decode_context_lens=move(context.decode_context_lens),
        prefills=prefills,
    )
