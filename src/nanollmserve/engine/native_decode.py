"""The single-stream decode step in one native call: what CUDA graphs are to vLLM's decode.

A decode step of one sequence is ~1000 small operator calls in PyTorch (norms, rotary, the K/V
write and gather, SDPA, 120 matmuls, residual adds); at one token their dispatch costs more
than their arithmetic. With the weights in GGUF blocks (`--quantization gguf`), the whole step
(token id to logits) runs as `nls_decode_step` in `native/gguf_cpu.c`: the same layers, the
same paged KV cache (written and read in place through the block table), the same block
kernels as the `GGUFLinear` layers.

`NativeDecodeStep.for_model` builds it when the model is a Llama-family decoder (Llama,
Mistral, Qwen2, Qwen3) in float32 on the CPU, on one rank, with every projection a
`GGUFLinear` (so not under LoRA) and head_dim a multiple of 8 up to 256; otherwise
it returns None and every step runs the PyTorch forward. The model runner uses it for steps
that are exactly one decode token of one request without draft tokens; everything after the
logits (grammar masks, sampling, logprobs) is unchanged.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from nanollmserve.layers.gguf_linear import GGUFLinear

logger = logging.getLogger(__name__)

_MAX_HEAD_DIM = 256


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv_kind", ctypes.c_int32),
        ("o_kind", ctypes.c_int32),
        ("gate_up_kind", ctypes.c_int32),
        ("down_kind", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("qkv_bias", "o_bias", "input_norm", "post_norm")),
        *((name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "k_cache", "v_cache")),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int32)
            for name in (
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "num_layers",
                "vocab",
                "block_size",
                "lm_head_kind",
                "max_context",
                "num_blocks",
            )
        ),  # fmt: skip
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "rope", "lm_head", "layers")),
    ]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeDecodeStep:
    """`step(token_id, position, block_ids)` -> float32 logits [1, vocab] of that token."""

    def __init__(self, model: nn.Module, library, max_context: int) -> None:
        config = model.config
        decoder = model.model
        layers = decoder.layers
        attention = layers[0].self_attn
        self._library = library
        self._model = model  # keeps every tensor the structures point into alive
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None) if attn.qk_norm else None
            k_norm = getattr(attn, "k_norm", None) if attn.qk_norm else None
            self._layers[i] = _Layer(
                attn.qkv_proj.kind, attn.o_proj.kind, mlp.gate_up_proj.kind, mlp.down_proj.kind,
                _ptr(attn.qkv_proj.tiles), _ptr(attn.o_proj.tiles),
                _ptr(mlp.gate_up_proj.tiles), _ptr(mlp.down_proj.tiles),
                _ptr(attn.qkv_proj.bias), _ptr(attn.o_proj.bias),
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                _ptr(None if q_norm is None else q_norm.weight),
                _ptr(None if k_norm is None else k_norm.weight),
                _ptr(attn.attn.k_cache), _ptr(attn.attn.v_cache),
            )  # fmt: skip
        lm_head = model.lm_head if isinstance(model.lm_head, GGUFLinear) else None
        rope = decoder.rotary_emb.cos_sin_cache
        self.vocab_size = config.vocab_size
        self.block_size = attention.attn.k_cache.shape[1]
        self.num_blocks = attention.attn.k_cache.shape[0]
        self.max_context = min(max_context, rope.shape[0])
        self._returns_logits = lm_head is not None
        self._struct = _Model(
            config.hidden_size, config.intermediate_size, attention.num_heads,
            attention.num_kv_heads, attention.head_dim, len(layers), config.vocab_size,
            self.block_size, 0 if lm_head is None else lm_head.kind,
            self.max_context, self.num_blocks, config.rms_norm_eps, attention.attn.scale,
            _ptr(decoder.embed_tokens.weight), _ptr(decoder.norm.weight), _ptr(rope),
            _ptr(None if lm_head is None else lm_head.tiles),
            ctypes.cast(self._layers, ctypes.c_void_p),
        )  # fmt: skip
        self._struct_ref = ctypes.byref(self._struct)
        scratch_bytes = library.nls_decode_scratch_bytes(self._struct_ref)
        self._scratch = torch.empty(scratch_bytes, dtype=torch.uint8)

    @classmethod
    def for_model(cls, model: nn.Module, max_context: int) -> NativeDecodeStep | None:
        """The fused step for `model`, or None when it cannot run it (module docstring)."""
        from nanollmserve.distributed.parallel_state import get_tp_size
        from nanollmserve.model.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM) or get_tp_size() != 1:
            return None
        from nanollmserve.native.build import load_kernels

        library = load_kernels()
        decoder = model.model
        embed = decoder.embed_tokens.weight
        attention = decoder.layers[0].self_attn
        projections = [
            module
            for layer in decoder.layers
            for module in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        if (
            library is None
            or embed.dtype != torch.float32
            or embed.device.type != "cpu"
            or not all(isinstance(p, GGUFLinear) for p in projections)
            or attention.head_dim % 8
            or attention.head_dim > _MAX_HEAD_DIM
            or attention.attn.k_cache.numel() == 0
        ):
            return None
        mlps = [layer.mlp for layer in decoder.layers]
        if any(m.gate_up_proj.bias is not None or m.down_proj.bias is not None for m in mlps):
            # The C layer has no MLP bias: the PyTorch forward (which adds it) decodes instead.
            logger.info("the native decode step has no MLP bias; decoding with PyTorch")
            return None
        logger.info("single-stream decode steps run as one native call (GGUF blocks)")
        return cls(model, library, max_context)

    def __call__(self, token_id: int, position: int, block_ids: list[int]) -> torch.Tensor:
        """Raises ValueError, before any native code runs, for a token id outside the
        vocabulary, a position outside [0, max_context), or a block table that does not
        reach `position` or names a block outside the KV pool (the C checks them again)."""
        self._check(token_id, position, block_ids)
        block_table = torch.tensor(block_ids, dtype=torch.int64)
        out = torch.empty(
            1, self.vocab_size if self._returns_logits else self._model.config.hidden_size
        )
        status = self._library.nls_decode_step(
            self._struct_ref,
            token_id,
            position,
            block_table.data_ptr(),
            self._scratch.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            reason = _STATUS_REASONS.get(status, f"status {status}")
            raise ValueError(f"native decode step refused token {token_id} at {position}: {reason}")
        return out if self._returns_logits else self._model.compute_logits(out)

    def _check(self, token_id: int, position: int, block_ids: list[int]) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if not 0 <= position < self.max_context:
            raise ValueError(f"position {position} is outside [0, {self.max_context})")
        used = block_ids[: position // self.block_size + 1]
        if len(used) <= position // self.block_size:
            raise ValueError(
                f"a block table of {len(block_ids)} blocks does not reach position {position}"
            )
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise ValueError(f"block table {used} names a block outside [0, {self.num_blocks})")


# What `nls_decode_step`'s error statuses mean (NLS_BAD_* in native/gguf_cpu.c).
_STATUS_REASONS = {
    -2: "position out of range",
    -3: "token id outside the vocabulary",
    -4: "block id outside the KV pool",
}
