"""Speculative decoding (m16) through the offline `LLM` API: `--speculative-config` parsing,
greedy output identical to decoding without speculation (n-gram and draft model, a batch of
8 prompts x 128 tokens, preemption forced, prefix cache on), the KV cache and prefix hashes
holding accepted tokens only, max_tokens / stop tokens exact, and sampled output following
the target distribution (a chi-square test on a tiny model).

Tiny random-weight models keep it fast: their greedy text repeats itself, so n-gram drafts
are often accepted and often rejected, and a second tiny model (another seed) drafts badly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import assert_no_leak
from test_model_parity import TINY, make_tiny_hf_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from nanollmserve import LLM, EngineConfig, SamplingParams
from nanollmserve.errors import UserError
from nanollmserve.model import resolve_model

pytestmark = pytest.mark.milestone("m16")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TINY_ARGS = {"dtype": "float32", "block_size": 8, "max_model_len": 256}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama target and a tiny Llama draft (another seed), sharing the bundled
    tokenizer (its ids cover the tiny vocabulary)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny-llama-{seed}")
        make_tiny_hf_model(LlamaConfig, path, seed=seed)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def prompts(num: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 40, (num,), generator=generator).tolist()
    return [
        torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist() for n in lengths
    ]


def check_prefix_cache_holds_accepted_tokens(llm: LLM, outputs) -> None:
    """Every cached block is a full block of some request's accepted tokens, at its place."""
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    bs = llm.engine.config.block_size
    for block in llm.engine.kv_cache.pool.cached_blocks.values():
        _, tokens = block.key
        assert len(tokens) == bs
        assert any(
            tuple(seq[i : i + bs]) == tokens for seq in sequences for i in range(0, len(seq), bs)
        )


def test_speculative_config_is_checked() -> None:
    parsed = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    spec = parsed.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's default
    only_max = EngineConfig(
        speculative_config={**NGRAM, "prompt_lookup_min": None, "prompt_lookup_max": 3}
    )
    assert only_max.speculative_config.prompt_lookup_min == 3
    assert (
        EngineConfig(
            speculative_config={"model": "x", "num_speculative_tokens": 2}
        ).speculative_config.method
        == "draft_model"
    )
    for bad, words in [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({**NGRAM, "k": 1}, "unknown keys"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ]:
        with pytest.raises(UserError, match=words):
            EngineConfig(speculative_config=bad)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_batched_with_preemption_equals_no_speculation(method, tiny_dirs) -> None:
    target, draft = tiny_dirs
    spec = NGRAM if method == "ngram" else {"model": str(draft), "num_speculative_tokens": 3}
    batch = prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    reference = LLM(str(target), num_kv_blocks=512, **TINY_ARGS).generate(
        batch, params, use_tqdm=False
    )
    # 40 blocks of 8 slots cannot hold 8 requests of up to 167 tokens: preemption is forced.
    llm = LLM(str(target), num_kv_blocks=40, speculative_config=spec, **TINY_ARGS)
    outputs = llm.generate(batch, params, use_tqdm=False)
    for ref, out in zip(reference, outputs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 128  # max_tokens exactly
    stats = llm.engine.stats()
    spec_stats = stats.spec_decode
    assert stats.num_preemptions > 0
    assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens  # both happened
    assert stats.num_steps < llm.engine.stats().num_generation_tokens  # several tokens a step
    assert sum(spec_stats.num_accepted_tokens_per_pos) == spec_stats.num_accepted_tokens
    check_prefix_cache_holds_accepted_tokens(llm, outputs)
    assert_no_leak(llm)


def test_stop_tokens_and_max_tokens_cut_an_accepted_run(tiny_dirs) -> None:
    target, _ = tiny_dirs
    prompt = prompts(1, seed=11)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2)
    llm = LLM(str(target), num_kv_blocks=128, speculative_config=NGRAM, **TINY_ARGS)
    full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    # logprobs: one entry per token, the sampled token's own first
    assert len(full.logprobs) == len(full.token_ids)
    assert all(t in entry for t, entry in zip(full.token_ids, full.logprobs, strict=True))
    # A stop token id inside a run of accepted drafts ends the output right there.
    stop_at = next(i for i in range(5, 60) if full.token_ids[i] not in full.token_ids[:i])
    stop = SamplingParams(
        temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[full.token_ids[stop_at]]
    )
    cut = llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == full.token_ids[: stop_at + 1]
    assert cut.finish_reason == "stop"
    for max_tokens in (1, 2, 7, 13):
        out = llm.generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.token_ids == full.token_ids[:max_tokens]
        assert out.finish_reason == "length"
    assert_no_leak(llm)


def test_draft_model_with_another_vocabulary_is_refused(tiny_dirs, tmp_path) -> None:
    _, draft = tiny_dirs
    make_tiny_hf_model(LlamaConfig, tmp_path, vocab_size=96)
    with pytest.raises(UserError, match="vocabulary"):
        LLM(
            str(draft),
            num_kv_blocks=32,
            speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2},
            **TINY_ARGS,
        )


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09): Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_tokens_follow_the_target_distribution(tiny_dirs) -> None:
    """The second output token is the first one the target checks against a draft: its
    empirical distribution over many seeded requests must match the target's own,
    computed exactly from the model (sum over the first token)."""
    target, _ = tiny_dirs
    temperature, num_samples = 0.8, 1500
    prompt = prompts(1, seed=3)[0]
    # The target drafts for itself (greedily): drafts are accepted about as often as the
    # argmax is sampled, and rejected otherwise, so both branches of the rule matter.
    llm = LLM(
        str(target),
        num_kv_blocks=1024,
        max_num_seqs=256,
        speculative_config={"model": str(target), "num_speculative_tokens": 2},
        **TINY_ARGS,
    )
    params = [
        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=i)
        for i in range(num_samples)
    ]
    outputs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
    spec = llm.engine.stats().spec_decode
    assert spec.num_drafts >= num_samples  # about one draft step per request
    observed = torch.bincount(
        torch.tensor([o.outputs[0].token_ids[1] for o in outputs]), minlength=TINY["vocab_size"]
    ).double()

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    with torch.inference_mode():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        sequences = torch.tensor([prompt + [t] for t in range(TINY["vocab_size"])])
        second = torch.softmax(hf(sequences).logits[:, -1] / temperature, -1)
    expected = (first[:, None] * second).sum(0) * num_samples
    # Bins expected >= 5 times, the rest pooled into one.
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    assert statistic < chi_square_critical(len(obs) - 1), (statistic, len(obs))
    # Both branches of the rule ran: drafts were accepted and rejected.
    assert 0.1 < spec.num_accepted_tokens_per_pos[0] / num_samples < 0.9


@pytest.mark.milestone("m22")
@pytest.mark.timeout(900)
def test_verify_steps_run_natively_on_the_default_path_with_the_same_greedy_output(make_llm):
    """The bundled model on the default flags (GGUF blocks): every verify step (the last
    token and its drafts) is one native call, plain and under a JSON schema, and greedy
    output equals decoding without speculation."""
    from nanollmserve.bench.spec_decode import (
        JSON_SCHEMA,
        copy_json_prompt_token_ids,
        copy_prompt_token_ids,
    )

    reference = make_llm(dtype="auto", num_kv_blocks=128)
    llm = make_llm(dtype="auto", num_kv_blocks=128, speculative_config=NGRAM)
    assert llm.engine.loaded.quantization == "gguf"
    runner = llm.engine.model_runner
    assert runner.native_decode is not None
    cases = [
        (copy_prompt_token_ids(llm.tokenizer, 120), {}),
        (
            copy_json_prompt_token_ids(llm.tokenizer, 60),
            {"structured_outputs": {"json": JSON_SCHEMA}},
        ),
    ]
    for prompt, extra in cases:
        params = SamplingParams(temperature=0.0, max_tokens=48, **extra)
        expected = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        runner.native_steps.clear()
        before = llm.engine.stats().spec_decode.num_drafts
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected
        num_drafts = llm.engine.stats().spec_decode.num_drafts - before
        assert num_drafts > 0
        assert runner.native_steps["verify"] == num_drafts  # every verify step ran natively


@pytest.mark.milestone("m22")
def test_ngram_lookup_finds_the_latest_earlier_match() -> None:
    """The proposer's search (a C scan for the suffix's first token) proposes what a plain
    scan of every position, latest first, finds."""
    import random

    from nanollmserve.engine.spec_decode.ngram_proposer import NgramProposer

    def plain(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        if k < 1 or len(ids) <= min_n:
            return []
        for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == ids[-n:]:
                    return ids[start + n : start + n + k]
        return []

    rng = random.Random(1)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 300])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(60))]
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 5), rng.randint(0, 5)
        assert NgramProposer(min_n, max_n).lookup(ids, k) == plain(ids, k, min_n, max_n)
