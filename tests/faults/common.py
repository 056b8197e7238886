"""What every suite shares: the deterministic workload, a trial's result, log capture."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import statekeeper as sk

KEYS = 120


def changes(operator: str, partition: int, version: int) -> list[tuple[bytes, bytes | None]]:
    """Commit ``version`` of a store: 12 puts over ``KEYS`` keys and one delete, deterministic
    and different for every store, so a blob of another store never holds the right state."""
    salt = sum(operator.encode()) + 31 * partition
    out: list[tuple[bytes, bytes | None]] = [
        (b"k%03d" % ((version * 7 + i + salt) % KEYS), b"%s/%d:%d.%d" % (
            operator.encode(), partition, version, i) * 6)
        for i in range(12)
    ]  # fmt: skip
    out.append((b"k%03d" % ((version * 13 + salt) % KEYS), None))
    return out


def expected(operator: str, partition: int, version: int) -> dict[bytes, bytes]:
    """The state of a store at ``version`` after commits 1..``version`` of :func:`changes`."""
    state: dict[bytes, bytes] = {}
    for v in range(1, version + 1):
        for key, value in changes(operator, partition, v):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    return state


def apply(store: sk.StateStore, version: int) -> None:
    """Write the changes of ``version`` into ``store`` (not committed)."""
    for key, value in changes(store.operator, store.partition, version):
        if value is None:
            store.delete(key)
        else:
            store.put(key, value)


@dataclass
class Trial:
    """One seeded trial: which attack it made, what it saw, and why it failed (if it did)."""

    suite: str
    seed: int
    attack: str = "?"
    observed: str = "?"
    failure: str | None = None
    notes: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        """Record a failed check (the first one is what the table shows)."""
        if self.failure is None:
            self.failure = message

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.fail(message)


def repro(suite: str, seed: int) -> str:
    """The command that replays one trial."""
    return f".venv/bin/python -m tests.faults --suite {suite} --seed {seed}"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """Collect the WARNING (and worse) messages statekeeper logs inside the block."""
    handler = _Collect()
    logger = logging.getLogger("statekeeper")
    logger.addHandler(handler)
    old, propagate = logger.level, logger.propagate
    # The trial reads the warnings; the console (or pytest) need not show them all.
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        logger.propagate = propagate


def read_all(store: sk.StateStore) -> dict[bytes, bytes]:
    return dict(store.scan())
