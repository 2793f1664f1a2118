"""Start-up (issue 14): what a start skips must not change what the engine computes.

- A Llama config.json read with `json` gives the ModelConfig transformers' AutoConfig gives.
- A GGUF model's fused weights are kept in its cache entry by the first start and mapped from
  there by the next, with the same answers; a fused file that does not fit is rebuilt.
- Loading the bundled model imports neither transformers nor torch._dynamo, and its KV pool
  reads as zeros.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_model_loading import save_tiny_llama, write_tiny_gguf
from transformers import AutoConfig, LlamaConfig

from nanollmserve import LLM, SamplingParams
from nanollmserve.model import ModelConfig, load_model
from nanollmserve.model.loader import FUSED_FILE_PREFIX

pytestmark = pytest.mark.milestone("m17")

CPU = torch.device("cpu")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(cache))
    return cache


def via_auto_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(AutoConfig.from_pretrained(model_dir), "LlamaForCausalLM")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 2, "hidden_size": 64, "tie_word_embeddings": True},
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "max_position_embeddings": 4096},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"head_dim": 16, "hidden_size": 128, "eos_token_id": [2, 7], "attention_bias": True},
    ],
    ids=["defaults", "gqa-tied", "llama3-rope", "linear-rope", "head-dim-eos-list-bias"],
)
def test_llama_config_from_json_equals_auto_config(tmp_path: Path, overrides: dict) -> None:
    LlamaConfig(**overrides).save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == via_auto_config(tmp_path)


def test_sparse_llama_config_json_takes_llama_defaults(tmp_path: Path) -> None:
    """A hand-written config.json with a few keys: the rest are LlamaConfig's defaults."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_pretrained(tmp_path)
    assert ours == via_auto_config(tmp_path)
    assert (ours.num_kv_heads, ours.head_dim, ours.rope_theta) == (32, 8, 10000.0)


def test_fused_weights_file_is_rebuilt_when_it_does_not_fit(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    config = ModelConfig.from_pretrained(model_dir)
    reference = load_model(model_dir, config, torch.float32, CPU).state_dict()
    first = load_model(model_dir, config, torch.float32, CPU, cache_fused=True).state_dict()
    fused = model_dir / f"{FUSED_FILE_PREFIX}float32.safetensors"
    assert fused.is_file()
    from safetensors.torch import load_file, save_file

    assert sorted(load_file(fused)) == sorted(n for n in reference if "qkv" in n or "gate_up" in n)
    second = load_model(model_dir, config, torch.float32, CPU, cache_fused=True).state_dict()
    save_file({"unrelated": torch.zeros(1)}, fused)  # e.g. written for another model
    third = load_model(model_dir, config, torch.float32, CPU, cache_fused=True).state_dict()
    assert "unrelated" not in load_file(fused)  # rewritten with the fused tensors
    # The right tensors saved without the part order they were concatenated in (an older
    # layout): rebuilt too, never trusted.
    save_file({n: torch.zeros_like(t) for n, t in load_file(fused).items()}, fused)
    fourth = load_model(model_dir, config, torch.float32, CPU, cache_fused=True).state_dict()
    for weights in (first, second, third, fourth):
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[n], reference[n]) for n in reference)


def test_gguf_model_keeps_fused_weights_in_its_cache_entry(
    tmp_path: Path, isolated_cache: Path
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    answers, stats = [], []
    for _ in range(2):
        with LLM(str(gguf_path), dtype="float32", num_kv_blocks=16) as llm:
            out = llm.generate([[1, 5, 9, 13, 40]], params, use_tqdm=False)[0]
            answers.append(out.outputs[0].token_ids)
            fused = llm.engine.loaded.model_dir / f"{FUSED_FILE_PREFIX}float32.safetensors"
            stats.append(fused.stat())
    assert len(answers[0]) == 12 and answers[0] == answers[1]
    assert stats[0].st_ino == stats[1].st_ino and stats[0].st_mtime_ns == stats[1].st_mtime_ns


def test_loading_the_bundled_model_skips_transformers_and_dynamo() -> None:
    script = textwrap.dedent(
        """
        import sys
        from nanollmserve import LLM, SamplingParams
        from nanollmserve.frontend.native_tokenizer import NativeTokenizer

        llm = LLM()
        assert isinstance(llm.tokenizer, NativeTokenizer), type(llm.tokenizer)
        assert not llm.engine.model_runner.kv_cache.any()
        skipped = [m for m in ("transformers", "torch._dynamo") if m in sys.modules]
        assert not skipped, skipped
        params = SamplingParams(temperature=0.0, max_tokens=8)
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params,
                       use_tqdm=False)
        print(out[0].outputs[0].text)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
