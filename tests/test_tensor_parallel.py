"""Tensor parallelism (m14) in CPU processes over gloo: greedy outputs with N ranks equal one
rank, each rank holds its share of the weights and KV cache, and a model that cannot be
split (or a feature that does not combine with it yet) is a clear error before any rank
starts. The served path is in `test_tensor_parallel_serve.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_parity import TINY, make_tiny_hf_model
from transformers import AutoTokenizer, LlamaConfig, Qwen3Config

from nanollmserve import LLM, EngineConfig, SamplingParams
from nanollmserve.engine.tensor_parallel.executor import check_tensor_parallel
from nanollmserve.errors import UserError
from nanollmserve.model import ModelConfig, count_parameters, resolve_model

pytestmark = pytest.mark.milestone("m14")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "Give me three tips for learning to cook.",
]
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


TINY_CASES = {
    # untied LM head, biases on q/k/v and o_proj (o_proj's bias is added once, after the sum)
    "llama-tp2": (LlamaConfig, 2, dict(tie_word_embeddings=False, attention_bias=True)),
    # 2 KV heads over 4 ranks (each replicated twice), q/k norms, a tied vocabulary of 130
    # that 4 does not divide (the last rank's rows are padding)
    "qwen3-tp4-kv-replicated": (
        Qwen3Config,
        4,
        dict(head_dim=16, tie_word_embeddings=True, vocab_size=130),
    ),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_models_sharded_answer_like_one_rank(case: str, tmp_path: Path) -> None:
    config_cls, size, overrides = TINY_CASES[case]
    make_tiny_hf_model(config_cls, tmp_path, **overrides)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (3, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # A small token budget chunks the longer prompts: prefills over cached blocks too.
    engine_args = dict(dtype="float32", block_size=8, num_kv_blocks=48, max_num_batched_tokens=16)
    with LLM(str(tmp_path), **engine_args) as single:
        expected = token_ids(single.generate(prompts, params, use_tqdm=False))
    with LLM(str(tmp_path), tensor_parallel_size=size, **engine_args) as sharded:
        kv_heads = sharded.engine.model_runner.kv_cache.shape[-2]
        assert kv_heads == max(1, TINY["num_key_value_heads"] // size)
        got = token_ids(sharded.generate(prompts, params, use_tqdm=False))
        workers = list(sharded.engine.tensor_parallel.processes.values())
    assert got == expected
    assert all(w.exitcode == 0 for w in workers)  # clean shutdown: every rank stopped itself
    assert all(len(set(ids)) > 1 for ids in got)  # not a degenerate constant output


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_shards_like_one_rank(
    kv_cache_dtype: str, tmp_path: Path, compat
) -> None:
    """Each rank writes and reads its own KV heads quantized (a scale per token and KV head),
    so two ranks answer as one rank with the same quantized cache."""
    make_tiny_hf_model(LlamaConfig, tmp_path)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (5, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine_args = dict(dtype="float32", block_size=8, num_kv_blocks=48, max_num_batched_tokens=16)
    engine_args["kv_cache_dtype"] = kv_cache_dtype
    with LLM(str(tmp_path), **engine_args) as single:
        expected = token_ids(single.generate(prompts, params, use_tqdm=False))
    with LLM(str(tmp_path), tensor_parallel_size=2, **engine_args) as sharded:
        assert sharded.engine.model_runner.kv_scales is not None
        got = token_ids(sharded.generate(prompts, params, use_tqdm=False))
        compat.exercised("tp", ranks=compat.ranks_running())
        compat.exercised("kvdtype", kv_cache_dtype=sharded.engine.model_runner.kv_cache.dtype)
    assert got == expected
    assert all(len(set(ids)) > 1 for ids in got)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_model(LlamaConfig, path)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(path)
    return path


def test_heads_that_do_not_divide_are_a_clear_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(UserError, match="tensor_parallel_size 3 must divide the model's 4"):
        LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=3)


def test_more_ranks_than_gpus_is_a_clear_error(tiny_llama_dir: Path) -> None:
    model_config = ModelConfig.from_pretrained(tiny_llama_dir)
    config = EngineConfig(model=str(tiny_llama_dir), device="cuda", tensor_parallel_size=4)
    with pytest.raises(UserError, match="needs 4 GPUs from cuda, but this machine has 2"):
        check_tensor_parallel(config, model_config, cuda_device_count=2)
    check_tensor_parallel(config, model_config, cuda_device_count=4)  # enough: no error


def test_quantization_with_tensor_parallelism_is_rejected(tiny_llama_dir: Path, compat) -> None:
    with pytest.raises(UserError, match="tensor parallelism with --quantization") as error:
        LLM(str(tiny_llama_dir), quantization="int8", tensor_parallel_size=2)
    compat.refused("tp", "int8", str(error.value))


# The bundled three-rank tests come last: their module-scoped engine holds this process's
# tensor-parallel group until the module ends, and a process can be in one group only.
@pytest.fixture(scope="module")
def bundled_reference(shared_llm) -> list:
    """The bundled model's greedy answers with one rank: 4 chats x 32 tokens, float32."""
    conversations = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
    return shared_llm.chat(conversations, GREEDY_32, use_tqdm=False)


@pytest.fixture(scope="module")
def bundled_three_ranks():
    """The bundled model over 3 ranks (9 query heads, 3 KV heads, vocabulary 49152)."""
    with LLM(dtype="float32", num_kv_blocks=64, tensor_parallel_size=3) as sharded:
        yield sharded


# Three tests, not one, so that each stays well inside the per-test timeout on a loaded CPU:
# the one-rank reference, the sharded engine's start, and the sharded answers.
@pytest.mark.slow
def test_bundled_reference_answers_make_sense(bundled_reference) -> None:
    assert "Paris" in bundled_reference[0].outputs[0].text
    assert [len(o.outputs[0].token_ids) for o in bundled_reference] == [32] * 4


@pytest.mark.slow
def test_bundled_model_ranks_hold_a_third_each(bundled_three_ranks, shared_llm) -> None:
    attention = bundled_three_ranks.engine.model_runner.attention_layers[0]
    assert (attention.num_heads, attention.num_kv_heads) == (3, 1)
    assert bundled_three_ranks.engine.model_runner.kv_cache.shape[-2] == 1
    share = count_parameters(bundled_three_ranks.engine.loaded.model) / count_parameters(
        shared_llm.engine.loaded.model
    )
    assert 0.33 <= share < 0.34  # a third, plus the replicated norms


@pytest.mark.slow
def test_bundled_model_three_ranks_answer_like_one(bundled_three_ranks, bundled_reference):
    conversations = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
    got = token_ids(bundled_three_ranks.chat(conversations, GREEDY_32, use_tqdm=False))
    assert got == token_ids(bundled_reference)
