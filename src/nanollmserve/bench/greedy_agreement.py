"""Greedy agreement with llama.cpp: how many tokens our greedy answer shares with llama.cpp's
before the first different one, on eight fixed chat prompts.

Both sides get the same prompt token ids (our chat template, rendered by our tokenizer) and
answer greedily up to `max_tokens`, stopping at end of generation; the trailing end-of-
generation token is dropped from both, so two identical answers agree on their whole length.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for writing clear code.",
    "Who wrote the play Romeo and Juliet?",
]


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """Each prompt as one user turn through the model's chat template."""
    from nanollmserve.frontend.tokenizer import chat_prompt_token_ids

    return [
        chat_prompt_token_ids(tokenizer, [{"role": "user", "content": text}])
        for text in CHAT_PROMPTS
    ]


def strip_end(token_ids: Sequence[int], end_ids: set[int]) -> list[int]:
    """Drop a final end-of-generation token (one side may report it, the other not)."""
    ids = list(token_ids)
    return ids[:-1] if ids and ids[-1] in end_ids else ids


def tokens_before_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def engine_greedy(llm, prompts: list[list[int]], max_tokens: int, end_ids: set[int]):
    """Our greedy answers (one batch) as token id lists, end token dropped."""
    from nanollmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [strip_end(out.outputs[0].token_ids, end_ids) for out in outputs]


def agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    """Per prompt: tokens before the first divergence; their median and min; how many answers
    are identical."""
    counts = [tokens_before_divergence(a, b) for a, b in zip(ours, peer, strict=True)]
    return {
        "tokens_before_divergence": counts,
        "median": statistics.median(counts),
        "min": min(counts),
        "identical_answers": sum(a == b for a, b in zip(ours, peer, strict=True)),
        "answer_lengths": [len(a) for a in ours],
    }
