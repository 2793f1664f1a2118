"""RMSNorm, with the residual add fused in as vLLM and nano-vllm do.

`norm(x)` normalizes; `norm(x, residual)` first adds the residual stream and returns both the
normalized sum and the sum (the next residual), so a decoder layer reads
`h, residual = norm(h, residual)`. The sum is taken in the model dtype and the normalization
in float32, cast back before the weight multiply: the same rounding as HF Llama/Qwen.
`F.rms_norm` without a weight does the float32 part in one call (bit for bit HF's
`x * rsqrt(mean(x^2) + eps)`), where writing it out costs seven op dispatches per norm.

With an `offset` (Gemma: 1.0) the scale is `offset + weight`, and the normalized value is
multiplied in float32 and cast back after, as HF's `Gemma3RMSNorm` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)
