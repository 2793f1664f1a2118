"""LoRA with the other features (compatibility matrix, scripts/compat_matrix.py): one live
worker with an adapter and speculative decoding (ngram) gives PEFT's greedy tokens, keeps a
JSON schema, serves the base model over gRPC (GenerateRequest has no `model` field) and
answers the adapter's requests through the router."""

from __future__ import annotations

import json

import pytest
from compat_stack import REPEATING_PROMPT, SPEC_NGRAM, CompatStack
from lora_adapters import adapter_dir, peft_greedy
from transformers import AutoTokenizer

from nanollmserve.model import resolve_model

pytestmark = [pytest.mark.milestone("m00"), pytest.mark.timeout(400), pytest.mark.slow]

BASE = "SmolLM2-135M-Instruct"
DRAFTS = "nanollmserve:spec_decode_num_drafts_total"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def stack():
    stack = CompatStack.start(
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={adapter_dir(1)}",
        "--num-kv-blocks", "128", "--speculative-config", SPEC_NGRAM,
    )  # fmt: skip
    yield stack
    stack.stop()


def test_adapter_with_speculation_gives_the_peft_greedy_tokens(stack, compat):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    ids = tokenizer.encode(REPEATING_PROMPT)
    drafts = stack.metric(DRAFTS)
    result = stack.worker.openai().completions.create(
        model="a", prompt=ids, max_tokens=24, temperature=0
    )
    compat.exercised("spec", num_drafts=stack.metric(DRAFTS) - drafts)
    (reference,) = peft_greedy(adapter_dir(1), [ids], 24)
    assert result.choices[0].text == tokenizer.decode(reference, skip_special_tokens=True)
    base = stack.worker.openai().completions.create(
        model=BASE, prompt=ids, max_tokens=24, temperature=0
    )
    compat.exercised("lora", output=result.choices[0].text, base=base.choices[0].text)


def test_adapter_keeps_a_json_schema(stack, compat):
    def chat(model: str) -> str:
        return (
            stack.worker.openai()
            .chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                max_tokens=24,
                temperature=0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
                },
            )
            .choices[0]
            .message.content
        )

    with_adapter = chat("a")
    assert isinstance(json.loads(with_adapter)["ok"], bool)
    compat.exercised("structured", output=with_adapter, schema=SCHEMA)
    compat.exercised("lora", output=with_adapter, base=chat(BASE))


def test_grpc_on_a_lora_worker_answers_with_the_base_model(stack, compat):
    prompt = "The capital of France is"

    async def body(client):
        return await client.generate(prompt, max_tokens=12, temperature=0)

    over_grpc = stack.grpc(body)
    client = stack.worker.openai()
    base = client.completions.create(model=BASE, prompt=prompt, max_tokens=12, temperature=0)
    adapter = client.completions.create(model="a", prompt=prompt, max_tokens=12, temperature=0)
    assert over_grpc.text == base.choices[0].text != adapter.choices[0].text
    compat.exercised("grpc", reply=over_grpc)
    compat.exercised("lora", output=adapter.choices[0].text, base=over_grpc.text)


def test_router_passes_the_adapter_name_through(stack, compat):
    prompt = "Write a haiku about the sea."
    direct = stack.worker.openai().completions.create(
        model="a", prompt=prompt, max_tokens=12, temperature=0
    )
    routed_before = stack.router.stats()["workers"][0]["num_routed"]
    routed, base = (
        stack.router.openai().completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0
        )
        for model in ("a", BASE)
    )
    assert routed.choices[0].text == direct.choices[0].text
    assert "a" in {model.id for model in stack.router.openai().models.list().data}
    routed_count = stack.router.stats()["workers"][0]["num_routed"] - routed_before
    compat.exercised("router", routed=routed_count)
    compat.exercised("lora", output=routed.choices[0].text, base=base.choices[0].text)
