"""The KV offload store shared by two live engines (prefill/decode disaggregation's
transport), offline: an engine finds blocks another engine wrote after it started, and
a block the other engine deleted (evicted) or a half-written temporary file is a miss that
is recomputed, never an error or wrong K/V."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nanollmserve import SamplingParams

pytestmark = pytest.mark.milestone("m26")

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "A shared store: " + " ".join(f"crate {i} holds {i * 5 % 11} apples;" for i in range(40))


def run(llm, prompt=PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def wait_for_files(store: Path, count: int, timeout: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(list(store.glob("*/*.kvb"))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(store.glob("*/*.kvb"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the GGUF blocks, native steps
def test_an_engine_finds_blocks_another_wrote_after_it_started(make_llm, tmp_path, dtype):
    decode = make_llm(kv_offload_dir=str(tmp_path), dtype=dtype)  # scans an empty directory
    prefill = make_llm(kv_offload_dir=str(tmp_path), dtype=dtype)
    computed = run(prefill)
    full_blocks = (len(computed.prompt_token_ids) - 1) // BLOCK
    assert len(wait_for_files(tmp_path, full_blocks)) >= full_blocks

    loaded = run(decode)
    assert loaded.num_cached_tokens == full_blocks * BLOCK
    assert loaded.outputs[0].token_ids == computed.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_blocks_evicted_by_another_engine_or_half_written_are_misses(make_llm, tmp_path):
    prefill = make_llm(kv_offload_dir=str(tmp_path))
    computed = run(prefill)
    full_blocks = (len(computed.prompt_token_ids) - 1) // BLOCK
    files = wait_for_files(tmp_path, full_blocks)
    decode = make_llm(kv_offload_dir=str(tmp_path))  # its index lists every file
    for path in files:  # the other engine evicts them all; one is being written again
        path.unlink()
    files[0].with_name(f"{files[0].stem}.4242.0badf00d.tmp").write_bytes(b"NLSKVBLK half")

    recomputed = run(decode)
    assert recomputed.num_cached_tokens == 0
    assert recomputed.outputs[0].token_ids == computed.outputs[0].token_ids
