"""Bounded, jittered retries of transient storage failures.

Only :class:`~statekeeper.errors.TransientStorageError` is retried: every other error is a
fact (the blob exists, the key is missing, access is denied) that trying again cannot change.
Backends disable their client's own retries so that attempts are not multiplied.

Why not obstore's ``RetryConfig`` (exponential backoff with jitter, like this)? Measured on
obstore 0.12.1 (``tests/storage/test_retry.py``):

* it retries a create-only PUT after a 5xx or a dropped connection, and when the first attempt
  had landed, the retry fails its own precondition and reports ``AlreadyExists``: our own
  write taken for another writer's, a false :class:`~statekeeper.errors.CommitConflictError`
  that would fail a commit. :func:`put_with_retry` reads the blob back and recognises it;
* it does not retry S3's ``409 ConditionalRequestConflict`` (another conditional write to
  the key in flight), which is worth waiting out;
* it logs through Rust ``tracing``, invisible to Python logging; here every retry is a
  warning naming the operation and key.

So this module stays, and is the only retry layer of the object store backend; the local
backend has nothing transient to retry.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from statekeeper.errors import (
    CommitConflictError,
    StateNotFoundError,
    StorageError,
    TransientStorageError,
)

__all__ = ["RetryPolicy", "call_with_retry", "put_with_retry"]

_T = TypeVar("_T")
_log = logging.getLogger("statekeeper.storage")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a transient storage failure is retried.

    The delay before retry ``n`` (1-based) is drawn uniformly from
    ``[0, min(max_delay_s, base_delay_s * 2 ** (n - 1))]`` ("full jitter"), so that many
    tasks throttled at once do not retry in lockstep.

    Attributes:
        max_attempts: total attempts, the first included; 1 disables retries.
        base_delay_s: upper bound of the first delay, in seconds.
        max_delay_s: upper bound of every delay, in seconds.

    Raises:
        ValueError: ``max_attempts`` < 1, a negative or non-finite delay, or ``max_delay_s``
            below ``base_delay_s``.
    """

    max_attempts: int = 6
    base_delay_s: float = 0.05
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ValueError(
                f"RetryPolicy.max_attempts must be an int >= 1, got {self.max_attempts!r}"
            )
        for name in ("base_delay_s", "max_delay_s"):
            value = getattr(self, name)
            # nan passes "value < 0" and then makes every sleep fail; inf sleeps forever.
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"RetryPolicy.{name} must be a finite number of seconds >= 0, got {value!r}"
                )
        if self.max_delay_s < self.base_delay_s:
            raise ValueError(
                f"RetryPolicy.max_delay_s ({self.max_delay_s}) must be >= "
                f"base_delay_s ({self.base_delay_s})"
            )

    def delay_cap_s(self, retry: int) -> float:
        """Largest delay before retry number ``retry`` (1-based)."""
        # Cap the exponent: 2 ** 1000 would overflow a float long after the cap applies.
        exponent = min(max(retry - 1, 0), 64)
        return float(min(self.max_delay_s, self.base_delay_s * 2.0**exponent))

    def delay_s(self, retry: int) -> float:
        """A random delay before retry number ``retry``, within ``[0, delay_cap_s(retry)]``."""
        return random.uniform(0.0, self.delay_cap_s(retry))


def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], _T],
    describe: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """Call ``fn`` until it succeeds, retrying only transient storage failures.

    Args:
        policy: attempts and delays.
        fn: the operation; called at most ``policy.max_attempts`` times.
        describe: the operation and key for log lines, e.g. ``"put 'a/b' at s3://bkt/root"``;
            must not hold credentials.
        sleep: how to wait between attempts (tests pass a recorder).

    Returns:
        What ``fn`` returned.

    Raises:
        TransientStorageError: the last failure, once ``policy.max_attempts`` are used up
            (with a note saying so).
        Exception: any other error of ``fn``, at once.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except TransientStorageError as exc:
            if attempt >= policy.max_attempts:
                exc.add_note(f"gave up after {attempt} attempt(s): {describe}")
                raise
            delay = policy.delay_s(attempt)
            _log.warning(
                "retrying %s in %.3f s (attempt %d of %d failed): %s",
                describe,
                delay,
                attempt,
                policy.max_attempts,
                exc,
            )
            sleep(delay)
            attempt += 1


def put_with_retry(
    policy: RetryPolicy,
    write: Callable[[], None],
    read_back: Callable[[], bytes],
    data: bytes,
    describe: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Retry a conditional write, resolving the ambiguity of a lost response.

    When an attempt fails transiently the write may still have landed (the server stored
    the blob but the reply was lost). The next attempt then finds the blob there and would
    report a conflict for our own write. So a conflict seen on a *retry* is checked: if the
    stored bytes equal ``data`` the write is taken as done. On a first attempt a conflict is
    always reported: someone else wrote first. If the blob is gone by the time it is read
    back (deleted in between, by garbage collection say), whose it was cannot be known: the
    write's outcome is unknown, a :class:`StorageError`, as when retries run out; neither a
    conflict (it may have been ours) nor another attempt (it would bring back a blob that
    was deleted on purpose).

    Args:
        policy: attempts and delays.
        write: one attempt of the conditional write.
        read_back: reads the blob currently stored at the key.
        data: the bytes being written.
        describe: the operation and key for log lines.
        sleep: how to wait between attempts.

    Raises:
        CommitConflictError: the key holds other bytes (or, for ``if_match``, a newer
            version).
        TransientStorageError: retries exhausted.
        StorageError: the outcome is unknown (the blob a retry found was deleted before it
            was read back), or any other failure of ``write``.
    """
    attempts = 0

    def attempt() -> None:
        nonlocal attempts
        attempts += 1
        try:
            write()
        except CommitConflictError:
            if attempts == 1:
                raise
            try:
                stored = read_back()
            except StateNotFoundError as exc:
                raise StorageError(
                    f"{describe}: outcome unknown: an attempt failed with a transient error "
                    "and may have landed; the next one found the blob there, and it was "
                    "deleted before it could be read back"
                ) from exc
            if stored != data:
                raise
            _log.info("%s: an earlier attempt had landed; treating it as done", describe)

    call_with_retry(policy, attempt, describe, sleep=sleep)
