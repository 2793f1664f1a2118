"""Everything the engine needs to start from `--model`, `--device` and `--dtype`: the weights
source, the device and dtype, the model config and the native model with its weights."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nanollmserve.config import EngineConfig
from nanollmserve.errors import UserError
from nanollmserve.layers.quantization import COMPUTE_DTYPES, quantize_model
from nanollmserve.model.device import resolve_device, resolve_dtype
from nanollmserve.model.loader import load_gguf_block_model, load_model
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.source import ModelSource, may_run_gguf_blocks, resolve_model
from nanollmserve.quantization_names import GGUF_METHOD

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    source: ModelSource
    model_config: ModelConfig
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    quantization: str | None = None
    """The weight format the linear layers run (`--quantization`, or the GGUF default)."""

    @property
    def model_dir(self) -> Path:
        """The HF directory the weights, tokenizer and chat template come from."""
        return self.source.path


def load_engine_model(config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    device = resolve_device(config.device)
    if may_run_gguf_blocks(config, device.type):
        # Compiled (once per machine) while the GGUF file is converted and laid out (`serve`
        # starts it earlier, before torch imports: then this finds it built or waits for it).
        from nanollmserve.native.build import build_in_background

        build_in_background()
    source = resolve_model(config.model)
    quantization = resolve_quantization(config, source, device)
    dtype = resolve_dtype(config.dtype, device)
    if quantization in COMPUTE_DTYPES:
        dtype = quantization_dtype(config, quantization, dtype)
    model_config = ModelConfig.from_pretrained(source.path)
    if quantization and device.type != "cpu":
        raise UserError(f"--quantization {quantization} runs on the CPU only")
    blocks = None
    if quantization == GGUF_METHOD:
        blocks = gguf_blocks_to_run(source, model_config, config.quantization)
    model = gguf_block_model(source, model_config, blocks) if blocks else None
    # Checked last: a native build still running in the background overlaps the steps above.
    if blocks and not native_kernels_run(config.quantization):
        blocks = model = None
    if quantization == GGUF_METHOD and not blocks:
        quantization = None  # the default, on a file without 4-bit blocks or without kernels
    if model is None:
        # A GGUF source's directory is our cache entry: it keeps the fused weights for later loads.
        model = load_model(source.path, model_config, dtype, device, source.gguf_path is not None)
        if blocks:
            from nanollmserve.layers.gguf_linear import apply_gguf_blocks

            replaced = apply_gguf_blocks(model, blocks)
            logger.info("%d linear layers run their GGUF blocks, the others dense", replaced)
        elif quantization:
            quantize_model(model, quantization)
    seconds = time.perf_counter() - start
    logger.info(
        "loaded %s (%s, %s, quantization %s) in %.1f s",
        *(source.description, device, dtype, quantization or "none", seconds),
    )
    return LoadedModel(source, model_config, model, device, dtype, seconds, quantization)


def resolve_quantization(config: EngineConfig, source: ModelSource, device: torch.device):
    """`--quantization` as given ("none": off); unset, a GGUF model on the CPU with `--dtype
    auto` runs its own 4-bit blocks (`gguf`: about twice the float32 single-stream speed, the
    same greedy answers; docs/benchmarks.md), unless a feature that does not support it yet
    (tensor parallelism) is on; LoRA deltas run beside the block matmuls. `--dtype X` or
    `--quantization none` give the
    dequantized weights in that dtype."""
    if config.quantization is not None:
        return None if config.quantization == "none" else config.quantization
    if (
        device.type == "cpu"
        and source.gguf_path is not None
        and config.dtype == "auto"
        and config.tensor_parallel_size == 1
    ):
        return GGUF_METHOD
    return None


def quantization_dtype(config: EngineConfig, method: str, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype a quantization method computes in: `--dtype auto` picks it."""
    required = COMPUTE_DTYPES[method]
    if config.dtype != "auto" and dtype != required:
        name = str(required).removeprefix("torch.")
        raise UserError(
            f"--quantization {method} computes in {name}: "
            f"use --dtype {name} or auto, not {config.dtype}"
        )
    return required


def gguf_blocks_to_run(
    source: ModelSource, model_config: ModelConfig, asked: str | None
) -> dict | None:
    """`gguf`: the GGUF file's own quantized blocks (weight name -> `BlockRows`) that the
    linear layers run through the native kernels (`native_kernels_run` says whether they can)
    -> None when the file has none and `--quantization gguf` was not `asked` for (else that is
    a UserError)."""
    from nanollmserve.model.gguf_cache import cached_gguf_blocks

    if source.gguf_path is None:
        raise UserError(
            f"--quantization {GGUF_METHOD} runs a GGUF file's blocks: give the bundled model or "
            f"a *.gguf file, not {source.description}"
        )
    blocks = cached_gguf_blocks(source.path, source.gguf_path, model_config)
    if not any(name != "lm_head.weight" for name in blocks):
        if asked is None:
            return None
        raise UserError(
            f"--quantization {GGUF_METHOD}: {source.gguf_path.name} stores no linear weight as "
            "blocks a native kernel runs (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1; "
            "other block types run dequantized: leave --quantization "
            "unset)"
        )
    return blocks


def native_kernels_run(asked: str | None) -> bool:
    """Whether the native kernels load here (waiting for a build still running in the
    background) -> False, with a warning, when they cannot and `--quantization gguf` was not
    `asked` for (the dequantized weights run instead; asked for, that is a UserError)."""
    from nanollmserve.native.ops import kernels_unavailable_reason

    reason = kernels_unavailable_reason()
    if reason is None:
        return True
    if asked is None:
        logger.warning("running the dequantized weights: %s", reason)
        return False
    raise UserError(f"--quantization {GGUF_METHOD} needs the native kernels: {reason}")


def gguf_block_model(source: ModelSource, model_config: ModelConfig, blocks: dict):
    """The model on `blocks` and the file's other tensors, no dense weight converted or read
    (`load_gguf_block_model`) -> None when some linear weight has no blocks: the caller loads
    the dense weights and replaces the layers that have them."""
    from nanollmserve.model.gguf_cache import cached_unblocked_tensors

    def read_unblocked() -> dict:
        return cached_unblocked_tensors(source.path, source.gguf_path, model_config)

    model = load_gguf_block_model(model_config, blocks, read_unblocked)
    if model is not None:
        logger.info("every linear layer runs its GGUF blocks (no dense weights converted)")
    return model
