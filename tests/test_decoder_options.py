"""Every `DecoderOptions` field, set to a value other than its default on a tiny random model
with its projections in Q4_0 blocks: the native step either runs it with the PyTorch forward's
logits and K/V, or refuses it at load with the field's name, logged at WARNING. Never silence.

The fields are enumerated with `dataclasses.fields`, so a field added to `DecoderOptions`
is covered here as it lands: with no value in `NON_DEFAULT` (bool fields need none) the test
fails and asks for one; not named in `native.supported.SUPPORTED` it must be refused. Each
field is also run with its name taken out of `SUPPORTED`, so the refusal path is exercised
for every field, not only for those the C step lacks today.

The blocks are Q4_0 because its kernel keeps int16 activations: the step and the forward
quantize activations that differ in their last float bits (fused against unfused ops), and
with Q8_0's int8 activations (decision 48) one flipped code, 1/127 of a block's largest
activation, moved these random models' logits by up to 1e-2, above the bounds that tell a
missing bias or norm apart. The int8 kernels are held to the `gguf` oracle in
tests/test_kquant_kernels.py; tests/test_native_decode.py runs the step over Q8 blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import fields, replace

import pytest
import torch
from test_model_parity import make_tiny_hf_model
from test_native_decode import (
    check_step_against_forward,
    native_against_forward,
    q4_0_rows,
    to_block_layers,
)
from transformers import AutoTokenizer, LlamaConfig

from nanollmserve import LLM
from nanollmserve.engine.native_decode import NativeDecodeStep
from nanollmserve.layers.attention import PagedAttention
from nanollmserve.model.decoder_options import DecoderOptions
from nanollmserve.model.llama import LlamaForCausalLM
from nanollmserve.model.source import resolve_model
from nanollmserve.native import ops, supported

pytestmark = [pytest.mark.milestone("m28"), pytest.mark.timeout(600)]

NON_DEFAULT = {
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "activation": "gelu_tanh",
    "norm_offset": 1.0,
    "embed_scale": 8.0,
    "sliding_window": 8,  # every layer slides (no layer_types); the prompts run past it
    "layer_types": ("sliding_attention", "full_attention"),
    "local_rope_theta": 1000.0,
    "query_pre_attn_scalar": 24.0,
    "final_logit_softcap": 5.0,
}
"""A value other than the default for each field that is not a bool (a bool is negated)."""
FIELDS = [field.name for field in fields(DecoderOptions)]


def non_default(name: str):
    default = getattr(DecoderOptions(), name)
    if isinstance(default, bool):
        return not default
    if name not in NON_DEFAULT:
        pytest.fail(f"DecoderOptions.{name} is new: give it a non-default value in NON_DEFAULT")
    assert NON_DEFAULT[name] != default
    return NON_DEFAULT[name]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_model(LlamaConfig, path, tie_word_embeddings=False)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(path)
    return path


def rebuild_with(llm: LLM, options: DecoderOptions) -> LlamaForCausalLM:
    """The LLM's model built again with `options`: the loaded weights where the shapes agree,
    random biases and norms where the options add them; every projection in Q4_0 blocks; the
    KV cache bound to it and its native step built (or refused) as at load."""
    runner = llm.engine.model_runner
    loaded = runner.model.state_dict()
    model = LlamaForCausalLM(runner.model.config, options)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in loaded and loaded[name].shape == param.shape:
                param.copy_(loaded[name])
            elif "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    model.requires_grad_(False)
    to_block_layers(model, q4_0_rows)
    runner.model = model
    runner.attention_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    runner._allocate_kv_cache()
    return model


@pytest.mark.parametrize("implemented", [True, False], ids=["as-declared", "taken-out"])
@pytest.mark.parametrize("field", FIELDS)
def test_every_option_runs_natively_with_parity_or_is_refused_by_name(
    field, implemented, tiny_dir, monkeypatch, caplog
):
    if ops.kernels_unavailable_reason():
        pytest.skip(ops.kernels_unavailable_reason())
    if not implemented:
        monkeypatch.setattr(supported, "SUPPORTED", supported.SUPPORTED - {field})
    options = replace(DecoderOptions(), **{field: non_default(field)})
    llm = LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=64, block_size=16)
    runner = llm.engine.model_runner
    with caplog.at_level(logging.INFO, logger="nanollmserve.engine.native_decode"):
        model = rebuild_with(llm, options)
    assert model.native_decoder().options == options
    if field not in supported.SUPPORTED:
        assert runner.native_decode is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"{field}=" in warnings[0].getMessage(), caplog.text
        assert NativeDecodeStep.for_model(model, 64 * 16) is None
        return
    assert isinstance(runner.native_decode, NativeDecodeStep), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    steps, worst = check_step_against_forward(llm, prompts, 12)
    assert steps == Counter(decode=2 * 11, prefill=2)
    assert worst < 3e-3, worst  # a missing bias, norm or scaling moves the logits by ~10-100%
    for num_tokens in (1, 4):
        worst, kv_error = native_against_forward(llm, list(range(3, 40)), 13, num_tokens)
        assert worst < 1e-3 and kv_error < 1e-3, (num_tokens, worst, kv_error)


def test_the_refusal_is_one_comparison_over_every_field() -> None:
    """Defaults pass; a set field outside SUPPORTED is named with its value; a field the
    dataclass gains later is refused without anyone listing it."""
    assert supported.refusal(DecoderOptions()) is None
    everything = DecoderOptions(**{name: non_default(name) for name in FIELDS})
    assert supported.unsupported_options(everything) == [
        f"{name}={getattr(everything, name)!r}"
        for name in FIELDS
        if name not in supported.SUPPORTED
    ]

    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Later(DecoderOptions):
        logit_softcap: float = 0.0

    assert supported.refusal(Later()) is None
    assert supported.refusal(Later(logit_softcap=30.0)) == (
        "the native step does not implement logit_softcap=30.0"
    )


def test_info_shows_the_native_steps_verdict_on_the_options(monkeypatch, capsys) -> None:
    """`nanollmserve info` on the bundled model (GGUF blocks, tied embeddings): implemented;
    with tied embeddings taken out of SUPPORTED, the refusal and its reason."""
    from nanollmserve.cli.main import main

    assert main(["info"]) == 0
    assert "yes: every decoder option it declares is implemented" in capsys.readouterr().out
    monkeypatch.setattr(supported, "SUPPORTED", supported.SUPPORTED - {"tie_word_embeddings"})
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("native step"))
    assert "no: the native step does not implement tie_word_embeddings=True" in line
