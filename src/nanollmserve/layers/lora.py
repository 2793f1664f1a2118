"""Multi-LoRA linear layers: a base linear layer plus the low-rank deltas of several adapters,
applied to one flat batch whose tokens belong to different adapters (or to none).

`LoRALinear` wraps a model's linear module without changing it: `y = base(x)`, then for each
adapter present in the step, `y[tokens of that adapter] += (x[tokens] @ A^T) @ B^T`. The
adapters live in preallocated slots (`max_loras` of them, rank padded to `max_lora_rank`):
`lora_a [slots, S * R, in]` and `lora_b [slots, out, S * R]`, with the alpha / rank scaling
folded into B when an adapter is copied into a slot. Zero-padded rank rows add nothing.

A fused projection (`qkv_proj`, `gate_up_proj`) has S slices: the adapter's q, k and v (or
gate and up) matrices map onto slices of the fused output. Their A matrices are stacked along
the rank (one "shrink" matmul for all slices) and B is block-diagonal (one "expand" matmul),
so a fused layer costs two matmuls per adapter, like an unfused one; a slice the adapter does
not target stays zero.

The tokens of a step are grouped by adapter once (`LoRABatch`, set by the engine before each
forward and shared by every LoRA layer): the idea of punica's SGMV, segments of tokens that
share an adapter, each multiplied as one matrix. A step costs two matmuls per adapter in the
batch per layer, whatever the number of tokens; base-model tokens cost nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """Which tokens of the step's flat batch use which slot: one (slot, token indices) pair
    per adapter in the step; tokens in no group use the base model only."""

    groups: list[tuple[int, torch.Tensor | slice]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """`base(x)` plus the deltas of the adapters in the step's batch: [T, in] -> [T, out]."""

    def __init__(
        self,
        base: nn.Module,
        slice_sizes: list[int],
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        if sum(slice_sizes) != self.out_features:
            raise ValueError(f"slices {slice_sizes} do not add up to {self.out_features}")
        self.slice_sizes = list(slice_sizes)
        self.max_rank = max_rank
        self.batch = batch
        # A GGUFLinear keeps no dense weight: its activations are float32 on the CPU.
        weight = getattr(base, "weight", None)
        if weight is None:
            weight = torch.empty(0, dtype=base.dtype)
        num_slices = len(slice_sizes)
        self.register_buffer(
            "lora_a",
            torch.zeros(
                max_loras,
                num_slices * max_rank,
                self.in_features,
                dtype=weight.dtype,
                device=weight.device,
            ),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(
                max_loras,
                self.out_features,
                num_slices * max_rank,
                dtype=weight.dtype,
                device=weight.device,
            ),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, tokens in self.batch.groups:
            delta = (x[tokens] @ self.lora_a[slot].T) @ self.lora_b[slot].T
            if isinstance(tokens, slice):
                out[tokens] += delta
            else:
                out.index_add_(0, tokens, delta)
        return out

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Copy one adapter into `slot`: per slice, (A [r, in], B [out_slice, r] already
        scaled) or None for a slice it does not target."""
        self.clear_slot(slot)
        offset = 0
        for i, (size, pair) in enumerate(zip(self.slice_sizes, weights, strict=True)):
            if pair is not None:
                a, b = pair
                rank = a.shape[0]
                rows = slice(i * self.max_rank, i * self.max_rank + rank)
                self.lora_a[slot, rows].copy_(a)
                self.lora_b[slot, offset : offset + size, rows].copy_(b)
            offset += size

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
