"""NativeTokenizer (tokenizer.json on the `tokenizers` library, chat templates on our own
Jinja environment) gives what transformers' AutoTokenizer gives for the same directory: ids,
text, special tokens, chat prompts with and without tools, incremental detokenization; and
directories it cannot reproduce load through transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from nanollmserve.frontend.detokenizer import IncrementalDetokenizer
from nanollmserve.frontend.native_tokenizer import NativeTokenizer, load_native_tokenizer
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids, load_tokenizer
from nanollmserve.model.source import resolve_model

pytestmark = pytest.mark.milestone("m17")

TOOL_TEMPLATE = Path(__file__).resolve().parent.parent / "examples/tool_chat_template_smollm2.jinja"
TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "unicode: café naïve Straße 日本語 한국어 Ελληνικά",
    "emoji: 😀👍🏽 👨‍👩‍👧 🇫🇷",
    "special tokens in text: <|im_start|>user\nhi<|im_end|><|endoftext|>",
    "not special: <|im_start <im_end|> <repo_name>x",
    "tabs\tand\nnewlines\r\n\n  indented",
    "numbers 3.14159 1,000,000 0x1F",
    "code: def f(x):\n    return {'a': [1, 2]}\n",
    "",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Qu'est-ce que c'est? 😀"},
        {"role": "assistant", "content": "Une question."},
        {"role": "user", "content": "<|im_end|> inside a message"},
    ],
    [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5 °C"},
    ],
]


@pytest.fixture(scope="module")
def bundled_dir() -> Path:
    return resolve_model(None).path


@pytest.fixture(scope="module")
def native(bundled_dir) -> NativeTokenizer:
    tokenizer = load_tokenizer(bundled_dir)
    assert isinstance(tokenizer, NativeTokenizer)  # the bundled model needs no transformers
    return tokenizer


@pytest.fixture(scope="module")
def hf(bundled_dir):
    return AutoTokenizer.from_pretrained(str(bundled_dir))


def test_encode_and_decode_equal_transformers(native, hf) -> None:
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = native.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        ids = hf.encode(text)
        for skip in (True, False):
            assert native.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    every_id = list(range(len(hf)))
    assert native.decode(every_id) == hf.decode(every_id)
    assert native.decode(every_id, skip_special_tokens=True) == hf.decode(
        every_id, skip_special_tokens=True
    )


def test_vocabulary_and_special_tokens_equal_transformers(native, hf) -> None:
    assert native.get_vocab() == hf.get_vocab()
    assert (len(native), native.vocab_size) == (len(hf), hf.vocab_size)
    assert native.special_tokens_map == hf.special_tokens_map
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(native, f"{name}_token") == getattr(hf, f"{name}_token")
        assert getattr(native, f"{name}_token_id") == getattr(hf, f"{name}_token_id")
    assert sorted(native.all_special_ids) == sorted(hf.all_special_ids)
    ids = [0, 1, 2, 17, 9690, 49151]
    assert native.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert native.convert_ids_to_tokens(2) == hf.convert_ids_to_tokens(2) == "<|im_end|>"
    tokens = hf.convert_ids_to_tokens(ids)
    assert native.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert native.chat_template == hf.chat_template


def test_chat_prompts_equal_transformers(native, hf) -> None:
    tool_template = TOOL_TEMPLATE.read_text()
    for messages in CONVERSATIONS:
        for template in (None, tool_template):
            for tools in ([WEATHER], None) if template else (None,):
                ours = chat_prompt_token_ids(native, messages, template, tools)
                assert ours == chat_prompt_token_ids(hf, messages, template, tools)
        for add_generation_prompt in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
            own = native.apply_chat_template(messages, **kwargs)
            assert own == hf.apply_chat_template(messages, **kwargs)
            with_tools = native.apply_chat_template(
                messages, tools=[WEATHER], chat_template=tool_template, **kwargs
            )
            assert with_tools == hf.apply_chat_template(
                messages, tools=[WEATHER], chat_template=tool_template, **kwargs
            )
    assert "Zürich" in with_tools  # tojson keeps non-ASCII text as it is
    ids = native.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert ids == hf.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)["input_ids"]


def test_template_features_render_as_in_transformers(native, hf) -> None:
    """The environment's extras: loop controls, namespace, dict, tojson options, the special
    token variables, extra variables, {% generation %}, strftime_now, raise_exception."""
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.role }}]{{ m.content | trim }}"
        "{% endgeneration %}{% if loop.index > 3 %}{% break %}{% endif %}\n"
        "    {% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} "
        "{{ {'k': 'é', 'b': [1, 2]} | tojson(indent=2, sort_keys=True) }}"
        "{{ strftime_now('%Y') }} {{ eos_token }} {{ pad_token }} {{ custom }}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    for messages in CONVERSATIONS:
        kwargs = {"chat_template": template, "tokenize": False, "custom": "x"}
        for prompt in (True, False):
            ours = native.apply_chat_template(messages, add_generation_prompt=prompt, **kwargs)
            assert ours == hf.apply_chat_template(messages, add_generation_prompt=prompt, **kwargs)
    failing = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        native.apply_chat_template(CONVERSATIONS[1], chat_template=failing, tokenize=False)
    escaping = "{{ ''.__class__.__mro__ }}"  # the sandbox refuses dunder attributes
    with pytest.raises(jinja2.exceptions.SecurityError):
        native.apply_chat_template(CONVERSATIONS[0], chat_template=escaping, tokenize=False)


def test_incremental_detokenization_equals_transformers(native, hf) -> None:
    prompt = hf.encode("A prompt before the output:")
    for text in TEXTS[:-1]:
        output = hf.encode(text, add_special_tokens=False) + [hf.eos_token_id]
        for skip in (True, False):
            deltas = []
            for tokenizer in (native, hf):
                detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
                deltas.append([detokenizer.add_token(t) for t in output])
            assert deltas[0] == deltas[1]
            assert "".join(deltas[0]) == hf.decode(output, skip_special_tokens=skip)


def test_hf_tokenizer_is_the_transformers_one_for_xgrammar(native, hf) -> None:
    assert native.hf_tokenizer.get_vocab() == hf.get_vocab()
    assert native.hf_tokenizer is native.hf_tokenizer  # loaded once


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},
        {"eos_token": "<|not_in_the_vocabulary|>"},
        {"clean_up_tokenization_spaces": True},
        {"added_tokens_decoder": {"2": {"content": "<|im_end|>", "special": False}}},
    ],
    ids=["model-specific class", "missing special token", "cleanup", "added token flags"],
)
def test_directories_it_cannot_reproduce_load_through_transformers(
    tmp_path: Path, bundled_dir: Path, change: dict
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir / name, tmp_path / name)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **change}))
    assert load_native_tokenizer(tmp_path) is None
    assert not isinstance(load_tokenizer(tmp_path), NativeTokenizer)
    config_path.write_text(json.dumps(config))  # unchanged: native again
    assert isinstance(load_tokenizer(tmp_path), NativeTokenizer)
