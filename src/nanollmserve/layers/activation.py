"""SiLU-and-multiply: the gated activation of Llama/Qwen MLPs on the fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
