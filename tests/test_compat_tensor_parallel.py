"""Tensor parallelism with the other features (compatibility matrix, scripts/compat_matrix.py):
a 2-rank CPU worker (gloo) of a tiny random Llama answers structured output over HTTP, gRPC
and through the router; the features it does not support yet are refused with one clear
error before any rank starts."""

from __future__ import annotations

import pytest
from cluster_process import tiny_model_dir
from compat_stack import SPEC_NGRAM, CompatStack

from nanollmserve import LLM
from nanollmserve.errors import UserError

pytestmark = [pytest.mark.milestone("m00"), pytest.mark.timeout(400), pytest.mark.slow]

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack():
    stack = CompatStack.start(
        str(tiny_model_dir()), "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
        "--served-model-name", MODEL,
    )  # fmt: skip
    yield stack
    stack.stop()


def test_sharded_worker_constrains_output_over_grpc(stack, compat):
    async def body(client):
        return await client.generate(
            "Pick one:", max_tokens=8, structured_outputs={"choice": ["left", "right"]}
        )

    answer = stack.grpc(body)
    assert "rank 1 of 2" in stack.worker.log()
    assert answer.text in ("left", "right") and answer.finish_reason == "stop"
    compat.exercised("tp", ranks=compat.ranks_in_log(stack.worker.log()))
    compat.exercised("grpc", reply=answer)
    compat.exercised("structured", output=answer.text, choice=["left", "right"])


def test_router_in_front_of_a_sharded_worker_keeps_the_choice(stack, compat):
    completion = stack.router.openai().completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert completion.choices[0].text in ("left", "right")
    assert stack.router.stats()["workers"][0]["num_routed"] >= 1
    compat.exercised("tp", ranks=compat.ranks_in_log(stack.worker.log()))
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])
    compat.exercised("structured", output=completion.choices[0].text, choice=["left", "right"])


@pytest.mark.parametrize(
    ("feature", "kwargs", "cell"),
    [
        ("--quantization", {"quantization": "gguf"}, "gguf"),
        ("LoRA adapters", {"enable_lora": True}, "lora"),
        ("speculative decoding", {"speculative_config": SPEC_NGRAM}, "spec"),
    ],
    ids=["quantization", "lora", "speculation"],
)
def test_unsupported_features_are_refused_before_ranks_start(feature, kwargs, cell, compat):
    with pytest.raises(UserError, match=f"tensor parallelism with {feature} is not supported") as e:
        LLM(str(tiny_model_dir()), dtype="float32", tensor_parallel_size=2, **kwargs)
    compat.refused("tp", cell, str(e.value))
