"""LoRAManager: the adapters an engine serves, the slots they run in, and each step's
token-to-adapter grouping.

At start it wraps the model's projections in `LoRALinear` layers (`layers/lora.py`) without
touching the model code: `o_proj` and `down_proj` as they are, the fused `qkv_proj` and
`gate_up_proj` with one slice per HF projection (the model's `packed_modules_mapping` says
which). Each wrapper holds `max_loras` preallocated slots of rank `max_lora_rank`.

Adapters are registered by name (`add_adapter`, from any thread: it reads the PEFT
directory and checks that every matrix fits the base model) and stay on the CPU until a step
needs them. Before each forward, `set_batch` puts every adapter of the step in a slot
(evicting the least recently used one that the step does not need) and groups the step's
tokens by slot. The scheduler keeps at most `max_loras` adapters among the running
requests, so a step's adapters always fit. A removed adapter keeps serving the requests that
already run with it (they hold it); new requests cannot name it.
"""

from __future__ import annotations

import itertools
import threading

import torch
from torch import nn

from nanollmserve.engine.lora_adapter import SUPPORTED_TARGETS, LoRAAdapter, load_peft_adapter
from nanollmserve.engine.request import Request
from nanollmserve.errors import UserError
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.layers.lora import LoRABatch, LoRALinear
from nanollmserve.model.model_config import ModelConfig


class LoRAManager:
    def __init__(
        self, model: nn.Module, model_config: ModelConfig, max_loras: int, max_rank: int
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = {}
        self.targets: dict[str, tuple[str, int]] = {}
        """HF module name (`model.layers.0.self_attn.q_proj`) -> (wrapped module, slice)."""
        self._wrap(model, model_config)
        first = next(iter(self.layers.values()))
        self.device = first.lora_a.device
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}
        self._uids = itertools.count(1)
        self._slots: list[int | None] = [None] * max_loras
        """The uid of the adapter in each slot."""
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)

    # -- the registry (any thread) --------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Load and check a PEFT adapter directory; UserError if it cannot be served."""
        with self._lock:
            if name in self._adapters:
                raise UserError(f"LoRA adapter {name!r} is already loaded")
            uid = next(self._uids)
        adapter = load_peft_adapter(name, path, uid, self.max_rank)
        self._check_fits(adapter)
        with self._lock:
            if name in self._adapters:
                raise UserError(f"LoRA adapter {name!r} is already loaded")
            self._adapters[name] = adapter
        return adapter

    def remove_adapter(self, name: str) -> bool:
        """Forget the adapter; False if no adapter has that name."""
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        return adapter

    def adapters(self) -> dict[str, str]:
        """Name -> path of every registered adapter."""
        with self._lock:
            return {name: a.path for name, a in self._adapters.items()}

    # -- each step (the engine thread) ----------------------------------------------------
    def set_batch(self, requests: list[Request], num_new_tokens: list[int]) -> None:
        """Slot the step's adapters and group its flat batch of tokens by slot."""
        spans: dict[int, tuple[LoRAAdapter, list[list[int]]]] = {}
        start = 0
        for request, num in zip(requests, num_new_tokens, strict=True):
            if request.lora is not None:
                _, ranges = spans.setdefault(request.lora.uid, (request.lora, []))
                if ranges and ranges[-1][1] == start:
                    ranges[-1][1] += num  # adjacent requests of one adapter: one segment
                else:
                    ranges.append([start, start + num])
            start += num
        needed = set(spans)
        groups = []
        for adapter, ranges in spans.values():
            slot = self._slot_for(adapter, needed)
            if len(ranges) == 1:
                tokens = slice(*ranges[0])
            else:
                tokens = torch.cat([torch.arange(s, e) for s, e in ranges]).to(self.device)
            groups.append((slot, tokens))
        self.batch.groups = groups

    def _slot_for(self, adapter: LoRAAdapter, needed: set[int]) -> int:
        if adapter.uid in self._slots:
            slot = self._slots.index(adapter.uid)
        else:
            free = [s for s, uid in enumerate(self._slots) if uid is None or uid not in needed]
            if not free:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            slot = min(free, key=lambda s: (self._slots[s] is not None, self._last_used[s]))
            self._load_slot(slot, adapter)
        self._last_used[slot] = next(self._clock)
        return slot

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        per_layer: dict[str, list] = {}
        for module, (a, b) in adapter.weights.items():
            path, index = self.targets[module]
            layer = self.layers[path]
            pairs = per_layer.setdefault(path, [None] * len(layer.slice_sizes))
            dtype = layer.lora_a.dtype
            pairs[index] = (a.to(self.device, dtype), b.to(self.device, dtype))
        for path, layer in self.layers.items():
            if path in per_layer:
                layer.set_slot(slot, per_layer[path])
            else:
                layer.clear_slot(slot)
        self._slots[slot] = adapter.uid

    # -- set-up ---------------------------------------------------------------------------
    def _wrap(self, model: nn.Module, config: ModelConfig) -> None:
        packed = getattr(model, "packed_modules_mapping", {})
        out_sizes = {
            "q_proj": config.num_heads * config.head_dim,
            "k_proj": config.num_kv_heads * config.head_dim,
            "v_proj": config.num_kv_heads * config.head_dim,
            "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size,
        }
        # our module name -> the HF projections it computes, in shard order
        slices: dict[str, list[str]] = {}
        for hf_name in SUPPORTED_TARGETS:
            fused, index = packed.get(hf_name, (hf_name, 0))
            names = slices.setdefault(fused, [])
            names.insert(index, hf_name)
        for path, module in list(model.named_modules()):
            parent_path, _, leaf = path.rpartition(".")
            if leaf not in slices or not isinstance(module, (nn.Linear, GGUFLinear)):
                continue
            hf_names = slices[leaf]
            sizes = [out_sizes[n] for n in hf_names] if len(hf_names) > 1 else [module.out_features]
            wrapper = LoRALinear(module, sizes, self.max_loras, self.max_rank, self.batch)
            setattr(model.get_submodule(parent_path), leaf, wrapper)
            self.layers[path] = wrapper
            for index, hf_name in enumerate(hf_names):
                self.targets[f"{parent_path}.{hf_name}"] = (path, index)
        if not self.layers:
            raise UserError(f"LoRA: {type(model).__name__} has no projection LoRA can wrap")

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        """Every matrix must match the base model's projection (else: another base model)."""
        for module, (a, b) in adapter.weights.items():
            target = self.targets.get(module)
            if target is None:
                trained_on = adapter.base_model_name_or_path
                raise UserError(
                    f"LoRA adapter {adapter.name!r}: the base model has no module {module} "
                    f"(was the adapter trained on another base model"
                    f"{f', {trained_on}' if trained_on else ''}?)"
                )
            path, index = target
            layer = self.layers[path]
            expected = [layer.slice_sizes[index], layer.in_features]
            if [b.shape[0], a.shape[1]] != expected:
                raise UserError(
                    f"LoRA adapter {adapter.name!r}: {module} maps {a.shape[1]} -> {b.shape[0]} "
                    f"features, the base model's {expected[1]} -> {expected[0]} (was the "
                    f"adapter trained on another base model?)"
                )
