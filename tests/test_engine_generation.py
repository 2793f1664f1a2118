"""End-to-end engine behaviour on the bundled model through the offline LLM API:
HF parity, batch invariance, prefix caching, chunked prefill, preemption, aborts."""

from __future__ import annotations

import pytest
import torch

from nanollmserve import SamplingParams
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
]


def long_text(num_words: int, seed: int = 0) -> str:
    words = ["alpha", "river", "stone", "cloud", "maple", "orbit", "ember", "quartz", "delta"]
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(words), (num_words,), generator=g).tolist()
    return " ".join(words[i] for i in picks)


@pytest.mark.slow
@pytest.mark.milestone("m01")
@pytest.mark.milestone("m03")
def test_greedy_matches_hugging_face_generate(llm):
    """64 greedy tokens for several chat prompts equal HF generate(do_sample=False)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.loaded.model_dir, dtype=torch.float32)
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = llm.chat(conversations, params)
    for conversation, output in zip(conversations, outputs, strict=True):
        prompt = chat_prompt_token_ids(llm.tokenizer, conversation)
        assert output.prompt_token_ids == prompt
        reference = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            eos_token_id=None,  # like ignore_eos: generate 64 tokens, EOS included
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == reference


@pytest.mark.milestone("m05")
# The prefix-cache variant runs in `make test-slow`: the no-prefix-cache one recomputes every
# token, the harder case, in `make test`.
@pytest.mark.parametrize(
    "prefix_caching",
    [
        pytest.param(False, id="no-prefix-cache"),
        pytest.param(True, id="prefix-cache", marks=pytest.mark.slow),
    ],
)
def test_batch_invariance(make_llm, prefix_caching):
    """16 prompts of mixed lengths give the same greedy tokens together as one by one. Without
    prefix caching the runs alone recompute every token instead of reusing the batch's blocks."""
    llm = make_llm(enable_prefix_caching=prefix_caching)
    prompts = [long_text(3 + 9 * i, seed=i) for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    for a, b in zip(together, alone, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats.num_steps > 0
    assert (stats.prefix_cache_hits > 0) == prefix_caching


@pytest.mark.milestone("m05")
def test_outputs_carry_text_reason_and_metrics(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # <|im_end|>
    assert completion.token_ids[-1] in llm.engine.eos_token_ids
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.num_generation_tokens == len(completion.token_ids)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft > 0 and m.tpot > 0 and m.time_in_queue >= 0
    assert llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True) == completion.text


@pytest.mark.milestone("m08")
def test_prefix_cache_reuses_a_shared_prefix(make_llm):
    prefix = long_text(200, seed=7)
    prompts = [prefix + " Summarize.", prefix + " Translate."]
    cached = make_llm()
    first = cached.generate(prompts[0], GREEDY)[0]
    second = cached.generate(prompts[1], GREEDY)[0]
    assert len(first.prompt_token_ids) > 200
    assert second.num_cached_tokens >= 192
    assert second.metrics.num_cached_tokens == second.num_cached_tokens
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == first.num_cached_tokens + second.num_cached_tokens
    uncached = make_llm(enable_prefix_caching=False)
    reference = uncached.generate(prompts, GREEDY)
    assert reference[1].num_cached_tokens == 0
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [
        r.outputs[0].token_ids for r in reference
    ]


@pytest.mark.milestone("m09")
def test_chunked_prefill_matches_unchunked(make_llm):
    prompt = long_text(1000, seed=3)
    chunked_llm = make_llm(max_num_batched_tokens=128, enable_prefix_caching=False)
    chunked = chunked_llm.generate(prompt, GREEDY)[0]
    assert len(chunked.prompt_token_ids) >= 1000
    steps_for_prefill = chunked_llm.engine.stats().num_steps - len(chunked.outputs[0].token_ids)
    assert steps_for_prefill >= len(chunked.prompt_token_ids) // 128
    whole = make_llm(max_num_batched_tokens=2048, enable_prefix_caching=False)
    assert whole.generate(prompt, GREEDY)[0].outputs[0].token_ids == chunked.outputs[0].token_ids


PREEMPTION_PROMPTS = [long_text(20 + 3 * i, seed=100 + i) for i in range(12)]
PREEMPTION_PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def big_pool_outputs():
    """The preemption test's requests on a big pool without prefix caching, computed once:
    the reference of both of its cases."""
    from nanollmserve import LLM

    with LLM(dtype="float32", num_kv_blocks=512, enable_prefix_caching=False) as big:
        return big.generate(PREEMPTION_PROMPTS, PREEMPTION_PARAMS)


@pytest.mark.milestone("m09")
# The prefix-cache variant runs in `make test-slow`: the no-prefix-cache one recomputes every
# token, the harder case, in `make test`.
@pytest.mark.parametrize(
    "prefix_caching",
    [
        pytest.param(False, id="no-prefix-cache"),
        pytest.param(True, id="prefix-cache", marks=pytest.mark.slow),
    ],
)
def test_preemption_recomputes_and_keeps_outputs(make_llm, big_pool_outputs, prefix_caching):
    """A pool for 2-3 requests: 12 requests still finish, with the outputs of a big pool.
    Without prefix caching a resumed request recomputes its tokens rather than finding them."""
    small = make_llm(
        num_kv_blocks=14, max_model_len=224, block_size=16, enable_prefix_caching=prefix_caching
    )
    squeezed = small.generate(PREEMPTION_PROMPTS, PREEMPTION_PARAMS)
    assert small.engine.stats().num_preemptions > 0
    for a, b in zip(squeezed, big_pool_outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "length"


@pytest.mark.milestone("m09")
def test_requests_that_can_never_fit_are_rejected_at_admission(make_llm):
    small = make_llm(num_kv_blocks=8, block_size=16)  # 128 tokens in all
    assert small.engine.max_model_len == 128
    with pytest.raises(ValueError, match="maximum context length is 128"):
        small.generate(long_text(200), GREEDY)
    with pytest.raises(ValueError, match="you requested"):
        small.generate("hello", SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="maximum context length"):
        small.engine.add_request(
            EngineCoreRequest("x", list(range(1, 300)), SamplingParams(max_tokens=4))
        )


@pytest.mark.milestone("m06")
def test_abort_at_any_point_returns_every_block(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    prompt = llm.tokenizer.encode(long_text(150, seed=5))
    for steps_before_abort in (0, 1, 3, 10):
        for i in range(3):
            engine.add_request(EngineCoreRequest(f"abort-{steps_before_abort}-{i}", prompt, params))
        for _ in range(steps_before_abort):
            engine.step()
        assert engine.kv_cache.num_free_blocks < engine.num_kv_blocks or steps_before_abort == 0
        engine.abort_requests([f"abort-{steps_before_abort}-{i}" for i in range(3)])
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


@pytest.mark.milestone("m07")
def test_paged_attention_reads_through_scattered_blocks(make_llm):
    """Fragment the pool so a request's blocks are not contiguous; output is unchanged."""
    prompt = long_text(60, seed=11)
    fresh = make_llm(enable_prefix_caching=False).generate(prompt, GREEDY)[0]
    fragmented = make_llm(enable_prefix_caching=False, num_kv_blocks=64)
    engine = fragmented.engine
    fillers = [
        EngineCoreRequest(f"filler-{i}", [1 + i] * 20, SamplingParams(max_tokens=1))
        for i in range(20)
    ]
    for filler in fillers:
        engine.add_request(filler)
    engine.step()  # every filler holds 2 blocks now; free every other one
    engine.abort_requests([f.request_id for f in fillers[::2]])
    out = fragmented.generate(prompt, GREEDY)[0]
    engine.abort_requests([f.request_id for f in fillers[1::2]])
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
