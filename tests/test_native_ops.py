"""The typed boundary to the C library (`native/ops.py`): every op refuses tensors of the
wrong shape, dtype or device with a ValueError before any native code runs, keeps its
scratch memory in a workspace reused across calls, and a library whose constants or struct
layouts differ from the Python side's is refused at load."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from nanollmserve.native import abi, ops

pytestmark = pytest.mark.milestone("m22")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
META = torch.device("meta")


@pytest.fixture
def no_native_code(monkeypatch):
    """Any op that gets as far as the library fails the test."""

    def library():
        raise AssertionError("native code was reached")

    monkeypatch.setattr(ops, "_library", library)


@pytest.fixture
def kernels():
    if ops.kernels_unavailable_reason():
        pytest.skip(ops.kernels_unavailable_reason())


@pytest.fixture
def reload_kernels(monkeypatch, kernels):
    """Loads the library afresh in the test (after its monkeypatches) and again after it."""
    ops._load.cache_clear()
    yield ops
    ops._load.cache_clear()


def q4_tiles(out: int, cols: int) -> torch.Tensor:
    from test_gguf_quantization import random_block_rows

    return random_block_rows(out, cols).tiled()


def attention_inputs(lengths=(5, 9, 1), num_blocks=12):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(len(lengths), HEADS, DIM, generator=generator)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    width = -(-max(lengths) // BLOCK)
    tables = torch.randperm(num_blocks, generator=generator)[: len(lengths) * width]
    return q, k_cache, v_cache, tables.view(len(lengths), width), torch.tensor(lengths)


def draw_inputs(rows: int = 3, vocab: int = 50):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    return (
        x,
        torch.softmax(x, dim=-1),
        torch.full((rows,), 5, dtype=torch.int64),
        torch.full((rows,), 0.9),
        torch.zeros(rows),
        torch.rand(rows, dtype=torch.float64),
    )


def replaced(inputs: tuple, index: int, value) -> tuple:
    return (*inputs[:index], value, *inputs[index + 1 :])


@pytest.mark.parametrize(
    "change",
    [
        "x 1-D",
        "x int64",
        "x on meta",
        "x width not whole blocks",
        "tiles float32",
        "tiles for other outputs",
        "tiles on meta",
        "tiles not contiguous",
        "unknown kind",
        "bias float64",
        "bias wrong length",
    ],
)
def test_gguf_matmul_refuses_bad_inputs_before_native_code(change, no_native_code):
    tiles, x, bias, kind, out = q4_tiles(48, 64), torch.randn(3, 64), torch.randn(48), 4, 48
    match change:
        case "x 1-D":
            x = x[0]
        case "x int64":
            x = x.long()
        case "x on meta":
            x = x.to(META)
        case "x width not whole blocks":
            x = torch.randn(3, 48)
        case "tiles float32":
            tiles = tiles.float()
        case "tiles for other outputs":
            out = 80
        case "tiles on meta":
            tiles = tiles.to(META)
        case "tiles not contiguous":
            tiles = torch.cat([tiles, tiles], dim=1)[:, ::2]
        case "unknown kind":
            kind = 5
        case "bias float64":
            bias = bias.double()
        case "bias wrong length":
            bias = torch.randn(47)
    with pytest.raises(ValueError, match="GGUF matmul"):
        ops.gguf_matmul(kind, tiles, out, x, bias)


@pytest.mark.parametrize(
    "index, change",
    [
        (0, lambda q: q.double()),
        (0, lambda q: q[0]),
        (0, lambda q: q.to(META)),
        (0, lambda q: q.tolist()),
        (0, lambda q: q[:, :5]),  # 5 query heads over 2 KV heads
        (0, lambda q: q[..., :8]),  # head_dim unlike the caches'
        (1, lambda k: k.transpose(0, 1)),  # not the v cache's shape
        (1, lambda k: k[..., :12].contiguous()),  # head_dim not a multiple of 8
        (1, lambda k: k.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)),  # not contiguous
        (2, lambda v: v.to(torch.bfloat16)),
        (2, lambda v: v.to(META)),
        (3, lambda t: t.int()),
        (3, lambda t: t[:2]),  # a row short
        (3, lambda t: t.flatten()),
        (4, lambda lens: lens.float()),
        (4, lambda lens: lens[:, None]),
        (4, lambda lens: lens.to(META)),
        (5, lambda scale: math.nan),
        (5, lambda scale: math.inf),
        (5, lambda scale: 0.0),
        (5, lambda scale: -scale),
    ],
)
def test_paged_decode_attention_refuses_bad_inputs_before_native_code(
    index, change, no_native_code
):
    inputs = (*attention_inputs(), DIM**-0.5)
    with pytest.raises(ValueError, match="native paged decode attention"):
        ops.paged_decode_attention(*replaced(inputs, index, change(inputs[index])))


def test_paged_decode_attention_refuses_a_head_size_past_the_limit(no_native_code):
    big = abi.MAX_HEAD_DIM + 8
    q = torch.randn(1, 2, big)
    cache = torch.randn(2, BLOCK, 1, big)
    with pytest.raises(ValueError, match=f"up to {abi.MAX_HEAD_DIM}"):
        ops.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                   torch.ones(1, dtype=torch.long), 1.0)  # fmt: skip


@pytest.mark.parametrize(
    "index, change",
    [
        (0, lambda x: x.double()),
        (0, lambda x: x[0]),
        (0, lambda x: x.to(META)),
        (0, lambda x: x[:, :0]),  # an empty vocabulary
        (1, lambda p: p[:, :10]),
        (1, lambda p: p.to(torch.float16)),
        (2, lambda k: k.float()),
        (2, lambda k: k[:2]),
        (3, lambda p: p.double()),
        (3, lambda p: p[:, None]),
        (4, lambda m: m.to(META)),
        (5, lambda u: u.float()),
        (5, lambda u: u[:1]),
        (5, lambda u: None),
    ],
)
def test_filtered_draw_refuses_bad_inputs_before_native_code(index, change, no_native_code):
    inputs = draw_inputs()
    with pytest.raises(ValueError, match="native filtered draw"):
        ops.filtered_draw(*replaced(inputs, index, change(inputs[index])))


def native_model(**fields):
    values = dict(hidden=8, vocab=10, max_context=32, block_size=16, num_blocks=4) | fields
    model = abi.NlsModel()
    for name, value in values.items():
        setattr(model, name, value)
    return model


@pytest.mark.parametrize(
    "change",
    [
        "not the model structure",
        "tokens int32",
        "no tokens",
        "a position short",
        "logit row past the tokens",
        "sequence index past the tables",
        "negative position",
        "past max_context",
        "table short of the last token",
        "a sequence's blocks short of its token",
        "token past the vocabulary",
        "block outside the pool",
        "a block before the token's outside the pool",
        "a block id below -1",
        "table on meta",
        "table 1-dimensional",
        "out float64",
        "out too small",
    ],
)
def test_decode_step_refuses_bad_inputs_before_native_code(change, no_native_code):
    model, tokens, positions = native_model(), torch.tensor([1, 2, 3]), torch.tensor([15, 16, 3])
    seqs, table = torch.tensor([0, 0, 1]), torch.tensor([[0, 1], [2, 3]])
    rows, out = torch.tensor([1, 2]), torch.empty(2, 8)
    match change:
        case "not the model structure":
            model = ctypes.c_int64(0)
        case "tokens int32":
            tokens = tokens.int()
        case "no tokens":
            tokens = tokens[:0]
        case "a position short":
            positions = positions[:2]
        case "logit row past the tokens":
            rows = torch.tensor([1, 3])
        case "sequence index past the tables":
            seqs = torch.tensor([0, 0, 2])
        case "negative position":
            positions = torch.tensor([15, 16, -1])
        case "past max_context":
            positions = torch.tensor([30, 31, 32])
        case "table short of the last token":
            table = table[:, :1]
        case "a sequence's blocks short of its token":
            table = torch.tensor([[0, -1], [2, 3]])  # position 16 of sequence 0: block 2
        case "a block before the token's outside the pool":
            table = torch.tensor([[4, 1], [2, 3]])  # sequence 0's tokens attend through it
        case "a block id below -1":
            table = torch.tensor([[0, 1], [-2, 3]])
        case "token past the vocabulary":
            tokens = torch.tensor([1, 2, 10])
        case "block outside the pool":
            table = torch.tensor([[0, 1], [4, 0]])
        case "table on meta":
            table = table.to(META)
        case "table 1-dimensional":
            table = table[0]
        case "out float64":
            out = out.double()
        case "out too small":
            out = torch.empty(1, 7)
    with pytest.raises(ValueError, match="native decode step"):
        ops.decode_step(model, tokens, positions, seqs, table, rows, out)


def test_decode_step_passes_valid_inputs_to_native_code(no_native_code):
    """The control of the test above: its inputs unchanged pass every check."""
    model, tokens, positions = native_model(), torch.tensor([1, 2, 3]), torch.tensor([15, 16, 3])
    seqs, table = torch.tensor([0, 0, 1]), torch.tensor([[0, 1], [2, 3]])
    rows, out = torch.tensor([1, 2]), torch.empty(2, 8)
    with pytest.raises(AssertionError, match="native code was reached"):
        ops.decode_step(model, tokens, positions, seqs, table, rows, out)


def reference_attention(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    out = torch.empty_like(q)
    for s, length in enumerate(lens.tolist()):
        slots = torch.tensor(
            [int(tables[s, t // BLOCK]) * BLOCK + t % BLOCK for t in range(length)]
        )
        k = k_cache.view(-1, KV_HEADS, DIM)[slots].transpose(0, 1)
        v = v_cache.view(-1, KV_HEADS, DIM)[slots].transpose(0, 1)
        grouped = q[s].view(KV_HEADS, HEADS // KV_HEADS, DIM)
        out[s] = F.scaled_dot_product_attention(grouped, k, v, scale=scale).reshape(HEADS, DIM)
    return out


def test_paged_decode_attention_merges_the_chunks_of_long_contexts(kernels):
    """A context's keys attend in chunks (64 keys, more past 1,024) whose partial softmaxes
    merge: one key, exactly one chunk, one key past it, several, and chunks of 128 all equal a
    dense reference."""
    lengths = (1, 64, 65, 200, 1500)
    width = -(-max(lengths) // BLOCK)
    inputs = (*attention_inputs(lengths=lengths, num_blocks=len(lengths) * width), DIM**-0.5)
    assert torch.allclose(
        ops.paged_decode_attention(*inputs), reference_attention(*inputs), atol=1e-5
    )


@pytest.fixture
def three_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


def test_each_op_reuses_its_workspace_for_equal_or_smaller_calls(kernels, three_threads):
    """The second and every smaller call run in the same buffer (same data_ptr), each
    thread in its own slice of it (the attention matches a dense reference on 3 threads)."""
    tiles = q4_tiles(48, 64)
    ops.gguf_matmul(4, tiles, 48, torch.randn(8, 64), None)
    matmul_buffer = ops.MATMUL_WORKSPACE.get(0).data_ptr()
    inputs = (*attention_inputs(lengths=(9, 5, 12, 3)), DIM**-0.5)
    ops.paged_decode_attention(*inputs)
    attention_buffer = ops.ATTENTION_WORKSPACE.get(0).data_ptr()
    ops.filtered_draw(*draw_inputs(rows=4))
    draw_buffer = ops.DRAW_WORKSPACE.get(0).data_ptr()
    for _ in range(2):
        ops.gguf_matmul(4, tiles, 48, torch.randn(8, 64), None)
        ops.gguf_matmul(4, tiles, 48, torch.randn(2, 64), None)
        smaller = (*attention_inputs(lengths=(4, 1)), DIM**-0.5)
        assert torch.allclose(
            ops.paged_decode_attention(*smaller), reference_attention(*smaller), atol=1e-5
        )
        assert torch.allclose(
            ops.paged_decode_attention(*inputs), reference_attention(*inputs), atol=1e-5
        )
        tokens = ops.filtered_draw(*draw_inputs(rows=2))
        assert ((tokens >= 0) & (tokens < 50)).all()
    assert ops.MATMUL_WORKSPACE.get(0).data_ptr() == matmul_buffer
    assert ops.ATTENTION_WORKSPACE.get(0).data_ptr() == attention_buffer
    assert ops.DRAW_WORKSPACE.get(0).data_ptr() == draw_buffer


def test_the_c_statuses_are_exceptions_that_say_what_was_out_of_range(kernels):
    q, k_cache, v_cache, tables, lens = attention_inputs()
    with pytest.raises(ValueError, match="names a block outside the KV pool"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables + 100, lens, 1.0)
    with pytest.raises(ValueError, match="longer than its block table"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens + 100, 1.0)


def test_the_library_matches_the_python_side(kernels):
    values = abi.library_abi(ops.load_kernels())
    assert values["sizeof(nls_model)"] > 0 and values["MAX_HEAD_DIM"] == abi.MAX_HEAD_DIM
    assert abi.abi_differences(values, abi.expected_abi()) == []


@pytest.mark.parametrize(
    "module, name, value, named",
    [
        ("nanollmserve.native.abi", "TILE_OUTPUTS", 32, "TILE: library 16, Python 32"),
        ("nanollmserve.native.abi", "NLS_BAD_SHAPE", -7, "NLS_BAD_SHAPE"),
        ("nanollmserve.native.abi", "MAX_HEAD_DIM", 512, "MAX_HEAD_DIM"),
    ],
)
def test_a_library_whose_constants_differ_is_refused(
    module, name, value, named, monkeypatch, reload_kernels
):
    monkeypatch.setattr(f"{module}.{name}", value)
    assert reload_kernels.load_kernels() is None
    reason = reload_kernels.kernels_unavailable_reason()
    assert "does not match the Python side" in reason and named in reason
    assert not ops.available()


def test_a_struct_layout_that_differs_is_refused(monkeypatch, reload_kernels):
    class ShortModel(ctypes.Structure):
        _fields_ = abi.NlsModel._fields_[:-1]

    monkeypatch.setattr(abi, "NlsModel", ShortModel)
    assert reload_kernels.load_kernels() is None
    reason = reload_kernels.kernels_unavailable_reason()
    assert "sizeof(nls_model)" in reason and "nls_model.layers" in reason


def test_a_library_without_an_entry_point_is_refused():
    from types import SimpleNamespace

    from nanollmserve.native.build import NativeUnavailable

    with pytest.raises(NativeUnavailable, match="has no nls_"):
        ops.bind(SimpleNamespace())
