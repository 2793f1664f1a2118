"""NativeTokenizer: a Hugging Face tokenizer directory read without transformers.

transformers' tokenizer for a `tokenizer.json` (`TokenizersBackend`, `PreTrainedTokenizerFast`)
wraps the Rust `tokenizers.Tokenizer` of that file; importing transformers for it took about
2 s of every start, the Rust library about 0.05 s. This class wraps the same object and offers
what nanollmserve uses of the HF tokenizer, with the same results: `encode` (with or without
the post-processor's special tokens), `decode`, the special tokens and their ids,
`get_vocab`, token <-> id conversion and `apply_chat_template` (rendered by
`chat_template.py` with the special-token variables transformers passes).

`load_native_tokenizer` takes a directory only where that equality holds, and says why not
otherwise (then `load_tokenizer` uses transformers' AutoTokenizer): a `tokenizer.json` with a
`tokenizer_config.json` of class `TokenizersBackend` or `PreTrainedTokenizerFast`; no legacy
`added_tokens.json` / `special_tokens_map.json`; no truncation or padding in the file; no
`clean_up_tokenization_spaces` or `split_special_tokens`; at most 100,000 tokens (transformers
may patch the pre-tokenizer regex of larger, Mistral, vocabularies); every special token of the
config already an added special token of the file (transformers would add the missing ones,
changing the vocabulary). Model-specific classes (`LlamaTokenizer`, `Qwen2Tokenizer`, ...)
rebuild or adjust the backend in their own ways and always go through transformers.

XGrammar builds its vocabulary table from a transformers tokenizer: `hf_tokenizer` loads that
one lazily (the first structured-output request pays its import).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from nanollmserve.frontend.chat_template import render_chat_template

logger = logging.getLogger(__name__)

NATIVE_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
MAX_NATIVE_VOCAB = 100_000
LEGACY_FILES = ("added_tokens.json", "special_tokens_map.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class NativeTokenizer:
    """The tokenizer of an HF directory on the `tokenizers` library alone (see the module)."""

    def __init__(
        self,
        backend,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: str | dict[str, str] | None,
        name_or_path: str,
    ) -> None:
        self.backend_tokenizer = backend
        """The `tokenizers.Tokenizer` read from tokenizer.json."""
        self.special_tokens_map = special_tokens
        """Named special tokens (`bos_token`, `eos_token`, ...) -> their text, as in HF."""
        self.extra_special_tokens = extra_special_tokens
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self._hf_tokenizer = None
        self._hf_lock = threading.Lock()
        for name in SPECIAL_TOKEN_NAMES:
            token = special_tokens.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Tokens of the base vocabulary (without the added tokens), as in HF."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        named = [t for name in SPECIAL_TOKEN_NAMES if (t := self.special_tokens_map.get(name))]
        return list(dict.fromkeys([*named, *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # -- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the post-processor (BOS/EOS)."""
        # encode_batch, as transformers calls it: it releases the GIL while it works.
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[
            0
        ].ids

    def decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of `token_ids` (`clean_up_tokenization_spaces` is off for every tokenizer this
        class loads; True is refused rather than ignored)."""
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces=True needs tokenizer.hf_tokenizer")
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )

    # -- chat ---------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template text: `chat_template` (a template, or a name of the model's), else the
        model's (`tool_use` when tools are given and it has one, else `default`)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(f"this model has several chat templates: {sorted(templates)}")
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        return templates

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ):
        """The conversation rendered (`tokenize=False`, the text transformers' method gives)
        or its token ids (a plain list, where transformers 5 returns a BatchEncoding holding
        them as `input_ids`; no special tokens added: the template writes them). The named
        special tokens are template variables, `kwargs` more of them."""
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        template = self.get_chat_template(chat_template, tools)
        text = render_chat_template(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- the transformers fallback ------------------------------------------------------------
    @property
    def hf_tokenizer(self):
        """transformers' tokenizer of the same directory, loaded at the first use (XGrammar's
        `TokenizerInfo.from_huggingface` needs one)."""
        with self._hf_lock:
            if self._hf_tokenizer is None:
                from transformers import AutoTokenizer

                self._hf_tokenizer = AutoTokenizer.from_pretrained(self.name_or_path)
            return self._hf_tokenizer


def load_native_tokenizer(model_dir: str | Path) -> NativeTokenizer | None:
    """The directory's tokenizer as a NativeTokenizer, or None where it needs transformers."""
    model_dir = Path(model_dir)
    reason, loaded = _read(model_dir)
    if reason is not None:
        logger.debug("tokenizer of %s loads through transformers: %s", model_dir, reason)
        return None
    return loaded


def _read(model_dir: Path) -> tuple[str | None, NativeTokenizer | None]:
    tokenizer_file = model_dir / "tokenizer.json"
    config_file = model_dir / "tokenizer_config.json"
    if not tokenizer_file.is_file() or not config_file.is_file():
        return "no tokenizer.json with a tokenizer_config.json", None
    if legacy := [name for name in LEGACY_FILES if (model_dir / name).exists()]:
        return f"legacy {', '.join(legacy)}", None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"unreadable tokenizer_config.json: {exc}", None
    if config.get("tokenizer_class") not in NATIVE_TOKENIZER_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r}", None
    for key in ("auto_map", "fast_tokenizer_files", "clean_up_tokenization_spaces"):
        if config.get(key):
            return f"{key} in tokenizer_config.json", None
    if config.get("split_special_tokens"):
        return "split_special_tokens", None

    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_file))
    if backend.truncation is not None or backend.padding is not None:
        return "truncation or padding in tokenizer.json", None
    if backend.get_vocab_size(with_added_tokens=True) > MAX_NATIVE_VOCAB:
        return f"more than {MAX_NATIVE_VOCAB} tokens", None
    added = {token.content: (i, token) for i, token in backend.get_added_tokens_decoder().items()}
    for i, entry in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(entry.get("content"))
        if have is None or have[0] != int(i) or _flags(have[1]) != _flags_of_entry(entry):
            return f"added token {entry.get('content')!r} differs from tokenizer.json", None
    special_tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = _token_text(config.get(name))
        if token is None:
            continue
        have = added.get(token)
        if have is None or not have[1].special or have[1].normalized:
            return f"{name} {token!r} is not a special token of tokenizer.json", None
        special_tokens[name] = token
    extra = [
        _token_text(t)
        for key in ("extra_special_tokens", "additional_special_tokens")
        for t in (config.get(key) or [])
    ]
    if missing := [t for t in extra if t not in added or not added[t][1].special]:
        return f"special tokens not in tokenizer.json: {missing}", None
    template = _chat_template(model_dir, config)
    native = NativeTokenizer(backend, special_tokens, extra, template, str(model_dir))
    return None, native


def _chat_template(model_dir: Path, config: dict) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja (these win, as in HF), else
    the tokenizer config's `chat_template` (a string, or a list of named templates)."""
    templates = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _flags(token) -> tuple:
    return (token.special, token.lstrip, token.rstrip, token.normalized, token.single_word)


def _flags_of_entry(entry: dict) -> tuple:
    return (
        bool(entry.get("special", False)),
        bool(entry.get("lstrip", False)),
        bool(entry.get("rstrip", False)),
        bool(entry.get("normalized", True)),
        bool(entry.get("single_word", False)),
    )
