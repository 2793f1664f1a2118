"""Seeded synthetic workloads: prompts as token ids with lengths drawn from ranges, so every
system under test gets exactly the same input."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256)."""
    low, _, high = text.partition("-")
    low_value = int(low)
    high_value = int(high) if high else low_value
    if low_value < 1 or high_value < low_value:
        raise ValueError(f"bad length range {text!r}: expected N or LOW-HIGH with 1 <= LOW <= HIGH")
    return low_value, high_value


def random_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token ids (avoiding the first 100 ids, where tokenizers keep special tokens)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        prompt = [rng.randrange(100, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(prompt, n_out))
    return requests
