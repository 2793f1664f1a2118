"""The model's declaration of itself for the native decode step (`engine/native_decode.py`).

The decoder is defined once, in PyTorch (`model/llama.py`). A model that the native step can
run describes itself as a `NativeDecoder`: its sizes, its options, and the tensors each layer
reads (the GGUF projections, the norms, the biases, the layer's paged K/V cache) and its
`DecoderOptions`. The native step is built from this declaration only, never from the model's
internals; a model that cannot describe itself this way (weights that are not GGUF blocks, a
sharded model) raises `NotNativeError` with the reason, and every step then runs the PyTorch
forward. Which options the native step implements is its own statement
(`native.supported.SUPPORTED`): a declared option outside it is refused at load, by name.

The options the native step runs, each with its parity test (tests/test_decoder_options.py,
tests/test_native_decode.py, tests/test_gemma3.py): q/k/v and o biases (Llama
`attention_bias`, Qwen2), MLP biases (`mlp_bias`), q/k RMSNorm per head (Qwen3), a tied or
untied output projection (in GGUF blocks, or left to `compute_logits`), any rotary scaling
(baked into the cos/sin table), a norm offset (Gemma's 1 + w, folded into the declared norm
scales), a query scale other than head_dim's (`attn_scale` is the attention's own), and Gemma
3's: GeGLU (`activation`), the embedding scale, the sandwich norms (`NativeLayer.attn_out_norm`
/ `mlp_out_norm`), the sliding layers' window and RoPE table (`NativeLayer.window` / `rope`)
and the final logit soft-cap (in the step after a native lm_head, else in `compute_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.model.decoder_options import DecoderOptions


class NotNativeError(Exception):
    """The model cannot run as the native decode step; the message says why."""


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer: RMSNorm, fused q/k/v (+ bias), per-head q/k norm, RoPE (the layer's
    own table or the decoder's), attention over the paged cache (all of it, or the last
    `window` keys), o (+ bias) (RMSNorm'd with sandwich norms), residual, RMSNorm, gate/up (+
    bias), SiLU- or tanh-GELU-and-mul (`options.activation`), down (+ bias) (RMSNorm'd with
    sandwich norms), residual. The biases are the projections' own (`GGUFLinear.bias`)."""

    qkv: GGUFLinear
    o: GGUFLinear
    gate_up: GGUFLinear
    down: GGUFLinear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    """[head_dim] (Qwen3), or None."""
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    """[blocks, block_size, kv_heads, head_dim], bound by the model runner: float32, or int8
    codes (`--kv-cache-dtype int8`, `layers/kv_quant.py`)."""
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    """An int8 cache's float32 scales [blocks, block_size, kv_heads]; else None."""
    v_scale: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    """Sandwich norms (Gemma): the scale of the norm of the attention output before its
    residual add, [hidden]; None without them. `post_norm` is then the norm before the MLP."""
    mlp_out_norm: torch.Tensor | None = None
    """Sandwich norms: the scale of the norm of the MLP output before its residual add."""
    rope: torch.Tensor | None = None
    """This layer's own cos/sin table (a sliding layer's base, `local_rope_theta`), or None:
    the decoder's."""
    window: int = 0
    """0: full attention; else the sliding window (`DecoderOptions.sliding_window`)."""


@dataclass(frozen=True)
class NativeDecoder:
    """A Llama-family decoder in float32 on the CPU, its projections in GGUF blocks."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attn_scale: float
    embed: torch.Tensor
    """The input embedding table: [vocab, hidden] float32 (`embed_kind` 0), or the tiled blocks
    it is stored in (`embed_kind` their kind: KIND_Q4, KIND_Q8 or a K-quant kind,
    `layers/gguf_embedding.py`), rows dequantized as they are looked up."""
    final_norm: torch.Tensor
    rope: torch.Tensor
    """[positions, head_dim]: cos of the half-dim frequencies, then sin."""
    lm_head: GGUFLinear | None
    """The output projection in GGUF blocks, or None: the step ends at the final norm and the
    model's `compute_logits` projects."""
    layers: tuple[NativeLayer, ...]
    options: DecoderOptions
    """The model's options: the native step refuses those it does not implement."""
    embed_kind: int = 0
