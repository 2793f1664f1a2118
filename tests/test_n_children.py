"""`n > 1` on the KV pool: the children of one request share its prompt blocks, and that
sharing is the prefix cache's doing (decision 4 of docs/ARCHITECTURE.md), so without prefix
caching each child holds its own copy of the prompt."""

from __future__ import annotations

import pytest
from cluster_process import tiny_model_dir

from nanollmserve import SamplingParams

pytestmark = pytest.mark.milestone("m08")

PROMPT_LEN = 200  # 12 full blocks of 16 and a partial one
BLOCK_SIZE = 16


def peak_blocks(make_llm, n: int, prefix_caching: bool) -> int:
    """Peak KV blocks in use while a fresh engine answers one `n`-completion request (on the
    tiny random-weight model: block accounting does not depend on the weights)."""
    llm = make_llm(
        model=str(tiny_model_dir()), block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching
    )
    prompt = [(7 * i + 3) % 1000 + 100 for i in range(PROMPT_LEN)]
    params = SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert len(out.prompt_token_ids) == PROMPT_LEN
    assert [len(c.token_ids) for c in out.outputs] == [8] * n
    return llm.engine.stats().kv_cache.peak_used_blocks


def test_n_children_share_the_prompt_blocks(make_llm):
    one = peak_blocks(make_llm, n=1, prefix_caching=True)
    four = peak_blocks(make_llm, n=4, prefix_caching=True)
    full_prompt_blocks = PROMPT_LEN // BLOCK_SIZE
    assert one == -(-(PROMPT_LEN + 8) // BLOCK_SIZE)  # 13: the prompt and 8 tokens
    assert four < 4 * one
    # Shared: the prompt's full blocks once, then each child's own tail blocks.
    assert four <= full_prompt_blocks + 4 * 2, (one, four)


def test_without_prefix_caching_each_child_copies_the_prompt(make_llm):
    one = peak_blocks(make_llm, n=1, prefix_caching=False)
    four = peak_blocks(make_llm, n=4, prefix_caching=False)
    assert four >= 4 * (PROMPT_LEN // BLOCK_SIZE), (one, four)
