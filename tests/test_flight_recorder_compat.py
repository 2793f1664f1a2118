"""The flight recorder with the other features (compatibility matrix): a worker on the GGUF
blocks with ngram speculation behind a router (its /debug/steps read on the worker's own
port with its admin key, the router forwarding no admin route, and replayed offline), a
2-rank tensor-parallel engine (recorded and replayed), and LoRA requests (recorded; replay
refuses them)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from cluster_process import tiny_model_dir
from compat_stack import REPEATING_PROMPT, SPEC_NGRAM, CompatStack

from nanollmserve import SamplingParams

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(500), pytest.mark.slow]


def replay(path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nanollmserve.cli.main", "replay", str(path), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=400)


def test_gguf_blocks_with_speculation_behind_the_router_record_and_replay(tmp_path, compat):
    stack = CompatStack.start(
        "--dtype", "auto", "--quantization", "gguf", "--num-kv-blocks", "128",
        "--speculative-config", SPEC_NGRAM, "--enable-debug-endpoints", "--step-record-prompts",
    )  # fmt: skip
    try:
        client = stack.router.openai()
        for prompt in (REPEATING_PROMPT, "The capital of France is"):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16)
        stack.worker.wait_idle()
        # The worker's own record, with its admin key: the router forwards no admin route.
        assert httpx.get(f"{stack.router.url}/debug/steps", timeout=60).status_code == 404
        response = stack.worker.admin_client(timeout=60).get("/debug/steps")
        assert response.status_code == 200, response.text
        compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])
        compat.exercised("gguf", quantization=compat.quantization_in_log(stack.ready_line()))
    finally:
        stack.stop()
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[0]["config"]["quantization"] == "gguf"
    assert sum(e["draft_proposed"] for step in lines[1:] for e in step["batch"]) > 0
    drafted = [e for step in lines[1:] for e in step["batch"] if e["draft_proposed"]]
    compat.exercised("spec", num_drafts=len(drafted))
    compat.exercised("recorder", records=len(lines) - 1)
    path = tmp_path / "gguf.jsonl"
    path.write_text(response.text)
    result = replay(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tensor_parallel_records_and_replays(tmp_path, compat):
    from nanollmserve import LLM

    with LLM(
        str(tiny_model_dir()),
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=32,
        step_record_prompts=True,
    ) as llm:
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
        llm.generate(["Hello there", "Pick one:"], params, use_tqdm=False)
        compat.exercised("tp", ranks=compat.ranks_running())
        llm.engine.flight_recorder.write(tmp_path / "tp.jsonl")
    header = json.loads((tmp_path / "tp.jsonl").read_text().splitlines()[0])
    assert header["config"]["tensor_parallel_size"] == 2 and header["num_steps"] > 1
    compat.exercised("recorder", records=header["num_steps"])
    result = replay(tmp_path / "tp.jsonl")  # it would start a second process: refused
    assert result.returncode == 2 and "--trust-record-config" in result.stderr
    result = replay(tmp_path / "tp.jsonl", "--trust-record-config")
    assert result.returncode == 0, result.stdout + result.stderr


def test_lora_requests_are_recorded_and_replay_refuses_them(make_llm, tmp_path, compat):
    from lora_adapters import adapter_dir

    from nanollmserve import LoRARequest

    llm = make_llm(enable_lora=True)
    lora = LoRARequest("sql", 1, str(adapter_dir(seed=1)))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    [with_adapter] = llm.generate("Hello", greedy, use_tqdm=False, lora_request=lora)
    [base] = llm.generate("Hello", greedy, use_tqdm=False)
    steps = [record.to_json() for record in llm.engine.flight_recorder.records()]
    assert steps[0]["arrivals"][0]["lora_name"] == "sql"
    compat.exercised(
        "lora", output=with_adapter.outputs[0].token_ids, base=base.outputs[0].token_ids
    )
    compat.exercised("recorder", records=sum(len(step["arrivals"]) for step in steps))
    llm.engine.flight_recorder.write(tmp_path / "lora.jsonl")
    result = replay(tmp_path / "lora.jsonl")
    assert result.returncode == 2 and "LoRA adapter 'sql'" in result.stderr
