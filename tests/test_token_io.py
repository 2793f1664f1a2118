"""Token-level outputs offline: `prompt_logprobs` equal Hugging Face's log-softmax of the
prompt positions (float32, dense weights), in vLLM's format (None for the first token, then
the prompt token and its top k), and stay the same with a chunked prefill, a preemption, a
prefix-cache hit the request must skip, and `n` > 1 (whose choices all get logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m23")

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to"


@pytest.fixture(scope="module")
def hf_logprobs(shared_llm):
    """HF transformers' log-softmax at every position of PROMPT's tokens (float32)."""
    from transformers import AutoModelForCausalLM

    model_dir = shared_llm.engine.loaded.model_dir
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    token_ids = shared_llm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return token_ids, torch.log_softmax(logits, dim=-1)


def _check_against_hf(prompt_logprobs, token_ids, ref, k: int) -> None:
    assert len(prompt_logprobs) == len(token_ids)
    assert prompt_logprobs[0] is None
    for position in range(1, len(token_ids)):
        entry = prompt_logprobs[position]
        expected = ref[position - 1]
        target = token_ids[position]
        ids = list(entry)
        assert ids[0] == target  # the prompt token first
        assert math.isclose(entry[target].logprob, float(expected[target]), rel_tol=1e-4)
        assert entry[target].rank == int((expected > expected[target]).sum()) + 1
        top = expected.topk(k)
        by_rank = sorted((lp.rank, t) for t, lp in entry.items() if t != target or lp.rank <= k)
        assert [t for rank, t in by_rank if rank <= k][:k] == top.indices.tolist()
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert math.isclose(entry[token_id].logprob, value, rel_tol=1e-4)
            assert entry[token_id].decoded_token is not None


def test_prompt_logprobs_match_transformers(llm, hf_logprobs):
    token_ids, ref = hf_logprobs
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5)
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.prompt_token_ids == token_ids
    _check_against_hf(out.prompt_logprobs, token_ids, ref, 5)
    # k = 0: just the prompt token
    [zero] = llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])
    # no prompt_logprobs asked: none returned
    [plain] = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_survive_chunking_preemption_and_a_cached_prefix(make_llm, hf_logprobs):
    token_ids, ref = hf_logprobs
    # a prefill chunked in pieces of 5 tokens, a pool that forces preemptions
    llm = make_llm(max_num_batched_tokens=5, num_kv_blocks=6, block_size=4, max_model_len=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    prompt = token_ids[:18]
    outputs = llm.generate([prompt] * 3, params, use_tqdm=False)  # the 2nd and 3rd: cache hits
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    for out in outputs:
        assert out.num_cached_tokens == 0  # it computed its whole prompt
        _check_against_hf(out.prompt_logprobs, prompt, ref, 3)
        assert out.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_logprobs_for_every_choice_with_n(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, logprobs=2)
    [out] = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for choice in out.outputs:
        assert len(choice.logprobs) == len(choice.token_ids) == 5
        for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=True):
            assert next(iter(entry)) == token_id
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("value", [-1, 21, 1.5, "5", True, float("nan"), float("inf")])
def test_prompt_logprobs_must_be_an_int_in_range(value):
    with pytest.raises(ParamError) as error:
        SamplingParams(prompt_logprobs=value)
    assert error.value.param == "prompt_logprobs"
