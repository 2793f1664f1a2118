"""Structured output through the offline LLM (the engine path the server shares): outputs
follow their grammar and end with `stop`, constrained and unconstrained requests share a
step without changing the unconstrained ones, seeds reproduce, and a grammar the engine
cannot compile is a ParamError naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanollmserve import SamplingParams, StructuredOutputsParams
from nanollmserve.errors import ParamError

pytestmark = pytest.mark.milestone("m15")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def is_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


CASES = [
    ({"json": PERSON}, is_person),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) is not None),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"grammar": 'root ::= "hello " ("world" | "there")'}, lambda t: t.startswith("hello ")),
    ({"grammar": 'start: "a" ("b" | "c") "d"\n'}, lambda t: t in ("abd", "acd")),  # Lark
]


def test_each_kind_of_constraint_holds_and_ends_with_stop(llm):
    params = [
        SamplingParams(temperature=1.0, max_tokens=32, n=2, seed=7, structured_outputs=so)
        for so, _ in CASES
    ]
    outputs = llm.chat([ASK] * len(CASES), params, use_tqdm=False)
    for (so, is_valid), output in zip(CASES, outputs, strict=True):
        for choice in output.outputs:
            assert choice.finish_reason == "stop", (so, choice.text)
            assert is_valid(choice.text), (so, choice.text)


def test_unconstrained_requests_in_the_same_step_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.chat(
        [ASK, ASK], [plain, SamplingParams(temperature=0.7, seed=3, max_tokens=12)], use_tqdm=False
    )
    mixed = llm.chat(
        [ASK, ASK, ASK],
        [
            plain,
            SamplingParams(temperature=0.7, seed=3, max_tokens=12),
            SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["no"]}),
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[2].outputs[0].text == "no"


def test_seeded_constrained_sampling_reproduces_and_reports_logprobs(llm):
    params = SamplingParams(
        temperature=1.0, seed=11, max_tokens=40, logprobs=2, structured_outputs={"json": PERSON}
    )
    first, second = llm.chat([ASK, ASK], [params, params], use_tqdm=False)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    jsonschema.validate(json.loads(first.outputs[0].text), PERSON)
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids)


def test_min_tokens_never_pads_a_finished_grammar_with_a_stray_token(llm):
    # The choice is complete after one or two tokens; min_tokens then blocks the stop token,
    # the only one the grammar allows, so the sampler sees every token masked.
    ask = [{"role": "user", "content": "Yes or no?"}]
    choice = {"choice": ["yes", "no"]}
    free, held = llm.chat(
        [ask, ask],
        [
            SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=choice),
            SamplingParams(
                temperature=0.0, max_tokens=16, min_tokens=10, structured_outputs=choice
            ),
        ],
        use_tqdm=False,
    )
    answer = free.outputs[0]
    assert answer.finish_reason == held.outputs[0].finish_reason == "stop"
    assert held.outputs[0].text == answer.text
    # The same answer tokens, without the stop token min_tokens held back and nothing else.
    assert held.outputs[0].token_ids == answer.token_ids[: len(held.outputs[0].token_ids)]
    assert len(held.outputs[0].token_ids) in (len(answer.token_ids), len(answer.token_ids) - 1)


@pytest.mark.parametrize(
    "structured_outputs, fragment",
    [
        ({"regex": "[0-9"}, "invalid regex"),
        ({"grammar": 'root ::= "a" |'}, "invalid grammar"),
        (
            {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "uniqueItems",
        ),
        ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, "not"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "invalid JSON schema"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_param_error(llm, structured_outputs, fragment):
    params = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(**structured_outputs)
    )
    with pytest.raises(ParamError, match=re.escape(fragment)) as info:
        llm.generate(["x"], params, use_tqdm=False)
    assert info.value.param == "structured_outputs"
