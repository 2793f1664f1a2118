"""Embeddings (`--runner pooling`) with the other features, for the compatibility matrix
(scripts/compat_matrix.py): int8 weights embed like float32 ones (offline); on a pooling
server scheduling by priority, `priority` orders the inputs and keeps the vectors, hostile
priorities are 400s naming it; token-id inputs embed like their text while the generation
fields of token I/O are refused; `/v1/messages` is refused there; `--reasoning-parser` with
`--runner pooling` is refused at start."""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import pytest
import torch
from live_server import LiveServer

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300), pytest.mark.slow]

API_KEY = "compat-embed-key"
TEXTS = ["The cat sat on the mat.", "Stock markets fell today."]


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def test_int8_weights_embed_like_float32(make_llm, compat):
    dense = make_llm(runner="pooling", num_kv_blocks=32)
    int8 = make_llm(runner="pooling", quantization="int8", num_kv_blocks=32)
    for ours, ref in zip(
        int8.embed(TEXTS, use_tqdm=False), dense.embed(TEXTS, use_tqdm=False), strict=True
    ):
        ours, ref = ours.outputs[0].embedding, ref.outputs[0].embedding
        # unit vectors (the pooler normalizes), which the cosine alone would not see
        assert abs(torch.tensor(ours, dtype=torch.float64).norm() - 1) < 1e-5
        assert abs(torch.tensor(ref, dtype=torch.float64).norm() - 1) < 1e-5
        # Measured 1 - cosine 4.1e-4 and 3.9e-4 for the two texts, the same on the AMX and
        # the AVX2 builds (the PyTorch int8 matmul); weights truncated instead of rounded
        # measured 2.2e-3 and 1.8e-3, inside the old bar (cosine > 0.99).
        distance = 1 - cosine(ours, ref)
        assert distance < 1e-3, distance
        compat.exercised("embed", embedding=ours)
    compat.exercised("int8", quantization=int8.engine.loaded.quantization)


@pytest.fixture(scope="module")
def server():
    live = LiveServer.start(
        "--runner", "pooling", "--scheduling-policy", "priority",
        "--num-kv-blocks", "64", "--max-model-len", "128",
        api_key=API_KEY,
    )  # fmt: skip
    yield live
    live.stop()


def _embed(server, **body) -> httpx.Response:
    with server.client() as http:
        return http.post("/v1/embeddings", json={"encoding_format": "float", **body})


def test_priority_is_taken_and_keeps_the_vectors(server, compat):
    plain = server.openai().embeddings.create(model=None, input=TEXTS, encoding_format="float")
    for priority in (-5, 7):
        ranked = server.openai().embeddings.create(
            model=None, input=TEXTS, encoding_format="float", extra_body={"priority": priority}
        )
        for ours, ref in zip(ranked.data, plain.data, strict=True):
            assert ours.embedding == pytest.approx(ref.embedding, abs=1e-6)
        compat.exercised("embed", embedding=ranked.data[0].embedding)
        status = _embed(server, input=TEXTS, priority=priority).status_code
        compat.exercised("priority", admitted=(priority, status))


@pytest.mark.parametrize(
    "priority",
    [1.5, "1", True, 2**31, -(2**31) - 1, [1], 1e300],
    ids=["float", "string", "bool", "past-int32", "below-int32", "list", "huge-float"],
)
def test_hostile_priorities_are_400s_naming_priority(server, priority, compat):
    reply = _embed(server, input="a", priority=priority)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "priority", error
    with server.client() as http:
        for raw in ('{"input": "a", "priority": NaN}', '{"input": "a", "priority": Infinity}'):
            reply = http.post(
                "/v1/embeddings", content=raw, headers={"Content-Type": "application/json"}
            )
            assert reply.status_code == 400, reply.text
    assert server.process.poll() is None
    compat.exercised("priority", refused=f"{error['param']}: {error['message']}")
    compat.exercised("embed", embedding=_embed(server, input="a").json()["data"][0]["embedding"])


def test_token_id_inputs_embed_like_their_text_and_generation_fields_are_refused(server, compat):
    with server.client() as http:
        ids = http.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_text, by_ids = _embed(server, input=TEXTS[0]), _embed(server, input=ids)
    assert by_text.status_code == by_ids.status_code == 200, by_ids.text
    assert by_ids.json()["data"][0]["embedding"] == pytest.approx(
        by_text.json()["data"][0]["embedding"], abs=1e-6
    )
    compat.exercised("embed", embedding=by_ids.json()["data"][0]["embedding"])
    compat.exercised("tokenio", token_ids=ids)  # a token-id input, answered 200 above
    for field, value in (("return_token_ids", True), ("prompt_logprobs", 1)):
        reply = _embed(server, input=ids, **{field: value})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == field


def test_messages_are_refused_on_a_pooling_server(server, compat):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
        )
    assert "this server embeds (--runner pooling)" in str(info.value)
    compat.refused("embed", "messages", str(info.value))


def test_llamacpp_completion_is_refused_on_a_pooling_server(server, compat):
    """llama.cpp's `/completion` generates: on a pooling server it is the 400 every
    generation route gives, naming `--runner pooling`; the server keeps embedding."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body in ({"prompt": "hi", "n_predict": 4}, {"prompt": [1, 2], "stream": True}):
        reply = httpx.post(f"{server.url}/completion", json=body, headers=headers, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]["message"]
        assert "this server embeds (--runner pooling)" in error, error
        compat.refused("embed", "llamacpp", error)
    assert _embed(server, input="hi").status_code == 200


def test_a_reasoning_parser_with_the_pooling_runner_is_refused_at_start(compat):
    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--runner", "pooling",
         "--reasoning-parser", "qwen3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--reasoning-parser has nothing to parse with --runner pooling" in proc.stderr
    compat.refused("reasoning", "embed", proc.stderr)
