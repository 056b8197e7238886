"""Where the time of one operation goes: named phases, summed per operation.

A commit wants to say how long it spent encoding, compressing, checksumming, uploading,
fsyncing and applying, but those steps happen in three layers (``changelog``, ``storage``,
``store``) that must not know of each other. Each layer marks its own steps with
:func:`phase`; the caller that wants the breakdown opens :func:`measure` around the
operation and reads the totals afterwards. Outside :func:`measure` a mark costs one
context-variable lookup and records nothing.

Phases are exclusive: a phase marked inside another (an fsync inside an upload) is counted
as itself only, and the outer phase gets the rest, so the totals add up to at most the wall
time of the block.

The totals live in a :class:`contextvars.ContextVar`, so they follow the calling thread (and
asyncio task) only: work handed to another thread is not counted unless that thread
measures it itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["measure", "phase"]


class _Clock:
    __slots__ = ("inner", "totals")

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.inner: list[int] = [0]
        """Per open phase (and the block itself): nanoseconds of the phases inside it."""


_clock: ContextVar[_Clock | None] = ContextVar("statekeeper_phases", default=None)


@contextlib.contextmanager
def measure() -> Iterator[dict[str, int]]:
    """Collect the phases marked inside the block: phase name -> nanoseconds.

    A nested :func:`measure` collects its own block only; the outer one does not see it.
    """
    clock = _Clock()
    token = _clock.set(clock)
    try:
        yield clock.totals
    finally:
        _clock.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the wall time of the block, less that of phases inside it, towards phase
    ``name`` (also when the block raises)."""
    clock = _clock.get()
    if clock is None:
        yield
        return
    clock.inner.append(0)
    started = time.perf_counter_ns()
    try:
        yield
    finally:
        elapsed = time.perf_counter_ns() - started
        inner = clock.inner.pop()
        clock.totals[name] = clock.totals.get(name, 0) + elapsed - inner
        clock.inner[-1] += elapsed
