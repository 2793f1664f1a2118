"""ModelConfig: what the native model and the engine need from an HF config.json.

A Llama config.json is read with `json` on top of `LlamaConfig`'s defaults (`LLAMA_DEFAULTS`,
the keys a config.json may leave out): importing transformers for `AutoConfig` took 1.7 s of
every start. Every other architecture goes through `transformers.AutoConfig`, so its own
defaults (and the values its config class derives, such as Qwen2's `layer_types`) apply to
keys a config.json leaves out. RoPE settings are read from both shapes transformers has used: the
`rope_parameters` dict of transformers 5 and the `rope_theta` / `rope_scaling` pair before it.
The engine sizes the KV cache with `kv_bytes_per_token` and caps the context at
`max_context_len`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from nanollmserve.errors import UserError
from nanollmserve.model.registry import (
    MODEL_TYPE_TO_ARCHITECTURE,
    WINDOWED_ARCHITECTURES,
    check_architecture,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
HIDDEN_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF `hidden_act` / `hidden_activation` -> `DecoderOptions.activation`."""
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
}
"""transformers' `LlamaConfig` defaults of the keys `from_hf_config` reads (no RoPE settings:
plain RoPE with theta 10000, the `_rope_settings` default)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None for plain RoPE, else the scaling parameters with their `rope_type`."""
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    """Window of sliding-window layers, if any (Mistral v0.1); None: full attention only."""
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    """`DecoderOptions.activation`: `silu` or `gelu_tanh`."""
    layer_types: tuple[str, ...] | None = None
    """Each layer's `sliding_attention` / `full_attention` where the config lists them."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding layers when it differs from the global one (Gemma 3)."""
    query_pre_attn_scalar: float | None = None
    """Gemma's attention scale `query_pre_attn_scalar ** -0.5`; None: head_dim's."""
    final_logit_softcapping: float | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence the native model computes exactly. The Llama decoder of Mistral
        and Qwen2 runs full attention, which equals sliding-window attention as long as the
        sequence fits in the window; an architecture that honours the window
        (`registry.WINDOWED_ARCHITECTURES`, Gemma 3) is not capped."""
        if self.sliding_window and self.architecture not in WINDOWED_ARCHITECTURES:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V one token takes over all layers (on one rank of a tensor-parallel
        group: its share of the KV heads, at least one)."""
        kv_heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (+ `generation_config.json` for more EOS ids) of an HF dir."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise UserError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {config_path}: {exc}") from None
        architectures = raw.get("architectures") or []
        architecture = (
            architectures[0]
            if architectures
            else MODEL_TYPE_TO_ARCHITECTURE.get(raw.get("model_type", ""), "unknown")
        )
        check_architecture(architecture)
        if architecture == "LlamaForCausalLM" and raw.get("model_type", "llama") == "llama":
            hf_config = SimpleNamespace(**{**LLAMA_DEFAULTS, **raw})
        else:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_dir)
        generation_eos = _read_generation_eos(model_dir / "generation_config.json")
        return cls.from_hf_config(hf_config, architecture, generation_eos)

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, architecture: str, extra_eos_token_ids: list[int] = ()
    ) -> ModelConfig:
        """Build from a transformers config object (or anything with the same attributes)."""
        c = hf_config
        num_heads = c.num_attention_heads
        num_kv_heads = getattr(c, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise UserError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None) or "silu"
        if act not in HIDDEN_ACTIVATIONS:
            raise UserError(
                f"unsupported hidden_act {act!r} (supported: {', '.join(HIDDEN_ACTIVATIONS)})"
            )
        if getattr(c, "attn_logit_softcapping", None) is not None:
            raise UserError("attention logit soft-capping is not supported (Gemma 2)")
        rope_theta, rope_scaling, local_theta = _layer_rope_settings(c)
        layer_types = getattr(c, "layer_types", None)
        return cls(
            architecture=architecture,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            vocab_size=c.vocab_size,
            intermediate_size=c.intermediate_size,
            max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=float(c.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            sliding_window=_sliding_window(c),
            eos_token_ids=_unique(_as_list(getattr(c, "eos_token_id", None)), extra_eos_token_ids),
            hidden_act=HIDDEN_ACTIVATIONS[act],
            layer_types=tuple(layer_types) if layer_types else None,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=_float_or_none(getattr(c, "query_pre_attn_scalar", None)),
            final_logit_softcapping=_float_or_none(getattr(c, "final_logit_softcapping", None)),
        )


def _layer_rope_settings(c: Any) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling) of the global layers and the sliding layers' own theta, or None.

    transformers 5 gives Gemma 3 one `rope_parameters` per layer type; before it, a
    `rope_local_base_freq` beside the global settings."""
    params = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or params["sliding_attention"]
        theta, scaling = _rope_settings(SimpleNamespace(rope_parameters=full))
        sliding = params.get("sliding_attention")
        if sliding is None:
            return theta, scaling, None
        local_theta, local_scaling = _rope_settings(SimpleNamespace(rope_parameters=sliding))
        if local_scaling is not None:
            raise UserError("RoPE scaling on the sliding-window layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = _rope_settings(c)
    local = getattr(c, "rope_local_base_freq", None)
    return theta, scaling, None if local is None else float(local)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope_settings(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(c, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", None) or getattr(c, "rope_theta", None) or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"unsupported RoPE scaling {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UserError(f"partial rotary embeddings are not supported (factor {partial})")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(c: Any) -> int | None:
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None  # Qwen2/3 with use_sliding_window false: every layer is full attention
    return window or None


def _read_generation_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        return _as_list(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        return []


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _unique(*id_lists: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for ids in id_lists for i in ids))
