"""Incremental detokenization: streamed deltas concatenate exactly to the text."""

from __future__ import annotations

import pytest

from nanollmserve.frontend.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.milestone("m05")

SAMPLES = [
    " leading space and  double  spaces",
    "Emoji 🐉🔥 and accents: café, naïve, Zürich — “quotes”",
    "中文字符和日本語のテキスト",
    "code:\n\tdef f(x):\n\t    return x  # done\n",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_concatenate_to_the_decoded_text(llm, text):
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("Say:")
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_token(t) for t in token_ids]
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character


def test_generated_text_equals_decode_of_tokens(llm):
    from nanollmserve import SamplingParams

    params = SamplingParams(temperature=1.0, seed=0, max_tokens=48)
    out = llm.chat([{"role": "user", "content": "Write two lines with emoji."}], params)[0]
    completion = out.outputs[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
