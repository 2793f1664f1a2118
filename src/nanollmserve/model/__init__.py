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

import importlib

_EXPORTS = {
    "resolve_device": "device",
    "resolve_dtype": "device",
    "build_model": "loader",
    "count_parameters": "loader",
    "load_model": "loader",
    "ModelConfig": "model_config",
    "SUPPORTED_ARCHITECTURES": "registry",
    "get_model_class": "registry",
    "ModelSource": "source",
    "resolve_model": "source",
}
"""Name -> the submodule defining it, imported when the name is first used: the torch-free
submodules (the GGUF cache, `source`) then load without torch, so `serve`
starts the native build before torch imports (`cli/serve.py`)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
