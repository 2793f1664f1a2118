"""The first start of a GGUF model converts no dense float32 weights when every linear weight
runs as GGUF blocks; a later start that needs dense weights converts them into the same entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from test_model_loading import write_tiny_gguf
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanollmserve import LLM, SamplingParams
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.model import gguf_cache, resolve_model

pytestmark = pytest.mark.milestone("m22")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three fruits:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(cache))
    return cache


def greedy_tokens(model: str | None = None, prompts=PROMPTS, **engine_args):
    """(token ids per prompt, the loaded model's description) of a fresh LLM."""
    with LLM(model, num_kv_blocks=128, **engine_args) as llm:
        loaded = llm.engine.loaded
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        linear = {
            (m.out_features, m.in_features)
            for name, m in loaded.model.named_modules()
            if isinstance(m, GGUFLinear) and name != "lm_head"
        }
        return tokens, {"quantization": loaded.quantization, "entry": loaded.model_dir}, linear


def float32_tensors(entry: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every float32 tensor in the entry's safetensors files."""
    found = {}
    for path in entry.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (not a dict)
                piece = f.get_slice(name)
                if piece.get_dtype() == "F32":
                    found[f"{path.name}:{name}"] = tuple(piece.get_shape())
    return found


def without_the_block_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a load take the path that existed before: dense weights, then the blocks."""
    monkeypatch.setattr(gguf_cache, "cached_unblocked_tensors", lambda *args: {})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bundled_first_start_writes_no_dense_weights_and_answers_as_before(
    isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, loaded, linear_shapes = greedy_tokens()
    entry = loaded["entry"]
    assert loaded["quantization"] == "gguf" and entry.parent == isolated_cache / "gguf"
    names = {p.name for p in entry.iterdir()}
    assert "model.safetensors" not in names
    assert not any(name.startswith("nanollmserve-fused-") for name in names)
    blocks, unblocked = gguf_cache.GGUF_BLOCKS_VERSION, gguf_cache.UNBLOCKED_VERSION
    written_parts = {
        f"gguf-blocks-v{blocks}.safetensors",
        f"gguf-unblocked-v{unblocked}.safetensors",
    }
    assert written_parts <= names
    # No float32 copy of a linear weight, nor of the tied Q8_0 embedding table (looked up in
    # the output projection's blocks): the float32 tensors are the norms.
    written = float32_tensors(entry)
    assert written and not any("_proj" in name for name in written)
    assert not set(written.values()) & linear_shapes
    assert not any("embed_tokens" in name for name in written)
    assert all(len(shape) == 1 for shape in written.values())
    assert json.loads((entry / "nanollmserve_gguf.json").read_text())["version"] == 2

    # The path that existed before (dense weights, then the blocks) gives the same tokens.
    with monkeypatch.context() as patch:
        without_the_block_model(patch)
        before, before_loaded, _ = greedy_tokens()
    assert before_loaded["quantization"] == "gguf" and before_loaded["entry"] == entry
    assert tokens == before
    assert (entry / "model.safetensors").is_file()  # that load needed the dense weights


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dense_start_after_the_first_one_converts_the_dense_weights(
    isolated_cache: Path,
) -> None:
    _, loaded, _ = greedy_tokens(prompts=PROMPTS[:1])
    assert not (loaded["entry"] / "model.safetensors").exists()
    tokens, dense, _ = greedy_tokens(prompts=PROMPTS[:1], quantization="none")
    assert dense["quantization"] is None and dense["entry"] == loaded["entry"]
    assert (loaded["entry"] / "model.safetensors").is_file()
    assert len(tokens[0]) == GREEDY.max_tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("architecture", "block_type", "tied"),
    [("llama", "Q4_0", True), ("qwen2", "Q8_0", False), ("qwen3", "Q8_0", True)],
)
def test_a_quantized_gguf_runs_its_blocks_without_dense_weights(
    tmp_path: Path,
    isolated_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    architecture: str,
    block_type: str,
    tied: bool,
) -> None:
    """Biases (qwen2), q/k norms (qwen3), an untied output projection, Q4_0 and Q8_0 blocks:
    the model built on the blocks and the other tensors answers as the dense load did."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", 3, architecture, block_type, tied)
    prompts = ["the", "hello there"]
    tokens, loaded, _ = greedy_tokens(str(path), prompts)
    assert loaded["quantization"] == "gguf"
    assert not (loaded["entry"] / "model.safetensors").exists()
    with monkeypatch.context() as patch:
        without_the_block_model(patch)
        before, _, _ = greedy_tokens(str(path), prompts)
    assert tokens == before


def mapped_file(address: int) -> str | None:
    """The file this process maps at `address` (/proc/self/maps), None for anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, _, _, *path = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return path[0] if path else None
    return None


def test_a_later_start_runs_the_legacy_blocks_from_the_mapped_cache_file(
    tmp_path: Path, isolated_cache: Path
) -> None:
    """The weights are in memory once: every linear layer's tiles are the cache file's mapped
    pages, not a copy tiled at load (which doubled the peak RSS of a 1.2B Q8_0 load)."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", 3, "llama", "Q8_0", False)
    for _ in range(2):  # the first start writes the cache; the second only maps it
        with LLM(str(path), num_kv_blocks=16) as llm:
            layers = [m for m in llm.engine.loaded.model.modules() if isinstance(m, GGUFLinear)]
            where = {mapped_file(m.tiles.data_ptr()) for m in layers}
    blocks_file = f"gguf-blocks-v{gguf_cache.GGUF_BLOCKS_VERSION}.safetensors"
    assert layers and len(where) == 1 and where.pop().endswith(blocks_file)


@pytest.mark.parametrize(
    ("architecture", "name"),
    [("llama", "tiny"), ("qwen2", "tiny"), ("qwen3", "tiny"), ("llama", "mistral")],
)
def test_the_model_files_are_what_transformers_reads_from_the_gguf(
    tmp_path: Path, isolated_cache: Path, architecture: str, name: str
) -> None:
    """config.json and the tokenizer files, written without transformers' GGUF model loading,
    are what `AutoConfig`/`AutoTokenizer` with `gguf_file=` give."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", architecture=architecture, name=name)
    entry = resolve_model(str(path)).path
    ours = AutoConfig.from_pretrained(entry).to_dict()
    reference_config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    reference = reference_config.to_dict()
    for key in ("_name_or_path", "architectures", "dtype", "transformers_version"):
        ours.pop(key, None), reference.pop(key, None)
    assert ours == reference
    generation = GenerationConfig.from_pretrained(entry)
    expected = GenerationConfig.from_model_config(reference_config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(generation, key) == getattr(expected, key), key
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name).save_pretrained(tmp_path / "ref")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (entry / file).read_bytes() == (tmp_path / "ref" / file).read_bytes(), file


@pytest.mark.timeout(300)
def test_the_hf_baseline_of_a_first_start_gets_the_dense_weights_it_needs(
    tmp_path: Path, isolated_cache: Path
) -> None:
    """`bench throughput` / `bench latency` load transformers from the engine's model dir; on
    a fresh machine a GGUF entry has no model.safetensors yet (it used to raise OSError)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanollmserve.bench.hf_baselines import load_hf_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", block_type="Q8_0")
    _, loaded, _ = greedy_tokens(str(path), prompts=PROMPTS[:1])
    assert not (loaded["entry"] / "model.safetensors").exists()
    baseline = load_hf_model(loaded["entry"], torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    with torch.inference_mode():
        torch.testing.assert_close(baseline(ids).logits, reference(ids).logits)


@pytest.mark.timeout(60)
def test_writing_a_part_removes_its_older_versions_and_nothing_else(tmp_path: Path) -> None:
    """An upgrade that bumps a part's version rewrites it once; the older files of that part
    (each as large as the weights) go, the other parts' files and newer versions stay."""
    import torch

    current = gguf_cache.GGUF_BLOCKS_VERSION
    kept = [
        f"gguf-unblocked-v{gguf_cache.UNBLOCKED_VERSION}.safetensors",
        f"gguf-blocks-v{current + 1}.safetensors",
        "model.safetensors",
        "config.json",
    ]
    older = [f"gguf-blocks-v{v}.safetensors" for v in range(1, current)]
    for name in kept + older:
        (tmp_path / name).write_bytes(b"x")
    path = tmp_path / f"gguf-blocks-v{current}.safetensors"
    tensors, _ = gguf_cache._cached_tensors(
        path, "test", lambda: ({"w": torch.ones(2)}, {"gguf_file": "x.gguf"})
    )
    assert tensors["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, path.name])
