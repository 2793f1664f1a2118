"""Architecture name (the `architectures` entry of an HF config.json) -> native model class.

Classes are imported on first use, so reading the list costs nothing. Mistral (without a
sliding window shorter than the context) is the Llama decoder, so it maps to the Llama class.
"""

from __future__ import annotations

import importlib

from torch import nn

from nanollmserve.errors import UserError

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
"""For the rare config.json without an `architectures` list (and a GGUF file's converted
config: `gguf_convert.py` writes a `gemma3` file's config as `gemma3_text`)."""

WINDOWED_ARCHITECTURES = frozenset({"Gemma3ForCausalLM"})
"""Architectures whose decoder honours their sliding window (`DecoderOptions.sliding_window`):
the engine does not cap their context at the window (`ModelConfig.max_context_len`)."""


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise UserError(
            f"unsupported model architecture {architecture!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def get_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"nanollmserve.model.{module_name}")
    return getattr(module, class_name)
