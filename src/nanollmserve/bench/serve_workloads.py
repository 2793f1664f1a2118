"""The request mixes of `nanollmserve bench serve`: `random`, `shared-prefix`, `sharegpt` and
`mixed` (mostly short chat turns among a few long prompts, the traffic where a long prefill
stalls the decodes it joins: what prefill/decode disaggregation is for).

Prompts are text by default, the portable form every OpenAI-compatible server accepts. The
text is a run of words that are each exactly one token of the local tokenizer (` ocean`,
` river`, ...), so N drawn words are N prompt tokens: the intended lengths hold for any
server that serves a model with the same tokenizer (ours and llama.cpp on the bundled GGUF),
and the benchmark reads the real counts from `usage` anyway. `--prompt-format ids` sends the
token ids themselves (`/v1/completions` with a list of ints: ours and vLLM accept it).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from nanollmserve.bench.workload import parse_range

WORKLOADS = ("random", "shared-prefix", "sharegpt", "mixed")
DEFAULT_LONG_INPUT_LEN = "2000-2200"
DEFAULT_LONG_FRACTION = 0.2


@dataclass
class ServeRequest:
    prompt: str
    """The user text (completions: the prompt after `system`)."""
    prompt_token_ids: list[int]
    """The same prompt as token ids, system part included (for `--prompt-format ids`)."""
    max_tokens: int
    system: str = ""
    """A shared system prompt (shared-prefix): chat sends it as the system message,
    completions puts it before the prompt."""
    group: int = -1
    """Which shared prefix this request uses (shared-prefix), -1 for none."""
    kind: str = ""
    """mixed: "short" or "long" (the benchmark also reports each kind on its own)."""

    @property
    def prompt_len(self) -> int:
        """Intended prompt tokens (the real count comes from the server's usage)."""
        return len(self.prompt_token_ids)

    def completion_prompt(self) -> str:
        return self.system + self.prompt

    def messages(self) -> list[dict]:
        user = {"role": "user", "content": self.prompt.lstrip()}
        if not self.system:
            return [user]
        return [{"role": "system", "content": self.system.lstrip()}, user]


class WordTokens:
    """Token ids that decode to ' word' (a space and lowercase ASCII letters) and encode back
    to exactly themselves: a sequence of them round-trips through text token for token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = []
        for token_id in sorted(tokenizer.get_vocab().values()):
            text = tokenizer.decode([token_id])
            word = text[1:]
            is_word = len(word) >= 3 and word.isascii() and word.isalpha() and word.islower()
            if (
                text[:1] == " "
                and is_word
                and tokenizer.encode(text, add_special_tokens=False) == [token_id]
            ):
                ids.append(token_id)
        if len(ids) < 100:
            raise ValueError("the tokenizer has too few single-token words to build prompts")
        self.ids = ids

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.ids) for _ in range(n)]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def random_workload(
    words: WordTokens, num_prompts: int, input_len: str, output_len: str, seed: int
) -> list[ServeRequest]:
    """Independent prompts with seeded lengths drawn from `input_len` / `output_len`."""
    rng = random.Random(seed)
    in_range, out_range = parse_range(input_len), parse_range(output_len)
    requests = []
    for _ in range(num_prompts):
        ids = words.sample(rng, rng.randint(*in_range))
        requests.append(ServeRequest(words.text(ids), ids, rng.randint(*out_range)))
    return requests


def shared_prefix_workload(
    words: WordTokens,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    input_len: str,
    output_len: str,
    seed: int,
) -> list[ServeRequest]:
    """`num_groups` long system prompts of `prefix_len` tokens, each used by an equal share
    of the requests (+-1) in a shuffled order (as SGLang's generated-shared-prefix dataset);
    each request adds its own question of `input_len` tokens. The shuffle matters for
    routing benchmarks: groups in turn (request i in group i % num_groups) would let round
    robin over an even number of workers split the groups by parity, a cache-aware
    placement no real traffic gives it."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError("shared-prefix needs --num-groups >= 1 and --prefix-len >= 1")
    rng = random.Random(seed)
    prefixes = [words.sample(rng, prefix_len) for _ in range(num_groups)]
    prefix_texts = [words.text(ids) for ids in prefixes]
    in_range, out_range = parse_range(input_len), parse_range(output_len)
    groups = [i % num_groups for i in range(num_prompts)]
    rng.shuffle(groups)
    requests = []
    for group in groups:
        ids = words.sample(rng, rng.randint(*in_range))
        requests.append(
            ServeRequest(
                words.text(ids),
                prefixes[group] + ids,
                rng.randint(*out_range),
                system=prefix_texts[group],
                group=group,
            )
        )
    return requests


def mixed_workload(
    words: WordTokens,
    num_prompts: int,
    input_len: str,
    long_input_len: str,
    long_fraction: float,
    output_len: str,
    seed: int,
) -> list[ServeRequest]:
    """Short turns of `input_len` tokens and, for `long_fraction` of the requests (rounded),
    long prompts of `long_input_len` tokens, in a seeded shuffled order; every request
    gets `output_len` tokens. Each prompt is its own (no shared prefix)."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"--long-fraction must be within [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    short_range, long_range = parse_range(input_len), parse_range(long_input_len)
    out_range = parse_range(output_len)
    num_long = round(num_prompts * long_fraction)
    kinds = ["long"] * num_long + ["short"] * (num_prompts - num_long)
    rng.shuffle(kinds)
    requests = []
    for kind in kinds:
        ids = words.sample(rng, rng.randint(*(long_range if kind == "long" else short_range)))
        requests.append(ServeRequest(words.text(ids), ids, rng.randint(*out_range), kind=kind))
    return requests


def sharegpt_workload(
    tokenizer,
    path: str | Path,
    num_prompts: int,
    output_len: str | None,
    max_model_len: int,
    seed: int,
) -> list[ServeRequest]:
    """Conversations from a ShareGPT file (a JSON list or JSONL of
    `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}`),
    or JSONL of `{"prompt": ..., "max_tokens": N}`. The first human turn is the prompt; the
    reply's length (or `output_len`) is max_tokens. Like vLLM, prompts or replies under 4
    tokens and pairs over max_model_len are skipped; `num_prompts` are drawn with `seed`."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(records)
    fixed_out = parse_range(output_len) if output_len else None
    requests = []
    for record in records:
        prompt, reply, max_tokens = _sharegpt_fields(record)
        if not prompt:
            continue
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if fixed_out:
            max_tokens = rng.randint(*fixed_out)
        elif max_tokens is None:
            max_tokens = len(tokenizer.encode(reply or "", add_special_tokens=False))
        if len(ids) < 4 or max_tokens < 4 or len(ids) + max_tokens > max_model_len:
            continue
        requests.append(ServeRequest(prompt, ids, max_tokens))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"{path}: no usable conversation (need prompt and reply >= 4 tokens)")
    return requests


def _sharegpt_fields(record: dict) -> tuple[str | None, str | None, int | None]:
    if "conversations" in record:
        turns = record["conversations"]
        prompt = next((t["value"] for t in turns if t.get("from") in ("human", "user")), None)
        reply = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None)
        return prompt, reply, None
    max_tokens = record.get("max_tokens", record.get("output_len"))
    return record.get("prompt"), record.get("completion"), max_tokens


def warmup_request(words: WordTokens, seed: int) -> ServeRequest:
    """A short request on fresh words (shares no prefix with the measured ones)."""
    rng = random.Random(seed + 7919)
    ids = words.sample(rng, 16)
    return ServeRequest(words.text(ids), ids, 4)
