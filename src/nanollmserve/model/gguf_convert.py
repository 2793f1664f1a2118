"""What a GGUF file becomes in the cache: the model's files, its other tensors, its dense weights.

Three conversions, each written once by `gguf_cache.py`:

- `write_model_files`: config.json, generation_config.json and the tokenizer files (with the
  chat template), everything but the weights. The config is mapped from the header with
  transformers' own GGUF key table (no config class instantiated) and the tokenizer built by
  transformers' GGUF tokenizer converter, in the class `AutoTokenizer` would pick; about
  0.6 s for the bundled model, most of it importing transformers' tokenizer modules.
  (`AutoConfig`/`AutoTokenizer` with `gguf_file=` would each parse the file with the gguf
  package's reader first, 1.7 to 5 s apiece.)
- `unblocked_tensors`: the tensors the GGUF block layers do not hold (embedding table unless
  it is looked up in its own blocks or the output projection's, norms, attention biases, an output
  projection stored in another type), dequantized to float32
  (`GGUFFile.dequantize`), under our parameter names. With the blocks they are the whole model
  (`loader.load_gguf_block_model`).
- `write_dense_weights`: every tensor dequantized by transformers (`gguf_file=`) into
  model.safetensors, ~20 s for the bundled model; only what runs dense weights needs it
  (`--quantization none`, an explicit `--dtype`, tensor parallelism, LoRA, files whose linear
  weights are K-quants, a machine without the native kernels).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from nanollmserve.errors import UserError
from nanollmserve.model.gguf_blocks import embedding_in_blocks, output_block_kind
from nanollmserve.model.gguf_file import GGUFFile, read_gguf_file
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.registry import MODEL_TYPE_TO_ARCHITECTURE

logger = logging.getLogger(__name__)

_TOKENIZER_STRINGS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_LAYER_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
"""`blk.N.<key>` -> our name under `model.layers.N` (stored as they are used)."""
_GEMMA_LAYER_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
"""The same for Gemma 3's four norms per layer. llama.cpp stores every Gemma norm as 1 + w
(the scale it multiplies by); the model holds w (`DecoderOptions.norm_offset`), so 1 is taken
off as they are read, as transformers' GGUF loader does."""
_NORM_SHIFTED_ARCHITECTURES = ("gemma3",)
_MODEL_TYPES = {"gemma3": "gemma3_text"}
"""GGUF architecture -> the HF `model_type` of its text model (a `gemma3` config is the
multimodal one)."""
_QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
_ROTARY_PERMUTED_ARCHITECTURES = ("llama", "mistral")
"""llama.cpp interleaves the rotary halves of these files' q/k rows (`gguf_blocks.py`)."""


def write_model_files(gguf_path: Path, out_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer files of `gguf_path`.

    config.json holds what the file's header says, not the config class's defaults: whoever
    reads it (`ModelConfig`, `AutoConfig`) applies those. Instantiating a transformers config
    class here would import its modeling utilities (0.5 s of the first start)."""
    from transformers import GenerationConfig

    gguf = read_gguf_file(gguf_path)
    config = hf_config_dict(gguf)
    model_type = config["model_type"]
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise UserError(f"unsupported GGUF architecture {gguf.architecture!r} in {gguf_path.name}")
    config |= {"architectures": [MODEL_TYPE_TO_ARCHITECTURE[model_type]], "dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(dict(config)).save_pretrained(out_dir)
    _tokenizer(gguf_path, model_type).save_pretrained(out_dir)


def hf_config_dict(gguf: GGUFFile) -> dict:
    """The transformers config of a llama/mistral/qwen2/qwen3 GGUF: what transformers'
    `load_gguf_checkpoint` maps its metadata to, from the same key table (with `model_type`)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    architecture = gguf.architecture
    # llama.cpp writes Mistral files as llama; transformers tells them apart by name.
    named_mistral = gguf.metadata.get("general.name") == "mistral"
    model_type = "mistral" if "llama" in architecture and named_mistral else architecture
    config = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    text_model_type = _MODEL_TYPES.get(model_type, model_type)
    for key, value in gguf.metadata.items():
        prefix, _, config_key = key.replace(architecture, model_type).partition(".")
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, model_type)
        elif isinstance(value, list) and len(value) == 1:
            value = value[0]
        renamed = renames.get(prefix, {}).get(config_key)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = gguf.metadata["tokenizer.ggml.tokens"]  # its length
    if model_type == "gemma3":
        config |= _gemma3_settings(gguf, config)
    config["model_type"] = text_model_type
    return config


def _gemma3_settings(gguf: GGUFFile, config: dict) -> dict:
    """What llama.cpp takes as given for a gemma3 file and transformers' key table does not
    map: the attention scale (llama.cpp: 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the
    62-layer 27B) and the global layers' linear RoPE scaling (4B and up)."""
    settings: dict = {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("num_hidden_layers") == 62:
        settings["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        settings["query_pre_attn_scalar"] = head_dim
    scaling = gguf.metadata.get("gemma3.rope.scaling.type")
    factor = gguf.metadata.get("gemma3.rope.scaling.factor")
    theta = float(config.get("rope_theta", 1000000.0))
    full: dict = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear" and factor:
        full = {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    elif scaling not in (None, "none"):
        raise UserError(f"unsupported RoPE scaling {scaling!r} in a gemma3 GGUF file")
    settings["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    return settings


def _tokenizer(gguf_path: Path, model_type: str):
    """The GGUF's tokenizer in the class `AutoTokenizer.from_pretrained(gguf_file=)` gives a
    file with no tokenizer files beside it (the model type's class, else TokenizersBackend)."""
    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import (
            TOKENIZER_MAPPING_NAMES,
            tokenizer_class_from_name,
        )
    except ImportError:  # transformers 4: its AutoTokenizer, parsing the file again
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type)
    tokenizer_class = (class_name and tokenizer_class_from_name(class_name)) or TokenizersBackend
    if tokenizer_class.__name__ == "MistralCommonBackend":  # needs files a GGUF does not have
        tokenizer_class = TokenizersBackend
    return tokenizer_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def unblocked_tensors(gguf_path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter name -> float32 tensor, for every tensor of the file that is not a linear
    weight of a decoder layer (those run as blocks): embedding table (unless it is looked up in
    its blocks: `gguf_blocks.embedding_in_blocks`), norms, attention biases and the output
    projection of an
    untied model when no kernel runs its blocks. Tensors this mapping does not know are left
    out: the loader then finds a parameter missing and loads the dense weights instead."""
    gguf = read_gguf_file(gguf_path)
    permuted = gguf.architecture in _ROTARY_PERMUTED_ARCHITECTURES
    norm_shift = 1.0 if gguf.architecture in _NORM_SHIFTED_ARCHITECTURES else 0.0
    layer_norms = _GEMMA_LAYER_NORMS if gguf.architecture == "gemma3" else _LAYER_NORMS
    out: dict[str, torch.Tensor] = {}

    def add(name: str, gguf_name: str) -> None:
        out[name] = torch.from_numpy(gguf.dequantize(gguf_name))
        if norm_shift and gguf_name.endswith("norm.weight"):
            out[name] -= norm_shift

    if not embedding_in_blocks(gguf, config):
        add("model.embed_tokens.weight", "token_embd.weight")
    add("model.norm.weight", "output_norm.weight")
    untied = "output.weight" in gguf.tensors and not config.tie_word_embeddings
    if untied and output_block_kind(gguf, config) is None:  # else it runs its blocks
        add("lm_head.weight", "output.weight")
    for layer in range(config.num_layers):
        prefix, ours = f"blk.{layer}.", f"model.layers.{layer}."
        for key, name in layer_norms.items():
            if prefix + key in gguf.tensors:
                add(ours + name, prefix + key)
        if prefix + "attn_output.bias" in gguf.tensors:
            add(ours + "self_attn.o_proj.bias", prefix + "attn_output.bias")
        qkv = [prefix + key for key in _QKV_BIASES]
        if all(name in gguf.tensors for name in qkv) and not permuted:
            biases = [torch.from_numpy(gguf.dequantize(name)) for name in qkv]
            out[ours + "self_attn.qkv_proj.bias"] = torch.cat(biases)
    return out


def write_dense_weights(gguf_path: Path, out_dir: Path) -> None:
    """model.safetensors: every tensor of `gguf_path` dequantized to float32 by transformers
    (with its config.json beside it, which the caller may drop)."""
    from transformers import AutoModelForCausalLM

    folder, name = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF "quantizer" so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
