"""Parity of the native models with Hugging Face transformers on the same weights.

Tiny random-weight models of every supported architecture (built in-process from a config,
saved with `save_pretrained`, loaded through our loader) must give HF's logits for each
sequence of a flat batch; the bundled SmolLM2 must too, on a real chat prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from nanollmserve.layers.attention_context import AttentionContext, reset_context, set_context
from nanollmserve.model import ModelConfig, load_model, resolve_model

pytestmark = pytest.mark.milestone("m01")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied": (LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-attention-bias": (LlamaConfig, dict(attention_bias=True)),
    "llama-mlp-bias": (LlamaConfig, dict(mlp_bias=True)),
    "llama3-rope": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE)),
    "linear-rope": (
        LlamaConfig,
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ),
    "mistral": (MistralConfig, dict(head_dim=32, sliding_window=4096)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied": (Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
}
SEQ_LENS = [7, 19]


def make_tiny_hf_model(
    config_cls, out_dir: Path, seed: int = 0, shard_size: str | None = None, **overrides
):
    """A seeded random-weight HF model saved to `out_dir`. Weights are redrawn larger than HF's
    init (and biases and norm weights made non-trivial) so every tensor shapes the logits."""
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model.eval()


def native_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run all sequences as one flat batch (positions restart at 0 for each)."""
    input_ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    set_context(AttentionContext.causal_prefill([len(s) for s in seqs]))
    try:
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions))
    finally:
        reset_context()
    assert logits.dtype == torch.float32
    return list(logits.split([len(s) for s in seqs]))


def load_native(model_dir: Path, dtype=torch.float32):
    source = resolve_model(str(model_dir))
    config = ModelConfig.from_pretrained(source.path)
    return load_model(source.path, config, dtype, torch.device("cpu"))


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_transformers(case: str, tmp_path: Path) -> None:
    config_cls, overrides = CASES[case]
    hf_model = make_tiny_hf_model(config_cls, tmp_path, **overrides)
    model = load_native(tmp_path)
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=generator) for n in SEQ_LENS]
    for seq, ours in zip(seqs, native_logits(model, seqs), strict=True):
        with torch.inference_mode():
            ref = hf_model(seq[None]).logits[0].float()
        assert ref.abs().max() > 1.0  # the weights matter: logits are far from zero
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_matches_transformers(tmp_path: Path) -> None:
    hf_model = make_tiny_hf_model(Qwen2Config, tmp_path, shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_native(tmp_path)
    seq = torch.arange(10) * 7 % TINY["vocab_size"]
    with torch.inference_mode():
        ref = hf_model(seq[None]).logits[0]
    torch.testing.assert_close(native_logits(model, [seq])[0], ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_close_to_transformers_bfloat16(tmp_path: Path) -> None:
    make_tiny_hf_model(Qwen3Config, tmp_path, head_dim=16)
    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    )
    model = load_native(tmp_path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seq = torch.arange(12) * 5 % TINY["vocab_size"]
    with torch.inference_mode():
        ref = hf_model(seq[None]).logits[0].float()
    ours = native_logits(model, [seq])[0]
    # Same rounding points as HF; fused q/k/v and gate/up matmuls may round differently.
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.fixture(scope="module")
def bundled_models():
    source = resolve_model(None)
    config = ModelConfig.from_pretrained(source.path)
    model = load_model(source.path, config, torch.float32, torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.path, dtype=torch.float32, attn_implementation="eager"
    )
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    return model, hf_model.eval(), tokenizer


def test_bundled_model_matches_transformers(bundled_models) -> None:
    model, hf_model, tokenizer = bundled_models
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about paged attention."}],
    ]
    seqs = [
        torch.tensor(
            tokenizer.apply_chat_template(
                p, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]
    for seq, ours in zip(seqs, native_logits(model, seqs), strict=True):
        with torch.inference_mode():
            ref = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
