"""Model-based test: random put/delete/commit/abort/reopen against a dict model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import statekeeper as sk

KEYS = st.sampled_from([b"a", b"b", b"ab", b"abc", b"b\x00", b"\xff", b"c"])
VALUES = st.binary(max_size=20)


class StoreMachine(RuleBasedStateMachine):
    """The store must always equal: committed model + this store's uncommitted writes."""

    @initialize()
    def setup(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="sk-model-"))
        self.root = str(self.tmp / "root")
        self.local_dirs = 0
        self.backend = self._backend()
        self.store = self.backend.open("op", partition=0)
        self.history: list[dict[bytes, bytes]] = [{}]  # committed state per version
        self.pending: dict[bytes, bytes | None] = {}

    def _backend(self) -> sk.StateBackend:
        self.local_dirs += 1
        config = sk.StoreConfig(
            local_dir=str(self.tmp / f"local{self.local_dirs}"), local_checkpoint_interval_s=0
        )
        return sk.StateBackend(self.root, config=config)

    def _expected(self) -> dict[bytes, bytes]:
        state = dict(self.history[self.store.version])
        for key, value in self.pending.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        return state

    @rule(key=KEYS, value=VALUES)
    def put(self, key: bytes, value: bytes) -> None:
        self.store.put(key, value)
        self.pending[key] = value

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        self.store.delete(key)
        self.pending[key] = None

    @precondition(lambda self: self.store.version == len(self.history) - 1)
    @rule()
    def commit(self) -> None:
        info = self.store.commit()
        self.history.append(self._expected_after_commit())
        self.pending = {}
        assert info.version == len(self.history) - 1

    def _expected_after_commit(self) -> dict[bytes, bytes]:
        state = dict(self.history[-1])
        for key, value in self.pending.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        return state

    @rule()
    def abort(self) -> None:
        self.store.abort()
        self.pending = {}

    @rule(fresh_local_dir=st.booleans(), data=st.data())
    def reopen(self, fresh_local_dir: bool, data: st.DataObject) -> None:
        self.store.close()
        self.pending = {}
        if fresh_local_dir:
            self.backend.close()
            self.backend = self._backend()
        latest = len(self.history) - 1
        version = data.draw(st.none() | st.integers(0, latest), label="version")
        self.store = self.backend.open("op", partition=0, version=version)
        assert self.store.version == (latest if version is None else version)

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "store"):
            return
        expected = self._expected()
        assert dict(self.store.scan()) == expected
        keys = sorted({*expected, b"missing"})
        assert self.store.multi_get(keys) == [expected.get(k) for k in keys]
        assert self.store.get(b"a") == expected.get(b"a")
        assert list(self.store.scan(b"a")) == sorted(
            (k, v) for k, v in expected.items() if k.startswith(b"a")
        )

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            self.backend.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30)
TestStoreModel = StoreMachine.TestCase
