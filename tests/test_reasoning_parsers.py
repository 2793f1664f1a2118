"""The `<think>` reasoning parsers on adversarial chunkings: every split point of texts
with `<think>`, `</think>`, a missing `<think>` (DeepSeek-R1, whose template opens it), no
`</think>` at all; streaming must split exactly as the whole text does."""

from __future__ import annotations

import pytest

from nanollmserve.api.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

pytestmark = pytest.mark.milestone("m23")

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>hi<｜Assistant｜><think>\n"

# (parser, prompt end, output) -> (reasoning, content)
CASES = [
    (Qwen3ReasoningParser, QWEN3_PROMPT, "<think>\nadd 1</think>\n\n2", ("\nadd 1", "\n\n2")),
    (Qwen3ReasoningParser, QWEN3_PROMPT, "  <think>a<b</think>c</think>", ("a<b", "c</think>")),
    (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "no thinking <think>x</think>",
        (None, "no thinking <think>x</think>"),
    ),
    (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "<think>cut off by max_tokens </thi",
        ("cut off by max_tokens </thi", ""),
    ),
    (Qwen3ReasoningParser, QWEN3_PROMPT, "<thin", (None, "<thin")),
    (Qwen3ReasoningParser, QWEN3_PROMPT, "", (None, "")),
    (Qwen3ReasoningParser, QWEN3_NO_THINK_PROMPT, '{"a": 1}', (None, '{"a": 1}')),
    (
        Qwen3ReasoningParser,
        R1_PROMPT,
        "opened by the template</think>ok",
        ("opened by the template", "ok"),
    ),
    (
        DeepSeekR1ReasoningParser,
        R1_PROMPT,
        "step 1\nstep 2\n</think>\n\nanswer",
        ("step 1\nstep 2\n", "\n\nanswer"),
    ),
    (
        DeepSeekR1ReasoningParser,
        R1_PROMPT,
        "<think>\nwrote it anyway</think>yes",
        ("\nwrote it anyway", "yes"),
    ),
    (DeepSeekR1ReasoningParser, "", "never ends <", ("never ends <", "")),
    (DeepSeekR1ReasoningParser, "", "</think>", ("", "")),
    (DeepSeekR1ReasoningParser, "", "a</think></think>", ("a", "</think>")),
]


def _ids(case) -> str:
    return f"{case[0].__name__[:6]}-{case[2][:12]!r}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_whole_text_split(case) -> None:
    parser_class, prompt, text, expected = case
    assert parser_class(prompt).parse(text) == expected


def _stream(parser_class, prompt: str, pieces: list[str]) -> tuple[str, str]:
    parser = parser_class(prompt)
    reasoning = content = ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    last = parser.finish()
    return reasoning + last.reasoning, content + last.content


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_every_split_point_and_every_char_streams_the_same(case) -> None:
    parser_class, prompt, text, (reasoning, content) = case
    expected = (reasoning or "", content)
    for cut in range(len(text) + 1):
        assert _stream(parser_class, prompt, [text[:cut], text[cut:]]) == expected, cut
        for cut2 in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            assert _stream(parser_class, prompt, pieces) == expected, (cut, cut2)
    assert _stream(parser_class, prompt, list(text)) == expected


def test_thinking_never_leaks_into_content_while_streaming() -> None:
    """A piece ending in a prefix of `</think>` is held back, not sent as reasoning."""
    parser = Qwen3ReasoningParser(QWEN3_PROMPT)
    first = parser.feed("<think>abc</")
    assert first.reasoning == "abc" and first.content == ""
    second = parser.feed("think>done")
    assert second.reasoning == "" and second.content == "done"


def test_registry_has_vllm_names() -> None:
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}


@pytest.mark.parametrize("parser_class", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_a_prompt_that_closed_the_thinking_makes_everything_the_answer(parser_class) -> None:
    assert parser_class(QWEN3_NO_THINK_PROMPT).parse("x</think>y") == (None, "x</think>y")
