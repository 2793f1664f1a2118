"""The benchmark commands run end to end as subprocesses and print the JSON they promise."""

from __future__ import annotations

import json

import pytest
from bench_cli import run_bench


@pytest.mark.milestone("m03")
def test_bench_latency_reports_engine_and_both_hf_baselines():
    result = run_bench(
        "latency", "--input-len", "8", "--output-len", "6", "--repeat", "1", "--dtype", "float32"
    )
    assert set(result["results"]) == {"engine", "hf_generate_kv_cache", "hf_naive_no_cache"}
    for system in result["results"].values():
        assert system["ttft_ms"] > 0 and system["tpot_ms"] > 0
    assert result["ratios"]["engine_vs_hf_generate_kv_cache_decode"] > 0


@pytest.mark.milestone("m04")
def test_bench_throughput_reports_engine_and_static_batching(tmp_path):
    out = tmp_path / "throughput.json"
    result = run_bench(
        "throughput",
        "--num-prompts", "6",
        "--input-len", "8-16",
        "--output-len", "4-6",
        "--hf-requests", "2",
        "--static-batch-size", "3",
        "--dtype", "float32",
        "--output", str(out),
    )  # fmt: skip
    assert json.loads(out.read_text()) == result
    engine = result["results"]["engine"]
    assert engine["requests"] == 6 and engine["output_tokens"] >= 24
    assert result["results"]["hf_static_batching"]["output_tokens"] == engine["output_tokens"]
    assert result["ratios"]["engine_vs_hf_static_batching"] > 0


@pytest.mark.milestone("m06")
def test_bench_blocks_compares_paging_with_contiguous_reservation(tmp_path):
    plot = tmp_path / "blocks.png"
    result = run_bench(
        "blocks", "--lengths", "10,17,33,100", "--max-model-len", "128",
        "--kv-budget-tokens", "256", "--plot", str(plot),
    )  # fmt: skip
    paged = result["schemes"]["paged_block_16"]
    assert paged["allocated_tokens"] == 160
    assert paged["reserved_tokens"] == 16 * (1 + 2 + 3 + 7)
    contiguous = result["schemes"]["contiguous_max_len"]
    assert contiguous["reserved_tokens"] == 4 * 128
    assert contiguous["max_concurrent_requests_in_budget"] == 2
    assert paged["max_concurrent_requests_in_budget"] == 4
    assert plot.stat().st_size > 1000
