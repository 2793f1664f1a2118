"""The first-ever start (issue 23, m22): on an empty cache `serve` logs each phase of the
conversion (config and tokenizer, native build, block layout, the other tensors, model,
tokenizer) and reaches ready; a second start on the same cache converts and builds nothing.
The GGUF blocks read from the memory-mapped file are the weights transformers dequantizes
from it, for every block type and architecture the layout handles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from live_server import LiveServer
from test_model_loading import write_tiny_gguf

from nanollmserve.model import ModelConfig, load_model, resolve_model
from nanollmserve.model.gguf_blocks import read_gguf_blocks
from nanollmserve.native.abi import KIND_Q4, KIND_Q8

pytestmark = pytest.mark.milestone("m22")

FIRST_START_PHASES = [
    r"first start with SmolLM2-135M-Instruct\.Q4_1\.gguf: converting it into the cache once",
    r"converted the config and tokenizer of .* in \d+\.\d s",
    r"laying out the quantized blocks into gguf-blocks-v\d+\.safetensors: \d+\.\d s",
    r"dequantizing the tensors besides the blocks into .*: \d+\.\d s",
    r"loaded bundled GGUF .*, converted into the cache at .* in \d+\.\d s",
    r"loaded the tokenizer \(\w+\) in \d+\.\d s",
    r"nanollmserve ready: .* quantization=gguf .* ready_in=\d+\.\ds",
]
"""The main thread's progress lines of a first start, in order."""
NATIVE_BUILD = [
    r"building the native kernels \(\w+\) for this CPU",
    r"built the native kernels \(\w+\) in \d+\.\d s",
]
"""The background build's lines, once each (the load waits for that build, never starts one)."""
CONVERSION = r"first start with|converted the|laying out|dequantizing|building the native"


def served_log(cache: Path) -> str:
    """The log of a default `serve` on `cache` that answered one completion."""
    server = LiveServer.start("--dtype", "auto", env={"NANOLLMSERVE_CACHE": str(cache)})
    try:
        completion = server.openai().completions.create(
            model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4
        )
        assert completion.choices[0].text
    finally:
        server.stop()
    return server.log()


def line_positions(log: str, patterns: list[str]) -> list[int]:
    """Where each pattern's first match starts in `log` (a failure names the missing one)."""
    positions = []
    for pattern in patterns:
        found = re.search(pattern, log)
        assert found, f"no log line matches {pattern!r}:\n{log}"
        positions.append(found.start())
    return positions


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_first_start_logs_each_phase_and_a_second_start_uses_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = served_log(cache)
    positions = line_positions(first, FIRST_START_PHASES)
    assert positions == sorted(positions), first
    building, built = line_positions(first, NATIVE_BUILD)
    assert building < built
    assert all(len(re.findall(pattern, first)) == 1 for pattern in NATIVE_BUILD), first
    entry = next((cache / "gguf").iterdir())
    assert not (entry / "model.safetensors").exists()  # no dense float32 conversion

    second = served_log(cache)
    assert not re.search(CONVERSION, second), second
    line_positions(second, [r"loaded bundled GGUF .*, from the cache at ", r"nanollmserve ready"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("architecture", "block_type", "tied"),
    [("llama", "Q4_0", True), ("llama", "Q4_1", False), ("qwen2", "Q8_0", False)],
)
def test_the_blocks_read_from_the_mapped_file_are_the_dequantized_weights(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    architecture: str,
    block_type: str,
    tied: bool,
) -> None:
    """Every fused weight (llama.cpp's q/k row order undone for llama) and an untied output
    projection dequantize bit for bit to what transformers makes of the same file (the tied
    Q8_0 embedding table as output projection: test_gguf_quantization, bundled model)."""
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", 5, architecture, block_type, tied)
    entry = resolve_model(str(path)).path
    config = ModelConfig.from_pretrained(entry)
    dense = load_model(entry, config, torch.float32, torch.device("cpu")).state_dict()
    dense.setdefault("lm_head.weight", dense["model.embed_tokens.weight"])
    blocks = read_gguf_blocks(path, config)
    linear = {name for name in dense if name.endswith("_proj.weight")}
    assert blocks.keys() == linear | (set() if tied else {"lm_head.weight"})  # F32 embedding
    kind = KIND_Q8 if block_type == "Q8_0" else KIND_Q4
    for name, rows in blocks.items():
        if name != "lm_head.weight":
            assert rows.kind == kind, name
        assert torch.equal(rows.dequantize(), dense[name]), name
