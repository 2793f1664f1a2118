"""Priority scheduling and token-level I/O with the other features (compatibility matrix):
speculative decoding, GGUF blocks, structured output and LoRA offline; tensor parallelism,
gRPC and the router through a 2-rank CPU worker (a tiny random Llama) behind a router."""

from __future__ import annotations

import math

import pytest
from cluster_process import tiny_model_dir
from compat_stack import SPEC_NGRAM, CompatStack
from lora_adapters import adapter_dir

from nanollmserve import LLM, LoRARequest
from nanollmserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(400)]

PROMPTS = [f"Item {i}: the weather today is sunny and the sky is" for i in range(4)]
PRIORITIES = [3, -1, 2, 0]


def _params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **extra)


def _prompt_lps(output) -> list[float]:
    return [next(iter(e.values())).logprob for e in output.prompt_logprobs[1:]]


def _started(outputs) -> list[tuple[int, float]]:
    """(priority, first scheduled time) of each of PROMPTS' outputs, in submission order."""
    return [(p, o.metrics.first_scheduled_time) for p, o in zip(PRIORITIES, outputs, strict=True)]


def _check_features_together(llm: LLM, reference: LLM, rel: float = 1e-4, **extra) -> list:
    """Priority order, greedy outputs and prompt logprobs under `llm` equal `reference`'s
    (fcfs, no prompt logprobs asked for the outputs); returns `llm`'s outputs."""
    outputs = llm.generate(
        PROMPTS, _params(prompt_logprobs=2, **extra), use_tqdm=False, priority=PRIORITIES
    )
    plain = reference.generate(PROMPTS, _params(prompt_logprobs=2, **extra), use_tqdm=False)
    for ours, ref in zip(outputs, plain, strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(_prompt_lps(ours), _prompt_lps(ref), strict=True):
            assert math.isclose(a, b, rel_tol=rel, abs_tol=rel)
    return outputs


def test_with_speculative_decoding(make_llm, llm, compat):
    spec = make_llm(
        speculative_config=SPEC_NGRAM,
        scheduling_policy="priority",
        max_num_seqs=2,
        num_kv_blocks=12,
        block_size=8,
    )
    outputs = _check_features_together(spec, llm)
    compat.exercised("spec", num_drafts=spec.engine.stats().spec_decode.num_drafts)
    compat.exercised("priority", started=_started(outputs))
    compat.exercised("tokenio", prompt_logprobs=outputs[0].prompt_logprobs)


def test_with_gguf_blocks(make_llm, compat):
    gguf = make_llm(dtype="auto", quantization="gguf", scheduling_policy="priority", max_num_seqs=1)
    reference = make_llm(dtype="auto", quantization="gguf")
    together = _check_features_together(gguf, reference)
    outputs = gguf.generate(PROMPTS, _params(), use_tqdm=False, priority=PRIORITIES)
    started = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 2, 0]
    compat.exercised("gguf", quantization=gguf.engine.loaded.quantization)
    compat.exercised("priority", started=_started(outputs))
    compat.exercised("tokenio", prompt_logprobs=together[0].prompt_logprobs)


def test_with_structured_output(make_llm, llm, compat):
    constrained = make_llm(scheduling_policy="priority", max_num_seqs=2)
    choice = {"structured_outputs": {"choice": ["sunny", "cloudy", "blue"]}}
    outputs = constrained.generate(
        PROMPTS, _params(prompt_logprobs=1, **choice), use_tqdm=False, priority=PRIORITIES
    )
    plain = llm.generate(PROMPTS, _params(prompt_logprobs=1), use_tqdm=False)
    for ours, ref in zip(outputs, plain, strict=True):
        assert ours.outputs[0].text in ("sunny", "cloudy", "blue")
        assert _prompt_lps(ours) == pytest.approx(_prompt_lps(ref), rel=1e-4)  # raw, unmasked
    choices = choice["structured_outputs"]["choice"]
    compat.exercised("structured", output=outputs[0].outputs[0].text, choice=choices)
    compat.exercised("priority", started=_started(outputs))
    compat.exercised("tokenio", prompt_logprobs=outputs[0].prompt_logprobs)


def test_with_lora(make_llm, compat):
    lora_llm = make_llm(enable_lora=True, max_loras=1, scheduling_policy="priority", max_num_seqs=2)
    adapter = LoRARequest("a", 1, str(adapter_dir(1)))
    with_adapter = lora_llm.generate(
        PROMPTS, _params(prompt_logprobs=1), use_tqdm=False, lora_request=adapter,
        priority=PRIORITIES,
    )  # fmt: skip
    base = lora_llm.generate(PROMPTS, _params(prompt_logprobs=1), use_tqdm=False)
    alone = lora_llm.generate(PROMPTS[:1], _params(), use_tqdm=False, lora_request=adapter)
    assert with_adapter[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert _prompt_lps(with_adapter[0]) != pytest.approx(_prompt_lps(base[0]), rel=1e-3)
    compat.exercised(
        "lora",
        output=[o.outputs[0].token_ids for o in with_adapter],
        base=[o.outputs[0].token_ids for o in base],
    )
    compat.exercised("priority", started=_started(with_adapter))
    compat.exercised("tokenio", prompt_logprobs=with_adapter[0].prompt_logprobs)


@pytest.fixture(scope="module")
def stack():
    model_dir = tiny_model_dir()
    # --dtype float32: the test compares the sharded worker's tokens and prompt logprobs with
    # an offline float32 engine's to 1e-4 (dtype auto is bfloat16 on a CPU with bfloat16).
    stack = CompatStack.start(
        str(model_dir), "--dtype", "float32", "--tensor-parallel-size", "2",
        "--num-kv-blocks", "64", "--scheduling-policy", "priority", "--served-model-name", "tiny",
    )  # fmt: skip
    stack.model_dir = model_dir
    yield stack
    stack.stop()


def test_tensor_parallel_worker_over_router_and_grpc(stack, compat):
    single = LLM(str(stack.model_dir), dtype="float32", num_kv_blocks=64)
    try:
        [expected] = single.generate(["Hello there"], _params(prompt_logprobs=2), use_tqdm=False)
    finally:
        single.shutdown()
    extra = {"priority": -3, "prompt_logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    for client in (stack.router.openai(), stack.worker.openai(strict=False)):
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="Hello there", max_tokens=6, temperature=0, extra_body=extra
        )
        choice = raw.parse().choices[0].model_dump()
        compat.exercised("priority", admitted=(extra["priority"], raw.status_code))
        compat.exercised("tokenio", token_ids=choice["token_ids"])
        assert choice["prompt_token_ids"] == expected.prompt_token_ids
        assert choice["token_ids"] == expected.outputs[0].token_ids
        ours = [next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"][1:]]
        assert ours == pytest.approx(_prompt_lps(expected), rel=1e-4, abs=1e-4)
    assert "rank 1 of 2" in stack.worker.log()
    compat.exercised("tp", ranks=compat.ranks_in_log(stack.worker.log()))
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])

    async def body(client):
        return await client.generate(
            "Hello there", max_tokens=6, temperature=0, ignore_eos=True, priority=-3
        )

    reply = stack.grpc(body)
    assert reply.text == expected.outputs[0].text
    compat.exercised("grpc", reply=reply)
