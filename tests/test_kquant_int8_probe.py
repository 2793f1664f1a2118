"""scripts/kquant_int8_probe.py, the kernel timing behind the int16-or-int8 activation choice
(milestones/m31-kquants.md): its two int8 kernels multiply the K-quant tile-blocks right, so
the times it reports are of a correct product. Each output's error against the dequantized
weights in float64 stays within what rounding the activations to int8 allows (half a step
per input, times |w|), at row counts that take each of its row paths."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nanollmserve.model.gguf_kquants import read_kquant_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

pytestmark = [pytest.mark.milestone("m31"), pytest.mark.slow, pytest.mark.timeout(120)]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))


needs_vnni = pytest.mark.skipif(
    not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "bmi2"} <= _cpu_flags(),
    reason="the probe is built for AVX-512 VNNI with BMI2",
)


def _int8_bound(x: np.ndarray, w: np.ndarray, group: int) -> np.ndarray:
    """[rows, out]: sum over inputs of |w| times half the int8 step of the input's group."""
    rows, n = x.shape
    step = np.abs(x.reshape(rows, n // group, group)).max(axis=2) / 127.0
    half_step = np.repeat(step / 2, group, axis=1)
    return half_step @ np.abs(w).T


@needs_vnni
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_the_int8_kernels_are_within_the_int8_rounding(tmp_path, type_name):
    import kquant_int8_probe as probe
    from kquant_kernel_bench import random_blocks

    lib = probe.build_probe(tmp_path)
    out, n = 40, 512  # a partial last tile; two super-blocks
    weights = read_kquant_rows(type_name, random_blocks(type_name, out, n, seed=3), n)
    tiles = torch.from_numpy(weights.tiled())
    w = weights.dequantize().astype(np.float64)
    for rows in (1, 5, 9, 32):  # register groups of each size, and the many-rows paths
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
        exact = x.double().numpy() @ w.T
        scale = np.abs(w).sum(axis=1).max() * np.abs(x.numpy()).max() * 1e-5  # float sums
        errors = {}
        for name, group in (("int16", None), ("int8", 32), ("int8_256", 256)):
            y = probe.caller(lib, name, weights.kind, out, x, threads=2)(tiles).double().numpy()
            errors[name] = err = np.abs(y - exact)
            if group is None:
                assert err.max() <= scale, (name, rows)
            else:
                bound = _int8_bound(x.double().numpy(), w, group) + scale
                assert (err <= bound).all(), (name, rows, (err / bound).max())
                # and the rounding is int8's, far coarser than int16's
                assert err.mean() > 10 * errors["int16"].mean(), (name, rows)
