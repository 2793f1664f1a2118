"""Multi-LoRA serving, offline (`LLM(enable_lora=True)`): PEFT adapters made in the test on
the bundled model (r=8, every projection, random A and B) give, per request, the tokens of
the base model merged with that adapter by PEFT; a batch mixing the base model and several
adapters (more than `max_loras`, so slots are reused) gives each request its tokens when run
alone; the prefix cache never hands one adapter's blocks to another or to the base model;
adapters that cannot be served fail at load with a clear error."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import adapter_dir, make_adapter, peft_greedy

from nanollmserve import LoRARequest, SamplingParams
from nanollmserve.errors import UserError

pytestmark = pytest.mark.milestone("m18")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three reasons to learn Python:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def lora_llm():
    from nanollmserve import LLM

    return LLM(dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=8)


def lora(name: str, seed: int, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, str(adapter_dir(seed)))


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_adapter_matches_peft_merged_model(lora_llm):
    ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
    ours = token_ids(lora_llm.generate(ids, GREEDY, use_tqdm=False, lora_request=lora("a", 1, 1)))
    reference = peft_greedy(adapter_dir(1), ids, GREEDY.max_tokens)
    assert ours == reference
    base = token_ids(lora_llm.generate(ids, GREEDY, use_tqdm=False))
    assert base != ours  # the adapter changes the answers: the check above is not vacuous


def test_mixed_batch_equals_each_run_alone(lora_llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    adapters = [None, lora("a", 1, 1), lora("b", 2, 2), lora("c", 3, 3)]  # 3 > max_loras=2
    prompts = [p for p in PROMPTS[:2] for _ in adapters]
    requests = [a for _ in PROMPTS[:2] for a in adapters]
    mixed = token_ids(lora_llm.generate(prompts, params, use_tqdm=False, lora_request=requests))
    alone = [
        token_ids(lora_llm.generate([p], params, use_tqdm=False, lora_request=r))[0]
        for p, r in zip(prompts, requests, strict=True)
    ]
    assert mixed == alone
    per_adapter = [tuple(map(tuple, mixed[i :: len(adapters)])) for i in range(len(adapters))]
    assert len(set(per_adapter)) == len(adapters)  # four different models answered


def test_prefix_cache_is_keyed_by_adapter(lora_llm):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # > 4 blocks
    params = SamplingParams(temperature=0, max_tokens=4)

    def run(lora_request):
        [output] = lora_llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)
        return output

    base_first = run(None)
    a_first = run(lora("a", 1, 1))
    assert a_first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    b_first = run(lora("b", 2, 2))
    assert b_first.num_cached_tokens == 0  # nor are adapter a's
    a_again, base_again = run(lora("a", 1, 1)), run(None)
    assert a_again.num_cached_tokens > 0 and base_again.num_cached_tokens > 0
    assert a_again.outputs[0].token_ids == a_first.outputs[0].token_ids
    assert base_again.outputs[0].token_ids == base_first.outputs[0].token_ids


def test_unservable_adapters_fail_at_load(lora_llm, tmp_path):
    prompt = PROMPTS[0]
    with pytest.raises(UserError, match="rank 16 is more than --max-lora-rank 8"):
        lora_llm.generate(prompt, lora_request=LoRARequest("big", 9, str(adapter_dir(1, 16))))
    embed = make_adapter(tmp_path / "embed", seed=4, targets=["embed_tokens", "q_proj"])
    with pytest.raises(UserError, match=r"target modules \['embed_tokens'\] are not supported"):
        lora_llm.generate(prompt, lora_request=LoRARequest("embed", 9, str(embed)))
    other = _adapter_of_another_model(tmp_path / "other")
    with pytest.raises(UserError, match="another base model"):
        lora_llm.generate(prompt, lora_request=LoRARequest("other", 9, str(other)))
    with pytest.raises(UserError, match="no adapter_config.json"):
        lora_llm.generate(prompt, lora_request=LoRARequest("none", 9, str(tmp_path)))
    assert set(lora_llm.engine.lora_manager.adapters()) <= {"a", "b", "c"}  # none was added


@pytest.mark.milestone("m22")
def test_adapter_on_the_gguf_blocks_matches_peft_merged_model(compat):
    """With `--enable-lora` a GGUF model keeps its blocks: each projection multiplies with its
    blocks in the native kernel and adds the adapter's delta in float32, and the answers are
    PEFT's on the float32 model merged with the same adapter."""
    from nanollmserve import LLM
    from nanollmserve.layers.gguf_linear import GGUFLinear

    llm = LLM(num_kv_blocks=256, enable_lora=True, max_loras=1, max_lora_rank=8)
    assert llm.engine.loaded.quantization == "gguf"
    model = llm.engine.model_runner.model
    assert any(isinstance(m, GGUFLinear) for m in model.modules())
    params = SamplingParams(temperature=0, max_tokens=16)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = token_ids(llm.generate(ids, params, use_tqdm=False, lora_request=lora("a", 1, 1)))
    assert ours == peft_greedy(adapter_dir(1), ids, params.max_tokens)
    base = token_ids(llm.generate(ids, params, use_tqdm=False))
    assert ours != base
    compat.exercised("lora", output=ours, base=base)
    compat.exercised("gguf", quantization=llm.engine.loaded.quantization)


def test_lora_needs_enable_lora_and_no_quantization(llm, compat):
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS[0], lora_request=lora("a", 1, 1), use_tqdm=False)
    from nanollmserve import EngineConfig

    with pytest.raises(UserError, match="--quantization") as error:
        EngineConfig(enable_lora=True, quantization="int8")
    compat.refused("int8", "lora", str(error.value))


def _adapter_of_another_model(out_dir):
    """A LoRA of a tiny random Llama (hidden size 64): its matrices do not fit SmolLM2."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = AutoModelForCausalLM.from_config(config)
    lora_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora_config).save_pretrained(out_dir)
    return out_dir


def test_bench_lora_reports_mixed_and_base_only():
    from bench_cli import run_bench

    args = ["lora", "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--rounds", "1"]
    report = run_bench(*args, "--num-adapters", "3", "--dtype", "float32", "--num-kv-blocks", "64")
    results = report["results"]
    assert results["mixed"]["output_tokens"] == results["base_only"]["output_tokens"] == 16
    assert report["num_adapters"] == 3 and report["ratios"]["mixed_vs_base_only"] > 0
