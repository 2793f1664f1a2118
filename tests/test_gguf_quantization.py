"""`--quantization gguf`: the GGUF file's own blocks, run through the native block kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve import SamplingParams
from nanollmserve.errors import UserError
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.model.gguf_blocks import BlockRows, read_gguf_blocks
from nanollmserve.model.gguf_cache import cache_root
from nanollmserve.model.source import bundled_gguf_path
from nanollmserve.native.abi import KIND_Q4, KIND_Q8

pytestmark = pytest.mark.milestone("m17")

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain gravity in one sentence.",
]


def random_block_rows(rows: int, cols: int, kind: int = KIND_Q4, seed: int = 0) -> BlockRows:
    """Random blocks in the kernels' row layout (Q4: codes, d, m; Q8: codes, d)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = (rng.random((rows, nb)) * 0.05).astype(np.float16).view(np.uint8).reshape(rows, -1)
    if kind == KIND_Q8:
        codes = rng.integers(-128, 128, (rows, cols), dtype=np.int8).view(np.uint8)
        return BlockRows(kind, torch.from_numpy(np.concatenate([codes, d], axis=1)))
    codes = rng.integers(0, 256, (rows, nb * 16), dtype=np.uint8)
    m = (-rng.random((rows, nb)) * 0.4).astype(np.float16).view(np.uint8).reshape(rows, -1)
    return BlockRows(kind, torch.from_numpy(np.concatenate([codes, d, m], axis=1)))


@pytest.mark.parametrize("cols", [160, 352])  # 5 and 11 blocks a row
@pytest.mark.parametrize("out", [96, 37])  # whole tiles of 16 outputs, and a padded last tile
@pytest.mark.parametrize("kind", [KIND_Q4, KIND_Q8])
@pytest.mark.parametrize("rows", [1, 2, 3, 24, 25, 40, 65])
def test_gguf_linear_computes_the_blocks_weights_at_every_step_size(kind, rows, cols, out):
    blocks = random_block_rows(out, cols, kind)
    weight = blocks.dequantize()
    bias = torch.randn(out)
    layer = GGUFLinear(blocks, bias, out, cols)
    assert not any(
        p.dtype.is_floating_point and p.numel() == weight.numel() for p in layer.parameters()
    )
    x = torch.randn(rows, cols)
    x[0, 7] = 40.0  # an outlier: its block's other activations keep 15 bits below it
    expected = F.linear(x.double(), weight.double(), bias.double()).float()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    if kind == KIND_Q4:  # the native kernel, activations rounded to int16 per block of 32
        assert (got - expected).abs().max() / expected.abs().max() < 2e-4
    else:  # Q8_0: then to int8 per block (decision 48), its C twin's numbers to the bit
        from nanollmserve.native import ops

        assert torch.equal(got, ops.q8_matmul_reference(layer.tiles, out, x) + bias)
        assert (got - expected).abs().max() / expected.abs().max() < 4e-2


def test_the_avx2_build_computes_what_the_widest_build_does(monkeypatch):
    """`NANOLLMSERVE_CPU_ISA=avx2` forces the fallback build; both ISA levels' kernels give the
    same products (integer sums are exact; only float rounding of the scaling differs, and for
    Q8_0's int8 kernel not even that)."""
    import ctypes

    from nanollmserve.native.build import ISA_ENV, build_library, isa_level

    widest = isa_level()
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert isa_level() == "avx2"
    libraries = {level: ctypes.CDLL(str(build_library(level))) for level in {"avx2", widest}}
    for kind in (KIND_Q4, KIND_Q8):
        results = _at_each_level(libraries, kind)
        if kind == KIND_Q8:  # int8 activations per block: the same integers and float steps
            assert torch.equal(results["avx2"], results[widest])


def _at_each_level(libraries, kind):
    import ctypes

    blocks = random_block_rows(48, 160, kind)
    tiles = blocks.tiled()
    x = torch.randn(5, 160)
    results = {}
    for level, library in libraries.items():
        library.nls_gguf_matmul_workspace_bytes.restype = ctypes.c_int64
        size = library.nls_gguf_matmul_workspace_bytes(ctypes.c_int64(160), ctypes.c_int64(5), 2)
        workspace = torch.empty(size, dtype=torch.uint8)
        y = torch.empty(5, 48)
        status = library.nls_gguf_matmul(
            kind, ctypes.c_void_p(tiles.data_ptr()), ctypes.c_int64(48), ctypes.c_int64(160),
            ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(5), None, 0,
            ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_int64(size), 2,
        )  # fmt: skip
        assert status == 0
        results[level] = y
    expected = F.linear(x.double(), blocks.dequantize().double()).float()
    for y in results.values():
        assert (y - expected).abs().max() / expected.abs().max() < (
            2e-4 if kind == KIND_Q4 else 4e-2
        )
    return results


def _raw_matmul(library, tiles, x, out, kind):
    import ctypes

    rows, cols = x.shape
    library.nls_gguf_matmul_workspace_bytes.restype = ctypes.c_int64
    size = library.nls_gguf_matmul_workspace_bytes(ctypes.c_int64(cols), ctypes.c_int64(rows), 2)
    workspace = torch.empty(size, dtype=torch.uint8)
    y = torch.empty(rows, out)
    status = library.nls_gguf_matmul(
        kind, ctypes.c_void_p(tiles.data_ptr()), ctypes.c_int64(out), ctypes.c_int64(cols),
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(rows), None, 0, ctypes.c_void_p(y.data_ptr()),
        ctypes.c_void_p(workspace.data_ptr()), ctypes.c_int64(size), 2,
    )  # fmt: skip
    assert status == 0
    return y


@pytest.mark.parametrize("kind", [KIND_Q4, KIND_Q8])
def test_the_amx_kernel_gives_the_vector_kernels_numbers_bit_for_bit(kind):
    """On a CPU with AMX, steps of 8+ rows run on int8 tiles (each int16 activation split into
    a high and a low byte): the integer block sums are the same, and so are the floats made of
    them, so a request's tokens do not depend on which kernel its step ran."""
    import ctypes

    from nanollmserve.native.build import build_library, runnable_levels

    if "amx" not in runnable_levels():
        pytest.skip("this CPU has no AMX int8")
    amx = ctypes.CDLL(str(build_library("amx")))
    if amx.nls_amx_init() != 0:
        pytest.skip("the kernel does not grant AMX tile state")
    vector = ctypes.CDLL(str(build_library("avx512")))
    for out, cols, rows in [(37, 64, 8), (96, 352, 17), (48, 1536, 40)]:
        tiles = random_block_rows(out, cols, kind).tiled()
        x = torch.randn(rows, cols)
        x[0, 3] = -50.0
        assert torch.equal(
            _raw_matmul(amx, tiles, x, out, kind), _raw_matmul(vector, tiles, x, out, kind)
        )


def test_an_isa_level_the_cpu_lacks_is_refused(monkeypatch):
    from nanollmserve.native.build import ISA_ENV, NativeUnavailable, isa_level

    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(NativeUnavailable, match="choose one of"):
        isa_level()


def test_q4_0_blocks_run_as_q4_1_with_m_minus_8d():
    from nanollmserve.model.gguf_blocks import _block_rows

    rng = np.random.default_rng(1)
    d = (rng.random((4, 2)) * 0.1).astype(np.float16)
    codes = rng.integers(0, 256, (4, 2, 16), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(4, 2, 2), codes], axis=-1).reshape(4, -1)
    blocks = _block_rows(raw, "Q4_0")
    nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(np.float32)
    expected = (d.astype(np.float32)[..., None] * (nibbles - 8)).reshape(4, 64)
    assert blocks.kind == KIND_Q4
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


def test_the_file_blocks_are_the_weights_of_the_converted_checkpoint(make_llm):
    """Nothing is re-quantized: the blocks dequantize bit for bit to what transformers made of
    the same file (q/k row order of llama.cpp undone, q/k/v and gate/up fused; the tied output
    projection is the Q8_0 embedding table)."""
    llm = make_llm(dtype="float32")
    weights = llm.engine.loaded.model.state_dict()
    blocks = read_gguf_blocks(bundled_gguf_path(), llm.engine.loaded.model_config)
    assert len(blocks) == 30 * 4 + 1  # qkv, o, gate_up, down of every layer, and the lm_head
    assert blocks["lm_head.weight"].kind == KIND_Q8
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), weights[name]), name


def test_the_bundled_model_answers_like_float32_with_gguf_blocks(make_llm):
    plain = make_llm(dtype="float32")
    gguf = make_llm(quantization="gguf")
    model = gguf.engine.loaded.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == 121
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.kind == KIND_Q8
    # The Q8_0 output projection keeps int16 activations (decision 48): with int8 ones this
    # chat's first answer was "L'Étoile, la Marseillaise, ..." instead of Paris.
    assert model.lm_head.int16
    params = SamplingParams(temperature=0.0, max_tokens=32)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    expected = [list(o.outputs[0].token_ids) for o in plain.chat(chats, params)]
    batched = [o.outputs[0] for o in gguf.chat(chats, params)]
    single = [gguf.chat([chat], params)[0].outputs[0] for chat in chats]
    assert "Paris" in batched[0].text
    # int16 activations keep the float32 answers token for token (the int4 kernel's bfloat16
    # activations flipped a late near-tie on one of these chats).
    assert [list(o.token_ids) for o in batched] == expected
    assert [list(o.token_ids) for o in single] == expected
    assert list((cache_root() / "gguf").glob("*/gguf-blocks-v*.safetensors")), "kept in the cache"


def test_gguf_quantization_needs_a_gguf_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nanollmserve.config import EngineConfig
    from nanollmserve.engine.model_loading import load_engine_model

    config = LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="needs|GGUF file's blocks"):
        load_engine_model(EngineConfig(model=str(tmp_path), quantization="gguf", dtype="float32"))


def test_gguf_blocks_are_the_default_for_a_gguf_model_with_dtype_auto(make_llm):
    default = make_llm(dtype="auto")
    assert default.engine.loaded.quantization == "gguf"
    off = make_llm(dtype="auto", quantization="none")
    assert off.engine.loaded.quantization is None
    assert any(isinstance(m, nn.Linear) for m in off.engine.loaded.model.modules())
    # An explicit --dtype asks for the dequantized weights in that dtype (today's behaviour).
    assert make_llm(dtype="float32").engine.loaded.quantization is None
