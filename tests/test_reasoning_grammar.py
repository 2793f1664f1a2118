"""Structured output of a reasoning model: the grammar applies to the answer after
`</think>`, never to the thinking (vLLM's behaviour), on the offline engine with the tiny
scripted Qwen3 checkpoint of `reasoning_model.py` (its greedy output is known text)."""

from __future__ import annotations

import json

import pytest
from reasoning_model import ANSWER, THINKING, VERDICT_SCHEMA, VERDICTS, make_reasoning_model

from nanollmserve import LLM, SamplingParams
from nanollmserve.api.reasoning_parsers import Qwen3ReasoningParser
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids
from nanollmserve.structured_outputs import StructuredOutputsParams, ThinkingSpan

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300)]

CHOICES = ["yes", "no"]
MESSAGES = [{"role": "user", "content": "Is it ok?"}]
SCHEMA = VERDICT_SCHEMA


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)


def _prompt(llm: LLM, **template_kwargs) -> list[int]:
    return chat_prompt_token_ids(llm.tokenizer, MESSAGES, template_kwargs=template_kwargs)


def _span(llm: LLM, open_at_start: bool) -> ThinkingSpan:
    [start] = llm.tokenizer.encode("<think>", add_special_tokens=False)
    [end] = llm.tokenizer.encode("</think>", add_special_tokens=False)
    return ThinkingSpan(start, end, open_at_start)


def _generate(llm: LLM, prompt: list[int], grammar: StructuredOutputsParams) -> str:
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    return output.outputs[0].text


def test_unconstrained_output_is_the_script(llm) -> None:
    [output] = llm.generate([_prompt(llm)], SamplingParams(temperature=0), use_tqdm=False)
    assert output.outputs[0].text == f"<think>{THINKING}</think>{ANSWER}"


def test_choice_applies_after_the_thinking_the_model_opens(llm, compat) -> None:
    grammar = StructuredOutputsParams(choice=CHOICES, after_thinking=_span(llm, False))
    text = _generate(llm, _prompt(llm), grammar)
    head = f"<think>{THINKING}</think>"
    assert text.startswith(head), text
    assert text[len(head) :] in CHOICES
    reasoning, answer = Qwen3ReasoningParser().parse(text)  # what the server would split
    compat.exercised("reasoning", reasoning_content=reasoning)
    compat.exercised("structured", output=answer, choice=CHOICES)


def test_without_the_span_the_grammar_holds_from_the_first_token(llm) -> None:
    text = _generate(llm, _prompt(llm), StructuredOutputsParams(choice=CHOICES))
    assert text in CHOICES


def test_json_schema_after_thinking_the_prompt_opened(llm) -> None:
    """DeepSeek-R1 style: the prompt ends with `<think>`, the output starts thinking."""
    prompt = _prompt(llm) + [_span(llm, True).start_token_id]
    grammar = StructuredOutputsParams(json=SCHEMA, after_thinking=_span(llm, True))
    text = _generate(llm, prompt, grammar)
    thinking, answer = text.split("</think>")
    assert thinking == THINKING
    assert json.loads(answer) in VERDICTS, answer


def test_thinking_closed_by_the_template_leaves_the_grammar_on(llm) -> None:
    """enable_thinking false: the prompt closed the thinking; a span opening-or-not still
    lets only the grammar's tokens or `<think>` first, and the model answers in the grammar
    (unconstrained, it would answer ANSWER: `test_offline_chat_takes_the_template_extras`)."""
    prompt = _prompt(llm, enable_thinking=False)
    grammar = StructuredOutputsParams(json=SCHEMA, after_thinking=_span(llm, False))
    text = _generate(llm, prompt, grammar)
    assert json.loads(text) in VERDICTS, text


def test_ngram_drafts_across_the_end_of_thinking(tmp_path, compat) -> None:
    """The prompt holds the script, so ngram drafts run through `</think>`: drafts are cut
    at the phase change and the output equals the unspeculated one."""
    model_dir = make_reasoning_model(tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
    drafting = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, speculative_config=spec)
    messages = [{"role": "user", "content": f"<think>{THINKING}</think>no"}]
    prompt = chat_prompt_token_ids(drafting.tokenizer, messages)
    grammar = StructuredOutputsParams(choice=CHOICES, after_thinking=_span(drafting, False))
    text = _generate(drafting, prompt, grammar)
    assert text == f"<think>{THINKING}</think>" + text.rsplit("</think>", 1)[1]
    assert text.rsplit("</think>", 1)[1] in CHOICES
    assert drafting.engine.stats().spec_decode.num_accepted_tokens > 0
    compat.exercised("spec", num_drafts=drafting.engine.stats().spec_decode.num_drafts)
    reasoning, _ = Qwen3ReasoningParser().parse(text)  # what the server would split
    compat.exercised("reasoning", reasoning_content=reasoning)


def test_offline_chat_takes_the_template_extras(llm) -> None:
    params = SamplingParams(temperature=0)
    off = {"enable_thinking": False}
    [output] = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs=off)
    assert output.outputs[0].text == ANSWER
    opened = MESSAGES + [{"role": "assistant", "content": "Consider"}]
    [output] = llm.chat(
        opened, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert output.outputs[0].text == f" quickly</think>{ANSWER}"
