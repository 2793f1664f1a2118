"""How sleep mode composes with the other features (m25), on the offline `LLM` API (vLLM's
`LLM.sleep` / `LLM.wake_up`): GGUF blocks and the native step, LoRA adapters, speculative
decoding (n-gram and a draft model), structured output, the prefix cache and the KV offload
tier keep their exact greedy output across a sleep and a wake; level 2 is refused with LoRA
or a draft model, sleep mode with tensor parallelism; generating while asleep raises.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cluster_process import tiny_model_dir
from lora_adapters import adapter_dir

from nanollmserve import LLM, LoRARequest, SamplingParams
from nanollmserve.config import EngineConfig
from nanollmserve.errors import UserError
from nanollmserve.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.milestone("m25")

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def texts(llm: LLM, params: SamplingParams = GREEDY, **kwargs) -> list[str]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, **kwargs)
    return [o.outputs[0].text for o in outputs]


def across_sleep(llm: LLM, level: int, **kwargs) -> None:
    """The greedy texts before a sleep at `level` equal those after the wake."""
    before = texts(llm, **kwargs)
    llm.sleep(level)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert texts(llm, **kwargs) == before


@pytest.mark.parametrize("level", [1, 2])
def test_gguf_blocks_and_the_native_step_across_a_sleep(level):
    llm = LLM(num_kv_blocks=128)  # the defaults: GGUF blocks, the native step
    assert llm.engine.loaded.quantization == "gguf"
    native = llm.engine.model_runner.native_decode is not None  # (the kernels may not build)
    across_sleep(llm, level)
    runner = llm.engine.model_runner
    assert (runner.native_decode is not None) == native  # rebuilt on the new pool
    assert sum(runner.native_steps.values()) > 0 or not native


def test_the_prefix_cache_is_forgotten_by_a_sleep():
    llm = LLM(num_kv_blocks=128)
    prompt = "word " * 80
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep(1)
    llm.wake_up()
    # The blocks it named are gone with the pool: no stale hit, then it caches again.
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    stats = llm.engine.stats()
    assert stats.num_requests_running == 0 and stats.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("level", [1, 2])
def test_the_kv_offload_tier_outlives_a_sleep(tmp_path, level):
    llm = LLM(num_kv_blocks=128, kv_offload_dir=str(tmp_path))
    prompt = "word " * 80
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    llm.sleep(level)
    llm.wake_up()
    # The pool forgot the prefix; the disk tier still holds it and loads it back.
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].text == first.outputs[0].text


def test_lora_across_a_sleep_level_1_and_level_2_refused():
    llm = LLM(dtype="float32", num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("a", 1, str(adapter_dir(1)))
    across_sleep(llm, 1, lora_request=adapter)
    with pytest.raises(UserError, match="level 2 is not supported with LoRA"):
        llm.sleep(2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_across_a_sleep(method):
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_model_dir()), "num_speculative_tokens": 2}
    )
    llm = LLM(dtype="float32", num_kv_blocks=128, speculative_config=spec)
    across_sleep(llm, 1)
    if method == "draft_model":
        with pytest.raises(UserError, match="level 2 is not supported with a draft model"):
            llm.sleep(2)
    else:
        across_sleep(llm, 2)


def test_structured_output_across_a_sleep():
    llm = LLM(num_kv_blocks=128)
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    before = texts(llm, params)
    assert set(before) <= {"yes", "no"}
    llm.sleep(2)
    llm.wake_up()
    assert texts(llm, params) == before


def test_bad_levels_are_refused():
    llm = LLM(num_kv_blocks=32)
    for level in (0, 3, -1):
        with pytest.raises(UserError, match="level must be 1 or 2"):
            llm.sleep(level)
    assert llm.engine.sleep_level is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable-sleep-mode", "--tensor-parallel-size", "2"],
        ["--sleep-idle-seconds", "5", "--tensor-parallel-size", "2"],
    ],
)
def test_sleep_mode_with_tensor_parallelism_is_refused_at_start(argv):
    with pytest.raises(UserError, match="not supported with tensor parallelism"):
        EngineConfig(enable_sleep_mode=True, tensor_parallel_size=2)
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "not supported with tensor parallelism" in result.stderr
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr
