"""Byte sizes as people write them on a command line: `2GiB`, `512MiB`, `1G`, `1.5GB`, `4096`.

`parse_size` is the argparse `type` of every byte-size flag (`--kv-cache-memory`), and
`EngineConfig` accepts the same strings from Python. Binary suffixes (KiB, MiB, GiB, TiB) are
powers of 1024; decimal ones (kB, MB, GB, TB) powers of 1000; a bare letter (K, M, G, T), as
llama.cpp and vLLM's `--kv-cache-memory` read it, is binary. Case and a space before the
suffix do not matter. No torch here: the CLI parses flags without it.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


class SizeError(argparse.ArgumentTypeError, ValueError):
    """A size that does not parse: argparse prints its message as is, and callers that
    catch ValueError (EngineConfig, the environment defaults) still do."""


def parse_size(text: str | int) -> int:
    """`"2GiB"` -> 2147483648. Raises SizeError, naming the accepted forms, on anything
    else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE_RE.match(str(text))
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise SizeError(
            f"invalid size {text!r}: expected bytes or a number with a suffix "
            "(512MiB, 2GiB, 1G, 1.5GB)"
        )
    return int(float(match.group(1)) * unit)
