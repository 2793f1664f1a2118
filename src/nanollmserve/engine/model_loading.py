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
from nanollmserve.model.loader import load_model
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.source import ModelSource, resolve_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    source: ModelSource
    model_config: ModelConfig
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    load_seconds: float

    @property
    def model_dir(self) -> Path:
        """The HF directory the weights, tokenizer and chat template come from."""
        return self.source.path


def load_engine_model(config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.quantization in COMPUTE_DTYPES:
        dtype = quantization_dtype(config, dtype)
    source = resolve_model(config.model)
    model_config = ModelConfig.from_pretrained(source.path)
    model = load_model(source.path, model_config, dtype, device)
    if config.quantization:
        if device.type != "cpu":
            raise UserError(f"--quantization {config.quantization} runs on the CPU only")
        quantize_model(model, config.quantization)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s) in %.1f s", source.description, device, dtype, seconds)
    return LoadedModel(source, model_config, model, device, dtype, seconds)


def quantization_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype a quantization method computes in: `--dtype auto` picks it."""
    required = COMPUTE_DTYPES[config.quantization]
    if config.dtype != "auto" and dtype != required:
        name = str(required).removeprefix("torch.")
        raise UserError(
            f"--quantization {config.quantization} computes in {name}: "
            f"use --dtype {name} or auto, not {config.dtype}"
        )
    return required
