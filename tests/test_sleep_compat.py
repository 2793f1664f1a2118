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
from nanollmserve.engine.native_decode import NativeDecodeStep
from nanollmserve.errors import UserError
from nanollmserve.native.ops import kernels_unavailable_reason
from nanollmserve.structured_outputs import StructuredOutputsParams

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def texts(llm: LLM, params: SamplingParams = GREEDY, **kwargs) -> list[str]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, **kwargs)
    return [o.outputs[0].text for o in outputs]


def across_sleep(llm: LLM, level: int, compat=None, **kwargs) -> None:
    """The greedy texts before a sleep at `level` equal those after the wake (with `compat`,
    the sleep is recorded for the compatibility matrix)."""
    before = texts(llm, **kwargs)
    llm.sleep(level)
    if compat is not None:
        compat.exercised("sleep", asleep=llm.engine.sleep_level == level)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert texts(llm, **kwargs) == before


@pytest.mark.parametrize("level", [1, 2])
def test_gguf_blocks_and_the_native_step_across_a_sleep(level, compat):
    reason = kernels_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native step cannot run here: {reason}")
    llm = LLM(num_kv_blocks=128)  # the defaults: GGUF blocks, the native step
    assert llm.engine.loaded.quantization == "gguf"
    compat.exercised("gguf", quantization=llm.engine.loaded.quantization)
    runner = llm.engine.model_runner
    step = runner.native_decode
    assert isinstance(step, NativeDecodeStep)
    before = texts(llm)
    assert sum(runner.native_steps.values()) > 0  # the greedy texts came from the native step
    llm.sleep(level)
    assert runner.native_decode is None  # it held pointers into the freed pool
    compat.exercised("sleep", asleep=llm.engine.sleep_level == level)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.wake_up()
    runner = llm.engine.model_runner  # level 2: a new runner over the reloaded weights
    # Rebuilt on the new pool: its K/V planes are the new pool's.
    assert isinstance(runner.native_decode, NativeDecodeStep)
    assert runner.native_decode is not step
    layer = runner.native_decode._decoder.layers[0]
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, 0].data_ptr()
    assert layer.v_cache.data_ptr() == runner.kv_cache[1, 0].data_ptr()
    runner.native_steps.clear()
    assert texts(llm) == before
    assert runner.native_steps["batched-decode"] + runner.native_steps["decode"] > 0


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
def test_the_kv_offload_tier_outlives_a_sleep(tmp_path, level, compat):
    llm = LLM(num_kv_blocks=128, kv_offload_dir=str(tmp_path))
    prompt = "word " * 80
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    llm.sleep(level)
    compat.exercised("sleep", asleep=llm.engine.sleep_level == level)
    llm.wake_up()
    # The pool forgot the prefix; the disk tier still holds it and loads it back.
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].text == first.outputs[0].text
    compat.exercised("offload", loaded_tokens=again.num_cached_tokens)


def test_lora_across_a_sleep_level_1_and_level_2_refused(compat):
    llm = LLM(dtype="float32", num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("a", 1, str(adapter_dir(1)))
    across_sleep(llm, 1, compat, lora_request=adapter)
    compat.exercised("lora", output=texts(llm, lora_request=adapter), base=texts(llm))
    with pytest.raises(UserError, match="level 2 is not supported with LoRA"):
        llm.sleep(2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_across_a_sleep(method, compat):
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_model_dir()), "num_speculative_tokens": 2}
    )
    llm = LLM(dtype="float32", num_kv_blocks=128, speculative_config=spec)
    across_sleep(llm, 1, compat)
    compat.exercised("spec", num_drafts=llm.engine.stats().spec_decode.num_drafts)
    if method == "draft_model":
        with pytest.raises(UserError, match="level 2 is not supported with a draft model"):
            llm.sleep(2)
    else:
        across_sleep(llm, 2)


def test_structured_output_across_a_sleep(compat):
    llm = LLM(num_kv_blocks=128)
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    before = texts(llm, params)
    assert set(before) <= {"yes", "no"}
    llm.sleep(2)
    compat.exercised("sleep", asleep=llm.engine.sleep_level == 2)
    llm.wake_up()
    assert texts(llm, params) == before
    compat.exercised("structured", output=before[0], choice=["yes", "no"])


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
def test_sleep_mode_with_tensor_parallelism_is_refused_at_start(argv, compat):
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
    compat.refused("tp", "sleep", result.stderr)
