"""Build a native model and fill it with the safetensors weights of an HF directory.

The model is built on the "meta" device (no memory, no random init), then every parameter is
replaced by the checkpoint tensor, read straight onto the target device and cast to the model
dtype. HF names map to ours one to one, except q/k/v and gate/up, which are concatenated into
the fused `qkv_proj` / `gate_up_proj` (the model's `packed_modules_mapping`). Under tensor
parallelism each tensor is cut to this rank's slice as it is read (`shard_checkpoint_tensor`),
so a rank never holds more than its shard plus one whole tensor. A checkpoint that
lacks a weight, has one the model does not know, or has a wrong shape fails with a UserError.

safetensors maps the files into memory, so a tensor loaded in its stored dtype costs no copy:
its pages are read when first used. The fused tensors are the exception, a concatenation.
In a directory nanollmserve owns (a GGUF cache entry: `cache_fused=True`) the first load
saves them, in the model dtype, into `nanollmserve-fused-<dtype>.safetensors` beside the
checkpoint, with the part order it concatenated (a changed `packed_modules_mapping` rebuilds
the file), and later loads map that file instead: concatenating them took 1.1 s of every
start of the bundled model (280 MB of float32). A GGUF cache entry gets its dense weights
converted the first time `load_model` reads it (`gguf_cache.cached_dense_weights`).

`load_gguf_block_model` builds a GGUF model without dense linear weights: its linear layers
take the file's blocks straight from the meta device (`GGUFLinear`), every other parameter
comes from the float32 tensors beside them, so no float32 copy of a linear weight is ever
converted, written or read.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from nanollmserve.distributed.parallel_state import get_tp_size
from nanollmserve.errors import UserError
from nanollmserve.layers.parallel_linear import shard_checkpoint_tensor
from nanollmserve.model import gguf_cache
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.registry import get_model_class

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
FUSED_FILE_PREFIX = "nanollmserve-fused-"


def build_model(model_config: ModelConfig) -> nn.Module:
    """The native model on the meta device: shapes only (enough to count parameters)."""
    with torch.device("meta"):
        return get_model_class(model_config.architecture)(model_config)


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model, a tied weight counted once."""
    return sum(p.numel() for p in model.parameters())


def load_model(
    source_dir: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    cache_fused: bool = False,
) -> nn.Module:
    """The native model of `source_dir` with its weights, on `device` in `dtype`, in eval mode.
    `cache_fused`: the directory is nanollmserve's own, keep the fused tensors there."""
    source_dir = Path(source_dir)
    if gguf_cache.is_gguf_entry(source_dir):
        gguf_cache.cached_dense_weights(source_dir)
    model = build_model(model_config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    weights = _read_weights(source_dir, model, model_config, dtype, device, cache_fused)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected {_names(unexpected)}")
        raise UserError(f"weights in {source_dir} do not match the model: {'; '.join(problems)}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name]:
            raise UserError(
                f"weight {name} in {source_dir} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[name])}"
            )
    model.load_state_dict(weights, strict=True, assign=True)
    model.to(device=device, dtype=dtype)  # the buffers built at init (RoPE table)
    model.requires_grad_(False)
    return model.eval()


def load_gguf_block_model(
    model_config: ModelConfig, blocks: dict, read_unblocked: Callable[[], dict]
) -> nn.Module | None:
    """The float32 CPU model whose linear layers run `blocks` (weight name -> `BlockRows`) and
    whose other parameters are `read_unblocked()` (name -> float32 tensor), in eval mode; its
    linear weights are never materialized. None when the two do not make up exactly this
    model (a linear weight stored in another block type, a tensor the mapping does not know):
    the caller loads the dense weights then, which also says what does not match."""
    from nanollmserve.layers.gguf_linear import apply_gguf_blocks
    from nanollmserve.model.gguf_blocks import EMBEDDING, embedding_blocks

    if get_tp_size() != 1:
        return None
    model = build_model(model_config)
    linear_weights = {
        f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    # An output projection without blocks may come dequantized with the other tensors.
    if not linear_weights - {"lm_head.weight"} <= blocks.keys():
        return None
    unblocked = read_unblocked()
    expected = {name: t.shape for name, t in model.state_dict().items()}
    needed = expected.keys() - blocks.keys()
    if embedding_blocks(blocks, model_config.tie_word_embeddings) is not None:
        needed -= {EMBEDDING}  # apply_gguf_blocks looks it up in the blocks
    if not needed <= unblocked.keys() or not unblocked.keys() <= expected.keys():
        return None
    if any(unblocked[name].shape != expected[name] for name in needed):
        return None
    model.load_state_dict({name: unblocked[name] for name in needed}, strict=False, assign=True)
    apply_gguf_blocks(model, blocks)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    model.requires_grad_(False)
    return model.eval()


def checkpoint_files(source_dir: Path) -> list[Path]:
    """The safetensors files of an HF dir (the index's shards, model.safetensors, or all)."""
    index = source_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (source_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        names = sorted(p.name for p in source_dir.glob("*.safetensors"))
    if not names:
        raise UserError(f"no *.safetensors weights in model directory {source_dir}")
    return [source_dir / name for name in names]


def _read_weights(
    source_dir: Path,
    model: nn.Module,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    cache_fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under our names, on `device` in `dtype`, packed shards concatenated
    (or, with `cache_fused`, read from the fused file of an earlier load)."""
    packed_mapping: dict[str, tuple[str, int]] = getattr(model, "packed_modules_mapping", {})
    weights: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    load_device = "cpu" if device.type == "cpu" else str(device)
    fused_path = source_dir / f"{FUSED_FILE_PREFIX}{str(dtype).removeprefix('torch.')}.safetensors"
    cache_fused = cache_fused and get_tp_size() == 1 and bool(packed_mapping)
    fused = _read_fused(fused_path, model, packed_mapping, load_device) if cache_fused else None
    if fused is not None:
        weights.update(fused)
    for path in checkpoint_files(source_dir):
        with safe_open(path, framework="pt", device=load_device) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if hf_name.endswith(_SKIPPED_SUFFIXES):
                    continue
                if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                name, shard = _our_name(hf_name, packed_mapping)
                if shard is not None and fused is not None:
                    continue
                tensor = shard_checkpoint_tensor(model, name, shard, f.get_tensor(hf_name))
                tensor = tensor.to(dtype)
                if shard is None:
                    weights[name] = tensor
                else:
                    shards.setdefault(name, {})[shard] = tensor
    num_shards = Counter(fused for fused, _ in packed_mapping.values())
    concatenated = {}
    for name, parts in shards.items():
        if len(parts) == num_shards[name.split(".")[-2]]:  # else reported as missing
            concatenated[name] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
    if cache_fused and fused is None and concatenated:
        _write_fused(fused_path, concatenated, packed_mapping)
    weights.update(concatenated)
    return weights


def _fused_names(model: nn.Module, packed_mapping: dict[str, tuple[str, int]]) -> set[str]:
    fused_modules = {fused for fused, _ in packed_mapping.values()}
    return {name for name in model.state_dict() if name.split(".")[-2] in fused_modules}


def _fused_layout(packed_mapping: dict[str, tuple[str, int]]) -> str:
    """How the parts were concatenated (saved with them: a changed mapping rebuilds them)."""
    return json.dumps(sorted((part, *where) for part, where in packed_mapping.items()))


def _read_fused(
    path: Path, model: nn.Module, packed_mapping: dict, device: str
) -> dict[str, torch.Tensor] | None:
    """The fused tensors saved by an earlier load (memory-mapped), None when there is no file,
    or it does not hold exactly the model's fused tensors in the model's part order (then they
    are concatenated again)."""
    if not path.is_file():
        return None
    try:
        with safe_open(path, framework="pt", device=device) as f:
            layout = (f.metadata() or {}).get("packed_modules_mapping")
            if layout != _fused_layout(packed_mapping):
                return None
            if set(f.keys()) != _fused_names(model, packed_mapping):
                return None
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (OSError, safetensors.SafetensorError):
        return None


def _write_fused(path: Path, tensors: dict[str, torch.Tensor], packed_mapping: dict) -> None:
    """Save the fused tensors for later loads (written aside, renamed into place); a failure
    (a read-only cache) only costs the concatenation again next time."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        try:
            metadata = {"packed_modules_mapping": _fused_layout(packed_mapping)}
            save_file({n: t.contiguous() for n, t in tensors.items()}, tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, safetensors.SafetensorError) as exc:
        logger.warning("cannot keep the fused weights in %s: %s", path.parent, exc)


def _our_name(hf_name: str, packed_mapping: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """`model.layers.0.self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in packed_mapping:
            fused, shard = packed_mapping[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return hf_name, None


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} (+{len(names) - limit} more)" if len(names) > limit else shown
