"""Gated activations on the fused gate_up output: SiLU-and-multiply (Llama/Qwen, SwiGLU) and
tanh-GELU-and-multiply (Gemma, GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> gelu_tanh(gate) * up [..., d] (`gelu_pytorch_tanh`)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}
"""`DecoderOptions.activation` -> its gated module."""
