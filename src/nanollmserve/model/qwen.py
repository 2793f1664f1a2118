"""Qwen2 / Qwen2.5 and Qwen3: the Llama decoder (`llama.py`) with other decoder options."""

from __future__ import annotations

from dataclasses import replace

from nanollmserve.model.decoder_options import DecoderOptions
from nanollmserve.model.llama import LlamaForCausalLM
from nanollmserve.model.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q, k and v projections, none on o_proj."""

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(super().decoder_options(config), qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: an RMSNorm over each query and key head before RoPE; biases only if configured."""

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(super().decoder_options(config), qk_norm=True)
