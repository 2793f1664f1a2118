"""The bundled model's quantized weights with the other features (compatibility matrix,
scripts/compat_matrix.py): `--quantization gguf` (the GGUF file's own 4-bit blocks, the CPU
default) and `--quantization int8`, each with speculative decoding (ngram), structured output,
gRPC and the router, on one live worker per format."""

from __future__ import annotations

import json

import pytest
from compat_stack import REPEATING_PROMPT, SPEC_NGRAM, CompatStack

pytestmark = [pytest.mark.milestone("m00"), pytest.mark.timeout(400), pytest.mark.slow]

ACCEPTED = "nanollmserve:spec_decode_num_accepted_tokens_total"
DRAFTS = "nanollmserve:spec_decode_num_drafts_total"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# The answer's JSON is in the prompt, so ngram drafts follow it inside the grammar.
COPY_JSON = 'Copy it: {"ok": true} {"ok": true} {"ok": true}. JSON:'


@pytest.fixture(scope="module", params=["gguf", "int8"])
def stack(request):
    # --dtype auto: gguf computes in float32 on the GGUF file's blocks; int8 in float32 too.
    stack = CompatStack.start(
        "--dtype", "auto", "--quantization", request.param, "--num-kv-blocks", "128",
        "--speculative-config", SPEC_NGRAM,
    )  # fmt: skip
    stack.quantization = request.param
    yield stack
    stack.stop()


def test_speculation_runs_on_the_quantized_weights(stack, compat):
    assert f"quantization={stack.quantization} " in stack.ready_line()
    drafts = stack.metric(DRAFTS)
    chat = stack.worker.openai().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": REPEATING_PROMPT}],
        max_tokens=32,
        temperature=0,
    )
    assert chat.choices[0].message.content
    assert stack.metric(ACCEPTED) > 0  # drafts were checked and kept on these weights
    compat.exercised("spec", num_drafts=stack.metric(DRAFTS) - drafts)
    quantization = compat.quantization_in_log(stack.ready_line())
    compat.exercised(stack.quantization, quantization=quantization)


def test_structured_output_over_grpc_on_the_quantized_weights(stack, compat):
    async def body(client):
        choice = await client.generate(
            "Is the sky blue?", max_tokens=8, structured_outputs={"choice": ["yes", "no"]}
        )
        as_json = await client.generate(
            "Answer in JSON:", max_tokens=24, structured_outputs={"json": json.dumps(SCHEMA)}
        )
        copied = await client.generate(
            COPY_JSON, max_tokens=24, temperature=0, structured_outputs={"json": json.dumps(SCHEMA)}
        )
        return choice, as_json, copied

    drafts = stack.metric(DRAFTS)
    choice, as_json, copied = stack.grpc(body)
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert isinstance(json.loads(as_json.text)["ok"], bool)
    compat.exercised("grpc", reply=copied)
    compat.exercised("structured", output=choice.text, choice=["yes", "no"])
    compat.exercised("structured", output=copied.text, schema=SCHEMA)
    compat.exercised("spec", num_drafts=stack.metric(DRAFTS) - drafts)
    quantization = compat.quantization_in_log(stack.ready_line())
    compat.exercised(stack.quantization, quantization=quantization)


def test_router_in_front_of_the_quantized_worker_keeps_the_schema(stack, compat):
    drafts = stack.metric(DRAFTS)
    chat = stack.router.openai().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": COPY_JSON}],
        max_tokens=24,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    )
    assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool)
    assert stack.router.stats()["workers"][0]["num_routed"] >= 1
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])
    compat.exercised("structured", output=chat.choices[0].message.content, schema=SCHEMA)
    compat.exercised("spec", num_drafts=stack.metric(DRAFTS) - drafts)
    quantization = compat.quantization_in_log(stack.ready_line())
    compat.exercised(stack.quantization, quantization=quantization)
