"""A step of a few tokens in one native call: what CUDA graphs are to vLLM's decode.

A step of a few tokens is ~1000 small operator calls in PyTorch (norms, rotary, the K/V
write and gather, attention, 120 matmuls, residual adds); at a few tokens per sequence their
dispatch costs more than their arithmetic. With the weights in GGUF blocks
(`--quantization gguf`), the whole step (token ids to logits) runs as `nls_decode_step` in
`native/gguf_cpu.c` (through `native/ops.py`'s `decode_step`): the same layers, the same
paged KV cache (written and read in place through the block tables), the same block kernels
as the `GGUFLinear` layers. A step is the model runner's `StepBatch`
(`engine/step_batch.py`), one span per sequence: consecutive tokens at positions p..p+T-1,
token i attending to its sequence's positions <= p+i; all the step's rows go through each
matrix together, and the logits of the tokens asked for come back. One token per sequence
is a decode step (of one sequence or a batch), the last token and k drafts a speculative
verify step (logits at every position), and a short prefill chunk asks for the last token's
logits at the prompt's end, none before. The batch's tensors go to `ops.decode_step` as they
are: it is the one place they are checked before the C runs.

The step is built from the model's own declaration (`model.native_decoder()`,
`model/native_decoder.py`), never from its internals. A model that cannot declare itself
(projections not in GGUF blocks, tensor parallelism) runs the PyTorch forward, logged at INFO:
the native step was not in play. A declaration the native step cannot run is refused at load
with the reason logged at WARNING (the GGUF blocks then run slower, through the forward): a
non-default `DecoderOptions` field the step does not implement (`native/supported.py`, one
comparison over every field), the kernels' limits (`ops.decode_step_limits`: head_dim a
multiple of 8 up to 256; a KV cache of float32, float16, or int8 with its scales:
`--kv-cache-dtype int8` is written quantized and read in place by the step, fp8 is not) or a
build without the kernels. `nanollmserve info` shows the options' verdict. The batch says
whether it may run here (`StepBatch.native_eligible`); everything after the logits (grammar
masks, sampling, logprobs) is unchanged.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from nanollmserve.engine.step_batch import StepBatch
from nanollmserve.model.native_decoder import NativeDecoder, NotNativeError
from nanollmserve.native import ops
from nanollmserve.native.abi import ACTIVATION_CODES, NlsLayer, NlsModel
from nanollmserve.native.ops import KV_DTYPE_CODES, decode_step, decode_step_limits
from nanollmserve.native.supported import refusal

logger = logging.getLogger(__name__)


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _layer_struct(layer) -> NlsLayer:
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    return NlsLayer(
        *(p.kind for p in projections),
        *(_ptr(p.tiles) for p in projections),
        _ptr(layer.qkv.bias), _ptr(layer.o.bias), _ptr(layer.gate_up.bias), _ptr(layer.down.bias),
        _ptr(layer.input_norm), _ptr(layer.post_norm),
        _ptr(layer.q_norm), _ptr(layer.k_norm), _ptr(layer.k_cache), _ptr(layer.v_cache),
        _ptr(layer.k_scale), _ptr(layer.v_scale),
        _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm), _ptr(layer.rope), layer.window, 0,
    )  # fmt: skip


def _kernel_limits(decoder: NativeDecoder) -> str | None:
    """Why the kernels cannot run this declaration, or None."""
    layer = decoder.layers[0]
    if layer.k_cache.numel() == 0:
        return "the KV cache is not bound"
    if decoder.options.activation not in ACTIVATION_CODES:
        return f"the step has no activation {decoder.options.activation!r}"
    return decode_step_limits(
        decoder.head_dim,
        decoder.num_heads,
        decoder.num_kv_heads,
        layer.k_cache.dtype,
        all(each.k_scale is not None and each.v_scale is not None for each in decoder.layers),
    )


class NativeDecodeStep:
    """`step(batch)` -> float32 logits [sum of num_logits, vocab]: for each span of the
    `StepBatch` in order, the logits of its last `num_logits` tokens."""

    def __init__(self, decoder: NativeDecoder, model: nn.Module, max_context: int) -> None:
        self._model = model  # keeps every tensor the structures point into alive
        self._decoder = decoder
        self._layers = (NlsLayer * len(decoder.layers))(*map(_layer_struct, decoder.layers))
        k_cache = decoder.layers[0].k_cache
        lm_head = decoder.lm_head
        self.vocab_size = decoder.vocab_size
        self.block_size = k_cache.shape[1]
        self.num_blocks = k_cache.shape[0]
        tables = [decoder.rope] + [each.rope for each in decoder.layers if each.rope is not None]
        self.max_context = min(max_context, *(table.shape[0] for table in tables))
        self._returns_logits = lm_head is not None
        options = decoder.options
        # the soft-cap of a native lm_head's logits is the step's; else `compute_logits` caps
        softcap = options.final_logit_softcap if lm_head is not None else None
        self._struct = NlsModel(
            decoder.hidden_size, decoder.intermediate_size, decoder.num_heads,
            decoder.num_kv_heads, decoder.head_dim, len(decoder.layers), decoder.vocab_size,
            self.block_size, 0 if lm_head is None else lm_head.kind,
            self.max_context, self.num_blocks, KV_DTYPE_CODES[k_cache.dtype], decoder.embed_kind,
            ACTIVATION_CODES[options.activation],
            decoder.rms_norm_eps, decoder.attn_scale, options.embed_scale, softcap or 0.0,
            _ptr(decoder.embed), _ptr(decoder.final_norm), _ptr(decoder.rope),
            _ptr(None if lm_head is None else lm_head.tiles),
            ctypes.cast(self._layers, ctypes.c_void_p),
        )  # fmt: skip

    @classmethod
    def for_model(cls, model: nn.Module, max_context: int) -> NativeDecodeStep | None:
        """The native step for `model`, or None (the reason logged) when it cannot run it."""
        declare = getattr(model, "native_decoder", None)
        if declare is None:
            logger.info("%s declares no native decoder; steps run in PyTorch", type(model).__name__)
            return None
        try:
            decoder = declare()
        except NotNativeError as reason:
            logger.info("steps run in PyTorch, not as one native call: %s", reason)
            return None
        reason = refusal(decoder.options) or _kernel_limits(decoder)
        if reason is None and ops.load_kernels() is None:
            reason = ops.kernels_unavailable_reason()
        if reason is not None:
            logger.warning("the GGUF blocks run through the PyTorch forward: %s", reason)
            return None
        logger.info("decode, verify and short prefill steps run as one native call (GGUF blocks)")
        return cls(decoder, model, max_context)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """The step's logits: float32 [len(batch.logit_rows), vocab], each span's last
        `num_logits` tokens in order. `ops.decode_step` checks the batch's values first
        (ValueError before any native code runs: a token id outside the vocabulary,
        positions outside [0, max_context), a block table that does not reach a span's last
        position or names a block outside the KV pool)."""
        out_width = self.vocab_size if self._returns_logits else self._decoder.hidden_size
        out = torch.empty(batch.logit_rows.shape[0], out_width)
        decode_step(
            self._struct, batch.token_ids, batch.positions, batch.seq_of_token,
            batch.block_tables, batch.logit_rows, out,
        )  # fmt: skip
        if self._returns_logits or not out.shape[0]:
            return out
        return self._model.compute_logits(out)
