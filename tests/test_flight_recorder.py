"""The step flight recorder offline: what a step record holds (preemptions, prefix hits,
drafts, grammar masks), `nanollmserve replay` reproducing a run step by step (and naming the
first step that differs when the engine is changed), `nanollmserve trace export`, and the
limits of `step_record`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nanollmserve import SamplingParams
from nanollmserve.config import EngineConfig
from nanollmserve.errors import UserError

REPEATED = "one two three four five six seven eight nine ten " * 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def nanollmserve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nanollmserve.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A run that preempts (10 blocks), hits the prefix cache (a repeated prompt), speculates
    (ngram) and follows a grammar, seeded, unseeded and greedy, saved as a record."""
    from nanollmserve import LLM

    llm = LLM(
        dtype="float32",
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        speculative_config=SPEC,
        step_record_prompts=True,  # a replay needs them
    )
    prompts = [REPEATED + "and then", REPEATED + "so what", "Hello there, my friend", REPEATED]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True),  # the engine's seed
        SamplingParams(max_tokens=20, temperature=0, structured_outputs={"choice": ["yes", "no"]}),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    path = tmp_path_factory.mktemp("record") / "run.jsonl"
    llm.engine.flight_recorder.write(path)
    steps = [record.to_json() for record in llm.engine.flight_recorder.records()]
    return path, steps, outputs


@pytest.mark.milestone("m24")
def test_a_record_holds_preemptions_prefix_hits_drafts_and_grammar_masks(recorded_run):
    path, steps, outputs = recorded_run
    assert [step["step"] for step in steps] == list(range(len(steps)))
    preemptions = [p for step in steps for p in step["preemptions"]]
    assert preemptions and {p["reason"] for p in preemptions} == {"kv_cache_full"}
    kv = [event for step in steps for event in step["kv_blocks"]["requests"]]
    assert sum(event["prefix_hit"] for event in kv) > 0
    # Every block a request took (allocated or found in the cache) it gave back.
    taken = sum(event["allocated"] + event["prefix_hit"] for event in kv)
    assert taken == sum(event["freed"] for event in kv) > 0
    batch = [entry for step in steps for entry in step["batch"]]
    assert sum(entry["draft_accepted"] for entry in batch) > 0
    assert all(entry["draft_accepted"] <= entry["draft_proposed"] for entry in batch)
    assert sum(step["grammar_masks"] for step in steps) > 0
    assert {entry["phase"] for entry in batch} == {"prefill", "decode"}
    arrivals = [a for step in steps for a in step["arrivals"]]
    assert [a["request_id"] for a in arrivals] == ["0", "1", "2", "3"]
    for step in steps:
        assert step["duration_ms"]["model"] >= 0 and step["num_running"] <= 4
    # Each request's sampled tokens, step after step, begin with what it returned.
    for index, output in enumerate(outputs):
        sampled = [
            token
            for entry in batch
            if entry["request_id"] == str(index)
            for token in entry["sampled_token_ids"] or ()
        ]
        token_ids = list(output.outputs[0].token_ids)
        assert sampled[: len(token_ids)] == token_ids
    finished = {f["request_id"]: f["reason"] for step in steps for f in step["finished"]}
    assert finished == {str(i): o.outputs[0].finish_reason for i, o in enumerate(outputs)}
    header = json.loads(path.read_text().splitlines()[0])
    assert header["type"] == "engine" and header["first_step"] == 0
    assert header["config"]["num_kv_blocks"] == 10


@pytest.mark.milestone("m24")
@pytest.mark.timeout(400)
def test_replay_reproduces_every_step_and_token(recorded_run, compat):
    path, steps, outputs = recorded_run
    result = nanollmserve("replay", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"identical: {len(steps)} steps" in result.stdout
    compat.exercised("recorder", records=len(steps))
    drafted = [e for step in steps for e in step["batch"] if e["draft_proposed"]]
    compat.exercised("spec", num_drafts=len(drafted))
    compat.exercised("structured", output=outputs[3].outputs[0].text, choice=["yes", "no"])


@pytest.mark.milestone("m24")
@pytest.mark.timeout(400)
def test_a_perturbed_replay_names_the_first_step_that_differs(recorded_run):
    path, steps, _ = recorded_run
    first_with_two = next(step["step"] for step in steps if len(step["batch"]) > 1)
    result = nanollmserve("replay", str(path), "--max-num-seqs", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"differs at step {first_with_two}: the batch differs" in result.stdout


@pytest.mark.milestone("m24")
def test_trace_export_writes_a_chrome_trace(recorded_run, tmp_path):
    path, steps, _ = recorded_run
    out = tmp_path / "trace.json"
    result = nanollmserve(
        "trace", "export", "--format", "chrome", "--input", str(path), "--output", str(out)
    )
    assert result.returncode == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    phases = {"step", "propose", "schedule", "model", "update"}
    assert {(1, phase) for phase in phases} | {(2, rid) for rid in "0123"} <= tracks
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert sum(e["name"].startswith("step ") for e in slices) == len(steps)
    assert any(e["name"] == "queued" for e in slices)
    assert any(e["ph"] == "i" and e["name"] == "preempted (kv_cache_full)" for e in events)
    assert any(e["ph"] == "i" and e["name"].startswith("prefix hit (") for e in events)
    assert sum(e["ph"] == "i" and e["name"].startswith("finished") for e in events) == 4
    # Perfetto takes thread id 0, or the process id, for the process's main thread: the step
    # track would vanish into it, a request's track would be labelled "main thread".
    assert all(e["tid"] not in (0, e["pid"]) for e in events if e["name"] == "thread_name")


@pytest.mark.milestone("m24")
def test_step_record_zero_keeps_no_record(make_llm):
    llm = make_llm(step_record=0)
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.flight_recorder is None


@pytest.mark.milestone("m24")
def test_a_small_ring_keeps_the_last_steps_and_its_record_is_refused_by_replay(make_llm, tmp_path):
    llm = make_llm(step_record=3)
    llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    recorder = llm.engine.flight_recorder
    assert [r.step for r in recorder.records()] == [5, 6, 7]
    assert [r.step for r in recorder.records(since=6)] == [6, 7]
    assert recorder.records(since=100) == []
    recorder.write(tmp_path / "wrapped.jsonl")
    result = nanollmserve("replay", str(tmp_path / "wrapped.jsonl"))
    assert result.returncode == 2 and "starts at step 5" in result.stderr


@pytest.mark.milestone("m24")
def test_replay_refuses_lora_requests_and_malformed_records(tmp_path):
    header = {"type": "engine", "config": {"dtype": "float32"}}
    arrival = {"request_id": "a", "lora_name": "sql", "prompt_token_ids": [1]}
    step = {"type": "step", "step": 0, "arrivals": [arrival], "aborts": []}
    path = tmp_path / "lora.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")
    result = nanollmserve("replay", str(path))
    assert result.returncode == 2 and "LoRA adapter 'sql'" in result.stderr
    path.write_text("not json\n")
    result = nanollmserve("replay", str(path))
    assert result.returncode == 2 and "line 1 of the record is not JSON" in result.stderr
    result = nanollmserve("replay", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2 and "cannot read the record" in result.stderr


@pytest.mark.milestone("m24")
@pytest.mark.parametrize("value", [-1, (1 << 20) + 1])
def test_step_record_out_of_range_is_refused(value):
    with pytest.raises(UserError, match="step_record must be in"):
        EngineConfig(step_record=value)
    result = nanollmserve("serve", "--step-record", str(value), timeout=60)
    assert result.returncode == 2 and "step_record must be in" in result.stderr


@pytest.mark.milestone("m24")
@pytest.mark.timeout(400)
def test_a_priority_preemption_mid_run_is_recorded_with_its_reason_and_replays(
    make_llm, tmp_path, compat
):
    from cluster_process import tiny_model_dir

    from nanollmserve.engine.messages import EngineCoreRequest

    llm = make_llm(
        model=str(tiny_model_dir()),  # the tiny model: the scheduling is under test, not the model
        num_kv_blocks=8,
        max_model_len=128,
        enable_prefix_caching=False,
        scheduling_policy="priority",
        step_record_prompts=True,
    )
    engine = llm.engine
    low = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True, priority=10)
    high = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority=-5)
    for i in range(2):
        engine.add_request(EngineCoreRequest(f"low{i}", list(range(300 + 7 * i, 320 + 7 * i)), low))
    while engine.kv_cache.num_free_blocks >= 2:  # until the pool cannot hold the high prompt
        engine.step()
    arrival_step = engine.flight_recorder.num_steps
    engine.add_request(EngineCoreRequest("high", list(range(1000, 1020)), high))
    while engine.has_unfinished_requests():
        engine.step()
    steps = [record.to_json() for record in engine.flight_recorder.records()]
    assert [a["request_id"] for a in steps[arrival_step]["arrivals"]] == ["high"]
    preemptions = steps[arrival_step]["preemptions"]
    assert preemptions and all(p["reason"] == "priority" for p in preemptions)
    assert all(
        p["for_request_id"] == "high" and p["request_id"].startswith("low") for p in preemptions
    )
    compat.exercised("priority", preempted=sum(p["reason"] == "priority" for p in preemptions))
    compat.exercised("recorder", records=len(steps))
    engine.flight_recorder.write(tmp_path / "priority.jsonl")
    result = nanollmserve("replay", str(tmp_path / "priority.jsonl"))
    assert result.returncode == 0, result.stdout + result.stderr
