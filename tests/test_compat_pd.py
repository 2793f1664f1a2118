"""Prefill/decode disaggregation (`--policy pd`) with the other features, for the
compatibility matrix (scripts/compat_matrix.py).

One `nanollmserve cluster --prefill-workers 1 --decode-workers 1` on the bundled model's GGUF
blocks, its workers started with a LoRA adapter, ngram speculative decoding, priority
scheduling, the flight recorder, sleep mode and OpenTelemetry tracing at once; a request is
disaggregated when the router's phase-1 counter moves and the decode worker read the prompt's
blocks from the store (`cached_tokens`). "Answered correctly" is the decode worker's own
greedy answer to the same request with a fresh `cache_salt` (nothing cached, no phase 1).
A second, short-lived cluster runs the tiny model on int8 weights with the Qwen3 reasoning
parser. What cannot run disaggregated is refused at start, checked here in one line each.
`/v1/messages` and llama.cpp's `/completion` have no phase 1: a decode worker serves them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import anthropic
import httpx
import pytest
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    tiny_model_dir,
    wait_until,
)
from compat_stack import REPEATING_PROMPT, SPEC_NGRAM
from live_server import free_port
from lora_adapters import adapter_dir
from prometheus_client.parser import text_string_to_metric_families
from test_tracing_router import CLIENT, SERVER, OtlpReceiver

pytestmark = [pytest.mark.milestone("m26"), pytest.mark.timeout(300), pytest.mark.slow]

PHASE_ONES = "nanollmserve_router:pd_prefill_latency_seconds_count"
FALLBACKS = "nanollmserve_router:pd_prefill_fallbacks_total"
CLUSTER_ARGS = ["--prefill-workers", "1", "--decode-workers", "1", "--health-interval", "0.5"]
CLUSTER_ARGS += ["--shutdown-timeout", "5"]
FEATURE_ARGS = [
    "--num-kv-blocks", "256", "--disable-log-requests",
    "--enable-lora", "--max-lora-rank", "8", "--scheduling-policy", "priority",
    "--speculative-config", SPEC_NGRAM, "--step-record", "4096", "--enable-debug-endpoints",
    "--enable-sleep-mode",
]  # fmt: skip
ADMIN_KEY = "pd-admin-key"
"""The cluster's --admin-api-key: the router's admin surface and the workers' admin routes."""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GREEDY = {"temperature": 0, "max_tokens": 12}


class PD:
    """A running pd cluster: the router's URL and each worker's."""

    def __init__(self, cluster: ClusterProcess, base_port: int) -> None:
        self.cluster = cluster
        self.url = cluster.url
        self.prefill = f"http://127.0.0.1:{base_port}"
        self.decode = f"http://127.0.0.1:{base_port + 1}"
        self.phase_1 = 0
        """How far the router's phase-1 counter moved in the last `disaggregated` call."""

    def metric(self, name: str, url: str | None = None) -> float:
        text = httpx.get(f"{url or self.url}/metrics", timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def post(self, path: str, body: dict, url: str | None = None) -> httpx.Response:
        return httpx.post(f"{url or self.url}{path}", json=body, timeout=120)

    def disaggregated(self, path: str, body: dict, cached: bool = True) -> dict:
        """The router's answer to `body`, checked to have run phase 1 (and, with `cached`,
        to have read the prompt's blocks from the store)."""
        before = self.metric(PHASE_ONES)
        answer = self.post(path, body)
        assert answer.status_code == 200, answer.text
        self.phase_1 = self.metric(PHASE_ONES) - before
        assert self.phase_1 == 1
        if cached:
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        return answer.json()

    def colocated(self, path: str, body: dict) -> dict:
        """The decode worker's answer to `body` on its own: no phase 1, nothing cached."""
        answer = self.post(path, {**body, "cache_salt": uuid.uuid4().hex}, url=self.decode)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        return answer.json()


def start_pd(*args: str, env: dict | None = None) -> PD:
    base_port, router_port = free_consecutive_ports(2), free_port()
    monkeypatch = pytest.MonkeyPatch()
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    try:
        cluster = ClusterProcess.start(
            "cluster", router_port, "--base-port", str(base_port), "--router-port",
            str(router_port), *CLUSTER_ARGS, *args, admin_api_key=ADMIN_KEY,
        )  # fmt: skip
    finally:
        monkeypatch.undo()
    return PD(cluster, base_port)


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def pd(receiver):
    pd = start_pd(
        "--otlp-traces-endpoint", receiver.url, *FEATURE_ARGS,
        "--lora-modules", f"a={adapter_dir(1)}",
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip
    yield pd
    assert pd.cluster.stop() == 0


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _cached(answer: dict) -> int:
    """Prompt tokens the decode worker did not compute: read from the store (each test's
    prompt is new to the pool)."""
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_gguf_blocks_answer_through_pd_as_the_decode_worker_alone(pd, compat):
    body = {"prompt": "The lighthouse keeper climbed the narrow stairs every evening to "
            "light the lamp, and on the night of the storm he saw", "return_token_ids": True,
            **GREEDY}  # fmt: skip
    answer = pd.disaggregated("/v1/completions", body)
    expected = pd.colocated("/v1/completions", body)
    assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert "quantization=gguf" in pd.cluster.log()
    assert [w["kv_role"] for w in pd.cluster.stats()["workers"]] == ["prefill", "decode"]
    compat.exercised("pd", phase_1=pd.phase_1)
    compat.exercised("offload", loaded_tokens=_cached(answer))
    compat.exercised("router", routed=sum(w["num_routed"] for w in pd.cluster.stats()["workers"]))
    compat.exercised("gguf", quantization=compat.quantization_in_log(pd.cluster.log()))


def test_an_adapter_runs_both_phases(pd, compat):
    body = {"model": "a", "prompt": "A short story about a fox who found a golden key in the "
            "snow behind the old mill, told to children at bedtime:", **GREEDY}  # fmt: skip
    answer = pd.disaggregated("/v1/completions", body)
    assert answer["model"] == "a"
    compat.exercised("pd", phase_1=pd.phase_1)
    assert _text(answer) == _text(pd.colocated("/v1/completions", body))
    base = pd.disaggregated("/v1/completions", {k: v for k, v in body.items() if k != "model"})
    compat.exercised("lora", output=_text(answer), base=_text(base))


def test_ngram_drafts_run_on_the_decode_worker(pd, compat):
    drafts = pd.metric("nanollmserve:spec_decode_num_drafts_total", pd.decode)
    body = {"prompt": REPEATING_PROMPT, **GREEDY, "max_tokens": 24}
    answer = pd.disaggregated("/v1/completions", body)
    compat.exercised("pd", phase_1=pd.phase_1)
    drafted = pd.metric("nanollmserve:spec_decode_num_drafts_total", pd.decode) - drafts
    compat.exercised("spec", num_drafts=drafted)
    assert _text(answer) == _text(pd.colocated("/v1/completions", body))


def test_a_json_schema_holds_through_pd(pd, compat):
    body = {
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
        **GREEDY,
        "max_tokens": 24,
    }
    answer = pd.disaggregated("/v1/chat/completions", body)
    assert isinstance(json.loads(_text(answer))["ok"], bool)
    compat.exercised("pd", phase_1=pd.phase_1)
    compat.exercised("structured", output=_text(answer), schema=SCHEMA)
    assert _text(answer) == _text(pd.colocated("/v1/chat/completions", body))


def test_priority_is_taken_by_both_phases(pd, compat):
    body = {"prompt": "Three rules for sailing in fog near a rocky coast at night, written "
            "for a young deckhand:", **GREEDY}  # fmt: skip
    for priority in (-5, 7):
        seen = {url: len(_arrivals(url)) for url in (pd.prefill, pd.decode)}
        answer = pd.disaggregated("/v1/completions", {**body, "priority": priority})
        compat.exercised("pd", phase_1=pd.phase_1)
        for url in (pd.prefill, pd.decode):  # each phase's engine got it
            [arrival] = _arrivals(url)[seen[url] :]
            assert arrival["sampling_params"]["priority"] == priority
            compat.exercised("priority", recorded=arrival["sampling_params"]["priority"])
        assert _text(answer) == _text(pd.colocated("/v1/completions", body))
    before = pd.metric(PHASE_ONES)
    for hostile in ('"high"', "1.5", str(2**70), "[1]", "NaN", "-Infinity"):
        raw = json.dumps(body)[:-1] + f', "priority": {hostile}}}'
        bad = httpx.post(
            f"{pd.url}/v1/completions", content=raw, timeout=60,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        assert bad.status_code == 400, (hostile, bad.text)
        assert bad.json()["error"]["param"] == "priority"
    assert pd.metric(PHASE_ONES) == before  # phase 1 refused each: no phase 2


def test_token_level_io_through_pd(pd, compat):
    ids = httpx.post(
        f"{pd.decode}/tokenize", json={"prompt": "Seven wonders of the ancient world, each "
        "with the city it stood in and the century it was built:"}, timeout=30,
    ).json()["tokens"]  # fmt: skip
    body = {"prompt": ids, "return_token_ids": True, **GREEDY}
    answer = pd.disaggregated("/v1/completions", body)
    compat.exercised("pd", phase_1=pd.phase_1)
    compat.exercised("tokenio", token_ids=answer["choices"][0]["token_ids"])
    expected = pd.colocated("/v1/completions", body)
    assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    # prompt_logprobs compute the whole prompt on the decode worker: phase 1 runs, no hit.
    logprobs = {**body, "prompt_logprobs": 1}
    answer = pd.disaggregated("/v1/completions", logprobs, cached=False)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    expected = pd.colocated("/v1/completions", logprobs)
    assert answer["choices"][0]["prompt_logprobs"] == expected["choices"][0]["prompt_logprobs"]
    compat.exercised("tokenio", prompt_logprobs=answer["choices"][0]["prompt_logprobs"])


def _arrivals(url: str) -> list[dict]:
    answer = httpx.get(f"{url}/debug/steps", headers=ADMIN, timeout=30)  # an admin route
    assert answer.status_code == 200, answer.text
    lines = answer.text.splitlines()
    return [arrival for line in lines[1:] for arrival in json.loads(line)["arrivals"]]


def test_both_workers_record_their_phase(pd, compat):
    body = {"prompt": "Notes from a beekeeper's diary in early spring, when the first "
            "willows flower along the river:", **GREEDY}  # fmt: skip
    seen = {url: len(_arrivals(url)) for url in (pd.prefill, pd.decode)}
    pd.disaggregated("/v1/completions", body)
    compat.exercised("pd", phase_1=pd.phase_1)
    [phase_1] = _arrivals(pd.prefill)[seen[pd.prefill] :]
    [phase_2] = _arrivals(pd.decode)[seen[pd.decode] :]
    recorded = sum(len(_arrivals(url)) - seen[url] for url in (pd.prefill, pd.decode))
    compat.exercised("recorder", records=recorded)
    assert phase_1["sampling_params"]["max_tokens"] == 1
    assert phase_2["sampling_params"]["max_tokens"] == GREEDY["max_tokens"]
    # The router forwards no admin route (m27): a worker's record is read on its own port.
    assert httpx.get(f"{pd.url}/debug/steps", headers=ADMIN, timeout=30).status_code == 404


def test_one_trace_holds_both_phases(pd, receiver, compat):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    body = {"messages": [{"role": "user", "content": "Name three old harbour towns on the "
            "North Sea and one thing each was known for."}], **GREEDY}  # fmt: skip
    before = pd.metric(PHASE_ONES)
    answer = httpx.post(
        f"{pd.url}/v1/chat/completions", json=body, timeout=120,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )  # fmt: skip
    assert answer.status_code == 200 and pd.metric(PHASE_ONES) == before + 1
    compat.exercised("pd", phase_1=pd.metric(PHASE_ONES) - before)

    def spans():  # the router's span, its two calls and the workers' spans, once all arrived
        found = receiver.trace(trace_id)
        router = [s for s in found if s["service"] == "nanollmserve-router"]
        workers = [s for s in found if s["service"] == "nanollmserve"]
        return len(router) == 3 and len(workers) == 2 and found

    found = wait_until(spans, 60, "the router's and both workers' spans")
    calls = {s["span_id"]: s for s in found if s["kind"] == CLIENT}
    assert len(calls) == 2
    workers = [s for s in found if s["service"] == "nanollmserve"]
    assert all(s["kind"] == SERVER and s["parent_id"] in calls for s in workers)
    tokens = sorted(s["attributes"]["gen_ai.request.max_tokens"] for s in workers)
    assert tokens == [1, GREEDY["max_tokens"]]
    compat.exercised("tracing", spans=len(found))


def test_messages_are_served_by_a_decode_worker_without_phase_1(pd, compat):
    conversation = [{"role": "user", "content": "Write one sentence about the sea."}]
    before = pd.metric(PHASE_ONES)
    seen = {url: len(_arrivals(url)) for url in (pd.prefill, pd.decode)}
    client = anthropic.Anthropic(base_url=pd.url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(
        model="", max_tokens=12, messages=conversation, extra_body={"temperature": 0}
    )
    assert pd.metric(PHASE_ONES) == before
    assert len(_arrivals(pd.prefill)) == seen[pd.prefill]
    assert len(_arrivals(pd.decode)) == seen[pd.decode] + 1
    chat = pd.disaggregated("/v1/chat/completions", {"messages": conversation, **GREEDY})
    assert [block.text for block in message.content] == [_text(chat)]
    compat.exercised("messages", message=message)
    compat.exercised("pd", phase_1=pd.phase_1)


def test_llamacpp_completion_is_served_by_a_decode_worker_without_phase_1(pd, compat):
    """llama.cpp's `/completion` is not one of the router's two-phase paths (`router/pd.py`'s
    TWO_PHASE_PATHS): a decode worker prefills its prompt itself, as for `/v1/messages`,
    and the answer is the disaggregated `/v1/completions` one."""
    prompt = ("The orchard keeper's almanac for the last week of autumn, with the pears and "
              "the apples still on the trees:")  # fmt: skip
    before = pd.metric(PHASE_ONES)
    seen = {url: len(_arrivals(url)) for url in (pd.prefill, pd.decode)}
    native = pd.post("/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0})
    assert native.status_code == 200, native.text
    assert pd.metric(PHASE_ONES) == before
    assert len(_arrivals(pd.prefill)) == seen[pd.prefill]
    assert len(_arrivals(pd.decode)) == seen[pd.decode] + 1
    assert native.json()["tokens_cached"] == 0  # the decode worker computed the prompt
    completion = pd.disaggregated("/v1/completions", {"prompt": prompt, **GREEDY})
    assert native.json()["content"] == _text(completion)
    compat.exercised("llamacpp", completion=native.json())
    compat.exercised("pd", phase_1=pd.phase_1)


def test_embeddings_through_pd_are_a_400(pd, compat):
    answer = pd.post("/v1/embeddings", {"input": "hello"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "--runner pooling" in error["message"]
    compat.refused("embed", "pd", error["message"])


def test_a_sleeping_worker_under_pd(pd, compat):
    body = {"prompt": "The ferry timetable for the islands in winter, with the first and last "
            "boat of each day:", **GREEDY}  # fmt: skip
    expected = _text(pd.colocated("/v1/completions", body))
    fallbacks = pd.metric(FALLBACKS)

    def admin(action: str, url: str) -> None:  # the router's admin surface (m27)
        answer = httpx.post(
            f"{pd.url}/admin/workers/{action}", params={"url": url, "level": "1"}, headers=ADMIN,
            timeout=60,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text

    admin("sleep", pd.prefill)
    try:  # no prefill worker in the rotation: the decode worker prefills it itself
        answer = pd.post("/v1/completions", body)
        assert answer.status_code == 200 and _text(answer.json()) == expected
        assert pd.metric(FALLBACKS) == fallbacks + 1
    finally:
        admin("wake_up", pd.prefill)
    admin("sleep", pd.decode)
    try:
        # The router sends a sleeping worker nothing (m27): with no other decode worker it
        # answers 503 itself.
        asleep = pd.post("/v1/completions", {**body, "prompt": body["prompt"] + " Monday"})
        assert asleep.status_code == 503
        assert "asleep" in asleep.json()["error"]["message"]
        compat.exercised("sleep", asleep="asleep" in asleep.json()["error"]["message"])
    finally:
        admin("wake_up", pd.decode)
    # The store outlives the decode worker's sleep: its pool refills from it.
    answer = pd.disaggregated("/v1/completions", body)
    assert _text(answer) == expected
    compat.exercised("pd", phase_1=pd.phase_1)


def test_int8_weights_and_the_reasoning_parser_through_pd(compat):
    pd = start_pd(
        str(tiny_model_dir()), *WORKER_ARGS, "--quantization", "int8",
        "--reasoning-parser", "qwen3",
    )  # fmt: skip
    try:
        assert "quantization=int8" in pd.cluster.log()
        compat.exercised("int8", quantization=compat.quantization_in_log(pd.cluster.log()))
        body = {"prompt": "A list of the tools a carpenter keeps in the workshop, from the "
                "largest saw to the smallest awl:", "return_token_ids": True, **GREEDY}  # fmt: skip
        answer = pd.disaggregated("/v1/completions", body)
        expected = pd.colocated("/v1/completions", body)
        assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        # A thinking block the prompt opens comes back as reasoning_content.
        opened = [
            {"role": "user", "content": "Think about the tides of the sea, then say hi."},
            {"role": "assistant", "content": "<think>"},
        ]
        chat = pd.disaggregated(
            "/v1/chat/completions",
            {"messages": opened, "continue_final_message": True, "add_generation_prompt": False,
             "return_token_ids": True, **GREEDY},
        )  # fmt: skip
        raw = pd.colocated("/v1/completions", {"prompt": chat["prompt_token_ids"], **GREEDY})
        thinking, _, content = _text(raw).partition("</think>")
        message = chat["choices"][0]["message"]
        assert thinking and message["reasoning_content"] == thinking
        assert (message["content"] or "") == content
        compat.exercised("reasoning", reasoning_content=message["reasoning_content"])
        compat.exercised("pd", phase_1=pd.phase_1)
    finally:
        assert pd.cluster.stop() == 0


def _refusal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message", "feature"),
    [
        (["--runner", "pooling"], "kv_offload_dir extends the prefix cache", "embed"),
        (
            ["--kv-cache-dtype", "int8"],
            "kv_cache_dtype int8 is not supported with kv_offload_dir",
            "kvdtype",
        ),
    ],
    ids=["pooling", "kv-cache-dtype"],
)
def test_a_worker_role_refuses_what_the_store_cannot_carry(
    tmp_path, flags, message, feature, compat
):
    done = _refusal("serve", "--kv-role", "decode", "--kv-offload-dir", str(tmp_path), *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    compat.refused(feature, "pd", done.stderr)


def test_the_pd_router_has_no_grpc_port(compat):
    done = _refusal("router", "--policy", "pd", "--worker", "http://127.0.0.1:1",
                    "--grpc-port", "50051")  # fmt: skip
    assert done.returncode == 2 and "unrecognized arguments: --grpc-port" in done.stderr
    compat.refused("grpc", "pd", done.stderr)
