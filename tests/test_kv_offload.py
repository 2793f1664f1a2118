"""KV offload (`kv_offload_dir`), offline: an engine finds the prefix blocks an earlier engine
wrote, gives the same greedy tokens as a cold run, and never loads a block that is corrupt,
truncated, misnamed, or from another weight format, dtype, block size or LoRA adapter; the
directory stays under its byte bound, least recently used blocks going first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from lora_adapters import adapter_dir

from nanollmserve import LoRARequest, SamplingParams
from nanollmserve.config import EngineConfig
from nanollmserve.engine.kv_block_format import deserialize_block
from nanollmserve.errors import UserError
from nanollmserve.kv_store_dir import store_key

pytestmark = pytest.mark.milestone("m25")

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "Once upon a time, " + " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(40))
OTHER_PROMPT = "A list of colours: " + ", ".join(f"shade {i}" for i in range(70))


def run(llm, prompt=PROMPT, params=GREEDY, **kwargs):
    return llm.generate([prompt], params, use_tqdm=False, **kwargs)[0]


def first_run(make_llm, store: Path, prompt=PROMPT, **engine_args):
    """A cold run that fills `store`; the engine is shut down (its writes finished)."""
    llm = make_llm(kv_offload_dir=str(store), **engine_args)
    out = run(llm, prompt)
    llm.shutdown()
    assert out.num_cached_tokens == 0
    return out


def block_files(store: Path) -> dict[tuple[int, ...], Path]:
    """Token ids a block covers -> its file."""
    files = {}
    for path in store.glob("*/*.kvb"):
        header, _ = deserialize_block(bytearray(path.read_bytes()), store_key(store))
        files[header.token_ids] = path
    return files


def wait_for_files(store: Path, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(store.glob("*/*.kvb"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(store.glob("*/*.kvb"))) >= count


def file_of_block(store: Path, prompt_ids: list[int], index: int) -> Path:
    return block_files(store)[tuple(prompt_ids[index * BLOCK : (index + 1) * BLOCK])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the GGUF blocks, native steps
def test_a_new_engine_loads_the_blocks_the_last_one_wrote(make_llm, tmp_path, dtype, compat):
    cold = first_run(make_llm, tmp_path, dtype=dtype)
    full_blocks = (len(cold.prompt_token_ids) - 1) // BLOCK
    assert len(block_files(tmp_path)) >= full_blocks

    reader = make_llm(kv_offload_dir=str(tmp_path), dtype=dtype)
    warm = run(reader)
    assert warm.num_cached_tokens == full_blocks * BLOCK
    compat.exercised("offload", loaded_tokens=warm.num_cached_tokens)
    if dtype == "auto":
        compat.exercised("gguf", quantization=reader.engine.loaded.quantization)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    no_offload = run(make_llm(dtype=dtype))
    assert no_offload.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_a_corrupt_truncated_or_misnamed_block_is_never_loaded_and_is_deleted(make_llm, tmp_path):
    cold = first_run(make_llm, tmp_path)
    ids = cold.prompt_token_ids
    corrupt, truncated, misnamed, tenth = (file_of_block(tmp_path, ids, i) for i in (3, 6, 9, 10))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the K/V payload
    corrupt.write_bytes(data)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    misnamed.write_bytes(tenth.read_bytes())  # an intact block, but not block 9

    # Each engine loads up to the first bad block, deletes it and writes it anew.
    for bad_block in (3, 6, 9):
        llm = make_llm(kv_offload_dir=str(tmp_path))
        out = run(llm)
        llm.shutdown()
        assert out.num_cached_tokens == bad_block * BLOCK
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    for path in tmp_path.glob("*/*.kvb"):
        deserialize_block(bytearray(path.read_bytes()), store_key(tmp_path))  # raises if bad
    assert file_of_block(tmp_path, ids, 3).read_bytes() != bytes(data)
    full = run(make_llm(kv_offload_dir=str(tmp_path)))
    assert full.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "changed",
    [{"dtype": "bfloat16"}, {"dtype": "auto"}, {"block_size": 32}],
    ids=["dtype", "weight-format", "block-size"],
)
def test_blocks_of_another_dtype_weight_format_or_layout_never_load(
    make_llm, tmp_path, changed, compat
):
    first_run(make_llm, tmp_path)
    num_files = len(list(tmp_path.glob("*/*.kvb")))
    other = make_llm(kv_offload_dir=str(tmp_path), **changed)
    out = run(other)
    other.shutdown()  # its own blocks are written
    assert out.num_cached_tokens == 0
    cold = run(make_llm(**changed))
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    # Nothing was deleted for it (the files are valid, just not this engine's).
    assert len(list(tmp_path.glob("*/*.kvb"))) >= num_files
    # What an engine of its kind wrote, the next one of its kind reads.
    reader = make_llm(kv_offload_dir=str(tmp_path), **changed)
    again = run(reader)
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    compat.exercised("offload", loaded_tokens=again.num_cached_tokens)
    if changed == {"dtype": "auto"}:  # the GGUF blocks
        compat.exercised("gguf", quantization=reader.engine.loaded.quantization)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_directory_stays_under_its_bound_least_recently_used_first(make_llm, tmp_path):
    probe = first_run(make_llm, tmp_path / "probe")
    sizes = [p.stat().st_size for p in (tmp_path / "probe").glob("*/*.kvb")]
    num_prompt_blocks = (len(probe.prompt_token_ids) - 1) // BLOCK
    # Room for the first prompt's blocks and two more: the second prompt's evict its first.
    bound = max(sizes) * (num_prompt_blocks + 2)
    store = tmp_path / "store"
    llm = make_llm(kv_offload_dir=str(store), kv_offload_max_bytes=bound)
    run(llm, PROMPT)
    other = run(llm, OTHER_PROMPT)
    llm.shutdown()
    assert sum(p.stat().st_size for p in store.glob("*/*.kvb")) <= bound

    llm = make_llm(kv_offload_dir=str(store), kv_offload_max_bytes=bound)
    num_other_blocks = (len(other.prompt_token_ids) - 1) // BLOCK
    assert run(llm, OTHER_PROMPT).num_cached_tokens == num_other_blocks * BLOCK
    assert run(llm, PROMPT).num_cached_tokens == 0  # its first blocks were the oldest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_blocks_are_kept_apart_by_adapter_and_cache_salt(make_llm, tmp_path, compat):
    lora = LoRARequest("a", 1, str(adapter_dir(seed=1)))
    engine_args = {"enable_lora": True, "max_lora_rank": 8, "kv_offload_dir": str(tmp_path)}
    llm = make_llm(**engine_args)
    with_adapter = run(llm, lora_request=lora)
    salted = run(llm, params=SamplingParams(temperature=0, max_tokens=8, cache_salt="tenant-1"))
    llm.shutdown()
    assert with_adapter.num_cached_tokens == 0 and salted.num_cached_tokens == 0

    llm = make_llm(**engine_args)
    base = run(llm)
    assert base.num_cached_tokens == 0  # the base model finds neither
    again = run(llm, lora_request=lora)
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == with_adapter.outputs[0].token_ids
    compat.exercised("offload", loaded_tokens=again.num_cached_tokens)
    compat.exercised("lora", output=again.outputs[0].token_ids, base=base.outputs[0].token_ids)
    other_salt = SamplingParams(temperature=0, max_tokens=8, cache_salt="tenant-2")
    assert run(llm, params=other_salt).num_cached_tokens == 0


@pytest.mark.timeout(240)
def test_speculative_decoding_reads_the_store_too(make_llm, tmp_path, compat):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    cold = first_run(make_llm, tmp_path, speculative_config=spec)
    reader = make_llm(kv_offload_dir=str(tmp_path), speculative_config=spec)
    warm = run(reader)
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    compat.exercised("offload", loaded_tokens=warm.num_cached_tokens)
    compat.exercised("spec", num_drafts=reader.engine.stats().spec_decode.num_drafts)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"enable_prefix_caching": False}, "prefix caching"),
        ({"runner": "pooling"}, "prefix caching"),
    ],
    ids=["tensor-parallel", "no-prefix-caching", "pooling"],
)
def test_what_it_cannot_extend_is_refused_at_start(tmp_path, args, message, compat):
    with pytest.raises(UserError, match=message) as error:
        EngineConfig(kv_offload_dir=str(tmp_path), **args)
    other = {"tensor_parallel_size": "tp", "runner": "embed"}.get(next(iter(args)))
    if other:  # a pair of the compatibility matrix
        compat.refused(other, "offload", str(error.value))


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf", "1e999", "lots", "", 0, -5])
def test_hostile_byte_bounds_are_refused(tmp_path, size):
    with pytest.raises(UserError, match="kv_offload_max_bytes"):
        EngineConfig(kv_offload_dir=str(tmp_path), kv_offload_max_bytes=size)


def test_a_store_path_that_is_a_file_is_refused(make_llm, tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(UserError, match="kv-offload-dir"):
        make_llm(kv_offload_dir=str(path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_prefix_restart_times_a_prefix_read_from_the_store(tmp_path):
    from bench_cli import run_bench

    result = run_bench(
        "prefix",
        *("--prefix-len", "64", "--suffix-len", "8", "--output-len", "2"),
        *("--num-requests", "2", "--dtype", "float32", "--num-kv-blocks", "128"),
        *("--kv-offload-dir", str(tmp_path), "--restart"),
    )
    assert result["restart"] is True
    assert result["warm_cached_tokens"] == [64, 64]
    assert result["cold_cached_tokens"] == [0, 0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("level", [1, 2])
def test_after_sleep_the_empty_pool_refills_from_the_store(make_llm, tmp_path, level, compat):
    llm = make_llm(kv_offload_dir=str(tmp_path), enable_sleep_mode=True)
    cold = run(llm)
    num_blocks = (len(cold.prompt_token_ids) - 1) // BLOCK
    wait_for_files(tmp_path, num_blocks)  # the writer thread writes them after the step
    llm.sleep(level)  # the pool and its prefix cache are gone (level 2: the weights too)
    compat.exercised("sleep", asleep=llm.engine.sleep_level == level)
    llm.wake_up()
    warm = run(llm)
    assert warm.num_cached_tokens == num_blocks * BLOCK
    compat.exercised("offload", loaded_tokens=warm.num_cached_tokens)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
