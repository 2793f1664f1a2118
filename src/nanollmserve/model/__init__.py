"""Model loading and the native model code (Llama, Mistral, Qwen2, Qwen3).

From a `--model` value to a model ready to run:

    source = resolve_model(engine_config.model)         # -> local HF dir (GGUF converted once)
    config = ModelConfig.from_pretrained(source.path)   # what the engine sizes things by
    device = resolve_device(engine_config.device)
    dtype = resolve_dtype(engine_config.dtype, device)
    model = load_model(source.path, config, dtype, device)

`model(input_ids, positions) -> hidden`, `model.compute_logits(hidden) -> float32 logits`, and
`model.attention_layers()` lists the PagedAttention modules whose `k_cache`/`v_cache` the model
runner binds. The tokenizer and chat template load from `source.path` too.
"""

from nanollmserve.model.device import resolve_device, resolve_dtype
from nanollmserve.model.loader import build_model, count_parameters, load_model
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.registry import SUPPORTED_ARCHITECTURES, get_model_class
from nanollmserve.model.source import ModelSource, resolve_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "ModelSource",
    "build_model",
    "count_parameters",
    "get_model_class",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
]
