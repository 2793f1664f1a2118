"""The quantized KV cache (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`): K and V kept as 8-bit
codes with one float32 scale per token and KV head, quantized when the attention writes them
and dequantized where it reads them.

A row (one token's K or V of one KV head, `head_dim` values x) is stored as codes c and a
scale s with x ~= s * c, s = max|x| / C, C the code's largest value: 127 for int8 (c =
round(x / s), ties to even, the bytes `native/gguf_cpu.c` writes for the same row), 448 for
float8_e4m3fn, 57344 for float8_e5m2 (c = x / s rounded by the cast). A scale per row follows
each token's own range, so an outlier token does not cost the others their precision, and a
block's rows never share a scale that a later token would have to rewrite (the scale of a
block is not known until the block is full). The scales sit in a tensor beside the codes,
`[2, layers, blocks, block_size, kv_heads]` (`ModelRunner.kv_scales`): 4 bytes per 64 codes
on the bundled model, so int8 holds 3.8x the tokens of float32 in the same memory.

"auto" keeps the cache in the model's dtype (no scales); "float32" and "float16" name a float
cache outright (no scales: the attention casts as it writes and reads, float16 rounded to
nearest even, the bits `native/gguf_cpu.c` writes). fp8 is vLLM's spelling; its scale per
row replaces vLLM's calibrated per-tensor scale (1.0 without calibration).
"""

from __future__ import annotations

import torch

from nanollmserve.quantization_names import GGUF_METHOD

KV_CACHE_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""`--kv-cache-dtype` value -> the storage dtype of a quantized cache ("auto": the model's)."""
KV_CACHE_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
"""`--kv-cache-dtype` value -> the dtype of a float cache named outright."""
_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_DTYPE = torch.float32


GGUF_AUTO_KV_CACHE_DTYPE = "float16"
"""What "auto" makes the cache under a GGUF file's blocks (decision 37): llama.cpp's default
K/V type for the same file. On the bundled model it costs +0.007% perplexity and KL 4.8e-6
nats against a float32 cache's 1.7e-6, top-1 unchanged (`bench quality --configs
fp32,gguf_kv32,gguf_kv16`), and halves what every decode step reads."""


def resolve_kv_cache_dtype(name: str, quantization: str | None) -> str:
    """`--kv-cache-dtype` as the pool is made: "auto" under a GGUF file's blocks
    (`quantization` "gguf") is `GGUF_AUTO_KV_CACHE_DTYPE`; any other name stays ("auto": the
    model's dtype)."""
    return GGUF_AUTO_KV_CACHE_DTYPE if name == "auto" and quantization == GGUF_METHOD else name


def kv_cache_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool holds for `--kv-cache-dtype name`."""
    if name == "auto":
        return model_dtype
    return KV_CACHE_FLOAT_DTYPES.get(name) or KV_CACHE_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds codes with scales beside them."""
    return dtype in _CODE_MAX


def kv_bytes_per_token(model_config, kv_dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V one token takes over all layers: the codes
    (`ModelConfig.kv_bytes_per_token`) and, quantized, a scale per layer and KV head."""
    count = model_config.kv_bytes_per_token(kv_dtype, tensor_parallel_size)
    if is_quantized(kv_dtype):
        rows = model_config.kv_bytes_per_token(torch.uint8, tensor_parallel_size)
        count += rows // model_config.head_dim * SCALE_DTYPE.itemsize
    return count


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] of `dtype`, float32 scales [...])."""
    x = x.float()
    code_max = _CODE_MAX[dtype]
    amax = x.abs().amax(dim=-1)
    # a true division (`code_max / amax` is reciprocal-then-multiply): the C's rounding
    inverse = torch.where(amax > 0, amax.new_tensor(code_max) / amax, 0.0)
    scaled = x * inverse[..., None]
    codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, amax / code_max


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] and their scales [...] -> values [..., head_dim] in `dtype`."""
    return (codes.float() * scales[..., None]).to(dtype)
