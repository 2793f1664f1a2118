"""The `vllm serve` flags of `nanollmserve serve` (issue 16): environment variables, bad
values, HTTPS (HTTP and gRPC), CORS, the request log, the routes without /v1, generation
defaults and the --gpu-memory-utilization arithmetic.

Two real servers: a TLS one (CORS on, request log off, a generation_config.json folder, a
flag from the environment) and a plain one (request log on, --root-path). The rest runs in
process or as a CLI subprocess that fails before the model loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from live_server import API_KEY, LiveServer

from nanollmserve.cli.env_defaults import apply_env_defaults, env_name
from nanollmserve.cli.main import build_parser
from nanollmserve.engine.kv_budget import GiB, gpu_kv_cache_bytes
from nanollmserve.errors import UserError

pytestmark = pytest.mark.milestone("m02")

ORIGIN = "https://app.example"
GENERATION_DEFAULTS = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.1}


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        + ["-addext", "basicConstraints=critical,CA:TRUE"],
        check=True,
        capture_output=True,
    )
    return {"key": key, "cert": cert}


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("genconfig")
    data = {**GENERATION_DEFAULTS, "do_sample": True, "max_new_tokens": 7, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def tls_server(tls_files, generation_dir):
    server = LiveServer.start(
        "--num-kv-blocks", "128",
        "--ssl-keyfile", str(tls_files["key"]),
        "--ssl-certfile", str(tls_files["cert"]),
        "--grpc-port", "0",
        "--allowed-origins", json.dumps([ORIGIN]),
        "--disable-log-requests",
        "--generation-config", str(generation_dir),
        api_key=API_KEY,
        env={"NANOLLMSERVE_SERVED_MODEL_NAME": "env-model"},
        verify=str(tls_files["cert"]),
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_server():
    server = LiveServer.start("--num-kv-blocks", "128", "--root-path", "/proxy", api_key=API_KEY)
    yield server
    server.stop()


# -- environment variables -------------------------------------------------------------------
def _parse(monkeypatch, env: dict[str, str], *argv: str):
    for name in list(__import__("os").environ):
        if name.startswith("NANOLLMSERVE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(["serve", *argv])


def test_env_sets_a_flag_and_the_flag_wins(monkeypatch):
    env = {
        "NANOLLMSERVE_MAX_NUM_SEQS": "7",
        "NANOLLMSERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "NANOLLMSERVE_SERVED_MODEL_NAME": "a b",
        "NANOLLMSERVE_DISABLE_LOG_REQUESTS": "true",
        "NANOLLMSERVE_ENABLE_PREFIX_CACHING": "0",
        "NANOLLMSERVE_API_KEY": "secret",
        "NANOLLMSERVE_LOG_LEVEL": "debug",
    }
    args = _parse(monkeypatch, env)
    assert args.max_num_seqs == 7
    assert args.gpu_memory_utilization == 0.5
    assert args.served_model_name == ["a", "b"]
    assert args.enable_log_requests is False
    assert args.enable_prefix_caching is False
    assert args.api_key == "secret"
    assert args.log_level == "debug"
    assert args.env_errors == []
    flags = ["--max-num-seqs", "9", "--enable-log-requests", "--enable-prefix-caching"]
    args = _parse(monkeypatch, env, *flags, "--api-key", "other", "--log-level", "info")
    assert args.max_num_seqs == 9
    assert args.enable_log_requests is True
    assert args.enable_prefix_caching is True
    assert (args.api_key, args.log_level) == ("other", "info")
    # Unset: the built-in defaults; the older alias still works.
    args = _parse(monkeypatch, {}, "--no-prefix-caching")
    assert args.max_num_seqs == 64 and args.gpu_memory_utilization == 0.9
    assert args.enable_log_requests is True and args.enable_prefix_caching is False
    assert args.generation_config == "auto"


def test_every_serve_option_has_a_variable():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    from nanollmserve.cli import serve

    serve.register(sub)
    serve_parser = sub.choices["serve"]
    names = {env_name(o) for a in serve_parser._actions for o in a.option_strings if o != "-h"}
    assert {"NANOLLMSERVE_API_KEY", "NANOLLMSERVE_SSL_KEYFILE", "NANOLLMSERVE_PORT"} <= names
    sources, errors = apply_env_defaults(serve_parser, {"NANOLLMSERVE_PORT": "x"})
    assert sources == {} and errors == ["NANOLLMSERVE_PORT='x': invalid int value"]
    _, errors = apply_env_defaults(serve_parser, {"NANOLLMSERVE_LOG_LEVEL": "loud"})
    assert "invalid choice" in errors[0]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], {}, "gpu_memory_utilization must be in (0, 1]"),
        (["--gpu-memory-utilization", "0"], {}, "gpu_memory_utilization must be in (0, 1]"),
        (["--allowed-origins", "[https://x"], {}, "--allowed-origins must be a JSON list"),
        (["--ssl-keyfile", "/no/key", "--ssl-certfile", "/no/cert"], {}, "TLS files"),
        (["--ssl-certfile", "/no/cert"], {}, "together"),
        (["--generation-config", "/nonexistent"], {}, "no generation_config.json"),
        ([], {"NANOLLMSERVE_MAX_NUM_SEQS": "many"}, "NANOLLMSERVE_MAX_NUM_SEQS='many'"),
    ],
)
def test_bad_values_fail_in_one_line_with_status_2(argv, env, message):
    import os

    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanollmserve: error: "), result.stderr
    assert message in lines[0]
    # No model load (it logs "loaded ..."), read from the log, not timed: the same anywhere.
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr


# -- --gpu-memory-utilization ------------------------------------------------------------------
def test_gpu_kv_cache_bytes():
    total = 80 * GiB
    # 90% of 80 GiB = 72 GiB; the 16 GiB of weights leave 56 GiB.
    kv = gpu_kv_cache_bytes(total=total, free=64 * GiB, used_by_engine=16 * GiB, utilization=0.9)
    assert kv == int(total * 0.9) - 16 * GiB
    # Another process holds memory: never more than is free.
    kv = gpu_kv_cache_bytes(total=total, free=10 * GiB, used_by_engine=16 * GiB, utilization=0.9)
    assert kv == 10 * GiB
    with pytest.raises(UserError, match="gpu-memory-utilization 0.1"):
        gpu_kv_cache_bytes(total=total, free=64 * GiB, used_by_engine=16 * GiB, utilization=0.1)


def test_engine_sizes_the_cuda_kv_pool_from_the_utilization(monkeypatch):
    import torch

    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.engine_core import EngineCore

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * GiB)
    fake = SimpleNamespace(
        config=EngineConfig(gpu_memory_utilization=0.5),
        device=torch.device("cuda"),
        dtype=torch.float16,
        kv_cache_dtype="auto",
        model_config=SimpleNamespace(kv_bytes_per_token=lambda dtype, tp_size=1: 1 << 20),
    )
    # 40 GiB budget - 20 GiB weights = 20 GiB = 20 * 1024 blocks of 16 tokens x 1 MiB... / 16.
    assert EngineCore._num_kv_blocks(fake, 16) == 20 * GiB // (16 << 20)
    fake.config = EngineConfig(gpu_memory_utilization=0.2)
    with pytest.raises(UserError, match="raise it"):
        EngineCore._num_kv_blocks(fake, 16)
    fake.config = EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=GiB)
    assert EngineCore._num_kv_blocks(fake, 16) == GiB // (16 << 20)


# -- generation defaults (in process) ---------------------------------------------------------
def test_generation_defaults_apply_to_unset_fields_only(generation_dir):
    from nanollmserve.api.protocol_chat import ChatCompletionRequest
    from nanollmserve.api.protocol_completions import CompletionRequest
    from nanollmserve.api.serving import ServerContext, ServerSettings
    from nanollmserve.api.simple_api import GenerateRequest
    from nanollmserve.frontend.admission import Admission
    from nanollmserve.frontend.request_policy import RequestPolicy
    from nanollmserve.generation_config import describe, load_generation_defaults

    defaults = load_generation_defaults(str(generation_dir))
    assert defaults == GENERATION_DEFAULTS  # max_new_tokens, do_sample, ids: not sampling
    assert load_generation_defaults("vllm", generation_dir) == {}
    assert load_generation_defaults("auto", generation_dir) == GENERATION_DEFAULTS
    assert describe({}) == "none"
    policy = RequestPolicy(generation_defaults=defaults, max_num_seqs=8)
    engine = SimpleNamespace(model_name="m", admission=Admission(policy, input_processor=None))
    ctx = ServerContext(engine, ServerSettings())

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = ctx.make_params(body.to_sampling_params)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 5, 1.1)
    assert params.top_p == 1.0
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=0.7, top_k=None
    )
    params = ctx.make_params(body.to_sampling_params)
    assert (params.temperature, params.top_k) == (0.7, 5)  # null counts as unset
    params = ctx.make_params(
        CompletionRequest(prompt="x", repetition_penalty=1.0).to_sampling_params
    )
    assert (params.temperature, params.repetition_penalty) == (0.0, 1.0)
    # The simple API keeps its own documented defaults.
    params = ctx.make_params(GenerateRequest(prompt="x", temperature=0.5).to_sampling_params)
    assert params.top_k == 0 and params.repetition_penalty == 1.0


def test_bundled_model_generation_config_has_no_sampling_defaults():
    from nanollmserve.generation_config import load_generation_defaults
    from nanollmserve.model.source import resolve_model

    assert load_generation_defaults("auto", resolve_model(None).path) == {}


def test_aliases_are_left_out_of_the_schema():
    from nanollmserve.api.routes import router

    paths = {route.path for route in router.routes}
    assert {"/chat/completions", "/completions", "/models", "/responses"} <= paths
    schema_paths = {r.path for r in router.routes if r.include_in_schema}
    assert "/chat/completions" not in schema_paths and "/v1/chat/completions" in schema_paths


# -- the TLS server ------------------------------------------------------------------------
def test_https_with_the_openai_sdk(tls_server, tls_files):
    import openai

    # Closed at the end: an idle TLS connection left open holds the server's shutdown for
    # asyncio's 30 s SSL shutdown timeout (the fixture's teardown took 30.7 s).
    with httpx.Client(verify=str(tls_files["cert"])) as http_client:
        client = openai.OpenAI(
            base_url=f"{tls_server.url}/v1",
            api_key=API_KEY,
            http_client=http_client,
            max_retries=0,
        )
        assert tls_server.url.startswith("https://")
        assert [m.id for m in client.models.list().data] == ["env-model"]  # from the env
        completion = client.chat.completions.create(
            model="env-model", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
    assert completion.usage.completion_tokens >= 1
    with pytest.raises(httpx.ConnectError):  # the certificate is not in the default store
        httpx.get(f"{tls_server.url}/health", timeout=10)
    assert f"nanollmserve ready: https://127.0.0.1:{tls_server.port}" in tls_server.log()


def test_grpc_takes_the_same_certificate(tls_server, tls_files):
    import re

    import grpc

    from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb
    from nanollmserve.api.grpc_gen import nanollmserve_pb2_grpc as pb_grpc

    port = re.search(r"grpc=127\.0\.0\.1:(\d+)", tls_server.log()).group(1)
    credentials = grpc.ssl_channel_credentials(tls_files["cert"].read_bytes())
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        health = pb_grpc.GenerationStub(channel).Health(
            pb.HealthRequest(), metadata=metadata, timeout=30
        )
    assert health.healthy is True
    assert health.model == "env-model"  # the served name from the environment, as on HTTP
    # The port speaks TLS only: a plaintext channel to it never gets an answer.
    with (
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
        pytest.raises(grpc.RpcError) as plaintext,
    ):
        pb_grpc.GenerationStub(channel).Health(pb.HealthRequest(), metadata=metadata, timeout=10)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE, plaintext.value


def test_cors_preflight_for_the_configured_origin_only(tls_server):
    request = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with httpx.Client(base_url=tls_server.url, verify=tls_server.verify, timeout=30) as http:
        allowed = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, **request})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        other = http.options(
            "/v1/chat/completions", headers={"Origin": "https://evil.example", **request}
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        simple = http.get("/v1/models", headers={"Origin": ORIGIN, **tls_server.headers})
        assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_generation_defaults_are_logged_and_applied(tls_server, generation_dir):
    log = tls_server.log()
    assert f"generation defaults (--generation-config {generation_dir}): " in log
    assert "temperature=0.0 top_k=5 repetition_penalty=1.1" in log
    with tls_server.client() as http:
        texts = []
        for extra in ({"seed": 1}, {"seed": 2}, {"temperature": 0.0, "seed": 3}):
            body = {"prompt": "Once upon a time", "max_tokens": 8, **extra}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]  # temperature 0 from the file: greedy


def test_no_request_log_with_disable_log_requests(tls_server):
    with tls_server.client() as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success
    time.sleep(0.5)
    assert "status=finished" not in tls_server.log()


# -- the plain server ------------------------------------------------------------------------
def test_routes_without_v1_answer_like_v1_and_need_the_key(plain_server):
    with plain_server.client() as http:
        assert http.get("/models").json() == http.get("/v1/models").json()
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        chat_json = http.post("/chat/completions", json=chat).json()
        assert chat_json["object"] == "chat.completion"
        completion = http.post("/completions", json={"prompt": "Hi", "max_tokens": 3}).json()
        assert completion["object"] == "text_completion"
        response = http.post("/responses", json={"input": "Hi", "max_output_tokens": 3})
        assert response.json()["object"] == "response"
        assert http.get(f"/responses/{response.json()['id']}").status_code == 200
        schema = http.get("/openapi.json").json()
        assert "/v1/chat/completions" in schema["paths"]
        assert "/chat/completions" not in schema["paths"] and "/models" not in schema["paths"]
    for method, path in [("GET", "/models"), ("POST", "/chat/completions")]:
        answer = httpx.request(method, f"{plain_server.url}{path}", json=chat, timeout=30)
        assert answer.status_code == 401
    # --root-path: the routes stay where they are, /health stays open.
    assert httpx.get(f"{plain_server.url}/health", timeout=30).status_code == 200


def test_openai_sdk_with_a_base_url_without_v1(plain_server):
    import openai

    with openai.OpenAI(base_url=plain_server.url, api_key=API_KEY, max_retries=0) as client:
        [model] = [m.id for m in client.models.list().data]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2}
        completion = client.completions.create(**body, temperature=0)
    assert completion.object == "text_completion" and completion.model == model
    [choice] = completion.choices
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 2
    assert choice.text.strip(), completion
    # The same greedy text as the /v1 route gives.
    with plain_server.client() as http:
        v1 = http.post("/v1/completions", json={**body, "temperature": 0})
    assert v1.status_code == 200, v1.text
    assert choice.text == v1.json()["choices"][0]["text"]


def test_request_log_line_without_the_prompt(plain_server):
    secret = "zebra-canary-prompt-text"
    with plain_server.client() as http:
        response = http.post("/v1/completions", json={"prompt": secret, "max_tokens": 3})
        assert response.status_code == 200
        request_id = response.json()["id"]
    deadline = time.monotonic() + 10
    while request_id not in plain_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in plain_server.log().splitlines() if f"request {request_id}" in line]
    assert len(lines) == 1, plain_server.log()[-3000:]
    line = lines[0]
    for part in ("status=finished", "finish_reason=length", "prompt_tokens=", "cached_tokens=0"):
        assert part in line
    assert "generated_tokens=3" in line and "ttft=" in line and "e2e=" in line
    assert secret not in plain_server.log()
    assert "generation defaults (--generation-config auto): none" in plain_server.log()


def test_no_cors_headers_by_default(plain_server):
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{plain_server.url}/v1/chat/completions", headers=headers)
    assert "access-control-allow-origin" not in preflight.headers
