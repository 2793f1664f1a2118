"""Qwen2 / Qwen2.5 and Qwen3: the Llama decoder (`llama.py`) with other decoder options."""

from __future__ import annotations

from nanollmserve.model.llama import DecoderOptions, LlamaForCausalLM
from nanollmserve.model.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q, k and v projections, none on o_proj."""

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: an RMSNorm over each query and key head before RoPE; biases only if configured."""

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        bias = config.attention_bias
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
