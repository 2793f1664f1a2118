"""The benchmark commands run end to end as subprocesses and print the JSON they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_cli import run_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.milestone("m03")
def test_bench_latency_reports_engine_and_both_hf_baselines():
    # 40 prompt tokens = 2 full blocks of 16: with one prompt reused, repeat 2 would hit the
    # prefix cache (warm TTFT); a fresh prompt per repeat keeps every timed TTFT cold.
    result = run_bench(
        "latency", "--input-len", "40", "--output-len", "6", "--repeat", "2", "--dtype", "float32"
    )  # fmt: skip
    assert set(result["results"]) == {"engine", "hf_generate_kv_cache", "hf_naive_no_cache"}
    for system in result["results"].values():
        assert system["ttft_ms"] > 0 and system["tpot_ms"] > 0
    assert result["ratios"]["engine_vs_hf_generate_kv_cache_decode"] > 0
    assert result["ttft"].startswith("cold")
    assert result["engine_cached_prompt_tokens"] == [0, 0]
    assert result["warmup"]["requests_per_system"] == 1
    assert result["warmup"]["output_len"] == 6


@pytest.mark.milestone("m12")
def test_bench_prefix_serve_measures_our_server_over_http():
    """`--serve` starts our server and sends the prompts over HTTP, as `--base-url` does for
    a peer: the comparable pair (the offline engine has no HTTP in its TTFT)."""
    result = run_bench(
        "prefix", "--serve", "--prefix-len", "32", "--suffix-len", "4", "--output-len", "2",
        "--num-requests", "1", "--server-args", "--dtype float32",
    )  # fmt: skip
    assert result["mode"] == "server over HTTP"
    assert result["base_url"] == "own server"
    assert result["server_args"] == "--dtype float32"
    assert "over HTTP" in result["compare_with"]
    assert result["hit_rate"] is not None and result["hit_rate"] > 0  # from our /stats
    assert result["cold_ttft_ms"]["p50"] > 0 and result["warm_ttft_ms"]["p50"] > 0


@pytest.mark.milestone("m12")
def test_bench_prefix_rejects_server_args_without_serve():
    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "bench", "prefix", "--server-args=-x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "--server-args needs --serve" in proc.stderr


def peer(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "peer-llamacpp"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.milestone("m12")
def test_peer_is_native_llama_server_with_one_slot_per_client():
    command = peer("command", "8").split()
    assert command[0].endswith(".peer/llama.cpp/build/bin/llama-server")
    assert command[command.index("-m") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    for flag, value in (("-t", "2"), ("-np", "8"), ("-c", str(4096 * 8))):
        assert command[command.index(flag) + 1] == value
    assert "--cont-batching" in command
    assert "llama_cpp.server" in peer("python-command")  # the old peer, second rows only


@pytest.mark.milestone("m12")
def test_peer_build_flags_follow_lscpu(tmp_path):
    def flags_for(cpu_flags: str) -> list[str]:
        fake = tmp_path / "lscpu"
        fake.write_text(f"#!/bin/sh\necho 'Flags: {cpu_flags}'\n")
        fake.chmod(0o755)
        return peer("cmake-flags", env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}).split()

    assert flags_for("fpu avx avx2 fma f16c") == ["-DGGML_NATIVE=ON"]
    amx = flags_for("avx avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8")
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AMX_TILE=OFF" in amx
    assert "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_VNNI=ON" in amx
    assert "-DGGML_AVX512_BF16=ON" not in amx and "-DGGML_AVX512_VBMI=ON" not in amx


@pytest.mark.milestone("m12")
def test_bench_summary_labels_each_llamacpp_row_by_the_server_it_measured(tmp_path):
    row = {
        "max_concurrency": 8, "completed": 64, "failed": 0, "request_throughput": 1.0,
        "output_throughput": 64.0, "ttft_ms": {"p50": 1, "p95": 2}, "tpot_ms": {"p50": 10},
        "itl_ms": {"p95": 3}, "e2el_ms": {"p50": 4},
    }  # fmt: skip
    files = {
        "serve-ours-c8": row,
        "serve-llamacpp-c8": {**row, "peer": {"server": "llama.cpp llama-server"}},
        "serve-llamacpp-python-c8": {**row, "peer": {"server": "llama-cpp-python server"}},
        "serve-llamacpp-c1": {**row, "max_concurrency": 1},  # an old file: no peer block
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_summary.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    labels = sorted((line.split(" | ")[0][2:], line.split(" | ")[1]) for line in lines[1:])
    assert labels == [
        ("llama-cpp-python server (one request at a time)", "8"),
        ("llama-cpp-python server (one request at a time), recorded before the native peer", "1"),
        ("llama.cpp llama-server", "8"),
        ("ours", "8"),
    ]
    assert "output tok/s ours / llama.cpp llama-server = 1.00" in out


@pytest.mark.slow
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
