"""Weight-only int8 quantization (`--quantization int8`): smaller weights, faster decode.

Each linear layer's weight is stored as int8 with one scale per output channel
(`w ~= q * scale`, symmetric, scale = max|w| / 127) and multiplied with PyTorch's CPU int8
weight-only matmul, which reads half of the bfloat16 bytes. A decode step at batch 1 reads
every weight once, so it is memory-bound and gets faster; large batches are compute-bound
and run faster in bfloat16. The lm_head is quantized too (for tied embeddings, a quantized
copy: the embedding lookup keeps the original table).

4-bit weights (PyTorch's int4 kernels, groups of 32) were tried and left out: on the bundled
135 M model they changed greedy answers ("the capital of France" stopped being Paris).
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8",)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every nn.Linear of the model (and its output projection) in place."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r} (supported: int8)")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
    if getattr(model, "lm_head", "absent") is None:  # tied: quantize a copy of the embedding
        model.lm_head = Int8Linear(model.model.embed_tokens.weight, None)
    return model
