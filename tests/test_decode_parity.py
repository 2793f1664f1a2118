"""Decoding parity with Hugging Face `generate`, through the engine's paged KV cache.

test_model_parity.py compares prefill logits only; here tokens are decoded one step at a
time through the block tables, several prompts batched, and must equal HF `generate`:
tiny random Qwen2, Qwen3 and Mistral models in float32 (exact), and the bundled model in
bfloat16, the dtype it is served in on CPUs with native bfloat16 and on GPUs (exact, or a
first divergence that HF's own bfloat16 logits show to be a near tie).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from test_model_parity import CASES, TINY, make_tiny_hf_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanollmserve import LLM, SamplingParams
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids
from nanollmserve.model import resolve_model
from nanollmserve.model.device import cpu_has_native_bf16

pytestmark = pytest.mark.milestone("m01")

TINY_PROMPT_LENS = [5, 17, 30, 41]  # across block boundaries of 8
TINY_NEW_TOKENS = 32


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt], device=hf_model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf_model.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # like ignore_eos
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral"])
def test_tiny_model_decode_matches_transformers_generate(case: str, tmp_path: Path) -> None:
    config_cls, overrides = CASES[case]
    hf_model = make_tiny_hf_model(config_cls, tmp_path, **overrides)
    # The engine's frontend needs a tokenizer; the bundled one covers the tiny vocabulary.
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist()
        for n in TINY_PROMPT_LENS
    ]
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=TINY_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # All four ran as one batch: the pool holds them, and decode steps carried several requests.
    assert llm.engine.stats().num_steps < len(prompts) * TINY_NEW_TOKENS
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        assert len(ours) == TINY_NEW_TOKENS
        assert len(set(ours)) > 1  # not a degenerate constant output
        assert ours == hf_greedy(hf_model, prompt, TINY_NEW_TOKENS)


BF16_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "Give me three tips for learning to cook.",
]
BF16_NEW_TOKENS = 64


def bf16_spacing(value: float) -> float:
    """Distance from `value` to the next bfloat16 (8 significant bits): 0.125 near 16."""
    return 2.0 ** (math.frexp(abs(value))[1] - 8)


def bf16_device() -> str:
    """Where bfloat16 is served: a GPU, or a CPU with native bfloat16 math. Elsewhere it is
    emulated (the CPU serves float32) and HF's bf16 `generate` takes minutes: skip, unless
    NANOLLMSERVE_TEST_BF16=1 asks for it anyway."""
    if torch.cuda.is_available():
        return "cuda"
    if not cpu_has_native_bf16() and os.environ.get("NANOLLMSERVE_TEST_BF16") != "1":
        pytest.skip("bfloat16 is emulated on this CPU (no AVX512-BF16 or AMX); it serves float32")
    return "cpu"


@pytest.mark.slow
def test_bundled_model_bfloat16_greedy_matches_transformers_bfloat16() -> None:
    """Served dtype: 64 greedy tokens x 4 chat prompts, engine bf16 vs HF bf16 `generate`.
    Where the two differ, the first differing position must be a tie in HF's own bf16
    logits: our token and HF's are both within two bf16 steps of HF's largest logit (a
    step is 0.125 for logits in [16, 32)); the gaps are printed."""
    device = bf16_device()
    llm = LLM(dtype="bfloat16", device=device, num_kv_blocks=256)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.loaded.model_dir, dtype=torch.bfloat16)
    hf.to(device).eval()
    conversations = [[{"role": "user", "content": p}] for p in BF16_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=BF16_NEW_TOKENS, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    exact = 0
    for conversation, output in zip(conversations, outputs, strict=True):
        prompt = chat_prompt_token_ids(llm.tokenizer, conversation)
        assert output.prompt_token_ids == prompt
        ours = output.outputs[0].token_ids
        reference = hf_greedy(hf, prompt, BF16_NEW_TOKENS)
        if ours == reference:
            exact += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b)
        with torch.inference_mode():
            ids = torch.tensor([prompt + reference[:i]], device=hf.device)
            logits = hf(ids).logits[0, -1].float()
        logits = logits.cpu()
        top = float(logits.max())
        gaps = {t: top - float(logits[t]) for t in (reference[i], ours[i])}
        print(f"bf16 divergence at token {i} of {conversation[0]['content']!r}: gaps {gaps}")
        # Both are at HF's top, within two bf16 steps of it: a tie has no order, it may take
        # more than two tokens (seen with AMX: three at 11.5), and HF's own cached `generate`
        # lands a step below the top of its full recompute (seen: 0.0625 at 13.69), so two
        # bf16 computations of one logit differ by a step; ours may differ by one more.
        assert all(gap <= 2 * bf16_spacing(top) for gap in gaps.values()), (i, gaps, top)
    # Ties are common over 64 bf16 tokens: every prompt may diverge, each at a tie.
    print(f"bf16 greedy: {exact} of {len(BF16_PROMPTS)} prompts equal HF token for token")
