"""The memory features with the others (compatibility matrix, m25), on in-process servers
(test_compat_recorder.py's `RecordedServer`: the step recorder and an in-memory span exporter)
running the scripted Qwen3 checkpoint (`reasoning_model.py`) on int8 weights with the qwen3
reasoning parser and scheduling by priority:

- an int8 KV cache (`kv_cache_dtype="int8"`) with sleep mode: a chat with token-level I/O and
  an Anthropic message are answered, traced and recorded; a level-2 sleep (weights and pool
  freed) answers 503 on both routes (and on llama.cpp's `/completion`) and the wake gives the
  same tokens and prompt logprobs;
  the record, sleep included, replays identically;
- the KV offload directory (`kv_offload_dir`): a second server on the first one's directory
  reads the prefixes of a chat, a schema-constrained chat and a message from it, with the
  same answers, and the prefix of a llama.cpp `/completion`; `prompt_logprobs` requests
  compute their prompt; the record replays;
- the pooling runner (embeddings) with an int8 KV cache and across a sleep, offline.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import anthropic
import pytest
import torch
from cluster_process import tiny_model_dir
from reasoning_model import (
    ANSWER,
    SCRIPT,
    THINKING,
    VERDICT_SCHEMA,
    VERDICTS,
    make_reasoning_model,
)
from test_compat_recorder import RecordedServer

from nanollmserve import LLM

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(400), pytest.mark.slow]

SYSTEM = "You are terse. " + " ".join(f"Rule {i}: answer in one line." for i in range(12))
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it ok?"}]
TOKEN_IO = {"return_token_ids": True, "prompt_logprobs": 1}
ADMIN_KEY = "compat-memory-admin-key"
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": VERDICT_SCHEMA,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning")))


def reasoning_server(model_dir: str, **engine_args) -> RecordedServer:
    engine_args = {
        "model": model_dir,
        "quantization": "int8",
        "scheduling_policy": "priority",
        **engine_args,
    }
    return RecordedServer(engine_args, reasoning_parser="qwen3", admin_api_key=ADMIN_KEY)


def chat(server: RecordedServer, **extra_body):
    return server.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, extra_body=extra_body
    )


def message(server: RecordedServer):
    return server.anthropic().messages.create(
        model="tiny", max_tokens=40, system=SYSTEM, messages=MESSAGES[1:],
        extra_body={"temperature": 0},
    )  # fmt: skip


NATIVE = {"prompt": f"{SYSTEM}\nIs it ok?\n", "n_predict": 40, "temperature": 0}
"""A llama.cpp `/completion` request: a raw prompt (the script follows its newline, its
text unsplit by the parser), long enough to fill prefix-cache blocks."""


def native(server: RecordedServer) -> dict:
    """llama.cpp's `/completion` answer to NATIVE (with the generated token ids)."""
    answer = server.client.post("/completion", json={**NATIVE, "return_tokens": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


def assert_thinks_then_answers(completion) -> None:
    reply = completion.choices[0].message
    assert (reply.reasoning_content, reply.content) == (THINKING, ANSWER)


def kv_pool(server: RecordedServer) -> torch.Tensor:
    return server.engine.engine_loop.engine.model_runner.kv_cache


def post(server: RecordedServer, path: str, **params):
    """An admin route (the sleep routes): the admin key (m27)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return server.client.post(path, params=params, headers=headers)


def replays_identically(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout, result.stdout


def replay(path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nanollmserve.cli.main", "replay", str(path), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


# -- an int8 KV cache, with sleep mode ------------------------------------------------------


@pytest.fixture(scope="module")
def int8_kv(model_dir):
    server = reasoning_server(model_dir, kv_cache_dtype="int8", enable_sleep_mode=True)
    yield server
    server.close()


def test_an_int8_kv_cache_thinks_answers_with_token_io_traced_and_recorded(int8_kv, compat):
    assert kv_pool(int8_kv).dtype == torch.int8
    completion = chat(int8_kv, priority=-1, **TOKEN_IO)
    assert_thinks_then_answers(completion)
    assert len(completion.prompt_logprobs) == len(completion.prompt_token_ids)
    span = int8_kv.exporter.get_finished_spans()[-1]
    assert span.name == "chat tiny"
    assert span.attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    arrival = int8_kv.arrivals()[-1]
    assert arrival["prompt_token_ids"] == completion.prompt_token_ids
    assert arrival["sampling_params"]["priority"] == -1
    compat.exercised("int8", quantization=int8_kv.engine.info.quantization)
    compat.exercised("kvdtype", kv_cache_dtype=kv_pool(int8_kv).dtype)
    compat.exercised("priority", recorded=arrival["sampling_params"]["priority"])
    compat.exercised("reasoning", reasoning_content=completion.choices[0].message.reasoning_content)
    compat.exercised("recorder", records=len(int8_kv.arrivals()))
    compat.exercised("tokenio", token_ids=completion.prompt_token_ids)
    compat.exercised("tracing", spans=len(int8_kv.exporter.get_finished_spans()))


def test_an_int8_kv_cache_answers_an_anthropic_message(int8_kv, compat):
    reply = message(int8_kv)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[1].text == ANSWER
    compat.exercised("kvdtype", kv_cache_dtype=kv_pool(int8_kv).dtype)
    compat.exercised("messages", message=reply)


def test_a_level_2_sleep_refuses_both_routes_and_the_wake_gives_the_same_tokens(int8_kv, compat):
    before = chat(int8_kv, priority=1, **TOKEN_IO)
    assert message(int8_kv).usage.cache_read_input_tokens > 0  # its prefix is in the pool
    native(int8_kv)
    native_before = native(int8_kv)  # its prefix is in the pool too
    assert post(int8_kv, "/sleep", level="2").status_code == 200
    try:
        asleep = int8_kv.client.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}
        )
        assert asleep.status_code == 503 and asleep.headers["retry-after"]
        assert asleep.json()["error"]["code"] == "engine_sleeping"
        compat.exercised("sleep", asleep=asleep.json()["error"]["code"] == "engine_sleeping")
        with pytest.raises(anthropic.APIStatusError) as refused:
            message(int8_kv)
        assert refused.value.status_code == 503
        asleep = int8_kv.client.post("/completion", json=NATIVE)  # llama.cpp's route too
        assert asleep.status_code == 503 and asleep.headers["retry-after"]
        assert asleep.json()["error"]["code"] == "engine_sleeping"
    finally:
        assert post(int8_kv, "/wake_up").status_code == 200
    assert kv_pool(int8_kv).dtype == torch.int8  # a fresh int8 pool, int8 weights reloaded
    reply = message(int8_kv)  # its prompt was cached before the sleep, which emptied the pool
    assert reply.content[1].text == ANSWER and reply.usage.cache_read_input_tokens == 0
    after = chat(int8_kv, priority=1, **TOKEN_IO)
    assert_thinks_then_answers(after)
    assert after.choices[0].token_ids == before.choices[0].token_ids
    assert after.prompt_logprobs == before.prompt_logprobs
    assert int8_kv.exporter.get_finished_spans()[-1].name == "chat tiny"
    compat.exercised("int8", quantization=int8_kv.engine.info.quantization)
    compat.exercised("kvdtype", kv_cache_dtype=kv_pool(int8_kv).dtype)
    compat.exercised("messages", message=reply)
    compat.exercised("priority", recorded=int8_kv.arrivals()[-1]["sampling_params"]["priority"])
    compat.exercised("reasoning", reasoning_content=after.choices[0].message.reasoning_content)
    compat.exercised("tokenio", token_ids=after.choices[0].token_ids)
    compat.exercised("tracing", spans=len(int8_kv.exporter.get_finished_spans()))
    native_after = native(int8_kv)  # the pool the sleep emptied: computed again, same tokens
    assert native_after["tokens"] == native_before["tokens"]
    assert native_after["content"] == native_before["content"] == SCRIPT
    assert native_after["tokens_cached"] == 0 < native_before["tokens_cached"]
    compat.exercised("llamacpp", completion=native_after)


def test_the_int8_kv_record_with_its_sleep_replays_identically(int8_kv, tmp_path, compat):
    # This test sleeps the engine itself (it does not lean on the test above having run), so
    # the record it replays holds a sleep between two requests.
    before = chat(int8_kv, priority=2, **TOKEN_IO)
    assert post(int8_kv, "/sleep", level="2").status_code == 200
    assert post(int8_kv, "/wake_up").status_code == 200
    after = chat(int8_kv, priority=2, **TOKEN_IO)
    assert after.choices[0].token_ids == before.choices[0].token_ids
    lines = [json.loads(line) for line in int8_kv.engine.step_record_lines()]
    assert any(step.get("sleeps") for step in lines[1:]), "the record holds no sleep"
    replays_identically(int8_kv.replay(tmp_path / "int8-kv.jsonl"))
    compat.exercised("recorder", records=len(lines) - 1)
    compat.exercised("sleep", asleep=any(step.get("sleeps") for step in lines[1:]))
    compat.exercised("kvdtype", kv_cache_dtype=kv_pool(int8_kv).dtype)


# -- the KV offload directory, read by a restarted server -----------------------------------


@pytest.fixture(scope="module")
def restarted(model_dir, tmp_path_factory):
    """The first server's answers (its directory filled, then shut down) and a second
    server on the same directory, its pool empty."""
    store = str(tmp_path_factory.mktemp("kv-offload"))
    first = reasoning_server(model_dir, kv_offload_dir=store)
    try:
        answers = {
            "chat": chat(first, priority=-1, return_token_ids=True),
            "schema": chat(first, response_format=SCHEMA),
            "message": message(first),
            "native": native(first),
        }
        assert answers["chat"].usage.prompt_tokens_details.cached_tokens == 0
        first_record = tmp_path_factory.mktemp("records") / "first.jsonl"
        first_record.write_text("".join(f"{line}\n" for line in first.engine.step_record_lines()))
    finally:
        first.close()
    second = reasoning_server(model_dir, kv_offload_dir=store)
    second.answers, second.first_record, second.store = answers, first_record, store
    yield second
    second.close()


def test_a_restarted_int8_reasoning_server_reads_the_prefix_from_the_store(restarted, compat):
    completion = chat(restarted, priority=-1, return_token_ids=True)
    assert completion.usage.prompt_tokens_details.cached_tokens >= 32
    assert_thinks_then_answers(completion)
    assert completion.choices[0].token_ids == restarted.answers["chat"].choices[0].token_ids
    span = restarted.exporter.get_finished_spans()[-1]
    assert span.name == "chat tiny"
    assert restarted.arrivals()[-1]["sampling_params"]["priority"] == -1
    compat.exercised("int8", quantization=restarted.engine.info.quantization)
    compat.exercised("offload", loaded_tokens=completion.usage.prompt_tokens_details.cached_tokens)
    compat.exercised("priority", recorded=restarted.arrivals()[-1]["sampling_params"]["priority"])
    compat.exercised("reasoning", reasoning_content=completion.choices[0].message.reasoning_content)
    compat.exercised("tokenio", token_ids=completion.choices[0].token_ids)
    compat.exercised("tracing", spans=len(restarted.exporter.get_finished_spans()))


def test_a_schema_constrained_chat_reads_the_store(restarted, compat):
    completion = chat(restarted, response_format=SCHEMA)
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    content = completion.choices[0].message.content
    assert json.loads(content) in VERDICTS, content  # the grammar's answer, not ANSWER
    assert content == restarted.answers["schema"].choices[0].message.content
    assert completion.choices[0].message.reasoning_content == THINKING
    compat.exercised("offload", loaded_tokens=completion.usage.prompt_tokens_details.cached_tokens)
    compat.exercised("structured", output=content, schema=SCHEMA["json_schema"]["schema"])


def test_a_message_reads_the_store(restarted, compat):
    reply = message(restarted)
    assert reply.usage.cache_read_input_tokens > 0
    assert reply.content[1].text == restarted.answers["message"].content[1].text == ANSWER
    compat.exercised("messages", message=reply)
    compat.exercised("offload", loaded_tokens=reply.usage.cache_read_input_tokens)


def test_a_llamacpp_completion_reads_the_store(restarted, compat):
    answer = native(restarted)
    assert answer["tokens_cached"] > 0 and answer["timings"]["cache_n"] == answer["tokens_cached"]
    assert answer["tokens"] == restarted.answers["native"]["tokens"]
    assert answer["content"] == SCRIPT
    compat.exercised("llamacpp", completion=answer)
    compat.exercised("offload", loaded_tokens=answer["tokens_cached"])


def test_prompt_logprobs_compute_the_prompt_instead_of_reading_the_store(restarted):
    completion = chat(restarted, **TOKEN_IO)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    assert len(completion.prompt_logprobs) == len(completion.prompt_token_ids)
    assert all(
        math.isfinite(next(iter(entry.values()))["logprob"])
        for entry in completion.prompt_logprobs[1:]
    )


def prompt_tokens_not_computed(record_lines) -> dict[str, int]:
    """Per request in a flight record: prompt tokens its prefill steps did not compute (read
    from the pool or the store)."""
    steps = [json.loads(line) for line in record_lines][1:]
    prompts = {a["request_id"]: len(a["prompt_token_ids"]) for s in steps for a in s["arrivals"]}
    computed = dict.fromkeys(prompts, 0)
    for step in steps:
        for entry in step["batch"]:
            if entry["phase"] == "prefill":
                computed[entry["request_id"]] += entry["num_tokens"]
    return {rid: prompts[rid] - computed[rid] for rid in prompts}


def test_records_of_the_store_servers_replay_from_the_pool_or_the_named_store(
    restarted, tmp_path, compat
):
    # The first server computed every prefix: its record replays although the directory now
    # holds them (a replay reads no directory unless told to).
    replays_identically(replay(restarted.first_record))
    # The second read its first prefix from the directory (its pool started empty), and its
    # record shows it: that request's prefill skipped the prompt tokens the store held.
    chat(restarted)  # at least one request, when this test runs alone
    skipped = prompt_tokens_not_computed(restarted.engine.step_record_lines())
    compat.exercised("recorder", records=len(skipped))
    compat.exercised("offload", loaded_tokens=next(iter(skipped.values())))
    # Without the directory the replay computes those prefixes and says where it differs...
    second = restarted.replay(tmp_path / "second.jsonl")
    assert second.returncode == 1 and "num_tokens recorded" in second.stdout, second.stdout
    # ...and with the directory named on the command line it reads them as the server did.
    replays_identically(replay(tmp_path / "second.jsonl", "--kv-offload-dir", restarted.store))


# -- embeddings -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir():
    return str(tiny_model_dir())


def embeddings(llm: LLM) -> list[list[float]]:
    return [output.outputs[0].embedding for output in llm.embed(["a b c d e f", "g h"])]


def test_the_pooling_runner_embeds_from_an_int8_kv_cache_like_float32(tiny_dir, compat):
    int8 = LLM(model=tiny_dir, runner="pooling", dtype="float32", kv_cache_dtype="int8")
    plain = LLM(model=tiny_dir, runner="pooling", dtype="float32")
    try:
        assert int8.engine.model_runner.kv_cache.dtype == torch.int8
        ours, reference = torch.tensor(embeddings(int8)), torch.tensor(embeddings(plain))
        compat.exercised("kvdtype", kv_cache_dtype=int8.engine.model_runner.kv_cache.dtype)
        compat.exercised("embed", embedding=ours[0].tolist())
    finally:
        int8.shutdown()
        plain.shutdown()
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("level", [1, 2])
def test_the_pooling_runner_embeds_the_same_across_a_sleep(tiny_dir, level, compat):
    llm = LLM(model=tiny_dir, runner="pooling", dtype="float32", enable_sleep_mode=True)
    try:
        before = embeddings(llm)
        llm.sleep(level)
        compat.exercised("sleep", asleep=llm.engine.sleep_level == level)
        with pytest.raises(ValueError, match="asleep"):
            llm.embed(["a b c"])
        llm.wake_up()
        assert embeddings(llm) == before
        compat.exercised("embed", embedding=before[0])
    finally:
        llm.shutdown()
