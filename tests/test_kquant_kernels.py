"""Reference twins as oracles (issue 40): random block bytes of every K-quant and 5-bit type
and of the legacy Q4_0, Q4_1, Q8_0 (valid: finite float16 scales), dequantized by the `gguf`
package (the oracle), against

- our reading of the blocks (model/gguf_kquants.py; model/gguf_blocks.py for the legacy
  types), which must be exact;
- a weight fusing rows of three types (Q4_K, Q5_0, Q6_K, as a Q4_K_M file's q/k/v may) in
  one kernel call;
- the native kernels of each ISA level this CPU runs (NANOLLMSERVE_CPU_ISA=avx2 / avx512, each
  in its own process: the library is chosen once per process), and the K-quant kernel's
  plain-C twin, at 1, 5, 24, 48 and 64 rows, within the error their activations allow:
  int16 activations are off by at most half their block's step (max |x| / 32767 / 2), so an
  output is off by at most sum |w| * step / 2, plus float32 rounding. The K-quant kinds of at
  most 6-bit codes requantize those int16 rows to int8, per 256 inputs for the super-block
  kinds (Q4_K, Q5_K, Q6_K and their fusions; decision 46) and per 32 for the others (Q5_0,
  Q5_1 and their fusions; decision 47), as does Q8_0 (per 32; decision 48, with its own C twin),
  which adds half an int8 step (max |x| over the group / 127 / 2) per input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanollmserve.model.gguf_blocks import _block_rows
from nanollmserve.model.gguf_kquants import KQUANT_TYPES, STORED, fuse_rows, read_kquant_rows
from nanollmserve.native.abi import int8_group

pytestmark = pytest.mark.milestone("m31")

ROWS = (1, 5, 24, 48, 64)
OUT, IN = 40, 512  # two and a half tiles; two 256-wide super-blocks
FUSED = "Q4_K+Q5_0+Q6_K"
FUSED_PARTS = (("Q4_K", 16), ("Q5_0", 8), ("Q6_K", 16))
"""A fused weight of three types (rows per part): one kernel call, offsets per output."""
LEGACY = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}
"""The types today's kernels (gguf_cpu.c) run -> (weights, bytes) per file block."""
HALF_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,)}  # fmt: skip
"""Byte offsets of each type's float16 fields in a file block: random there, except finite."""


def random_blocks(type_name: str, out: int, n: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """uint8 [out, bytes]: random block bytes whose float16 fields are finite (normal, times
    `scale`)."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = {**STORED, **LEGACY}[type_name]
    raw = rng.integers(0, 256, size=(out, n // per_block, block_bytes), dtype=np.uint8)
    for start in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal((out, n // per_block)) * scale).astype(np.float16)
        raw[..., start : start + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def oracle(type_name: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64)


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_blocks_read_exactly_as_the_oracle_dequantizes_them(type_name: str) -> None:
    raw = random_blocks(type_name, OUT, IN, seed=1)
    rows = read_kquant_rows(type_name, raw, IN)
    np.testing.assert_array_equal(rows.dequantize().astype(np.float64), oracle(type_name, raw))


@pytest.mark.parametrize("type_name", list(LEGACY))
def test_legacy_blocks_read_exactly_as_the_oracle_dequantizes_them(type_name: str) -> None:
    raw = random_blocks(type_name, OUT, IN, seed=2)
    rows = _block_rows(raw, type_name)
    np.testing.assert_array_equal(rows.dequantize().double().numpy(), oracle(type_name, raw))


def kernel_errors() -> dict:
    """Per type and row count: the worst error of the vector kernel and of the C twin, each
    as a fraction of its activations' bound (<= 1 passes), and the worst vector/twin difference as a
    fraction of sum |w x|. Runs in the process's own ISA level."""
    from nanollmserve.native import ops

    results = {}
    for seed, type_name in enumerate([*KQUANT_TYPES, *LEGACY, FUSED]):
        if type_name == FUSED:  # q/k/v of a Q4_K_M file: one weight, three types
            parts = [random_blocks(t, n, IN, seed=20 + i) for i, (t, n) in enumerate(FUSED_PARTS)]
            weights = np.concatenate(
                [oracle(t, r) for (t, _), r in zip(FUSED_PARTS, parts, strict=True)]
            )
            rows = fuse_rows(
                [read_kquant_rows(t, r, IN) for (t, _), r in zip(FUSED_PARTS, parts, strict=True)]
            )
            tiles = torch.from_numpy(rows.tiled())
        elif type_name in LEGACY:
            raw = random_blocks(type_name, OUT, IN, seed=10 + seed)
            weights = oracle(type_name, raw)
            legacy = _block_rows(raw, type_name)
            tiles = legacy.tiled()
        else:
            raw = random_blocks(type_name, OUT, IN, seed=10 + seed)
            weights = oracle(type_name, raw)
            rows = read_kquant_rows(type_name, raw, IN)
            tiles = torch.from_numpy(rows.tiled())
        for count in ROWS:
            x = np.random.default_rng(count).standard_normal((count, IN)).astype(np.float32)
            x[:, :32] *= 50  # blocks of very different scales
            exact = x.astype(np.float64) @ weights.T
            step = np.abs(x).reshape(count, -1, 32).max(-1) / 32767  # per activation block
            half_step = np.repeat(step, 32, axis=1) / 2
            kind = legacy.kind if type_name in LEGACY else rows.kind
            group = int8_group(kind)
            if group:  # int8 per 256 (super-block kinds) or per 32 (the others)
                step8 = np.abs(x).reshape(count, -1, group).max(-1) * (1 + 1e-4) / 127
                half_step = half_step + np.repeat(step8, group, axis=1) / 2
            magnitude = np.abs(x).astype(np.float64) @ np.abs(weights).T
            bound = half_step @ np.abs(weights).T + 2e-6 * magnitude + 1e-30
            xt = torch.from_numpy(x)
            if type_name == "Q8_0":  # its int8 kernel's C twin (decision 48)
                vec = ops.gguf_matmul(legacy.kind, tiles, OUT, xt, None).numpy()
                ref = ops.q8_matmul_reference(tiles, OUT, xt).numpy()
            elif type_name in LEGACY:  # no C twin: the vector kernel stands for both
                vec = ref = ops.gguf_matmul(legacy.kind, tiles, OUT, xt, None).numpy()
            else:
                vec = ops.kquant_matmul(rows.kind, tiles, OUT, xt).numpy()
                ref = ops.kquant_matmul(rows.kind, tiles, OUT, xt, reference=True).numpy()
            results[f"{type_name}/{count}"] = {
                "vector": float((np.abs(vec - exact) / bound).max()),
                "reference": float((np.abs(ref - exact) / bound).max()),
                "twins": float((np.abs(vec - ref) / (magnitude + 1e-30)).max()),
            }
    return results


def isa_levels() -> list[str]:
    """avx2, and avx512 where this CPU runs that build (amx runs the same vector kernels)."""
    from nanollmserve.native.build import runnable_levels

    return [level for level in runnable_levels() if level != "amx"]


def at_isa(isa: str, module: str, function: str, timeout: float):
    """`module.function()` (a test module's, JSON-able) run in a process of its own with
    NANOLLMSERVE_CPU_ISA=isa: the native library is chosen once per process."""
    code = (
        f"import json, sys; sys.path.insert(0, sys.argv[1]); import {module} as t; "
        f"print(json.dumps(t.{function}()))"
    )
    env = {**os.environ, "NANOLLMSERVE_CPU_ISA": isa}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("isa", isa_levels())
def test_every_kernel_agrees_with_the_oracle(isa: str) -> None:
    results = at_isa(isa, "test_kquant_kernels", "kernel_errors", 540)
    assert len(results) == (len(KQUANT_TYPES) + len(LEGACY) + 1) * len(ROWS)
    worst = {
        key: value
        for key, value in results.items()
        if value["vector"] > 1 or value["reference"] > 1
    }
    assert not worst, worst
    assert max(value["twins"] for value in results.values()) < 1e-5, results


def test_a_rows_numbers_do_not_depend_on_how_many_rows_share_the_call() -> None:
    """One row, a register group and many rows give the same bits for the same row: a
    request's logits must not depend on its batch. Q6_K runs the int8 kernel of the
    super-block kinds (rows in groups of up to 4 on AVX-512), whose requantization is per row."""
    from nanollmserve.native import ops

    rows = read_kquant_rows("Q6_K", random_blocks("Q6_K", 40, 512, 3, 1e-4), 512)
    tiles = torch.from_numpy(rows.tiled())
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(0))
    together = ops.kquant_matmul(rows.kind, tiles, 40, x)
    one_by_one = torch.cat(
        [ops.kquant_matmul(rows.kind, tiles, 40, x[i : i + 1]) for i in range(16)]
    )
    assert torch.equal(together, one_by_one)
    assert torch.equal(together[:7], ops.kquant_matmul(rows.kind, tiles, 40, x[:7]))


def int8_model(x: np.ndarray, weights: np.ndarray, group: int) -> np.ndarray:
    """The products as kquant_int8_cpu.c defines them, in numpy: each row quantized to int16
    per 32 (kq_quantize_row), requantized to int8 per `group` inputs (kq8_requantize), in the
    same float32 steps, then multiplied by the exact weights in float64."""
    blocks = x.astype(np.float32).reshape(len(x), -1, 32)
    amax = np.abs(blocks).max(-1)
    q16 = np.rint(blocks * (np.float32(32767) / amax)[..., None]).astype(np.float32)
    dx = amax / np.float32(32767)
    per_group = group // 32
    m = (dx * np.abs(q16).max(-1)).reshape(len(x), -1, per_group).max(-1)  # max |dx q| a group
    d8 = m / np.float32(127)
    scale = (dx.reshape(len(x), -1, per_group) * (np.float32(127) / m)[..., None]).reshape(dx.shape)
    q8 = np.clip(np.rint(q16 * scale[..., None]), -127, 127).astype(np.float64)
    a = q8.reshape(len(x), -1, group) * d8.astype(np.float64)[..., None]
    return a.reshape(len(x), -1) @ weights.T


@pytest.mark.parametrize(
    ("type_name", "group"), [("Q5_0", 32), ("Q5_1", 32), ("Q4_K", 256), ("Q8_0", 32)]
)
def test_the_kernel_multiplies_int8_activations_per_group(type_name: str, group: int) -> None:
    """Which arithmetic runs, not only how close it is: Q5_0 and Q5_1 multiply int8
    activations per 32 inputs (decision 47), Q4_K per 256 (decision 46), Q8_0 per 32 (decision
    48). The kernel matches the numpy model of that arithmetic to float32 rounding, while the
    model is a hundred times further from the exact products (and so from int16 activations,
    or another group)."""
    from nanollmserve.native import ops

    raw = random_blocks(type_name, OUT, IN, seed=40)
    weights = oracle(type_name, raw)
    x = np.random.default_rng(41).standard_normal((5, IN)).astype(np.float32)
    x[:, :32] *= 50
    if type_name in LEGACY:
        legacy = _block_rows(raw, type_name)
        assert int8_group(legacy.kind) == group
        got = ops.gguf_matmul(legacy.kind, legacy.tiled(), OUT, torch.from_numpy(x), None)
    else:
        rows = read_kquant_rows(type_name, raw, IN)
        assert int8_group(rows.kind) == group
        tiles = torch.from_numpy(rows.tiled())
        got = ops.kquant_matmul(rows.kind, tiles, OUT, torch.from_numpy(x))
    model = int8_model(x, weights, group)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(weights).T
    off_model = np.abs(got.numpy() - model) / magnitude
    off_exact = np.abs(model - x.astype(np.float64) @ weights.T) / magnitude
    assert off_model.max() < 1e-5, off_model.max()
    assert off_exact.max() > 100 * off_model.max() and off_exact.max() > 1e-4, off_exact.max()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q8_0"])
def test_int16_keeps_the_int16_activations_of_every_kind(type_name: str) -> None:
    """`int16=True` (the output projection's products, decision 48) runs the int16 arithmetic
    whatever the kind: within the int16 bound, a hundred times closer to the exact products
    than the same kind's int8 products."""
    from nanollmserve.native import ops

    raw = random_blocks(type_name, OUT, IN, seed=50)
    weights = oracle(type_name, raw)
    x = np.random.default_rng(51).standard_normal((5, IN)).astype(np.float32)
    x[:, :32] *= 50
    xt = torch.from_numpy(x)
    if type_name in LEGACY:
        rows = _block_rows(raw, type_name)
        tiles = rows.tiled()
    else:
        rows = read_kquant_rows(type_name, raw, IN)
        tiles = torch.from_numpy(rows.tiled())
    int16 = ops.gguf_matmul(rows.kind, tiles, OUT, xt, None, int16=True).numpy()
    int8 = ops.gguf_matmul(rows.kind, tiles, OUT, xt, None).numpy()
    exact = x.astype(np.float64) @ weights.T
    step = np.abs(x).reshape(5, -1, 32).max(-1) / 32767
    magnitude = np.abs(x).astype(np.float64) @ np.abs(weights).T
    bound = np.repeat(step, 32, axis=1) / 2 @ np.abs(weights).T + 2e-6 * magnitude
    assert (np.abs(int16 - exact) <= bound).all()
    off16 = (np.abs(int16 - exact) / magnitude).max()
    assert (np.abs(int8 - exact) / magnitude).max() > 100 * off16
