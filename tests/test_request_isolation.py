"""One request never fails another: hostile sampling parameters beside innocent requests,
and a failure injected into one request's sampling (`NANOLLMSERVE_FAIL_SAMPLING_SEED`),
through a live HTTP server and the offline `LLM`.

Hostile requests get a 400 naming their parameter or a valid answer; the request whose
sampling fails gets a 500 (or, streaming, a last chunk with finish_reason "error"); every
innocent request gets the same answer as alone, and the server stays up.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from live_server import LiveServer

from nanollmserve import SamplingParams

pytestmark = pytest.mark.milestone("m21")

FAILING_SEED = 4242
"""Preparing the sampling of a request with this seed raises (fault injection)."""
INNOCENT = {
    "messages": [{"role": "user", "content": "Name a color."}],
    "max_tokens": 8,
    "temperature": 0,
}
CHOICE_MIN_TOKENS = {"structured_outputs": {"choice": ["a"]}, "min_tokens": 5}

# (JSON body without the messages, the parameter a 400 must name or None: a valid answer).
# NaN and Infinity are what Python's JSON encoder (and many clients) send for float("nan").
HOSTILE = [
    ({"temperature": 1e-40, "logprobs": True, "top_logprobs": 2, "max_tokens": 6}, None),
    ({"temperature": 1e-40, "max_tokens": 6}, None),
    ({"temperature": 1e-40, "top_p": 0.5, "max_tokens": 6}, None),
    ({"repetition_penalty": 1e-30, "max_tokens": 6}, "repetition_penalty"),
    ({**CHOICE_MIN_TOKENS, "logprobs": True, "top_logprobs": 3}, None),
    ({**CHOICE_MIN_TOKENS, "logprobs": True, "temperature": 0.7, "top_p": 0.9}, None),
    ({"temperature": float("nan"), "max_tokens": 6}, "temperature"),
    ({"top_p": float("inf"), "max_tokens": 6}, "top_p"),
    ({"presence_penalty": float("-inf"), "max_tokens": 6}, "presence_penalty"),
    ({"logit_bias": {"5": float("nan")}, "max_tokens": 6}, "logit_bias"),
]


@pytest.fixture(scope="module")
def server():
    server = LiveServer.start(
        "--num-kv-blocks", "256", env={"NANOLLMSERVE_FAIL_SAMPLING_SEED": str(FAILING_SEED)}
    )
    yield server
    server.stop()


def post_chat(client: httpx.Client, body: dict) -> httpx.Response:
    content = json.dumps(body)  # allow_nan: NaN / Infinity literals, as many clients send
    headers = {"Content-Type": "application/json"}
    return client.post("/v1/chat/completions", content=content, headers=headers)


def assert_error_shape(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def compile_choice_grammar(client: httpx.Client) -> None:
    """Send one valid choice request until it is answered: the grammar compiler's first use
    (its tokenizer tables) must not run into the compile deadline on a loaded machine."""
    deadline = time.monotonic() + 120
    while True:
        response = post_chat(client, {**INNOCENT, **CHOICE_MIN_TOKENS})
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return


def alive(server: LiveServer) -> None:
    assert server.process.poll() is None, server.log()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.timeout(600)
def test_hostile_sampling_parameters_never_hurt_innocent_requests(server):
    with server.client() as client:
        expected = post_chat(client, INNOCENT).json()["choices"][0]["message"]["content"]
        compile_choice_grammar(client)
        # 50 hostile requests, each followed by an innocent one, 12 in flight at a time.
        jobs = [("hostile", HOSTILE[i % len(HOSTILE)]) for i in range(50)]
        jobs = [job for pair in zip(jobs, [("innocent", None)] * 50, strict=True) for job in pair]

        def send(job):
            kind, hostile = job
            body = dict(INNOCENT) if kind == "innocent" else {**INNOCENT, **hostile[0]}
            return job, post_chat(client, body)

        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(send, jobs))
    for (kind, hostile), response in results:
        assert response.status_code < 500, (kind, hostile, response.text)
        if kind == "innocent":
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == expected
            continue
        body, param = hostile
        if param is not None:
            assert_error_shape(response, 400, param)
        else:
            assert response.status_code == 200, (body, response.text)
            [choice] = response.json()["choices"]
            assert choice["finish_reason"] in ("stop", "length"), choice
    alive(server)
    assert server.wait_idle()["num_requests_running"] == 0


@pytest.mark.timeout(300)
def test_a_request_whose_sampling_fails_fails_alone_over_http(server):
    failing = {**INNOCENT, "seed": FAILING_SEED, "temperature": 0.8}
    with server.client() as client:
        expected = post_chat(client, INNOCENT).json()["choices"][0]["message"]["content"]

        def send(body):
            if body.get("stream"):
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
                return response.status_code, lines
            return post_chat(client, body)

        bodies = [INNOCENT, failing, INNOCENT, {**failing, "stream": True}, INNOCENT] * 3
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(send, bodies))
    for body, result in zip(bodies, results, strict=True):
        if body is INNOCENT:
            assert result.status_code == 200, result.text
            assert result.json()["choices"][0]["message"]["content"] == expected
        elif body.get("stream"):
            status, lines = result
            assert status == 200
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert reasons[-1] == "error", chunks
        else:
            error = assert_error_shape(result, 500)
            assert error["type"] == "server_error"
    alive(server)
    stats = server.wait_idle()
    assert stats["num_requests_running"] == 0
    with server.client() as client:
        metrics = client.get("/metrics").text
    failed = [line for line in metrics.splitlines()
              if line.startswith("nanollmserve:num_failed_requests_total{")]  # fmt: skip
    assert failed and float(failed[0].split()[-1]) >= 6, failed  # never counted as successes


@pytest.mark.timeout(300)
def test_a_request_whose_sampling_fails_fails_alone_offline(make_llm, monkeypatch):
    monkeypatch.setenv("NANOLLMSERVE_FAIL_SAMPLING_SEED", str(FAILING_SEED))
    llm = make_llm()
    prompts = ["The capital of France is", "One, two, three,", "The sky is"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    failing = SamplingParams(temperature=0.8, seed=FAILING_SEED, max_tokens=8)
    outputs = llm.generate(
        [prompts[0], "Hello", prompts[1], prompts[2]],
        [greedy, failing, greedy, greedy],
        use_tqdm=False,
    )
    assert outputs[1].outputs[0].finish_reason == "error"
    assert [outputs[i].outputs[0].text for i in (0, 2, 3)] == alone
    assert all(outputs[i].outputs[0].finish_reason == "length" for i in (0, 2, 3))


@pytest.mark.timeout(600)
def test_native_entry_points_refuse_out_of_range_inputs(make_llm):
    """Through the Python wrappers (a ValueError before any native code runs) and, for the
    C's own checks, straight through ctypes: a status, never a read out of bounds."""
    import ctypes
    from types import SimpleNamespace

    from nanollmserve.engine.step_batch import StepBatch, StepSpan
    from nanollmserve.native import ops

    if ops.kernels_unavailable_reason():
        pytest.skip(ops.kernels_unavailable_reason())
    llm = make_llm(quantization="gguf", block_size=16, num_kv_blocks=64)
    step = llm.engine.model_runner.native_decode
    vocab, library, model = step.vocab_size, ops.load_kernels(), ctypes.byref(step._struct)
    for tokens, position, blocks, what in [
        ([vocab], 0, [0], "vocabulary"),
        ([1, -1], 0, [0], "vocabulary"),
        ([1], -1, [0], "positions"),
        ([1], 10**6, [0], "positions"),
        ([1], 16, [0], "does not reach"),
        ([1, 2], 15, [0], "does not reach"),
        ([1], 0, [64], "outside"),
        ([1], 0, [-1], "outside"),
        ([], 0, [0], "at least one token"),
    ]:
        with pytest.raises(ValueError, match=what):
            step(StepBatch.of([StepSpan(tokens, position, blocks, 1)]))
    with pytest.raises(ValueError, match="num_logits"):
        step(StepBatch.of([StepSpan([1, 2], 0, [0], 3)]))
    with pytest.raises(ValueError, match="vocabulary"):  # the second sequence's token
        step(StepBatch.of([StepSpan([1], 0, [0], 1), StepSpan([vocab], 0, [1], 1)]))

    def raw_step(
        tokens: list[int], position: int, blocks: list[int], scratch: int = 0, seq: int = 0
    ) -> int:
        table = torch.tensor([blocks], dtype=torch.int64)
        ids = torch.tensor(tokens, dtype=torch.int64)
        positions = torch.arange(position, position + len(tokens))
        seqs = torch.full((len(tokens),), seq, dtype=torch.int64)
        rows = torch.arange(len(tokens))
        out = torch.empty(len(tokens), vocab)
        size = scratch or library.nls_decode_scratch_bytes(model, len(tokens), 1)
        buffer = torch.empty(size, dtype=torch.uint8)
        return library.nls_decode_step(
            model, ids.data_ptr(), positions.data_ptr(), seqs.data_ptr(), len(tokens),
            table.data_ptr(), 1, len(blocks), rows.data_ptr(), len(tokens),
            buffer.data_ptr(), size, out.data_ptr(), 1,
        )  # fmt: skip

    assert raw_step([vocab], 0, [0]) == -3  # NLS_BAD_TOKEN
    assert raw_step([1, 2, vocab], 0, [0]) == -3
    assert raw_step([1], step.max_context, [0]) == -2  # NLS_BAD_POSITION
    assert raw_step([1, 2], step.max_context - 1, [0] * 10**4) == -2
    assert raw_step([1, 2], 15, [0]) == -2  # the second token's position is past the table
    assert raw_step([1], 0, [step.num_blocks]) == -4  # NLS_BAD_BLOCK
    assert raw_step([1, 2], 15, [0, step.num_blocks]) == -4  # the second token's block
    assert raw_step([1, 2], 0, [0], scratch=64) == -5  # NLS_BAD_SHAPE: scratch too small
    assert raw_step([1, 2], 0, [0], seq=1) == -5  # a sequence without a block table
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].text

    attention = llm.engine.model_runner.attention_layers[0]
    q = torch.randn(1, attention.num_heads, attention.head_dim)
    for tables, lens in [([[64]], [3]), ([[-1]], [3]), ([[0]], [17])]:
        ctx = SimpleNamespace(
            decode_block_tables=torch.tensor(tables), decode_context_lens=torch.tensor(lens)
        )
        with pytest.raises(ValueError, match="block"):
            attention._decode_native(q, ctx)
    k_cache = attention.k_cache
    out = torch.empty_like(q)
    scores = torch.empty(1 << 16, dtype=torch.uint8)

    def raw_attention(table: list[int], length: int, kv_dtype: int | None = None) -> int:
        tables, lens = torch.tensor([table]), torch.tensor([length])
        kv_dtype = ops.KV_DTYPE_CODES[k_cache.dtype] if kv_dtype is None else kv_dtype
        return library.nls_paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), attention.v_cache.data_ptr(), None, None, kv_dtype,
            1, attention.num_heads, attention.num_kv_heads, attention.head_dim, k_cache.shape[1],
            k_cache.shape[0], attention.scale, tables.data_ptr(), 1, lens.data_ptr(),
            out.data_ptr(), scores.data_ptr(), scores.numel(), 1,
        )  # fmt: skip

    assert raw_attention([0], 17) == -2  # longer than its one block of 16
    assert raw_attention([-5], 3) == -4
    assert raw_attention([k_cache.shape[0]], 3) == -4  # one past the pool
    assert raw_attention([0], 3, kv_dtype=7) == -5  # a K/V type it does not know
    assert raw_attention([0], 3, kv_dtype=ops.NLS_KV_INT8) == -5  # int8 without its scales
    assert raw_attention([0], 3) == 0

    projection = llm.engine.model_runner.model.model.layers[0].mlp.down_proj
    with pytest.raises(ValueError, match="do not fit an input"):
        projection.matmul(torch.randn(1, projection.in_features + 32))
    workspace = torch.empty(1 << 16, dtype=torch.uint8)
    status = library.nls_gguf_matmul(
        projection.kind, projection.tiles.data_ptr(), projection.out_features, 33,
        q.data_ptr(), 1, None, 0, out.data_ptr(), workspace.data_ptr(), workspace.numel(), 1,
    )  # fmt: skip
    assert status == -5  # NLS_BAD_SHAPE
