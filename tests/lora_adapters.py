"""PEFT LoRA adapters made in the test session on the bundled model (not a test module).

`make_adapter(out_dir, seed)` wraps the bundled SmolLM2 (float32, loaded by transformers from
the converted HF directory) with PEFT, `init_lora_weights=False` (random A and B, so the
adapter changes the answers), r=8 on every projection, and saves the adapter directory.
`peft_greedy` is the reference: transformers greedy `generate` on the base model merged with
the adapter by PEFT (`merge_and_unload`: the same function as the unmerged PEFT model, at the
speed of a plain model).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bundled_model_dir() -> Path:
    from nanollmserve.model import resolve_model

    return resolve_model(None).path


def load_base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()


def make_adapter(out_dir: Path, seed: int, rank: int = 8, targets=None, base=None) -> Path:
    """Save a random LoRA of the bundled model to `out_dir`; returns it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or ALL_PROJECTIONS,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base if base is not None else load_base(), config)
    model.save_pretrained(out_dir)
    return out_dir


_references: dict[tuple, list[list[int]]] = {}


def peft_greedy(adapter_dir: Path, prompts_ids: list[list[int]], max_tokens: int):
    """transformers + PEFT greedy token ids of each prompt with the adapter (computed once
    per test process for the same arguments)."""
    key = (str(adapter_dir), tuple(map(tuple, prompts_ids)), max_tokens)
    if key not in _references:
        _references[key] = _peft_greedy(adapter_dir, prompts_ids, max_tokens)
    return _references[key]


def _peft_greedy(adapter_dir: Path, prompts_ids: list[list[int]], max_tokens: int, base=None):
    from peft import PeftModel

    model = PeftModel.from_pretrained(base if base is not None else load_base(), adapter_dir)
    model = model.merge_and_unload().eval()
    results = []
    with torch.inference_mode():
        for ids in prompts_ids:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
            )
            results.append(out[0, len(ids) :].tolist())
    return results


_made: dict[tuple, Path] = {}
_root: Path | None = None


def adapter_dir(seed: int, rank: int = 8) -> Path:
    """The adapter of `seed` and `rank`, made once per test process (shared by modules)."""
    global _root
    key = (seed, rank)
    if key not in _made:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="nanollmserve-lora-"))
            atexit.register(shutil.rmtree, _root, ignore_errors=True)
        _made[key] = make_adapter(_root / f"seed{seed}-r{rank}", seed, rank)
    return _made[key]
