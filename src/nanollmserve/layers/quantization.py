"""Weight-only quantization (`--quantization int8|fp16`): other weight formats, faster decode.

A decode step at small batch reads every weight once and does little math with it, so it is
bound by how fast the matmul kernel streams the weights. PyTorch's CPU bfloat16 matmul
streams them at ~12 GB/s here; these two formats use kernels that stream at 25-35 GB/s:

- `int8`: each weight stored as int8 with one scale per output channel (`w ~= q * scale`,
  symmetric, scale = max|w| / 127), multiplied with PyTorch's CPU int8 weight-only matmul,
  which also reads half of the bfloat16 bytes. Activations stay in the model dtype.
- `fp16`: each weight stored as float16 in fbgemm's packed layout and multiplied with
  fbgemm's float16-weight GEMM, which computes in float32. Activations are float32 (the
  engine picks `--dtype float32` for it), so the weights carry 3 more mantissa bits than
  bfloat16 and the math is float32: answers stay those of the float32 model.

Large batches are compute-bound and run faster in bfloat16 with either format off. The
lm_head is replaced too (for tied embeddings, a converted copy: the embedding lookup keeps
the original table).

- `gguf`: the linear weights a GGUF file stores as Q4_0 / Q4_1 / Q8_0 blocks run from those
  blocks through our native kernels (`layers/gguf_linear.py`), in a float32 model; nothing is
  re-quantized. (Re-quantizing
  the dequantized weights to 4 bits with our own scales was tried first and left out: on the
  bundled 135 M model it changed greedy answers.)
"""

from __future__ import annotations

import torch
from torch import nn

from nanollmserve.quantization_names import GGUF_METHOD


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weight is kept in another format: [..., in] -> [..., out]."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> WeightOnlyLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out], bias included."""
        raise NotImplementedError


class Int8Linear(WeightOnlyLinear):
    """int8 weights with one scale per output channel; activations in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x, self.qweight, self.scale)
        return out if self.bias is None else out + self.bias


class Fp16Linear(WeightOnlyLinear):
    """float16 weights packed for fbgemm; float32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape)
        if weight.dtype != torch.float32:
            raise ValueError(f"fp16 weight-only linear needs a float32 model, got {weight.dtype}")
        bias = None if bias is None else bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


LINEAR_CLASSES = {"int8": Int8Linear, "fp16": Fp16Linear}
COMPUTE_DTYPES = {"fp16": torch.float32, GGUF_METHOD: torch.float32}
"""Methods whose kernels take one activation dtype only (the others use the model's)."""


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every nn.Linear of the model (and its output projection) in place."""
    if method not in LINEAR_CLASSES:
        raise ValueError(
            f"unknown quantization {method!r} (supported: {', '.join(LINEAR_CLASSES)}; "
            f"{GGUF_METHOD!r} needs the file's blocks: layers.gguf_linear.apply_gguf_blocks)"
        )
    linear_class = LINEAR_CLASSES[method]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, linear_class.from_linear(child))
    if getattr(model, "lm_head", "absent") is None:  # tied: convert a copy of the embedding
        model.lm_head = linear_class(model.model.embed_tokens.weight, None)
    return model
