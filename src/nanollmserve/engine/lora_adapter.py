"""Reading a PEFT LoRA adapter directory: `adapter_config.json` + `adapter_model.safetensors`.

`load_peft_adapter` checks what the engine can serve and fails with a `UserError` naming the
problem otherwise (rank above `--max-lora-rank`, DoRA, bias or embedding adapters, modules
outside q/k/v/o/gate/up/down, ...). It returns the A and B matrices of each targeted module
under its Hugging Face name (`model.layers.3.self_attn.q_proj`), with B already multiplied by
the adapter's scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`).
Whether the shapes fit the base model is checked when the manager places it
(`lora_manager.py`), which knows the model's layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from nanollmserve.errors import UserError

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (PEFT's names for the Llama/Qwen decoders)."""

_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    """One loaded adapter, its weights on the CPU until the manager copies them into a slot."""

    name: str
    path: str
    uid: int
    """Unique per load (never reused): keys the adapter's slot and its prefix-cache blocks."""
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """HF module name -> (A [r, in], B [out, r] scaled)."""
    base_model_name_or_path: str | None = None


def load_peft_adapter(name: str, path: str, uid: int, max_rank: int) -> LoRAAdapter:
    directory = Path(path)
    config_path = directory / "adapter_config.json"
    weights_path = directory / "adapter_model.safetensors"
    if not config_path.is_file():
        raise UserError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    if not weights_path.is_file():
        raise UserError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise UserError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {exc}") from None
    rank, alpha = _check_config(name, config, max_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _split_key(name, key)
        pairs.setdefault(module, {})[kind] = tensor
    weights = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise UserError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise UserError(
                f"LoRA adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}, not [r, in] and [out, r]"
            )
        if a.shape[0] > max_rank:
            raise UserError(
                f"LoRA adapter {name!r}: {module} has rank {a.shape[0]}, more than "
                f"--max-lora-rank {max_rank}"
            )
        weights[module] = (a, b * scaling)
    if not weights:
        raise UserError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(name, str(path), uid, rank, weights, config.get("base_model_name_or_path"))


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    def fail(reason: str) -> UserError:
        return UserError(f"LoRA adapter {name!r}: {reason}")

    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type is {config.get('peft_type')!r}, only LORA is supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise fail("adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise fail(f"rank {rank} is more than --max-lora-rank {max_rank}")
    if config.get("use_dora"):
        raise fail("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise fail("rank_pattern / alpha_pattern are not supported")
    if config.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS)
        if unsupported:
            raise fail(
                f"target modules {unsupported} are not supported "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
    return rank, float(alpha)


def _split_key(name: str, key: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ->
    (`model.layers.0.self_attn.q_proj`, `lora_A`)."""
    parts = key.removeprefix(_PEFT_PREFIX).split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise UserError(f"LoRA adapter {name!r}: unsupported tensor {key}")
    module = ".".join(parts[:-2])
    if parts[-3] not in SUPPORTED_TARGETS:
        raise UserError(
            f"LoRA adapter {name!r}: module {module} is not supported "
            f"(supported: {', '.join(SUPPORTED_TARGETS)})"
        )
    return module, parts[-2]
