"""`DecoderOptions`: every option that changes the math of the Llama-family decoder.

The decoder is defined once (`model/llama.py`) and built from its `ModelConfig` plus these
options; an architecture is the decoder with other options (`qwen.py`). Each field's default
is the plain Llama decoder. The native decode step (`engine/native_decode.py`) reads the
options from the model's declaration and refuses, at load, every non-default value of a field
it does not implement (`native/supported.py`: one generic comparison over these fields), so a
field added here runs in PyTorch until the native step is taught it and its name is added to
`native.supported.SUPPORTED`; tests/test_decoder_options.py sets each field in turn and checks
the native step against the PyTorch forward, or its refusal by name.

Not options of this decoder (their only value is the default, refused at config time by
`model_config.py`): the activation (SiLU-and-mul), the norm style (RMSNorm), partial rotary
embeddings. A sliding window is not one either: both paths run full attention and the engine
caps the context at the window (`ModelConfig.max_context_len`), where the two agree.
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
