"""A tiny Qwen3 checkpoint that writes a known text: the bundled model's tokenizer plus
`<think>` / `</think>` as tokens of their own, the real Qwen3 chat template, and random
weights arranged as a bigram table (attention and MLP outputs zeroed, so each next token
depends only on the current one): greedy decoding follows `SCRIPT` after the prompt ends
in `\\n` (the Qwen3 generation prompt), and `ANSWER` after `\\n\\n` (the end of the empty
thinking block `enable_thinking: false` writes)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from nanollmserve.model import resolve_model

TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
THINKING = "Consider quickly"
ANSWER = '{"ok": true}'
SCRIPT = f"<think>{THINKING}</think>{ANSWER}"
VERDICT_SCHEMA = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}},
    "required": ["verdict"],
    "additionalProperties": False,
}
"""A schema the script's own answer (`{"ok": true}`) breaks: an answer in it is the grammar's."""
VERDICTS = [{"verdict": "yes"}, {"verdict": "no"}]


def make_reasoning_model(out_dir: Path, seed: int = 0) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    tokenizer.add_tokens(
        [
            AddedToken("<think>", special=False, normalized=False),
            AddedToken("</think>", special=False, normalized=False),
        ]
    )
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(out_dir)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    [newline] = encode("\n")
    [blank_line] = encode("\n\n")
    script, answer = encode(SCRIPT), encode(ANSWER)
    assert script[-len(answer) :] == answer
    chain = [newline, *script, end_id]
    assert len(set(chain)) == len(chain) and blank_line not in chain, chain
    transitions = dict(zip(chain, chain[1:], strict=False))
    transitions[blank_line] = answer[0]

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=end_id,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        embed = torch.nn.functional.normalize(torch.randn(config.vocab_size, 64), dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(config.vocab_size, 64)
        for current, following in transitions.items():
            head[following] += 10.0 * embed[current]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out_dir)
    return out_dir
