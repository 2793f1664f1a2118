"""`DecoderOptions`: every option that changes the math of the Llama-family decoder.

The decoder is defined once (`model/llama.py`) and built from its `ModelConfig` plus these
options; an architecture is the decoder with other options (`qwen.py`). Each field's default
is the plain Llama decoder. The native decode step (`engine/native_decode.py`) reads the
options from the model's declaration and refuses, at load, every non-default value of a field
it does not implement (`native/supported.py`: one generic comparison over these fields), so a
field added here runs in PyTorch until the native step is taught it and its name is added to
`native.supported.SUPPORTED`; tests/test_decoder_options.py sets each field in turn and checks
the native step against the PyTorch forward, or its refusal by name.

Gemma 3 (`gemma.py`) is this decoder with the options from `activation` down: GeGLU, the
(1 + w) norm, the scaled embedding, the sandwich norms, the interleave of sliding-window and
global layers with their two RoPE bases, the query scale and the final logit soft-cap.

Not options of this decoder (refused at config time by `model_config.py`): other activations
and norm styles, partial rotary embeddings, attention logit soft-capping (Gemma 2). A sliding
window declared by Mistral or Qwen2 is not an option either: the decoder runs full attention
for them and the engine caps the context at the window (`ModelConfig.max_context_len`), where
the two agree; an architecture whose options carry `sliding_window` (Gemma 3) has it honoured
by the attention layer (`layers/attention.py`) and its context is not capped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the Llama-like architectures (defaults: Llama)."""

    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`)."""
    o_bias: bool = False
    """A bias on the output projection of the attention (Llama's `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on the gate/up and down projections (Llama's `mlp_bias`)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    """The output projection is the input embedding table (no `lm_head` of its own)."""
    rope_scaling: dict[str, Any] | None = None
    """None for plain RoPE, else the scaling parameters with their `rope_type` (`linear`,
    `llama3`): baked into the cos/sin table."""
    activation: str = "silu"
    """The gated MLP's activation: `silu` (SwiGLU) or `gelu_tanh` (GeGLU with the tanh
    approximation of GELU, Gemma's `gelu_pytorch_tanh`)."""
    norm_offset: float = 0.0
    """Every RMSNorm scales by `norm_offset + weight`, in float32 before the cast back (Gemma's
    `(1 + w)` with 1.0, whose checkpoints store `w` around 0)."""
    embed_scale: float = 1.0
    """The input embeddings are multiplied by this (in the model dtype): Gemma's sqrt(hidden)."""
    sandwich_norms: bool = False
    """Gemma 2/3's four norms per layer: `post_attention_layernorm` on the attention output
    before its residual add, `pre_feedforward_layernorm` before the MLP,
    `post_feedforward_layernorm` on the MLP output before its residual add."""
    sliding_window: int | None = None
    """None: every layer attends to the whole context. Else the window of the sliding layers:
    a query at position p sees the keys at positions p - window + 1 .. p."""
    layer_types: tuple[str, ...] | None = None
    """Each layer's `sliding_attention` or `full_attention` (Gemma 3: five sliding, one
    global); None with a `sliding_window`: every layer slides."""
    local_rope_theta: float | None = None
    """The RoPE base of the sliding layers (Gemma 3: 10000, without the global layers'
    scaling); None: the one table of the global base for every layer."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by `query_pre_attn_scalar ** -0.5`; None: `head_dim ** -0.5`."""
    final_logit_softcap: float | None = None
    """None, or the logits become `cap * tanh(logits / cap)` (Gemma 2; Gemma 3 has none)."""

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"
