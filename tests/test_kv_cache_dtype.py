"""The KV cache's element type (`--kv-cache-dtype`, m25, m22): int8 codes with a float32
scale per token and KV head, written quantized and read in place by the native attention
(`native/attention_cpu.c`) and the native step (`native/gguf_cpu.c`), dequantized per
gathered block by SDPA (fp8, and the reference); float16 halves, what "auto" makes under the
GGUF file's blocks (decision 37), read in place by the same kernels. Attention against
float32, the native step against the PyTorch path on the same cache, greedy agreement and
perplexity against float32, the pool's capacity, sleep and wake, and the features int8
composes with: prefix caching, preemption, ngram speculative decoding, LoRA, structured
output; the combinations it refuses (tensor parallelism, the KV offload tier) and hostile flag
values, refused at start.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanollmserve import LLM, LoRARequest, SamplingParams
from nanollmserve.engine.step_batch import StepBatch, StepSpan
from nanollmserve.errors import UserError
from nanollmserve.layers import attention as attention_module
from nanollmserve.layers.attention_context import (
    AttentionContext,
    PrefillSpan,
    additive_mask,
    set_context,
)
from nanollmserve.layers.kv_quant import dequantize, quantize
from nanollmserve.native import ops
from nanollmserve.structured_outputs import StructuredOutputsParams

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(600)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
"""GREEDY with each chosen token's logprob (`drift`)."""
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
]
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6
QUALITY_TEXT = Path(__file__).parent / "data/quality/public_domain_en.txt"
CHUNK = 64
"""The int8 engine's prefill chunk: a long prompt's later chunks read its earlier K/V from the
int8 cache (the first chunk attends to its own, not yet quantized)."""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each answer's tokens before its first divergence from the reference."""
    shares = []
    for a, b in zip(ours, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        shares.append(same / len(b))
    return sum(shares) / len(shares)


def drift(ours, reference) -> tuple[float, float, float]:
    """Two greedy runs of the same prompts (outputs with logprobs): the agreement of their
    tokens, then the mean and the largest |difference| of the chosen tokens' logprobs before
    each answer's first divergence, where both sides saw the same context. The logprobs
    measure the K/V error at every token, where greedy agreement only sees the tokens it
    flips (a near tie flips on a tiny error; a 5% wrong scale may flip none)."""
    diffs = []
    for a, b in zip(ours, reference, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        pairs = zip(x.token_ids, y.token_ids, strict=False)
        same = next((i for i, (p, q) in enumerate(pairs) if p != q), len(y.token_ids))
        diffs += [
            abs(x.logprobs[i][x.token_ids[i]].logprob - y.logprobs[i][y.token_ids[i]].logprob)
            for i in range(min(same, len(x.token_ids)))
        ]
    share = agreement(token_ids(ours), token_ids(reference))
    if not diffs:  # diverged at the first token
        return share, math.inf, math.inf
    return share, sum(diffs) / len(diffs), max(diffs)


BLOCKS = {"dtype": "float32", "quantization": "gguf"}
"""The CPU default's weights (the GGUF file's blocks, float32 math): the native step runs."""


def engine(**engine_args) -> LLM:
    return LLM(**BLOCKS, num_kv_blocks=512, max_num_batched_tokens=CHUNK, **engine_args)


@pytest.fixture(scope="module")
def engines():
    """Three engines on the same weights: int8 K/V, float16 K/V ("auto" under the GGUF
    blocks) and float32 K/V (the reference)."""
    built = {
        "int8": engine(kv_cache_dtype="int8"),
        "float16": engine(),
        "float32": engine(kv_cache_dtype="float32"),
    }
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def f32_greedy(engines):
    """The float32 K/V engine's greedy answers to PROMPTS, with logprobs (computed once)."""
    return engines["float32"].generate(PROMPTS, GREEDY_LOGPROBS, use_tqdm=False)


@pytest.fixture(scope="module")
def f32_perplexity(engines) -> float:
    """The float32 K/V engine's `quality_text_perplexity` (computed once)."""
    return quality_text_perplexity(engines["float32"])


@pytest.fixture
def int8(engines):
    from conftest import assert_no_leak

    yield engines["int8"]
    assert_no_leak(engines["int8"])


@pytest.fixture
def f32(engines):
    from conftest import assert_no_leak

    yield engines["float32"]
    assert_no_leak(engines["float32"])


@pytest.fixture
def f16(engines):
    from conftest import assert_no_leak

    yield engines["float16"]
    assert_no_leak(engines["float16"])


# -- attention ------------------------------------------------------------------------------


def paged_inputs(seed: int = 0):
    """q [3 seqs, 6 heads, 64], a float32 pool [12 blocks, 16, 2 KV heads, 64], scattered
    block tables and lengths that end inside, and at the end of, a block."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 6, 64, generator=gen)
    k = torch.randn(12, 16, 2, 64, generator=gen) * 2
    v = torch.randn(12, 16, 2, 64, generator=gen)
    k[3, 5, 1] *= 40  # an outlier token: its own scale, nobody else's
    tables = torch.tensor([[3, 7, 1, 0], [11, 2, 0, 0], [5, 9, 4, 8]])
    lens = torch.tensor([37, 17, 64])
    return q, k, v, tables, lens


def reference_attention(q, k, v, tables, lens, scale):
    """SDPA over each sequence's gathered keys and values (float32)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[2]
    for s in range(q.shape[0]):
        keys = k[tables[s]].flatten(0, 1)[: lens[s]]  # [ctx, kv_heads, dim]
        values = v[tables[s]].flatten(0, 1)[: lens[s]]
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)
        values = values.repeat_interleave(group, 1).transpose(0, 1)
        out[s] = torch.nn.functional.scaled_dot_product_attention(
            q[s][:, None], keys, values, scale=scale
        )[:, 0]
    return out


@pytest.mark.skipif(not ops.available(), reason="the native kernels are not built here")
def test_int8_attention_against_float32_and_the_dequantized_reference():
    q, k, v, tables, lens = paged_inputs()
    scale = 64**-0.5
    exact = ops.paged_decode_attention(q, k, v, tables, lens, scale)
    (k8, k_scale), (v8, v_scale) = quantize(k, torch.int8), quantize(v, torch.int8)
    ours = ops.paged_decode_attention(
        q, k8, v8, tables, lens, scale, k_scale=k_scale, v_scale=v_scale
    )
    dequantized = reference_attention(
        q, dequantize(k8, k_scale, torch.float32), dequantize(v8, v_scale, torch.float32),
        tables, lens, scale,
    )  # fmt: skip
    # In registers, the same numbers as SDPA over the dequantized blocks...
    assert relative_error(ours, dequantized) < 1e-5
    # ...and within int8's rounding of the float32 cache (~0.5% per row).
    error = relative_error(ours, exact)
    assert 0 < error < 2e-2, error
    # fp8 on the PyTorch path: dequantized per gathered block, within its coarser rounding.
    for dtype, bound in ((torch.float8_e4m3fn, 6e-2), (torch.float8_e5m2, 1.2e-1)):
        (kf, ks), (vf, vs) = quantize(k, dtype), quantize(v, dtype)
        fp8 = reference_attention(
            q, dequantize(kf, ks, torch.float32), dequantize(vf, vs, torch.float32),
            tables, lens, scale,
        )  # fmt: skip
        assert relative_error(fp8, exact) < bound, dtype


@pytest.mark.skipif(not ops.available(), reason="the native kernels are not built here")
def test_float16_attention_reads_the_halves_exactly():
    q, k, v, tables, lens = paged_inputs()
    scale = 64**-0.5
    k16, v16 = k.half(), v.half()
    ours = ops.paged_decode_attention(q, k16, v16, tables, lens, scale)
    # the halves widened in registers: the numbers float32 K/V holding the same values give
    assert torch.equal(
        ours, ops.paged_decode_attention(q, k16.float(), v16.float(), tables, lens, scale)
    )
    # and within float16's rounding of the float32 cache (2^-11 a value)
    error = relative_error(ours, ops.paged_decode_attention(q, k, v, tables, lens, scale))
    assert 0 < error < 2e-3, error
    with pytest.raises(ValueError, match="v_cache is torch.float32, not torch.float16"):
        ops.paged_decode_attention(q, k16, v, tables, lens, scale)


@pytest.mark.skipif(not ops.available(), reason="the native kernels are not built here")
def test_int8_attention_refuses_caches_without_their_scales():
    q, k, v, tables, lens = paged_inputs()
    (k8, k_scale), (v8, v_scale) = quantize(k, torch.int8), quantize(v, torch.int8)
    for kwargs in (
        {},  # int8 codes read as float32
        {"k_scale": k_scale, "v_scale": v_scale[:, :8]},
        {"k_scale": k_scale, "v_scale": v_scale.double()},
        {"k_scale": k_scale, "v_scale": None},
    ):
        with pytest.raises(ValueError, match="native paged decode attention"):
            ops.paged_decode_attention(q, k8, v8, tables, lens, 0.125, **kwargs)


# -- the engine -----------------------------------------------------------------------------


def cache_row(runner, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K/V codes and scales at `slot` (copies)."""
    bs = runner.block_size
    return (
        runner.kv_cache[:, :, slot // bs, slot % bs].clone(),
        runner.kv_scales[:, :, slot // bs, slot % bs].clone(),
    )


def clear_row(runner, slot: int) -> None:
    bs = runner.block_size
    runner.kv_cache[:, :, slot // bs, slot % bs] = 0
    runner.kv_scales[:, :, slot // bs, slot % bs] = 0


class LastToken:
    """A prompt whose tokens but the last are written into scattered blocks by the PyTorch
    forward; its last token can then run as a native step or a forward decode step."""

    def __init__(self, llm) -> None:
        self.runner = runner = llm.engine.model_runner
        self.ids = llm.tokenizer.encode("A lighthouse keeper finds a message in a bottle. " * 4)
        self.position, bs = len(self.ids) - 1, runner.block_size
        self.block_ids = [(5 * i + 3) % 64 for i in range(self.position // bs + 1)]
        self.slots = torch.tensor(
            [self.block_ids[p // bs] * bs + p % bs for p in range(self.position + 1)]
        )
        self.slot = int(self.slots[self.position])
        prefill = PrefillSpan(0, self.position, self.position)
        set_context(AttentionContext(slot_mapping=self.slots[: self.position], prefills=[prefill]))
        runner.run_model(torch.tensor(self.ids[: self.position]), torch.arange(self.position), None)

    def native(self) -> torch.Tensor:
        return self.runner.native_decode(
            StepBatch.of([StepSpan(self.ids[self.position :], self.position, self.block_ids, 1)])
        )

    def forward(self) -> torch.Tensor:
        width = len(self.block_ids) * self.runner.block_size
        context = AttentionContext(slot_mapping=self.slots[self.position :], num_decode_tokens=1)
        context.decode_block_tables = torch.tensor([self.block_ids])
        context.decode_context_lens = torch.tensor([self.position + 1])
        mask = additive_mask(torch.arange(width)[None] <= self.position, torch.float32)
        context.decode_mask = mask.view(1, 1, 1, -1)
        set_context(context)
        return self.runner.run_model(
            torch.tensor(self.ids[self.position :]),
            torch.tensor([self.position]),
            torch.tensor([0]),
        )


def test_the_native_step_and_the_pytorch_path_agree_on_one_int8_cache(int8, monkeypatch):
    runner = int8.engine.model_runner
    assert runner.kv_cache.dtype == torch.int8 and runner.native_decode is not None
    int8.engine.reset()  # this test writes blocks the prefix cache may hold: forget them
    # The prompt's K/V written quantized by the PyTorch forward...
    last = LastToken(int8)
    # ...then the last token by the native step (it quantizes its own K/V row in C)...
    native = last.native()
    native_row = cache_row(runner, last.slot)
    # ...and by the forward: native attention over the int8 rows, then SDPA dequantized.
    clear_row(runner, last.slot)
    forward = last.forward()
    codes, scales = cache_row(runner, last.slot)
    monkeypatch.setattr(attention_module, "_native_kernels", lambda *args: None)
    clear_row(runner, last.slot)
    sdpa = last.forward()
    # With a float32 cache the three agree to ~4e-4. With int8, the current token's K/V row is
    # quantized after 30 layers of float rounding that differs between the paths, and a
    # value near a rounding boundary lands one code apart: measured 4.6e-3 (native) and 3.3e-3
    # (SDPA) here. A wrong scale or code would be ~10-100%; the kernels alone agree to 1e-5
    # (test_int8_attention_against_float32_and_the_dequantized_reference).
    assert relative_error(native, forward) < 1e-2
    assert relative_error(sdpa, forward) < 1e-2
    # Both sides quantize a row alike: codes at most one apart, most of them equal.
    assert (codes.int() - native_row[0].int()).abs().max() <= 1
    assert float((codes == native_row[0]).float().mean()) > 0.9  # 95% measured
    assert torch.allclose(scales, native_row[1], rtol=2e-2)
    int8.engine.reset()


def test_the_native_step_and_the_pytorch_path_write_the_same_float16_row(f16, monkeypatch):
    runner = f16.engine.model_runner
    assert runner.kv_cache.dtype == torch.float16 and runner.native_decode is not None
    assert runner.kv_scales is None
    f16.engine.reset()  # this test writes blocks the prefix cache may hold: forget them
    last = LastToken(f16)
    row = (slice(None), slice(None), last.slot // runner.block_size, last.slot % runner.block_size)
    native = last.native()
    native_row = runner.kv_cache[row].clone()
    runner.kv_cache[row] = 0
    monkeypatch.setattr(attention_module, "_native_kernels", lambda *args: None)
    sdpa = last.forward()
    sdpa_row = runner.kv_cache[row].clone()
    # Layer 0's K/V come from the same embedding row through the same kernels: both paths
    # round them to the same halves (nearest even). Later layers' floats differ by the paths'
    # summation orders (measured 1e-4 to 4e-4), so about half their halves land one apart.
    assert torch.equal(native_row[:, 0], sdpa_row[:, 0])
    assert relative_error(native_row.float(), sdpa_row.float()) < 2e-3
    assert relative_error(native, sdpa) < 2e-3  # measured 6e-4; 4e-4 with a float32 cache
    f16.engine.reset()


def test_greedy_answers_agree_with_float32_mostly(int8, f32_greedy, record_property):
    """The native step's int8 K/V (these short prompts and every decode token quantize in C)
    against float32 K/V: greedy agreement and the logprobs of the tokens both chose."""
    ours = int8.generate(PROMPTS, GREEDY_LOGPROBS, use_tqdm=False)
    share, mean, worst = drift(ours, f32_greedy)
    record_property("int8_greedy_agreement", share)
    record_property("int8_greedy_logprob_drift", mean)
    print(
        f"int8 K/V: {share:.0%} of greedy tokens before the first divergence from float32; "
        f"their logprobs {mean:.4f} apart on average, {worst:.4f} at most"
    )
    assert all(len(t) == GREEDY.max_tokens for t in token_ids(ours))
    # Measured: AMX build 85% (three answers whole, "def fibonacci" parts at token 13), mean
    # 0.016, largest 0.13; AVX2 build (NANOLLMSERVE_CPU_ISA=avx2) 100%, 0.013, 0.13. A decode
    # row's scale 5% too large (native quantize_kv_head) measured 75%, 0.045, 0.46.
    assert share >= 0.8, share
    assert mean < 0.035, mean
    assert worst < 0.3, worst


def quality_text_perplexity(llm) -> float:
    """The perplexity of the quality text's first 640 tokens by the engine's prompt logprobs
    (prefill chunks of 64: each chunk reads the earlier ones' K/V from the cache)."""
    ids = llm.tokenizer.encode(QUALITY_TEXT.read_text(), add_special_tokens=False)[:640]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    [output] = llm.generate([ids], params, use_tqdm=False)
    rows = output.prompt_logprobs[1:]
    return math.exp(-sum(row[t].logprob for t, row in zip(ids[1:], rows, strict=True)) / len(rows))


def test_perplexity_with_int8_kv_is_within_half_a_percent(
    int8, f32_perplexity, record_property, compat
):
    ours, reference = quality_text_perplexity(int8), f32_perplexity
    change = ours / reference - 1
    record_property("int8_perplexity_change", change)
    print(
        f"perplexity over 640 tokens: float32 K/V {reference:.4f}, "
        f"int8 K/V {ours:.4f} ({change:+.3%})"
    )
    assert abs(change) < 5e-3  # measured +0.139% (AMX and AVX2 builds alike: the PyTorch path)
    compat.exercised("gguf", quantization=int8.engine.loaded.quantization)
    compat.exercised("kvdtype", kv_cache_dtype=int8.engine.model_runner.kv_cache.dtype)


def test_float16_kv_keeps_float32s_perplexity_and_greedy_answers(
    f16, f32_greedy, f32_perplexity, record_property, compat
):
    change = quality_text_perplexity(f16) / f32_perplexity - 1
    share = agreement(
        token_ids(f16.generate(PROMPTS, GREEDY, use_tqdm=False)), token_ids(f32_greedy)
    )
    record_property("float16_perplexity_change", change)
    record_property("float16_greedy_agreement", share)
    print(f"float16 K/V: perplexity {change:+.4%}, greedy agreement {share:.0%}")
    assert abs(change) < 1e-3  # measured +0.036% (AMX and AVX2); int8's bound is 5e-3
    assert share >= 0.75  # measured 100% (AMX and AVX2)
    compat.exercised("gguf", quantization=f16.engine.loaded.quantization)
    compat.exercised("kvdtype", kv_cache_dtype=f16.engine.model_runner.kv_cache.dtype)


FP8_PERPLEXITY_BOUNDS = {"fp8_e4m3": 2e-2, "fp8_e5m2": 1e-1}
"""|perplexity change| against float32 K/V, prefill chunks of 64 (`quality_text_perplexity`).
Measured +0.74% (e4m3: 3 mantissa bits) and +4.39% (e5m2: 2), the same on the AMX and the AVX2
builds (fp8 runs on the PyTorch path); bounds 2.7x and 2.3x those. A scale 5% too large
(`kv_quant.quantize`) measured +13.0% and +18.8%."""


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_runs_on_the_pytorch_path(make_llm, f32_greedy, f32_perplexity, name, caplog):
    with caplog.at_level("INFO", logger="nanollmserve.engine.native_decode"):
        fp8 = make_llm(**BLOCKS, kv_cache_dtype=name, max_num_batched_tokens=CHUNK)
    runner = fp8.engine.model_runner
    expected = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    assert runner.kv_cache.dtype == expected and runner.kv_scales.shape == (2, 30, 512, 16, 3)
    assert runner.native_decode is None
    assert "not torch.float8" in caplog.text  # the reason the native step is refused
    ours = token_ids(fp8.generate(PROMPTS, GREEDY, use_tqdm=False))
    change = quality_text_perplexity(fp8) / f32_perplexity - 1
    # greedy agreement is reported only: 65% (e4m3) and 45% (e5m2) measured, and a wrong
    # scale moved it either way (60%, 56%); the perplexity is the bar
    print(
        f"{name} K/V: perplexity {change:+.3%}, "
        f"{agreement(ours, token_ids(f32_greedy)):.0%} greedy agreement with float32"
    )
    assert all(len(t) == GREEDY.max_tokens for t in ours)
    assert abs(change) < FP8_PERPLEXITY_BOUNDS[name], change


def test_the_same_memory_holds_more_float16_and_int8_tokens(make_llm):
    memory = 16 << 20
    sized = {
        name: make_llm(**BLOCKS, kv_cache_dtype=name, num_kv_blocks=None, kv_cache_memory=memory)
        for name in ("float32", "auto", "float16", "int8")
    }
    blocks = {name: llm.engine.num_kv_blocks for name, llm in sized.items()}
    runner = sized["int8"].engine.model_runner
    assert runner.kv_cache.nbytes + runner.kv_scales.nbytes <= memory
    # float32 K/V: 4 bytes a value; float16: 2; int8: 1 byte a value + a 4-byte scale per 64
    assert blocks["int8"] >= 3.5 * blocks["float32"], blocks
    assert blocks["float16"] >= 1.9 * blocks["float32"], blocks
    assert blocks["auto"] == blocks["float16"]  # "auto" under the GGUF blocks
    for name in ("float16", "int8"):  # both run the native step
        assert sized[name].engine.model_runner.native_decode is not None


def test_auto_is_float16_under_gguf_blocks_and_the_models_dtype_otherwise(make_llm):
    gguf = make_llm(**BLOCKS)
    dense = make_llm(dtype="float32", quantization="none", num_kv_blocks=64)
    assert gguf.engine.model_runner.kv_cache.dtype == torch.float16
    assert dense.engine.model_runner.kv_cache.dtype == torch.float32
    named = make_llm(
        dtype="float32", quantization="none", num_kv_blocks=64, kv_cache_dtype="float16"
    )
    assert named.engine.model_runner.kv_cache.dtype == torch.float16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for llm in (gguf, dense, named):  # the PyTorch forward casts as it writes and gathers
        assert all(
            len(t) == 8 for t in token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        )


def test_prefix_caching_reads_int8_blocks(int8):
    """The second run reads the first's int8 blocks: the same codes and scales through the
    same kernels, so the same answers and logprobs, bit for bit (measured on the AMX and
    the AVX2 builds: 100%, logprobs 0.0 apart). A hit that skipped one token for the second
    request admitted in a step measured 59%, the old bar (50%) let it through."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [SYSTEM + "Name a colour.", SYSTEM + "Name a fruit."]
    first = int8.generate(prompts, params, use_tqdm=False)
    again = int8.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 48 for o in again)
    share, _, worst = drift(again, first)
    print(f"prefix hit vs cold: {share:.0%}, logprobs {worst:.2g} apart at most")
    assert token_ids(again) == token_ids(first)
    assert worst == 0.0, worst


def test_preemption_recomputes_into_int8_blocks(make_llm, int8):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    small = make_llm(**BLOCKS, kv_cache_dtype="int8", num_kv_blocks=8, enable_prefix_caching=False)
    outputs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert all(len(t) == 40 for t in token_ids(outputs))
    share, mean, worst = drift(outputs, int8.generate(PROMPTS, params, use_tqdm=False))
    print(
        f"preempted vs not: {share:.0%}, logprobs {mean:.5f} apart on average, {worst:.4f} at most"
    )
    # The recompute runs the tokens as one span (tiles) where they first ran one at a time:
    # other float rounding, so codes one apart. Measured: AMX build 90% ("def fibonacci" parts
    # at token 24 of 40), mean 0.00032, largest 0.025; AVX2 build 100%, 0.0010, 0.027. The
    # span kernel reading int8 values 30% too large measured 89%, 0.0035, 0.19.
    assert share >= 0.85, share
    assert mean < 2.5e-3, mean
    assert worst < 0.075, worst


def test_ngram_speculative_decoding_on_int8(make_llm, int8, compat):
    from spec_decode_prompts import ASK_JSON

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec = make_llm(**BLOCKS, kv_cache_dtype="int8", speculative_config=ngram)
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)
    drafted = spec.chat(ASK_JSON, params, use_tqdm=False)
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
    compat.exercised("spec", num_drafts=spec.engine.stats().spec_decode.num_drafts)
    compat.exercised("kvdtype", kv_cache_dtype=spec.engine.model_runner.kv_cache.dtype)
    plain = int8.chat(ASK_JSON, params, use_tqdm=False)
    share, mean, worst = drift(drafted, plain)
    print(
        f"ngram vs plain decode: {share:.0%}, "
        f"logprobs {mean:.5f} apart on average, {worst:.4f} at most"
    )
    # A verify span's rows attend together where plain decode runs one row: other float
    # rounding only. Measured (19 tokens, then the end of the answer): AMX build 100%, mean
    # 0.0017, largest 0.0087; AVX2 build 100%, 0.0017, 0.0068. A span row past the first six
    # reading int8 keys 5% too large measured 100%, 0.0078, 0.087.
    assert share >= 0.9, share
    assert mean < 4e-3, mean
    assert worst < 0.025, worst


def test_lora_on_int8(make_llm, compat):
    from lora_adapters import adapter_dir

    lora = make_llm(**BLOCKS, kv_cache_dtype="int8", enable_lora=True)
    adapter = LoRARequest("a", 1, str(adapter_dir(1)))
    with_adapter = token_ids(
        lora.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=adapter)
    )
    base = token_ids(lora.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    assert all(len(t) == GREEDY.max_tokens for t in with_adapter)
    assert with_adapter != base  # the adapter's answers, not the base model's
    compat.exercised("lora", output=with_adapter, base=base)
    compat.exercised("kvdtype", kv_cache_dtype=lora.engine.model_runner.kv_cache.dtype)


def test_structured_output_on_int8(int8, compat):
    # bounded fields: the answer ends within max_tokens whatever digits the small model picks
    # (unbounded, a greedy "rank": 1000... ran past them)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["city", "rank"],
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=96,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    [output] = int8.generate(["Give the largest city of Spain as JSON."], params, use_tqdm=False)
    answer = json.loads(output.outputs[0].text)
    assert isinstance(answer["city"], str) and isinstance(answer["rank"], int)
    compat.exercised("structured", output=output.outputs[0].text, schema=schema)
    compat.exercised("kvdtype", kv_cache_dtype=int8.engine.model_runner.kv_cache.dtype)


def test_sleep_and_wake_keep_the_int8_cache(make_llm, compat):
    llm = make_llm(**BLOCKS, kv_cache_dtype="int8")
    before = token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    llm.sleep(1)
    runner = llm.engine.model_runner
    assert runner.kv_cache is None and runner.kv_scales is None and runner.native_decode is None
    compat.exercised("sleep", asleep=llm.engine.sleep_level == 1 and runner.kv_cache is None)
    llm.wake_up()
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_scales is not None
    assert runner.native_decode is not None
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == before
    compat.exercised("kvdtype", kv_cache_dtype=runner.kv_cache.dtype)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"kv_cache_dtype": "fp8", "kv_offload_dir": "/tmp/kv"}, "kv_offload_dir"),
        ({"kv_cache_dtype": 8}, "kv_cache_dtype must be"),
        ({"kv_cache_dtype": None}, "kv_cache_dtype must be"),
        ({"kv_cache_dtype": float("nan")}, "kv_cache_dtype must be"),
    ],
)
def test_combinations_it_cannot_run_are_refused_before_loading(engine_args, message, compat):
    with pytest.raises(UserError, match=message) as error:
        LLM(**engine_args)
    if "kv_offload_dir" in engine_args:
        compat.refused("kvdtype", "offload", str(error.value))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--kv-cache-dtype", "int4"], {}),
        (["--kv-cache-dtype", "INT8"], {}),
        (["--kv-cache-dtype", ""], {}),
        (["--kv-cache-dtype", "nan"], {}),
        (["--kv-cache-dtype", "1e309"], {}),
        (["--kv-cache-dtype", "float64"], {}),
        (["--kv-cache-dtype", "half"], {}),
        (["--kv-cache-dtype", "FLOAT16"], {}),
        ([], {"NANOLLMSERVE_KV_CACHE_DTYPE": "fp8_e4m3fn"}),
    ],
)
def test_hostile_flag_values_fail_at_start_in_one_line(argv, env):
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanollmserve: error: "), result.stderr
    assert (
        "kv_cache_dtype must be auto | float32 | float16 | int8 | fp8 | fp8_e4m3 | fp8_e5m2"
        in lines[0]
    )
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr


@pytest.mark.skipif(not ops.available(), reason="the native kernels are not built here")
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_a_span_attends_as_tiles_like_its_tokens_one_at_a_time(engines, kv_dtype):
    """A prefill chunk or a verify span of one sequence attends as tiles of its tokens (8 at
    a time, each KV head's query heads together, `nls_attend_span`); the same tokens one per
    native step take the per-token kernel. Their logits agree, on float32 and int8 K/V, for a
    span that starts mid-block, crosses blocks and ends with a partial tile."""
    llm = engines[kv_dtype]
    runner = llm.engine.model_runner
    llm.engine.reset()  # this test writes blocks the prefix cache may hold: forget them
    ids = llm.tokenizer.encode("A lighthouse keeper finds a message in a bottle. " * 5)[:45]
    bs = runner.block_size
    block_ids = [(7 * i + 2) % 64 for i in range(len(ids) // bs + 1)]
    one_at_a_time = [
        runner.native_decode(StepBatch.of([StepSpan([ids[p]], p, block_ids, 1)]))[0]
        for p in range(len(ids))
    ]
    runner.native_decode(StepBatch.of([StepSpan(ids[:19], 0, block_ids, 0)]))
    span = runner.native_decode(StepBatch.of([StepSpan(ids[19:], 19, block_ids, len(ids) - 19)]))
    # Measured: float32 at most 6e-4 (the span's products sum in another order), int8 up to
    # 2.5e-2 (the span writes its own K/V rows, and a row computed in another order rounds to
    # codes one apart, which the later positions read); a wrong mask, scale or weight is
    # ~10-100%. The int8 kernel differs from the float32 one only where it reads a row.
    tolerance = 6e-2 if kv_dtype == "int8" else 2e-3
    worst = max(relative_error(span[r], one_at_a_time[19 + r]) for r in range(len(ids) - 19))
    assert worst < tolerance, worst
    llm.engine.reset()
