"""The names `--quantization` accepts, with no torch: the config checks them, the CLI parses
them, the model loader and the layers act on them.

`int8` and `fp16` replace each linear weight with another format (`layers/quantization.py`);
`gguf` runs a GGUF file's own blocks through the native kernels (`layers/gguf_linear.py`).
`none` (or unset) leaves the weights as they are.
"""

from __future__ import annotations

WEIGHT_ONLY_METHODS = ("int8", "fp16")
"""Methods that convert an nn.Linear's weight (`layers.quantization.LINEAR_CLASSES`)."""
GGUF_METHOD = "gguf"
"""Runs a GGUF file's own blocks: the loader applies it (`gguf_linear.apply_gguf_blocks`)."""
QUANTIZATION_METHODS = (*WEIGHT_ONLY_METHODS, GGUF_METHOD)
NO_QUANTIZATION = "none"
"""Same as leaving `quantization` unset."""
