"""The input embedding read from the GGUF file's own blocks (m25, issue 25: the bundled
model's tied Q8_0 table; m31, issue 40: every type the kernels run, tied or not, such as a
Q4_K_M file's untied Q4_K table): with the weights in GGUF blocks (the default) no float32
embedding table is kept or cached; each looked-up row is the dequantized table's row bit for
bit, in the PyTorch forward and in the native step, so the answers do not move. The
dequantized weights (`--quantization none`, `--dtype float32`) keep the float32 table.

The tolerance is zero: every kind stands for its weights as products of a float16 and small
integers (below 2^13) plus at most one more such product, so each product is exact in float32
and the one rounding is the add, as in the `gguf` package's dequantization (the oracle).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_kquant_kernels import LEGACY, at_isa, isa_levels, oracle, random_blocks
from test_model_loading import write_tiny_gguf

from nanollmserve import SamplingParams
from nanollmserve.layers.gguf_embedding import GGUFEmbedding
from nanollmserve.model.gguf_blocks import EMBEDDING, _block_rows
from nanollmserve.model.gguf_kquants import KQUANT_TYPES, read_kquant_rows
from nanollmserve.native.abi import KIND_Q8, KQ_MIN, KQ_SUPER, KQ_TWO_SC, kquant_kind
from nanollmserve.native.build import isa_level

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(600)]

CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
TYPES = [*LEGACY, *KQUANT_TYPES]
VOCAB, HIDDEN = 40, 512  # two and a half tiles; two 256-wide super-blocks
IDS = torch.tensor([0, 39, 17, 17, 5, 31, 16, 15, 32])  # first, last (padded tile), repeats


def table(type_name: str) -> tuple[GGUFEmbedding, torch.Tensor]:
    """Random valid blocks of `type_name` as the embedding holds them, and the oracle's
    float32 table of the same bytes."""
    raw = random_blocks(type_name, VOCAB, HIDDEN, seed=TYPES.index(type_name))
    if type_name in LEGACY:
        blocks = _block_rows(raw, type_name)
        kind, tiles = blocks.kind, blocks.tiled()
    else:
        rows = read_kquant_rows(type_name, raw, HIDDEN)
        kind, tiles = rows.kind, torch.from_numpy(rows.tiled())
    dequantized = torch.from_numpy(oracle(type_name, raw).astype(np.float32))
    return GGUFEmbedding(kind, tiles, VOCAB, HIDDEN), dequantized


@pytest.mark.milestone("m31")
@pytest.mark.parametrize("type_name", TYPES)
def test_each_types_rows_are_the_oracles_in_pytorch(type_name: str) -> None:
    embedding, dequantized = table(type_name)
    assert torch.equal(embedding(IDS), dequantized[IDS])
    assert torch.equal(embedding(IDS[:6].view(2, 3)), dequantized[IDS[:6]].view(2, 3, -1))


def native_mismatches() -> dict[str, float]:
    """Per type: the largest |native row - oracle row| of the step's lookup (`embed_row`
    through `nls_embed_rows`), in this process's ISA level."""
    from nanollmserve.native import ops

    worst = {}
    for type_name in TYPES:
        embedding, dequantized = table(type_name)
        rows = ops.embed_rows(embedding.kind, embedding.tiles, VOCAB, IDS)
        worst[type_name] = float((rows - dequantized[IDS]).abs().max())
    return worst


@pytest.mark.milestone("m31")
@pytest.mark.parametrize(
    "isa",  # another ISA level's process (~8 s) runs in `make test-slow`
    [pytest.param(i, marks=() if i == isa_level() else pytest.mark.slow) for i in isa_levels()],
)
def test_the_native_lookup_reads_each_types_rows_as_the_oracle(isa: str) -> None:
    """This process's own ISA level here; another in a process of its own (the library is
    chosen once per process)."""
    if isa == isa_level():
        assert native_mismatches() == dict.fromkeys(TYPES, 0.0)
        return
    mismatches = at_isa(isa, "test_gguf_embedding", "native_mismatches", 300)
    assert mismatches == dict.fromkeys(TYPES, 0.0)


def float32_tables(model) -> list[str]:
    """Names of the model's float32 tensors the size of the embedding table."""
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in tensors if t.dtype == torch.float32 and t.numel() == vocab * hidden]


def test_the_gguf_embedding_is_the_q8_blocks_row_for_row_and_no_float32_table_is_kept(make_llm):
    gguf = make_llm(dtype="auto")  # the default: the bundled file's own blocks
    dense = make_llm(dtype="float32")  # the dequantized weights (`--quantization none`)
    model = gguf.engine.loaded.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding) and embedding.kind == KIND_Q8
    assert embedding.tiles.data_ptr() == model.lm_head.tiles.data_ptr(), "the lm_head's blocks"
    assert float32_tables(model) == []
    table = dense.engine.loaded.model.model.embed_tokens.weight
    assert float32_tables(dense.engine.loaded.model) == ["model.embed_tokens.weight"]
    every_id = torch.arange(table.shape[0])
    assert torch.equal(embedding(every_id), table)
    assert torch.equal(embedding(every_id[:6].view(2, 3)), table[:6].view(2, 3, -1))

    declared = model.native_decoder()
    assert declared.embed_kind == KIND_Q8
    assert declared.embed.data_ptr() == model.lm_head.tiles.data_ptr()


def test_native_and_pytorch_steps_read_the_same_rows_and_keep_the_answers(make_llm):
    """Greedy chats through the native step (the default) and through the PyTorch forward
    over the same blocks (the native step off) give the same tokens as the float32 model."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    expected = [list(o.outputs[0].token_ids) for o in make_llm(dtype="float32").chat(chats, params)]

    gguf = make_llm(dtype="auto")
    runner = gguf.engine.model_runner
    assert runner.native_decode is not None
    native = [list(gguf.chat([chat], params)[0].outputs[0].token_ids) for chat in chats]
    assert sum(runner.native_steps.values()) > 0
    runner.native_decode = None  # every step through the PyTorch forward and GGUFEmbedding
    forward = [list(gguf.chat([chat], params)[0].outputs[0].token_ids) for chat in chats]
    assert native == expected
    assert forward == expected


@pytest.mark.milestone("m31")
@pytest.mark.parametrize(
    ("tied", "table_type", "kind"),
    [
        (False, "Q4_K", kquant_kind(4, KQ_SUPER | KQ_MIN)),
        (True, "Q6_K", kquant_kind(6, KQ_SUPER | KQ_TWO_SC)),
    ],
    ids=["untied", "tied"],
)
def test_a_kquant_table_is_looked_up_in_its_blocks(
    tied, table_type, kind, tmp_path, monkeypatch, make_llm
):
    """A Q4_K_M-like file (untied: a Q4_K `token_embd` beside a Q6_K `output`) and a tied
    Q6_K table: the table's blocks are cached with the linear weights (a tied table's are the
    output projection's), no float32 table is written or kept, and greedy answers are the
    dequantized model's, on the native step and through the PyTorch forward. The linear
    weights are Q4_0, whose kernel keeps int16 activations (Q8_0's multiplies int8 ones,
    decision 48, which may flip this random model's near-ties); the output projection keeps
    int16 whatever its type."""
    monkeypatch.setenv("NANOLLMSERVE_CACHE", str(tmp_path / "cache"))
    hidden, inter, vocab = 256, 512, 128
    scale = {"Q4_K": 2e-3, "Q6_K": 1e-3}[table_type]
    raw = {"token_embd.weight": (table_type, random_blocks(table_type, vocab, hidden, 5, scale))}
    if not tied:
        raw["output.weight"] = ("Q6_K", random_blocks("Q6_K", vocab, hidden, 6, 1e-4))
    path = write_tiny_gguf(
        tmp_path / "kquant-table.gguf", tied=tied, hidden=hidden, inter=inter,
        block_type="Q4_0", raw_blocks=raw,
    )  # fmt: skip
    gguf = make_llm(model=str(path), dtype="auto", block_size=16)
    model = gguf.engine.loaded.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding) and embedding.kind == kind
    assert float32_tables(model) == []
    shared = embedding.tiles.data_ptr() == model.lm_head.tiles.data_ptr()
    assert shared == tied, "a tied table is the lm_head's blocks, an untied one its own"
    declared = model.native_decoder()
    assert declared.embed_kind == kind
    assert declared.embed.data_ptr() == embedding.tiles.data_ptr()
    (entry,) = (tmp_path / "cache" / "gguf").glob("kquant-table-*")
    with safe_open(next(entry.glob("gguf-blocks-v*.safetensors")), "pt") as f:
        assert (EMBEDDING in f.keys()) == (not tied)  # noqa: SIM118 (not a dict)
    with safe_open(next(entry.glob("gguf-unblocked-v*.safetensors")), "pt") as f:
        assert EMBEDDING not in f.keys()  # noqa: SIM118

    dense = make_llm(model=str(path), dtype="float32", quantization="none", block_size=16)
    table = dense.engine.loaded.model.model.embed_tokens.weight
    assert torch.equal(embedding(torch.arange(vocab)), table)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 11, 13]]
    expected = [list(o.outputs[0].token_ids) for o in dense.generate(prompts, params)]
    runner = gguf.engine.model_runner
    assert runner.native_decode is not None
    native = [list(o.outputs[0].token_ids) for o in gguf.generate(prompts, params)]
    assert sum(runner.native_steps.values()) > 0
    runner.native_decode = None  # every step through the PyTorch forward and GGUFEmbedding
    forward = [list(o.outputs[0].token_ids) for o in gguf.generate(prompts, params)]
    assert native == expected
    assert forward == expected
