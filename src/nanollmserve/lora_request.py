"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's name and fields).

    llm = LLM(enable_lora=True, max_lora_rank=8)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

`lora_path` is a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).
The name identifies the adapter: the first request naming it loads it, later ones reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    """The caller's id for the adapter (kept for vLLM compatibility; the name identifies it)."""
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
