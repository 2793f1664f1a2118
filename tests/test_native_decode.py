"""One sequence's step as one native call (`engine/native_decode.py`): it runs for steps of
one request's next token, its verify steps (the last token and its drafts) and its short
prefill chunks with the weights in GGUF blocks, is built from the model's own declaration
(`model.native_decoder()`), and computes what the PyTorch forward over the same blocks
computes: the logits of every token asked for and the K/V it writes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from test_model_parity import CASES, make_tiny_hf_model
from torch import nn
from transformers import AutoTokenizer

from nanollmserve import LLM, SamplingParams
from nanollmserve.engine.native_decode import NativeDecodeStep
from nanollmserve.engine.step_batch import StepBatch, StepSpan
from nanollmserve.errors import UserError
from nanollmserve.layers.attention_context import AttentionContext, PrefillSpan, set_context
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.model.gguf_blocks import BlockRows
from nanollmserve.model.native_decoder import NotNativeError
from nanollmserve.model.source import resolve_model
from nanollmserve.native.abi import KIND_Q8

pytestmark = [pytest.mark.milestone("m17"), pytest.mark.timeout(600)]

PROMPTS = [
    "The quick brown fox",
    "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 3,
    "1, 2, 3, 4,",
]


class CountingStep:
    """Wraps the runner's native step and keeps the logits of every call."""

    def __init__(self, step: NativeDecodeStep) -> None:
        self.step = step
        self.calls: list[tuple[int, torch.Tensor]] = []

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        logits = self.step(batch)
        self.calls.append((batch.spans[0].position, logits.clone()))
        return logits


def forward_logits(runner, scheduled) -> torch.Tensor:
    """The PyTorch forward's logits for the same step."""
    input_ids, positions, logits_indices = runner._forward_inputs(StepBatch.of_scheduled(scheduled))
    return runner.run_model(input_ids, positions, logits_indices)


def native_against_forward(llm, token_ids: list[int], position: int, num_tokens: int):
    """Run `token_ids[:position + num_tokens]` through the PyTorch forward as one prefill,
    then the last `num_tokens` again through the native step over the K/V the forward wrote
    before them (their own K/V slots cleared first), through a scattered block table ->
    (worst relative logits error over the tokens, relative error of the K/V written)."""
    runner = llm.engine.model_runner
    bs, total = runner.block_size, position + num_tokens
    num_blocks = runner.kv_cache.shape[2]
    block_ids = [(7 * i + 3) % num_blocks for i in range(-(-total // bs))]
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(total)])
    set_context(AttentionContext(slot_mapping=slots, prefills=[PrefillSpan(0, total, total)]))
    reference = runner.run_model(
        torch.tensor(token_ids[:total]), torch.arange(total), torch.arange(position, total)
    )
    kv = runner.kv_cache.flatten(2, 3)  # [2, layers, slots, kv_heads, head_dim]
    new = slots[position:]
    kv_reference = kv[:, :, new].clone()
    kv[:, :, new] = 0.0
    native = runner.native_decode(
        StepBatch.of([StepSpan(token_ids[position:total], position, block_ids, num_tokens)])
    )
    assert native.shape == reference.shape
    worst = max(float((n - r).norm() / r.norm()) for n, r in zip(native, reference, strict=True))
    kv_error = float((kv[:, :, new] - kv_reference).norm() / kv_reference.norm())
    return worst, kv_error


def check_step_against_forward(llm, prompts, max_tokens: int) -> tuple[Counter, float]:
    """Generate greedily, one request at a time; at every native step that gives logits also
    run the PyTorch forward (it rewrites the same K/V slots) -> (native steps by kind, worst
    relative logits error)."""
    runner = llm.engine.model_runner
    step = runner.native_decode
    execute = runner.execute_model
    worst = 0.0
    before = Counter(runner.native_steps)

    def execute_and_compare(scheduled):
        nonlocal worst
        batch = StepBatch.of_scheduled(scheduled)
        if batch.native_eligible and batch.sample_rows:
            native = step(batch)
            reference = forward_logits(runner, scheduled)
            worst = max(worst, float((native - reference).norm() / reference.norm()))
        return execute(scheduled)

    runner.execute_model = execute_and_compare
    try:
        for prompt in prompts:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate([prompt], params, use_tqdm=False)
    finally:
        runner.execute_model = execute
    return Counter(runner.native_steps) - before, worst


def test_a_single_stream_decodes_natively_with_the_forwards_answers(make_llm):
    llm = make_llm(quantization="gguf", block_size=16)
    runner = llm.engine.model_runner
    assert isinstance(runner.native_decode, NativeDecodeStep)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    counting = CountingStep(runner.native_decode)
    runner.native_decode = counting
    native = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    # one prefill step, then 39 decode steps per prompt (positions cross block ends), native
    assert runner.native_steps == Counter(decode=39 * len(PROMPTS), prefill=len(PROMPTS))
    assert len(counting.calls) == 40 * len(PROMPTS)
    assert any(position % 16 == 0 for position, _ in counting.calls)
    runner.native_decode = None
    forward = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert native == forward
    # A batch of several requests: one native call per step for all of them.
    runner.native_decode = counting
    counting.calls.clear()
    runner.native_steps.clear()
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == forward
    assert runner.native_steps == Counter({"batched-prefill": 1, "batched-decode": 39})
    assert [len(logits) for _, logits in counting.calls] == [3] * 40


# Bounds on the relative logits error of a native step against the PyTorch forward over the
# same blocks, per K/V type. The forward of a prefill attends to its K/V before they are
# stored; the native step reads them back from the cache, so float16 K/V add their rounding
# (2^-11 relative a value) to the kernels' own error. Measured worst errors (relative norm):
#   mixed sequences, float32 K/V: 4.5e-4 (Xeon AMX: amx, avx512 and avx2 builds alike);
#   mixed sequences, float16 K/V: 8.6e-4 (Xeon AMX, all three builds), 1.45e-3 (EPYC AVX-512);
#   every position, float32 K/V: 1.04e-3 (Xeon amx/avx512), 8.3e-4 (Xeon avx2 build);
#   every position, float16 K/V: 2.6e-3 (Xeon amx/avx512), 2.7e-3 (Xeon avx2), 3.8e-3 (EPYC
#   AVX-512).
# A missing bias, norm or rotary moves the logits by ~10-100%, far above every bound.
MIXED_BOUND = {"float32": 1e-3, "float16": 3e-3}
EVERY_POSITION_BOUND = {"float32": 3e-3, "float16": 8e-3}


@pytest.mark.milestone("m22")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_a_batched_native_step_equals_the_forward_for_mixed_sequences(make_llm, kv_cache_dtype):
    """One native call for several sequences at once: decode tokens at different context
    lengths (across block ends), a verify span (a token and 3 drafts: logits at each) and a
    prefill chunk that gives none, each through its own scattered block table: the logits and
    the K/V written equal the PyTorch forward's, sequence by sequence."""
    llm = make_llm(
        quantization="gguf", block_size=16, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype
    )
    bound = MIXED_BOUND[kv_cache_dtype]
    runner = llm.engine.model_runner
    bs = runner.block_size
    token_ids = llm.tokenizer.encode(PROMPTS[1])
    # (context before the step, tokens in the step, logits asked for)
    shapes = [(15, 1, 1), (31, 1, 1), (3, 4, 4), (0, 7, 0), (20, 1, 1)]
    tables, references, kv_references = [], [], []
    kv = runner.kv_cache.flatten(2, 3)  # [2, layers, slots, kv_heads, head_dim]
    next_block = 0
    for seq, (position, count, num_logits) in enumerate(shapes):
        total = position + count
        table = [(next_block + 5 * i + seq) % 64 for i in range(-(-total // bs))]
        next_block += 13
        tables.append(table)
        tokens = token_ids[seq : seq + total]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
        set_context(AttentionContext(slot_mapping=slots, prefills=[PrefillSpan(0, total, total)]))
        rows = torch.arange(total - num_logits, total)
        references.append(runner.run_model(torch.tensor(tokens), torch.arange(total), rows))
        kv_references.append(kv[:, :, slots[position:]].clone())
    assert len({b for table in tables for b in table}) == sum(map(len, tables))  # no overlap
    spans = []
    for seq, (position, count, num_logits) in enumerate(shapes):
        table = tables[seq]
        slots = torch.tensor(
            [table[p // bs] * bs + p % bs for p in range(position, position + count)]
        )
        kv[:, :, slots] = 0.0
        tokens = token_ids[seq + position : seq + position + count]
        spans.append(StepSpan(tokens, position, table, num_logits))
    native = runner.native_decode(StepBatch.of(spans))
    assert native.shape[0] == sum(num_logits for _, _, num_logits in shapes)
    first = 0
    for seq, (position, count, num_logits) in enumerate(shapes):
        for row in range(num_logits):
            n, r = native[first + row], references[seq][row]
            assert float((n - r).norm() / r.norm()) < bound, (seq, row)
        first += num_logits
        table = tables[seq]
        slots = torch.tensor(
            [table[p // bs] * bs + p % bs for p in range(position, position + count)]
        )
        written, reference = kv[:, :, slots], kv_references[seq]
        assert float((written - reference).norm() / reference.norm()) < bound, seq


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_native_step_logits_equal_the_forwards_at_every_position(make_llm, kv_cache_dtype):
    llm = make_llm(quantization="gguf", block_size=16, kv_cache_dtype=kv_cache_dtype)
    steps, worst = check_step_against_forward(llm, PROMPTS[:2], max_tokens=24)
    assert steps == Counter(decode=2 * 23, prefill=2)
    # A native prefill writes its own K/V too, so the two paths drift a little further apart
    # over a prompt than a decode step after the forward's prefill does (see the bounds).
    assert worst < EVERY_POSITION_BOUND[kv_cache_dtype], worst


@pytest.mark.milestone("m22")
def test_the_native_step_runs_several_tokens_of_a_sequence_like_the_forward(make_llm):
    """T consecutive tokens in one native call (a verify step, a prefill chunk): the logits
    of every token and the K/V it writes equal the PyTorch forward's, for T = 1..6 across a
    block's end, and from position 0."""
    llm = make_llm(quantization="gguf", block_size=16, num_kv_blocks=64)
    token_ids = llm.tokenizer.encode(PROMPTS[1])
    for num_tokens in range(1, 7):
        worst, kv_error = native_against_forward(llm, token_ids, 14, num_tokens)
        assert worst < 1e-3 and kv_error < 1e-3, (num_tokens, worst, kv_error)
    worst, kv_error = native_against_forward(llm, token_ids, 0, 20)
    assert worst < 3e-3 and kv_error < 1e-3, (worst, kv_error)


@pytest.mark.milestone("m22")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_a_verify_span_gives_the_bits_of_its_tokens_one_at_a_time(make_llm, kv_cache_dtype):
    """Decode tokens and verify spans attend over chunks of their keys (64 each, more past
    1,024 keys), one work item per KV head and chunk, merged after. At a context inside one
    chunk, over several, and across the length where the chunks grow, a 5-token span's logits
    equal the PyTorch forward's, and, bit for bit, those of its tokens run one at a time: a
    row's numbers depend on its own context only, not on the rows beside it. On a float16
    cache too (the default), where the forward's prefill attends to its K/V before they are
    rounded to halves and the native steps read the halves: measured 1.2e-3 at 1,021 keys."""
    llm = make_llm(
        quantization="gguf", block_size=16, num_kv_blocks=160, kv_cache_dtype=kv_cache_dtype
    )
    runner = llm.engine.model_runner
    token_ids = (llm.tokenizer.encode(PROMPTS[1]) * 40)[:1100]
    block_ids = [(7 * i + 3) % 160 for i in range(-(-1100 // runner.block_size))]
    tolerance = 1e-3 if kv_cache_dtype == "float32" else 4e-3
    for position in (10, 300, 1021):
        worst, kv_error = native_against_forward(llm, token_ids, position, 5)
        assert worst < tolerance and kv_error < tolerance, (position, worst, kv_error)
        span = runner.native_decode(
            StepBatch.of([StepSpan(token_ids[position : position + 5], position, block_ids, 5)])
        )
        one_at_a_time = torch.cat(
            [
                runner.native_decode(StepBatch.of([StepSpan([token_ids[p]], p, block_ids, 1)]))
                for p in range(position, position + 5)
            ]
        )
        assert torch.equal(span, one_at_a_time), position


@pytest.mark.milestone("m22")
def test_a_chunked_prefill_of_a_lone_request_runs_natively(make_llm):
    """Chunks of 16 of a 49-token prompt: three native prefill steps that give no logits, the
    prompt's last token (a step like a decode), then decode steps, all native; the answer is
    the PyTorch forward's."""
    llm = make_llm(
        quantization="gguf", block_size=16, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    runner = llm.engine.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    native = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    assert runner.native_steps == Counter(prefill=3, decode=12)
    step, runner.native_decode = runner.native_decode, None
    assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == native
    runner.native_decode = step


def test_sampling_logprobs_and_stops_work_on_native_steps(make_llm):
    llm = make_llm(quantization="gguf")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, logprobs=3)
    first = llm.generate(["Once upon a time"], params)[0].outputs[0]
    again = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert first.token_ids == again.token_ids  # seeded: the same draw each time
    assert len(first.logprobs) == len(first.token_ids)
    assert all(len(entry) >= 3 for entry in first.logprobs)
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, stop=[","]))
    assert stopped[0].outputs[0].finish_reason == "stop"


def q8_rows(weight: torch.Tensor) -> BlockRows:
    """Quantize a float32 weight to Q8_0-like rows (d = max|w| / 127 per block of 32)."""
    out, cols = weight.shape
    w = weight.detach().double().numpy().reshape(out, cols // 32, 32)
    d = (np.abs(w).max(axis=-1) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d.astype(np.float64))
    codes = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int8)
    rows = np.concatenate(
        [codes.reshape(out, cols).view(np.uint8), d.view(np.uint8).reshape(out, -1)], axis=1
    )
    return BlockRows(KIND_Q8, torch.from_numpy(np.ascontiguousarray(rows)))


def q4_0_rows(weight: torch.Tensor) -> BlockRows:
    """Quantize a float32 weight to Q4_0 blocks (the `gguf` package's quantizer): a kind whose
    kernel keeps int16 activations, where Q8_0's multiplies int8 ones (decision 48)."""
    import gguf

    from nanollmserve.model.gguf_blocks import _block_rows

    values = weight.detach().float().numpy()
    return _block_rows(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0), "Q4_0")


def to_block_layers(model: nn.Module, quantize=q8_rows) -> None:
    """Every projection of the decoder as a GGUFLinear over blocks of its own weights
    (`quantize`: Q8 blocks unless told)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and ".layers." in name:
            blocks = quantize(module.weight)
            parent_name, _, attr = name.rpartition(".")
            layer = GGUFLinear(blocks, module.bias, module.out_features, module.in_features)
            setattr(model.get_submodule(parent_name), attr, layer)


@pytest.mark.milestone("m22")
@pytest.mark.parametrize(
    "case",
    [
        "llama",
        "llama-tied",
        "llama-attention-bias",
        "llama-mlp-bias",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3-untied",
    ],
)
def test_the_native_step_covers_biases_qk_norm_and_untied_heads(case, tmp_path):
    """Tiny random models of each option the model declares to the native step (q/k/v, o and
    MLP biases, Qwen3's q/k norms, tied and untied output projections that stay in PyTorch,
    Mistral), their projections in Q8 blocks: the engine's native steps and T-token steps
    (T = 1..6) against the PyTorch forward (itself checked against transformers for each case
    in tests/test_model_parity.py)."""
    config_cls, overrides = CASES[case]
    make_tiny_hf_model(config_cls, tmp_path, **overrides)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=16)
    runner = llm.engine.model_runner
    assert runner.native_decode is None  # dense weights: the PyTorch forward
    to_block_layers(runner.model)
    runner.native_decode = NativeDecodeStep.for_model(runner.model, 64 * 16)
    assert runner.native_decode is not None
    prompts = [[5, 9, 17, 33, 2, 71], list(range(3, 40))]
    steps, worst = check_step_against_forward(llm, prompts, 20)
    assert steps == Counter(decode=2 * 19, prefill=2)
    assert worst < 3e-3, worst  # a missing bias or norm moves the logits by ~10-100%
    for num_tokens in range(1, 7):
        worst, kv_error = native_against_forward(llm, list(range(3, 40)), 13, num_tokens)
        assert worst < 1e-3 and kv_error < 1e-3, (num_tokens, worst, kv_error)


@pytest.mark.milestone("m22")
def test_a_model_whose_projections_are_not_blocks_declares_no_native_decoder(tmp_path, caplog):
    """The model declares itself (`native_decoder()`) or says why it cannot: dense weights
    keep the PyTorch forward, logged at INFO (the native step is not in play); with its
    projections in blocks the same model runs natively (its options: tests/
    test_decoder_options.py, refused at WARNING when the step lacks one)."""
    from transformers import LlamaConfig

    make_tiny_hf_model(LlamaConfig, tmp_path, mlp_bias=True)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="nanollmserve.engine.native_decode"):
        llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=16)
    assert "not all GGUF blocks" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    runner = llm.engine.model_runner
    assert runner.native_decode is None
    with pytest.raises(NotNativeError, match="not all GGUF blocks"):
        runner.model.native_decoder()
    to_block_layers(runner.model)
    assert runner.model.model.layers[0].mlp.down_proj.bias is not None
    assert runner.model.native_decoder().options.mlp_bias
    assert NativeDecodeStep.for_model(runner.model, 64 * 16) is not None


def test_without_the_native_kernels_gguf_is_a_clear_error_and_the_default_dequantizes(
    make_llm, monkeypatch
):
    from nanollmserve.native import ops

    monkeypatch.setattr(ops, "kernels_unavailable_reason", lambda: "no C compiler (test)")
    with pytest.raises(UserError, match="needs the native kernels: no C compiler"):
        make_llm(quantization="gguf")
    fallback = make_llm(dtype="auto")
    assert fallback.engine.loaded.quantization is None
    assert fallback.engine.model_runner.native_decode is None


def test_a_missing_compiler_is_reported_not_raised(tmp_path):
    code = (
        "from nanollmserve.native.ops import kernels_unavailable_reason, load_kernels\n"
        "assert load_kernels() is None\n"
        "print(kernels_unavailable_reason())\n"
    )
    env = {"CC": str(tmp_path / "no-such-cc"), "NANOLLMSERVE_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    assert "no C compiler" in result.stdout
