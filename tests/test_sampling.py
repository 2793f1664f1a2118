"""Sampling parameters end to end: seeds, n, logprobs, stop strings and tokens, penalties,
logit bias, min/max tokens, and the ValueError of every invalid value."""

from __future__ import annotations

import math

import pytest
import torch

from nanollmserve import SamplingParams

pytestmark = pytest.mark.milestone("m05")
M21 = pytest.mark.milestone("m21")

PROMPT = "Once upon a time, in a small village by the sea,"


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


@pytest.mark.milestone("m01")
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_same_seed_same_output_whatever_the_batch(make_llm, prefix_caching):
    """Without prefix caching the batched run recomputes the prompt the run alone computed."""
    llm = make_llm(enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16)
    batch = llm.generate(["Hello", PROMPT, "The weather today"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16))
    assert different[0].outputs[0].token_ids != alone


@pytest.mark.milestone("m08")
def test_n_completions_share_the_prompt_blocks(llm):
    prompt = PROMPT + " " + "there lived an old fisherman who " * 6
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in out.outputs)
    # The children after the first reuse the prompt's full blocks through the prefix cache.
    block_size = llm.engine.config.block_size
    full_blocks = (len(out.prompt_token_ids) - 1) // block_size
    hits_before = llm.engine.stats().prefix_cache_hits
    llm.generate(prompt + " again", SamplingParams(n=2, temperature=0.0, max_tokens=2))
    assert llm.engine.stats().prefix_cache_hits - hits_before >= 2 * full_blocks * block_size


def test_greedy_ignores_seed_and_top_k_1_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    top1 = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, seed=3))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_logprobs_are_log_softmax_of_the_logits(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    out = llm.generate(PROMPT, params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    model = llm.engine.loaded.model
    from nanollmserve.layers.attention_context import AttentionContext, reset_context, set_context

    ids = out.prompt_token_ids + completion.token_ids
    set_context(AttentionContext.causal_prefill([len(ids)]))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        reference = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    reset_context()
    start = len(out.prompt_token_ids) - 1
    total = 0.0
    for i, (token_id, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        expected = reference[start + i]
        assert entry[token_id].logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3  # the sampled token is also the top-1 alternative
        top3 = expected.topk(3).indices.tolist()
        assert list(entry) == top3
        assert entry[token_id].decoded_token == llm.tokenizer.decode([token_id])
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_stop_string_truncates_across_token_boundaries(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    # A stop string that spans the boundary between two generated tokens.
    pieces = [llm.tokenizer.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    cut = next(i for i in range(4, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    stop = pieces[cut - 1][-2:] + pieces[cut][len(pieces[cut - 1]) : len(pieces[cut - 1]) + 2]
    expected = base.text[: base.text.index(stop)]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))[0]
    assert out.outputs[0].text == expected
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = SamplingParams(
        temperature=0.0, max_tokens=30, stop=[stop], include_stop_str_in_output=True
    )
    assert llm.generate(PROMPT, kept)[0].outputs[0].text == expected + stop


def test_min_tokens_holds_back_stop_strings(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    early = llm.tokenizer.decode(base.token_ids[:3])
    stop = early.strip()[-3:] or early[-3:]  # text of the first tokens
    assert base.text.index(stop) < len(early)
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    held = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], min_tokens=10)
    )[0].outputs[0]
    assert len(held.token_ids) >= 10
    assert held.token_ids == base.token_ids[: len(held.token_ids)]
    # Once past min_tokens the stop string counts again, like vLLM: only later occurrences.
    later = base.text.find(stop, len(llm.tokenizer.decode(base.token_ids[:10])))
    if later == -1:
        assert held.finish_reason == "length" and held.text == base.text
    else:
        assert held.finish_reason == "stop" and held.text == base.text[:later]


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    stop_token = base.token_ids[4]
    first = base.token_ids.index(stop_token)
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token])
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token

    chat = [{"role": "user", "content": "Say hi."}]
    plain, with_min_tokens, ignoring_eos = (
        SamplingParams(temperature=0.0, max_tokens=40, **extra)
        for extra in ({}, {"min_tokens": 30}, {"ignore_eos": True})
    )  # one batch: each request keeps its own stopping rules
    short, longer, forced = llm.chat([chat] * 3, [plain, with_min_tokens, ignoring_eos])
    short = short.outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 40
    assert len(longer.outputs[0].token_ids) >= 30
    assert len(forced.outputs[0].token_ids) == 40
    assert forced.outputs[0].finish_reason == "length"


def test_logit_bias_and_penalties_change_the_choice(llm):
    target = llm.tokenizer.encode(" banana")[0]
    biased = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=3, logit_bias={target: 100})
    )[0]
    assert biased.outputs[0].token_ids == [target] * 3
    penalties = SamplingParams(
        temperature=0.0, max_tokens=40, repetition_penalty=1.5, frequency_penalty=1.0
    )
    plain, penalized = (  # one batch: the penalties apply to their own request only
        o.outputs[0]
        for o in llm.generate(
            [PROMPT] * 2, [SamplingParams(temperature=0.0, max_tokens=40), penalties]
        )
    )
    assert penalized.token_ids != plain.token_ids
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))


def test_top_p_keeps_the_smallest_set_that_covers_p(llm):
    """top_p=0.5: each sampled token lies in the nucleus: the tokens ranked above it cover
    less than half of the (raw) probability mass."""
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=16, seed=11, logprobs=20)
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        rank = entry[token_id].rank
        above = sorted((lp.logprob for lp in entry.values()), reverse=True)[: rank - 1]
        assert sum(math.exp(lp) for lp in above) < 0.5 + 1e-4
    wide = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, seed=11, logprobs=20)
    narrow_ranks = [
        e[t].rank for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    wide_out = llm.generate(PROMPT, wide)[0].outputs[0]
    wide_ranks = [e[t].rank for t, e in zip(wide_out.token_ids, wide_out.logprobs, strict=True)]
    assert max(wide_ranks) >= max(narrow_ranks)


def test_presence_penalty_discourages_tokens_already_generated(llm):
    plain, penalized = (  # one batch: the penalty applies to its own request only
        o.outputs[0]
        for o in llm.generate(
            [PROMPT] * 2,
            [
                SamplingParams(temperature=0.0, max_tokens=40),
                SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=2.0),
            ],
        )
    )
    assert penalized.token_ids != plain.token_ids
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(penalized.token_ids) < repeats(plain.token_ids)


def test_sampling_filters_keep_tokens_in_the_allowed_set(llm):
    """With top_k=2 every sampled token is one of the two most likely (checked via logprobs)."""
    params = SamplingParams(temperature=1.5, top_k=2, max_tokens=12, seed=5, logprobs=2)
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    assert all(
        entry[t].rank <= 2
        for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    params = SamplingParams(temperature=1.0, min_p=0.5, max_tokens=12, seed=5, logprobs=1)
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        best = max(lp.logprob for lp in entry.values())
        assert entry[token_id].logprob >= best + math.log(0.5) - 1e-5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        pytest.param({"repetition_penalty": 1e-30}, "repetition_penalty", marks=M21),
        pytest.param({"repetition_penalty": 0.009}, "repetition_penalty", marks=M21),
        pytest.param({"temperature": math.nan}, "temperature", marks=M21),
        pytest.param({"temperature": math.inf}, "temperature", marks=M21),
        pytest.param({"top_p": math.nan}, "top_p", marks=M21),
        pytest.param({"min_p": math.nan}, "min_p", marks=M21),
        pytest.param({"presence_penalty": -math.inf}, "presence_penalty", marks=M21),
        pytest.param({"frequency_penalty": math.nan}, "frequency_penalty", marks=M21),
        pytest.param({"logit_bias": {5: math.nan}}, "logit_bias", marks=M21),
        pytest.param({"temperature": "hot"}, "temperature", marks=M21),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as raised:
        SamplingParams(**kwargs)
    assert raised.value.param == field


@M21
def test_a_temperature_below_the_sampling_epsilon_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=2))
    for temperature in (1e-40, 1e-6):
        params = SamplingParams(temperature=temperature, max_tokens=8, logprobs=2)
        assert params.is_greedy
        tiny = llm.generate(PROMPT, params)
        assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert not SamplingParams(temperature=1e-5).is_greedy


def _sample(rows: torch.Tensor, temperature: float = 0.0, **meta_fields):
    """Sample `rows` through the Sampler with one temperature for every row."""
    from nanollmserve.layers.sampler import Sampler, SamplingMetadata

    num_rows = rows.shape[0]
    meta = SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        all_greedy=temperature == 0.0,
        max_num_logprobs=2,
        **meta_fields,
    )
    return Sampler(seed=0)(rows.clone(), meta)


@M21
@pytest.mark.parametrize(
    "filters",
    [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}],
    ids=["greedy-or-whole-vocabulary", "top-p", "top-k", "min-p"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_without_a_finite_candidate_fall_back_to_a_token_in_the_vocabulary(
    temperature, filters
):
    vocab = 1000
    rows = torch.randn(5, vocab)
    rows[0] = float("nan")  # every logit NaN
    rows[1] = float("-inf")  # every token masked (a grammar that has nothing left)
    rows[2, :] = float("nan")
    rows[2, 7] = 3.0  # NaN around one finite logit: NaN counts as -inf
    rows[3, :] = float("-inf")
    rows[3, 11] = 0.5  # a grammar's end token, that min_tokens blocks below
    rows[4, 13] = float("inf")  # an overflowed logit
    num_rows = rows.shape[0]
    meta = {
        name: torch.full((num_rows,), value, dtype=torch.long if name == "top_k" else None)
        for name, value in filters.items()
    }
    if "top_k" in meta:
        meta["max_top_k"] = filters["top_k"]
    blocked = (torch.tensor([3]), torch.tensor([11]))
    out = _sample(rows, temperature, blocked_index=blocked, **meta)
    tokens = out.token_ids.tolist()
    assert all(0 <= t < vocab for t in tokens), tokens
    assert tokens[2] == 7
    assert tokens[3] == 11  # the logits as they came in: before min_tokens blocked it
    assert tokens[4] == 13
    assert torch.isfinite(out.logprobs).all()
    assert out.logprobs.min() >= -9999.0


def test_vocabulary_checks_at_admission(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[vocab + 5]))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, vocab]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")


def test_greedy_rows_take_argmaxs_token_ties_nans_and_empty_rows_included():
    from nanollmserve.layers.sampler import Sampler, SamplingMetadata, argmax_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen)
    logits[0, [7, 40000]] = 50.0  # a tie: the first
    logits[1, 123] = float("nan")  # a NaN: argmax's pick
    logits[2] = float("-inf")  # nothing finite: index 0
    logits[3, 9] = float("inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[:4].tolist() == [7, 123, 0, 9]
    meta = SamplingMetadata(temperature=torch.zeros(6), all_greedy=True)
    finite = torch.randn(6, 49152, generator=gen)
    assert torch.equal(Sampler()(finite, meta).token_ids, finite.argmax(dim=-1))
