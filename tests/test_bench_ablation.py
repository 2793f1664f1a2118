"""`nanollmserve bench ablation`: the five systems on one workload, in one run."""

from __future__ import annotations

import pytest
from test_bench_serve import run_bench

pytestmark = [pytest.mark.milestone("m12"), pytest.mark.slow]


def test_bench_ablation_runs_all_five_systems(tmp_path):
    plot = tmp_path / "ablation.png"
    result = run_bench(
        "ablation", "--num-requests", "5", "--num-groups", "2", "--prefix-len", "32",
        "--question-len", "4-8", "--long-len", "80", "--long-every", "4", "--output-len", "3",
        "--static-batch-size", "2", "--max-num-batched-tokens", "32", "--dtype", "float32",
        "--plot", str(plot),
    )  # fmt: skip
    systems = result["systems"]
    assert list(systems) == [
        "hf_one_at_a_time",
        "hf_static_batching",
        "engine_continuous_batching",
        "engine_prefix_caching",
        "engine_chunked_prefill",
    ]
    assert result["num_long_prompts"] == 1  # request 1 (i % 4 == 1)
    for system in systems.values():
        assert system["requests"] == 5 and system["output_tokens"] == 15
        assert system["output_tokens_per_s"] > 0 and system["ttft_p95_ms"] > 0
    # "Off": a budget no step can exceed (all 5 prompts + a decode token for 64 sequences).
    assert systems["engine_continuous_batching"]["max_num_batched_tokens"] == (
        result["prompt_tokens"] + 64
    )
    assert systems["engine_chunked_prefill"]["max_num_batched_tokens"] == 32
    assert systems["engine_continuous_batching"]["prefix_cache_hit_rate"] == 0
    assert systems["engine_prefix_caching"]["prefix_cache_hit_rate"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
