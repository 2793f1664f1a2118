"""Speculative decoding with structured output (m16) through the offline `LLM` API, on the
bundled model: the grammar checks the drafts (cut at the first token it refuses) and masks
every verified position with its state after the drafts before it, so greedy constrained
output with speculation equals constrained output without it, token for token (json_schema,
regex and choice batched with an unconstrained request, a prompt that makes n-gram drafts
likely; stop strings, max_tokens and n > 1 cut the same way), a self-drafting draft model
whose unconstrained drafts the grammar refuses still gives the same output, and sampled
constrained output at temperature 1.0 validates.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import assert_no_leak
from spec_decode_prompts import ASK_JSON, REGEX, SCHEMA

from nanollmserve import LLM, SamplingParams
from nanollmserve.model import resolve_model

pytestmark = [pytest.mark.milestone("m16"), pytest.mark.slow]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
CONSTRAINTS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": ["Ada Lovelace", "Alan Turing"]}]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(dtype="float32", num_kv_blocks=512, speculative_config=NGRAM)


def greedy(max_tokens: int = 80, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def accepted_tokens(llm: LLM) -> int:
    return llm.engine.stats().spec_decode.num_accepted_tokens


def test_greedy_constrained_batch_equals_no_speculation(llm, spec_llm, compat):
    params = [greedy(structured_outputs=so) for so in CONSTRAINTS] + [greedy()]
    reference = llm.chat([ASK_JSON] * len(params), params, use_tqdm=False)
    before = accepted_tokens(spec_llm)
    outputs = spec_llm.chat([ASK_JSON] * len(params), params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert accepted_tokens(spec_llm) > before
    json_out, regex_out, choice_out, plain_out = (o.outputs[0] for o in outputs)
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    assert re.fullmatch(REGEX, regex_out.text)
    assert choice_out.text in ("Ada Lovelace", "Alan Turing")
    assert all(o.finish_reason == "stop" for o in (json_out, regex_out, choice_out))
    assert plain_out.text != json_out.text  # the grammar changed what the model says

    # A constrained request alone gets drafts, and the target keeps some.
    before = accepted_tokens(spec_llm)
    drafts = spec_llm.engine.stats().spec_decode.num_drafts
    alone = spec_llm.chat([ASK_JSON], params[0], use_tqdm=False)
    assert token_ids(alone) == token_ids(reference[:1])
    assert accepted_tokens(spec_llm) - before >= 8
    drafts = spec_llm.engine.stats().spec_decode.num_drafts - drafts
    compat.exercised("spec", num_drafts=drafts)
    compat.exercised("structured", output=alone[0].outputs[0].text, schema=SCHEMA)
    assert_no_leak(spec_llm)


def test_stop_max_tokens_and_n_cut_the_same_way(llm, spec_llm):
    schema = {"json": SCHEMA}
    full = llm.chat([ASK_JSON], greedy(structured_outputs=schema), use_tqdm=False)[0].outputs[0]
    assert '"city"' in full.text
    params = [
        greedy(structured_outputs=schema, stop=['"city"']),  # a stop string inside a run
        greedy(max_tokens=13, structured_outputs=schema),
        greedy(structured_outputs=schema, n=2),
    ]
    reference = llm.chat([ASK_JSON] * len(params), params, use_tqdm=False)
    outputs = spec_llm.chat([ASK_JSON] * len(params), params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    stopped, cut, pair = outputs
    assert stopped.outputs[0].text == full.text[: full.text.index('"city"')]
    assert stopped.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].token_ids == full.token_ids[:13]
    assert cut.outputs[0].finish_reason == "length"
    assert [c.text for c in pair.outputs] == [full.text, full.text]
    assert_no_leak(spec_llm)


def test_sampled_constrained_output_validates(spec_llm):
    before = accepted_tokens(spec_llm)
    params = [
        SamplingParams(temperature=1.0, seed=s, n=3, max_tokens=120, structured_outputs=so)
        for s, so in enumerate(CONSTRAINTS[:2])
    ]
    json_outs, regex_outs = spec_llm.chat([ASK_JSON, ASK_JSON], params, use_tqdm=False)
    for choice in json_outs.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    for choice in regex_outs.outputs:
        assert choice.finish_reason == "stop", choice.text
        assert re.fullmatch(REGEX, choice.text), choice.text
    assert accepted_tokens(spec_llm) > before
    assert_no_leak(spec_llm)


def test_draft_model_drafts_the_grammar_refuses(llm):
    """The bundled model drafts for itself, unconstrained: where the grammar forces another
    token than its greedy choice, the drafts are cut there, and the output is unchanged."""
    spec = {"model": str(resolve_model(None).path), "num_speculative_tokens": 3}
    drafting = LLM(dtype="float32", num_kv_blocks=256, speculative_config=spec)
    params = [greedy(structured_outputs={"json": SCHEMA}), greedy()]
    reference = llm.chat([ASK_JSON] * 2, params, use_tqdm=False)
    assert reference[0].outputs[0].text != reference[1].outputs[0].text
    outputs = drafting.chat([ASK_JSON] * 2, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    stats = drafting.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert_no_leak(drafting)
