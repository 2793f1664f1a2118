"""Embeddings (m23): `--runner pooling` / `--task embed` and `POST /v1/embeddings`.

Parity: the pooled vector equals transformers' last hidden state (after the final norm,
`output_hidden_states[-1]`) pooled the same way, cosine > 0.9999, for the bundled model with
dense float32 weights, with its default GGUF blocks (the kernels compute in float32 from the
blocks transformers' reference dequantizes, so the same bound holds), and for a tiny random
causal model, one rank and two (tensor parallelism). Pooling runs over chunked prefills in
a crowded pool. Over HTTP, with the openai SDK: every input shape, float and base64, usage,
hostile values (400 naming the field, the server still up), the KV blocks all back after
each request, and what a pooling server refuses (generation, gRPC Generate) and a
generating server refuses (embeddings).
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from live_server import LiveServer, free_port, shared_server
from test_grpc import run as grpc_run
from test_model_parity import make_tiny_hf_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from nanollmserve import LLM
from nanollmserve.errors import UserError
from nanollmserve.model import resolve_model

pytestmark = pytest.mark.milestone("m23")

API_KEY = "embed-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 64
NUM_BLOCKS = 64
TEXTS = [
    "The cat sat on the mat.",
    "Paged attention keeps keys and values in fixed-size blocks. " * 12,  # chunked
    "hi",
]


def pool(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def hf_bundled():
    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_pooled(model, token_ids: list[int], pooling_type="LAST", normalize=True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]
    return pool(hidden[0], pooling_type, normalize)


# -- the engine, offline ----------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "pooling_type, normalize", [("LAST", True), ("MEAN", True), ("CLS", True), ("MEAN", False)]
)
def test_bundled_float32_matches_transformers(make_llm, hf_bundled, pooling_type, normalize):
    config = {"pooling_type": pooling_type.lower(), "normalize": normalize}
    # A budget of 32 tokens: the long text runs as several chunks, batched with the others.
    llm = make_llm(runner="pooling", pooler_config=config, max_num_batched_tokens=32)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert len(outputs[1].prompt_token_ids) > 32
    for output in outputs:
        choice = output.outputs[0]
        assert choice.finish_reason == "stop" and choice.token_ids == []
        expected = hf_pooled(hf_bundled[0], output.prompt_token_ids, pooling_type, normalize)
        assert cosine(choice.embedding, expected) > 0.9999
        if not normalize:  # the raw vector, not only its direction
            assert torch.allclose(torch.tensor(choice.embedding), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.timeout(600)
def test_bundled_gguf_blocks_match_transformers(make_llm, hf_bundled, compat):
    llm = make_llm(runner="pooling", dtype="auto", pooler_config={"pooling_type": "MEAN"})
    assert llm.engine.loaded.quantization == "gguf"
    compat.exercised("gguf", quantization=llm.engine.loaded.quantization)
    for output in llm.embed(TEXTS, use_tqdm=False):
        expected = hf_pooled(hf_bundled[0], output.prompt_token_ids, "MEAN")
        assert cosine(output.outputs[0].embedding, expected) > 0.9999
        compat.exercised("embed", embedding=output.outputs[0].embedding)


@pytest.mark.timeout(600)
def test_a_crowded_pool_embeds_as_one_request_alone(make_llm):
    """Six 90-token prompts through a pool of 8 blocks (128 tokens) in chunks of 32: they wait
    for blocks, run chunked beside one another, and embed as each does alone; every block is
    back at the end (`make_llm` checks)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 20000, (90,), generator=generator).tolist() for _ in range(6)]
    args = dict(runner="pooling", pooler_config={"pooling_type": "MEAN"}, block_size=16)
    alone = make_llm(num_kv_blocks=NUM_BLOCKS, **args)
    expected = [alone.embed([p], use_tqdm=False)[0].outputs[0].embedding for p in prompts]
    crowded = make_llm(num_kv_blocks=8, max_num_batched_tokens=32, **args)
    got = crowded.embed(prompts, use_tqdm=False)
    assert crowded.engine.stats().num_steps >= 6 * 90 // 32
    for output, vector in zip(got, expected, strict=True):
        assert cosine(output.outputs[0].embedding, vector) > 0.99999


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-embed")
    make_tiny_hf_model(LlamaConfig, path, tie_word_embeddings=False)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(path)
    return path


@pytest.mark.timeout(600)
def test_tiny_random_model_one_and_two_ranks_match_transformers(tiny_llama_dir, compat):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (1, 9, 40)]
    args = dict(
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        dtype="float32",
        block_size=8,
        num_kv_blocks=32,
        max_num_batched_tokens=16,
    )
    for ranks in (1, 2):
        with LLM(str(tiny_llama_dir), tensor_parallel_size=ranks, **args) as llm:
            for output in llm.embed(prompts, use_tqdm=False):
                expected = hf_pooled(hf, output.prompt_token_ids, "MEAN")
                assert cosine(output.outputs[0].embedding, expected) > 0.9999, ranks
                compat.exercised("embed", embedding=output.outputs[0].embedding)
            if ranks == 2:
                compat.exercised("tp", ranks=compat.ranks_running())


def test_what_a_pooling_engine_refuses(make_llm, compat):
    with pytest.raises(UserError, match="speculative decoding") as error:
        LLM(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    compat.refused("spec", "embed", str(error.value))
    with pytest.raises(UserError, match="pooling_type"):
        LLM(runner="pooling", pooler_config='{"pooling_type": "ALL"}')
    with pytest.raises(UserError, match="needs --runner pooling"):
        LLM(pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(UserError, match="task must be embed or generate"):
        LLM(task="score")
    llm = make_llm(task="embed", num_kv_blocks=16)
    assert llm.config.runner == "pooling"
    with pytest.raises(ValueError, match="use LLM.embed"):
        llm.generate("hi", use_tqdm=False)


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--task", "embed",  # vLLM's spelling of --runner pooling
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_BLOCKS),
        "--max-num-batched-tokens", "32",
        "--max-num-seqs", "4",
        "--max-queue-len", "8",
        "--grpc-port", str(grpc_port),
        api_key=API_KEY,
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def assert_blocks_back(server) -> None:
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == NUM_BLOCKS, stats


@pytest.mark.timeout(300)
def test_openai_sdk_inputs_formats_and_usage(server, hf_bundled):
    model, tokenizer = hf_bundled
    client = server.openai()
    texts = ["A query about cats.", "Cats sleep a lot.", "Stock markets fell today."]
    # The SDK asks for base64 unless told otherwise and decodes it after parsing, so only its
    # default (lax) validation takes that answer, as it does OpenAI's own.
    lax = server.openai(strict=False)
    as_base64 = lax.embeddings.create(model=MODEL, input=texts)
    as_floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = [tokenizer.encode(t) for t in texts]
    as_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one_text = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    one_ids = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert as_floats.object == "list" and [d.index for d in as_floats.data] == [0, 1, 2]
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, ids))
    assert one_text.usage.prompt_tokens == len(ids[0])
    for i, data in enumerate(as_floats.data):
        assert data.object == "embedding" and len(data.embedding) == 576
        assert math.isclose(sum(x * x for x in data.embedding), 1.0, rel_tol=1e-4)
        assert cosine(data.embedding, hf_pooled(model, ids[i])) > 0.9999
        assert np.allclose(as_base64.data[i].embedding, data.embedding, atol=1e-6)
        assert np.allclose(as_ids.data[i].embedding, data.embedding, atol=1e-5)
    assert np.allclose(one_text.data[0].embedding, as_floats.data[0].embedding, atol=1e-5)
    assert np.allclose(one_ids.data[0].embedding, as_floats.data[0].embedding, atol=1e-5)
    assert_blocks_back(server)


def test_base64_is_float32_little_endian(server):
    with server.client() as http:
        body = {"input": "hello", "encoding_format": "base64"}
        encoded = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
        body["encoding_format"] = "float"
        floats = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.allclose(decoded, floats, atol=1e-6)


def test_an_input_of_max_model_len_tokens_is_embedded(server):
    with server.client() as http:
        reply = http.post("/v1/embeddings", json={"input": [[7] * MAX_MODEL_LEN]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


HOSTILE = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [49152]}, "input"),  # out of the vocabulary
    ({"input": [[1, 2], [10**9]]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [2**40]}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": [True, False]}, "input"),
    ({"input": None}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": [["a"]]}, "input"),
    ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input"),  # longer than the model's context
    ({"input": "word " * 400}, "input"),
    ({"input": ["a"] * 13}, "input"),  # more than the server admits at once (4 + 8)
    ({"input": ["a"] * 257}, "input"),  # more than any request may carry
    ({"input": "a", "dimensions": 64}, "dimensions"),
    ({"input": "a", "dimensions": 576}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": -3}, "dimensions"),
    ({"input": "a", "dimensions": "5"}, "dimensions"),
    ({"input": "a", "dimensions": 1e300}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "encoding_format": None}, "encoding_format"),
    ({"input": "a", "model": "other-model"}, "model"),
    ({"input": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "a", "user": "u" * 100_000}, "user"),
    # llama.cpp's forms: mixed token ids and strings, prompt objects
    ({"input": [1, "a", -1]}, "input"),
    ({"input": [1, "a", 2**40]}, "input"),
    ({"input": [1, "a", 49152]}, "input"),  # out of the vocabulary
    ({"input": [1, "a", 1.5]}, "input"),
    ({"input": [1, "a", True]}, "input"),
    ({"input": [1, "a", None]}, "input"),
    ({"input": [1, "a", ["b"]]}, "input"),
    ({"input": ["a", [1, "b", -5]]}, "input"),
    ({"input": [1] + ["a"] * 100_000}, "input"),  # more pieces than the context, not tokenized
    ({"input": [1, "word " * 400]}, "input"),  # longer than the context
    ({"input": ["a", {"prompt_string": [1, "word " * 400]}]}, "input"),
    ({"input": [[1, "a"]] * 13}, "input"),  # more than the server admits at once
    ({"input": [{"prompt_string": "a"}] * 257}, "input"),  # more than any request may carry
    ({"input": {"prompt_string": ""}}, "input"),
    ({"input": {"prompt_string": []}}, "input"),
    ({"input": {"prompt_string": ["", ""]}}, "input"),  # no tokens
    ({"input": {"prompt_string": 5}}, "input"),
    ({"input": {"prompt_string": "a", "multimodal_data": ["AAAA"]}}, "input"),
    ({"input": {"content": "a"}}, "input"),
    ({"input": {"content": []}}, "input"),
    ({"input": {"content": [{"type": "text", "text": ""}]}}, "input"),  # no tokens
    ({"input": {"content": [{"type": "text"}]}}, "input"),
    ({"input": {"content": [{"type": "unknown"}]}}, "input"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,A"}}]}}, "input"),
    ({"input": {"content": [{"type": "text", "text": "a"}], "prompt_string": "b"}}, "input"),
    ({"input": [{"content": [{"type": "text", "text": "a"}]}, {"prompt": "b"}]}, "input"),
]


def _hostile_id(index: int, param: str) -> str:
    """The position, except for the compatibility matrix's cell, which names its id."""
    return "response_format" if param == "response_format" else str(index)


@pytest.mark.parametrize(
    "body, param", HOSTILE, ids=[_hostile_id(i, param) for i, (_, param) in enumerate(HOSTILE)]
)
def test_hostile_requests_are_400_naming_the_field(server, body, param, compat):
    with server.client() as http:
        reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param or error["param"].startswith(f"{param}."), error
    assert server.process.poll() is None
    if param == "response_format":  # structured output on a pooling server
        compat.refused("structured", "embed", error["message"])


def test_non_finite_numbers_are_400(server):
    with server.client() as http:
        for raw in (
            '{"input": [NaN]}',
            '{"input": "a", "dimensions": Infinity}',
            '{"input": [1, "a", NaN]}',
            '{"input": ["a", [-Infinity, "b"]]}',
            '{"input": {"prompt_string": [1, Infinity]}}',
        ):
            reply = http.post(
                "/v1/embeddings", content=raw, headers={"Content-Type": "application/json"}
            )
            assert reply.status_code == 400, reply.text
    assert_blocks_back(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_llamacpp_input_forms_embed_like_their_text(server, hf_bundled):
    """llama.cpp's forms of `input` (its server test's test_embedding_mixed_input and
    test_embedding_content_text_same_as_string): a list mixing token ids and strings is one
    prompt, a prompt object one prompt, a list of them several; each embeds as its text."""
    tokenizer = hf_bundled[1]
    head, tail = tokenizer.encode("The cat"), " sat on the mat."
    ids = head + tokenizer.encode(tail, add_special_tokens=False)
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    forms = [
        "hello world",
        {"prompt_string": "hello world"},
        {"content": parts},
        ids,
        [*head, tail],
        {"prompt_string": [*head, tail]},
    ]
    with server.client() as http:
        reply = http.post("/v1/embeddings", json={"input": forms})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        singles = [
            http.post("/v1/embeddings", json={"input": form}).json()
            for form in (forms[4], forms[2], forms[1])
        ]
        too_long = http.post("/v1/embeddings", json={"input": "word " * 400})
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == list(range(len(forms)))
    for vector in vectors[1:3]:
        assert np.allclose(vector, vectors[0], atol=1e-5)
    for vector in vectors[4:]:
        assert np.allclose(vector, vectors[3], atol=1e-5)
    assert not np.allclose(vectors[0], vectors[3], atol=1e-2)
    text_tokens = len(tokenizer.encode("hello world"))
    assert body["usage"]["prompt_tokens"] == 3 * text_tokens + 3 * len(ids)
    for single, expected in zip(singles, (vectors[3], vectors[0], vectors[0]), strict=True):
        assert len(single["data"]) == 1
        assert np.allclose(single["data"][0]["embedding"], expected, atol=1e-5)
    # llama.cpp's test_embedding_error_prompt_too_long looks for its words "too large".
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "input"
    assert "too large" in too_long.json()["error"]["message"]
    assert_blocks_back(server)


def test_mixed_prompt_pieces_tokenize_in_place_with_special_tokens_first_only():
    """llama.cpp's tokenize_mixed: each string's tokens where it stands, the tokenizer's
    special tokens (BOS) only for a string that comes first; at most the context length in
    pieces; the ids checked as any token ids."""
    from nanollmserve.errors import ParamError
    from nanollmserve.frontend.input_processor import InputProcessor

    class Tokenizer:  # BOS 1, then one id per character
        eos_token_id = 2

        def encode(self, text, add_special_tokens=True):
            return [1] * add_special_tokens + [ord(c) for c in text]

    processor = InputProcessor(Tokenizer(), max_model_len=8, vocab_size=1000, pooling=True)
    assert processor.tokenize(["ab", 5, "c"]) == (None, [1, 97, 98, 5, 99])
    assert processor.tokenize([5, "", "c"]) == (None, [5, 99])
    for hostile, match in (
        ([5] + ["c"] * 8, "at most 8 pieces"),
        ([5, "c", 1000], "integers in"),
        (["", ""], "must not be empty"),
    ):
        with pytest.raises(ParamError, match=match):
            processor.tokenize(hostile)


def test_generation_routes_are_refused_on_a_pooling_server(server):
    client = server.openai()
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "--runner pooling" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi")


def test_grpc_generate_is_refused_on_a_pooling_server(server, compat):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_run(server, lambda c: c.generate("hi", max_tokens=4), api_key=API_KEY)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--runner pooling" in info.value.details()
    compat.refused("grpc", "embed", info.value.details())


def test_a_generating_server_refuses_embeddings_naming_the_flag():
    live = shared_server()
    with live.client() as http:
        reply = http.post("/v1/embeddings", json={"input": "hello"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model" and "--runner pooling" in error["message"]


@pytest.mark.timeout(600)
def test_a_lora_adapter_embeds_like_peft_merged(make_llm, hf_bundled, compat):
    from lora_adapters import adapter_dir, load_base
    from peft import PeftModel

    from nanollmserve.lora_request import LoRARequest

    adapter = adapter_dir(seed=11)
    llm = make_llm(runner="pooling", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("embed-lora", 1, str(adapter))
    with_lora, without = llm.embed(TEXTS[:2], use_tqdm=False, lora_request=[lora, None])
    merged = PeftModel.from_pretrained(load_base(), adapter).merge_and_unload().eval()
    ids = with_lora.prompt_token_ids
    assert cosine(with_lora.outputs[0].embedding, hf_pooled(merged, ids)) > 0.9999
    base = hf_pooled(hf_bundled[0], without.prompt_token_ids)
    assert cosine(without.outputs[0].embedding, base) > 0.9999
    assert cosine(with_lora.outputs[0].embedding, hf_pooled(hf_bundled[0], ids)) < 0.999
    [same_text] = llm.embed(TEXTS[:1], use_tqdm=False)  # the same input, no adapter
    compat.exercised(
        "lora", output=with_lora.outputs[0].embedding, base=same_text.outputs[0].embedding
    )
    compat.exercised("embed", embedding=with_lora.outputs[0].embedding)


@pytest.mark.timeout(300)
def test_the_router_forwards_embeddings(server, compat):
    from cluster_process import ClusterProcess

    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", server.url,
        api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    try:
        via_router = router.openai().embeddings.create(
            model=MODEL, input=["routed text", "another"], encoding_format="float"
        )
        compat.exercised("router", routed=router.stats()["workers"][0]["num_routed"])
    finally:
        router.stop()
    compat.exercised("embed", embedding=via_router.data[0].embedding)
    direct = server.openai().embeddings.create(
        model=MODEL, input=["routed text", "another"], encoding_format="float"
    )
    for routed, own in zip(via_router.data, direct.data, strict=True):
        assert np.allclose(routed.embedding, own.embedding, atol=1e-5)
    assert via_router.usage.prompt_tokens == direct.usage.prompt_tokens


@pytest.mark.timeout(600)
def test_bench_serve_drives_embeddings_with_an_hf_baseline(server):
    from bench_cli import run_bench

    result = run_bench(
        "serve", "--base-url", server.url, "--api-key", API_KEY, "--endpoint", "embeddings",
        "--num-prompts", "8", "--input-len", "16", "--max-concurrency", "4",
        "--hf-baseline", "--disable-tqdm",
    )  # fmt: skip
    assert result["endpoint"] == "embeddings"
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 16 and result["total_output_tokens"] == 0
    baseline = result["hf_baseline"]
    assert baseline["num_texts"] == 8 and baseline["batch_size"] == 32
    assert baseline["input_token_throughput"] > 0
    assert baseline["ours_vs_hf_input_token_throughput"] > 0
