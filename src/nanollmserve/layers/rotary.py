"""Rotary position embedding (RoPE), rotate-half ("neox") layout as in HF Llama and Qwen.

The cos/sin table is computed once for every position up to `max_position` (in float32, like
HF) and indexed by `positions` once per step (`cos_sin`); every layer then rotates with the
same rows (`apply_rotary`), queries and keys together in one call when they are adjacent.
The step's rows come as full-width `cos = [c, c]` and a signed `sin = [-s, s]`, so a layer
computes HF's `q * cos + rotate_half(q) * sin` bit for bit as `q * cos + swap_halves(q) * sin`:
four ops instead of the eight of rotating each half on its own.

Frequency scaling: "default", "linear" (positions divided by `factor`) and "llama3" (Llama 3.1+:
long wavelengths divided by `factor`, short ones kept, a smooth blend between).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # Computed on the CPU even when the model is built on "meta" (the loader does that to
        # skip weight init), so the table is real; `model.to(device)` moves it.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, base, scaling)
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, head_dim]: cos of the half-dim frequencies, then sin. Cast with the
        # model (`.to(dtype)`), which is what HF does with its float32 cos/sin.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, head_dim]: the rows of this step."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by each token's (cos, signed sin) from `cos_sin`."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin
