"""scripts/activation_precision.py, the measurement behind the int16-or-int8 activation choice
(issue 40): its rounding is the kernels' (per block, max |x| / L steps, nearest), within half
a step of the input, and it acts only while its context is open."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import activation_precision as ap  # noqa: E402

pytestmark = pytest.mark.milestone("m31")


@pytest.mark.parametrize(("levels", "block"), [(32767, 32), (127, 32), (127, 256)])
def test_rounding_is_within_half_a_step_per_block(levels: int, block: int) -> None:
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(block)) * torch.logspace(
        -3, 3, 512
    )
    rounded = ap.fake_quantize(x, levels, block)
    step = x.reshape(3, -1, block).abs().amax(-1, keepdim=True) / levels
    error = (rounded - x).reshape(3, -1, block).abs()
    # half a step, plus float32's own rounding of x / step (~levels * 2^-24 steps)
    assert bool((error <= step * (0.5 + levels * 2.0**-22)).all())
    codes = rounded.reshape(3, -1, block) / step
    assert torch.allclose(codes, codes.round(), atol=1e-3)  # on the grid
    assert int(codes.abs().max().round()) == levels  # the largest input is the largest code


def test_inputs_are_rounded_only_inside_the_context() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(2, 64)
    exact = model(x)
    with ap.rounding_inputs(model, "int8/32"):
        rounded = model(x)
    manual = model[0].weight @ ap.fake_quantize(x, 127, 32).T
    assert torch.allclose(rounded, model[2](model[1](manual.T + model[0].bias)), atol=1e-6)
    assert not torch.allclose(rounded, exact, atol=1e-6)
    assert torch.equal(model(x), exact)  # hooks removed
    with ap.rounding_inputs(model, "float32"):
        assert torch.equal(model(x), exact)
