"""Gemma 3 (text, `Gemma3ForCausalLM`): the Llama decoder (`llama.py`) with Gemma's options.

GeGLU with tanh-GELU, RMSNorms scaling by (1 + w), the input embeddings multiplied by
sqrt(hidden_size), an RMSNorm over each query and key head, four norms per layer (the
attention and MLP outputs normalized before their residual adds), five sliding-window layers
to one global layer (`layer_types`) with their two RoPE bases (local 10000, global 1e6 with
its scaling), the attention scale `query_pre_attn_scalar ** -0.5`, tied embeddings (as the
config says) and the final logit soft-cap where the config has one. Every one of them is a
`DecoderOptions` field, and the native step implements them all (`native/supported.py`):
a GGUF file's steps run as `nls_decode_step`, the rest in this PyTorch forward, its
projections in GGUF blocks.

The HF checkpoint's names are ours: `pre_feedforward_layernorm` and
`post_feedforward_layernorm` beside Llama's two norms; q/k/v and gate/up packed as for Llama.
"""

from __future__ import annotations

from dataclasses import replace

from nanollmserve.model.decoder_options import DecoderOptions
from nanollmserve.model.llama import LlamaForCausalLM
from nanollmserve.model.model_config import ModelConfig


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(
            super().decoder_options(config),
            qk_norm=True,
            norm_offset=1.0,
            embed_scale=config.hidden_size**0.5,
            sandwich_norms=True,
            sliding_window=config.sliding_window,
            layer_types=config.layer_types,
            local_rope_theta=config.local_rope_theta,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            final_logit_softcap=config.final_logit_softcapping,
        )
