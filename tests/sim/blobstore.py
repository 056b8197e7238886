"""SimBlobStore: a real LocalBlobStore whose every call is a yield point of the simulation.

Layering, as in a real backend: ``statekeeper``'s own retry (``call_with_retry`` /
``put_with_retry``, the functions the backends use) sits on top, the fault injection and the
yield point below it, and the real store (with its own retries switched off) at the bottom. So
an injected transient failure is absorbed by the library's retry exactly as a real one would
be, each retry attempt is a yield point of its own (other actors run while it "sleeps"), and a
lost response to a create-only put exercises the read-back that resolves it.

Bulk calls are made one blob at a time in the calling thread: every blob is its own yield
point, and no thread of this wrapper can race the scheduler. With ``page_size`` a listing is
paged like an object store's (each page a yield point, continuing after the last key seen),
so it is not atomic: writes and deletes of other actors land between pages.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterable, Sequence

from statekeeper import layout
from statekeeper.errors import StateKeeperError
from statekeeper.storage import BlobMeta, LocalBlobStore, RetryPolicy
from statekeeper.storage._retry import call_with_retry, put_with_retry
from tests.sim.scheduler import Sim

__all__ = ["SimBlobStore", "open_inner"]

# Enough attempts that a few injected transient failures in a row are absorbed; no delay:
# between attempts the scheduler lets other actors run, which is what a delay would allow.
RETRY = RetryPolicy(max_attempts=4, base_delay_s=0.0, max_delay_s=0.0)


def _no_sleep(_: float) -> None:
    """Retries wait for nothing: the scheduler interleaves other actors instead."""


def open_inner(root: str) -> LocalBlobStore:
    """The real store under a simulation: no retries of its own, no I/O threads in use."""
    return LocalBlobStore(root, io_threads=1, retry=RetryPolicy(max_attempts=1))


class SimBlobStore:
    """One host's view of the shared root: a BlobStore whose calls the scheduler interleaves.

    ``close`` does nothing: the inner store is shared by every host of the run (a backend
    closes the blob store it was given).
    """

    def __init__(
        self,
        sim: Sim,
        inner: LocalBlobStore,
        *,
        page_size: int | None = None,
        lose_put: int | None = None,
        on_change: Callable[[str], None] | None = None,
        on_manifest: Callable[[], None] | None = None,
        age_s: float = 0.0,
    ) -> None:
        self._sim = sim
        # Every blob reads as written ``age_s`` earlier: past any GC grace if large.
        self._age_s = age_s
        # Told of every call that reached the store and may have changed the root, whatever
        # it returned: "put", "sweep", "delete" (done) or "failed delete".
        self._on_change = on_change
        # Told when a manifest put of this view took effect (whatever it then returned):
        # the moment a commit of its actor took effect, which may be well before it returns.
        self._on_manifest = on_manifest
        self._inner = inner
        self._uri = inner.uri  # named in every call's error message: built once
        self._page_size = page_size
        # Self-test only: a store that lies, silently dropping every create-only put from the
        # ``lose_put``-th on while reporting success; the model must notice.
        self._lose_put = lose_put
        self._puts = 0

    @property
    def uri(self) -> str:
        return self._uri

    def _describe(self, op: str, key: str) -> str:
        return f"{op} {key!r} at {self.uri}"

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        lose = self._lose_put

        def write() -> None:
            self._puts += 1
            if lose and self._puts >= lose and not overwrite and if_match is None:
                return
            try:
                self._inner.put(key, data, overwrite=overwrite, if_match=if_match)
            finally:
                self._changed("put")
            if self._on_manifest is not None and layout.parse_manifest_key(key) is not None:
                self._on_manifest()

        put_with_retry(
            RETRY,
            lambda: self._sim.call("put", key, write),
            lambda: self._sim.call("get", key, lambda: self._inner.get(key)),
            data,
            self._describe("put", key),
            sleep=_no_sleep,
        )

    def get(self, key: str) -> bytes:
        return call_with_retry(
            RETRY,
            lambda: self._sim.call("get", key, lambda: self._inner.get(key)),
            self._describe("get", key),
            sleep=_no_sleep,
        )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return call_with_retry(
            RETRY,
            lambda: self._sim.call(
                "get_range", key, lambda: self._inner.get_range(key, start, length)
            ),
            self._describe("get_range", key),
            sleep=_no_sleep,
        )

    def _aged(self, meta: BlobMeta) -> BlobMeta:
        # GC's clock probe is written now and read at once: it tells the store's "now", from
        # which every other blob is ``age_s`` older.
        if not self._age_s or meta.key.startswith(layout.clock_prefix()):
            return meta
        return dataclasses.replace(meta, last_modified=meta.last_modified - self._age_s)

    def head(self, key: str) -> BlobMeta:
        return self._aged(self._head(key))

    def list(self, prefix: str = "") -> builtins.list[BlobMeta]:
        return [self._aged(m) for m in self._list(prefix)]

    def _head(self, key: str) -> BlobMeta:
        return call_with_retry(
            RETRY,
            lambda: self._sim.call("head", key, lambda: self._inner.head(key)),
            self._describe("head", key),
            sleep=_no_sleep,
        )

    def _list(self, prefix: str) -> builtins.list[BlobMeta]:
        if self._page_size is None:
            return call_with_retry(
                RETRY,
                lambda: self._sim.call("list", prefix, lambda: self._inner.list(prefix)),
                self._describe("list", prefix),
                sleep=_no_sleep,
            )
        out: builtins.list[BlobMeta] = []
        after = ""
        while True:
            page = self._list_page(prefix, after)
            out.extend(page)
            if len(page) < self._page_size:
                return out
            after = page[-1].key

    def _list_page(self, prefix: str, after: str) -> builtins.list[BlobMeta]:
        """One page: the next ``page_size`` keys after ``after``, as the store is now."""
        size = self._page_size

        def page() -> builtins.list[BlobMeta]:
            return [m for m in self._inner.list(prefix) if m.key > after][:size]

        return call_with_retry(
            RETRY,
            lambda: self._sim.call("list", f"{prefix}>{after}", page),
            self._describe("list", prefix),
            sleep=_no_sleep,
        )

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            call_with_retry(
                RETRY,
                lambda key=key: self._sim.call(  # type: ignore[misc]
                    "delete", key, lambda: self._delete(key)
                ),
                self._describe("delete", key),
                sleep=_no_sleep,
            )

    def _delete(self, key: str) -> None:
        done = False
        try:
            self._inner.delete_many([key])
            done = True
        finally:
            self._changed("delete" if done else "failed delete")

    def _changed(self, op: str) -> None:
        if self._on_change is not None:
            self._on_change(op)

    def put_many(self, items: Sequence[tuple[str, bytes]], *, overwrite: bool = False) -> None:
        error: StateKeeperError | None = None
        for key, data in items:
            try:
                self.put(key, data, overwrite=overwrite)
            except StateKeeperError as exc:  # every item is attempted, the first error raised
                error = error or exc
        if error is not None:
            raise error

    def get_many(self, keys: Sequence[str]) -> builtins.list[bytes]:
        return [self.get(key) for key in keys]

    def sweep_incomplete(self, older_than_s: float, *, dry_run: bool = False) -> int:
        def sweep() -> int:
            try:
                return self._inner.sweep_incomplete(older_than_s, dry_run=dry_run)
            finally:
                self._changed("sweep")

        return self._sim.call("sweep", "", sweep)

    def close(self) -> None:
        """Nothing to release: the inner store is shared by the run's hosts."""
