"""bench/decode_bandwidth.py: the bytes a one-token step of a GGUF model reads (every tensor
but the embedding table, which counts in full when it is also the output head), and the
machine's read bandwidth, which scripts/bench-batched sets c1 decode against."""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest

from nanollmserve.bench.decode_bandwidth import decode_bytes_per_token, read_bandwidth_gb_s
from nanollmserve.model.source import bundled_gguf_path

pytestmark = [pytest.mark.milestone("m31"), pytest.mark.timeout(120)]


def write_gguf(path, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_untied_model_reads_all_but_its_embedding_table(tmp_path):
    tensors = {
        "token_embd.weight": np.ones((64, 32), np.float16),  # 4,096 bytes: one row is read
        "blk.0.attn_q.weight": np.ones((32, 32), np.float16),  # 2,048
        "blk.0.attn_norm.weight": np.ones(32, np.float32),  # 128
        "output.weight": np.ones((64, 32), np.float16),  # 4,096
    }
    write_gguf(tmp_path / "untied.gguf", tensors)
    assert decode_bytes_per_token(tmp_path / "untied.gguf") == 2048 + 128 + 4096


def test_a_tied_model_reads_its_embedding_table_as_the_output_head(tmp_path):
    tensors = {
        "token_embd.weight": np.ones((64, 32), np.float16),
        "blk.0.attn_q.weight": np.ones((32, 32), np.float16),
    }
    write_gguf(tmp_path / "tied.gguf", tensors)
    assert decode_bytes_per_token(tmp_path / "tied.gguf") == 4096 + 2048


def test_the_bundled_model_reads_nearly_its_whole_file():
    path = bundled_gguf_path()
    tensors = gguf.GGUFReader(str(path)).tensors
    assert "output.weight" not in {t.name for t in tensors}  # SmolLM2 ties its head
    assert decode_bytes_per_token(path) == sum(int(t.n_bytes) for t in tensors)
    assert 0.9 * os.path.getsize(path) < decode_bytes_per_token(path) < os.path.getsize(path)


def test_the_read_bandwidth_is_a_positive_rate_and_refuses_an_empty_buffer():
    rate = read_bandwidth_gb_s(nbytes=1 << 20, repeats=2)
    assert rate > 0 and math.isfinite(rate)
    for nbytes, repeats in ((0, 1), (1 << 20, 0)):
        with pytest.raises(ValueError, match="must be positive"):
            read_bandwidth_gb_s(nbytes=nbytes, repeats=repeats)
