"""The commands the engine loop's inbox takes (`engine_loop.py`): `Add | Abort | Sleep | Wake |
SlotCall`.

Any thread queues one (`EngineLoop.add`, `abort`, `sleep`, `wake_up`); the engine thread
drains the inbox each turn and dispatches each with `match`. Anything else is a bug: queuing
it raises `UnknownCommandError` in the caller's thread, never an abort or a silent drop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanollmserve.frontend.admission import AdmittedRequest

if TYPE_CHECKING:
    from nanollmserve.frontend.async_engine import RequestStream

__all__ = ["Abort", "Add", "EngineCommand", "Sleep", "SlotCall", "UnknownCommandError", "Wake"]


@dataclass(frozen=True)
class Add:
    """Run an admitted request; its outputs go to `stream`."""

    stream: RequestStream
    request: AdmittedRequest


@dataclass(frozen=True)
class Abort:
    """End a request as aborted (unknown or finished ids are ignored)."""

    request_id: str


@dataclass(frozen=True)
class Sleep:
    """Sleep at `level` once no request is in the engine (`abort`: end them first); `done`
    is resolved once asleep."""

    level: int
    abort: bool
    done: Future


@dataclass(frozen=True)
class Wake:
    """Wake the engine (a pending Sleep is called off); `done` once it serves again."""

    done: Future


@dataclass(frozen=True)
class SlotCall:
    """A slot action (`engine/slot_save.py`): `fn(engine, slots)` runs on the engine thread
    between steps; `done` gets its result or its exception."""

    fn: Callable
    done: Future


EngineCommand = Add | Abort | Sleep | Wake | SlotCall
COMMAND_TYPES = (Add, Abort, Sleep, Wake, SlotCall)


class UnknownCommandError(TypeError):
    """Something that is not an EngineCommand was sent to the engine loop (a bug)."""
