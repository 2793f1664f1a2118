"""Engine failures that no retry can fix."""

from __future__ import annotations


class EngineFatalError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died, or a step failed
    part-way and the ranks are out of step): fail everything and stop, do not retry."""
