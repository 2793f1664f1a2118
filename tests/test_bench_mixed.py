"""`nanollmserve bench serve --workload mixed` (m26): the request mix (80% short turns, 20%
long prompts by default, seeded, shuffled) and its flag checks. A run of it through a
disaggregated cluster is in test_cluster_pd.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanollmserve.bench.serve_workloads import WordTokens, mixed_workload

pytestmark = pytest.mark.milestone("m26")


@pytest.fixture(scope="module")
def words():
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.source import resolve_model

    return WordTokens(load_tokenizer(resolve_model(None).path))


def test_mixed_workload_is_one_long_prompt_in_five_seeded_and_shuffled(words) -> None:
    requests = mixed_workload(words, 50, "16-64", "2000-2200", 0.2, "32", seed=3)
    assert requests == mixed_workload(words, 50, "16-64", "2000-2200", 0.2, "32", seed=3)
    assert requests != mixed_workload(words, 50, "16-64", "2000-2200", 0.2, "32", seed=4)
    long = [r for r in requests if r.kind == "long"]
    short = [r for r in requests if r.kind == "short"]
    assert len(long) == 10 and len(short) == 40
    assert all(2000 <= r.prompt_len <= 2200 for r in long)
    assert all(16 <= r.prompt_len <= 64 for r in short)
    assert all(r.max_tokens == 32 for r in requests)
    assert [r.kind for r in requests] != ["long"] * 10 + ["short"] * 40  # shuffled
    encoded = words.tokenizer.encode(long[0].completion_prompt(), add_special_tokens=False)
    assert encoded == long[0].prompt_token_ids  # one token a word: the lengths hold
    assert {r.kind for r in mixed_workload(words, 4, "8", "20", 0.0, "2", seed=0)} == {"short"}


@pytest.mark.parametrize("fraction", ["nan", "inf", "-0.1", "1.5"])
def test_a_long_fraction_outside_zero_to_one_is_one_line(fraction: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "bench", "serve", "--workload", "mixed",
         "--base-url", "http://127.0.0.1:1", "--long-fraction", fraction],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--long-fraction must be within [0, 1]" in result.stderr
