"""Commit protocol v2 at the store level: the events of issue 11 as a user meets them."""

from __future__ import annotations

from pathlib import Path

import pytest

import statekeeper as sk


def _backend(tmp: Path, name: str, **config: object) -> sk.StateBackend:
    cfg = sk.StoreConfig(local_dir=str(tmp / name), **config)  # type: ignore[arg-type]
    return sk.StateBackend(str(tmp / "root"), config=cfg)


def _commit(store: sk.StateStore, items: dict[bytes, bytes], order: tuple[int, ...]) -> None:
    for key, value in items.items():
        store.put(key, value)
    store.commit(order=order)  # type: ignore[arg-type]


def test_a_fixed_processor_re_runs_a_committed_batch_and_the_old_run_is_fenced(
    tmp_path: Path,
) -> None:
    first = _backend(tmp_path, "run1")
    with first.open("op", 0) as store:
        _commit(store, {b"k": b"v1"}, (1, 0, 0, 0))
        _commit(store, {b"k": b"old-2"}, (1, 1, 0, 0))  # batch 1: the sink failed after it
    zombie = first.open("op", 0, version=1)  # a task of run 1 still alive
    second = _backend(tmp_path, "run2")
    with second.open("op", 0, version=1) as store:  # run 2 re-runs batch 1, other logic
        _commit(store, {b"k": b"new-2"}, (2, 0, 0, 0))
        _commit(store, {b"k": b"new-3"}, (2, 1, 0, 0))
    zombie.put(b"k", b"zombie")
    with pytest.raises(sk.CommitConflictError, match="zombie"):
        zombie.commit(order=(1, 1, 0, 1))
    zombie.close()
    reader = _backend(tmp_path, "reader")
    for version, value in ((1, b"v1"), (2, b"new-2"), (3, b"new-3")):
        with reader.open("op", 0, version=version) as store:
            assert store.get(b"k") == value


def test_equal_orders_do_not_replace_each_other_and_a_final_version_stays(tmp_path: Path) -> None:
    a, b = _backend(tmp_path, "a"), _backend(tmp_path, "b")
    sa, sb = a.open("op", 0), b.open("op", 0)
    _commit(sa, {b"k": b"a"}, (0, 0, 0, 0))
    sb.put(b"k", b"b")
    with pytest.raises(sk.CommitConflictError, match="not newer"):
        sb.commit()
    _commit(sa, {b"k": b"a2"}, (0, 0, 0, 0))
    sa.close()
    sb.close()
    with b.open("op", 0, version=0) as late:  # version 1 has a successor: it is final
        late.put(b"k", b"late")
        with pytest.raises(sk.CommitConflictError, match="final"):
            late.commit(order=(9, 0, 0, 0))
    with _backend(tmp_path, "reader").open("op", 0, version=1) as store:
        assert store.get(b"k") == b"a"


@pytest.mark.parametrize("mode", ["snapshot", "changelog"])
def test_batch_0_re_runs_in_either_mode_and_version_0_stays_restorable(
    tmp_path: Path, mode: str
) -> None:
    backend = _backend(tmp_path, "w", mode=mode)
    with backend.open("op", 0) as store:
        _commit(store, {b"k": b"first"}, (1, 0, 0, 0))
    assert backend.versions("op", 0) == [0, 1]
    with backend.open("op", 0, version=0) as store:
        assert list(store.scan()) == []
        _commit(store, {b"k": b"again"}, (2, 0, 0, 0))
    with _backend(tmp_path, "reader").open("op", 0) as store:
        assert (store.version, store.get(b"k")) == (1, b"again")


def test_two_writers_in_different_modes_agree_on_one_version(tmp_path: Path) -> None:
    log = _backend(tmp_path, "log")
    snap = _backend(tmp_path, "snap", mode="snapshot")
    s1, s2 = log.open("op", 0), snap.open("op", 0)
    _commit(s1, {b"k": b"changelog"}, (0, 0, 0, 0))
    s2.put(b"k", b"snapshot")
    with pytest.raises(sk.CommitConflictError):
        s2.commit()
    s1.close()
    s2.close()
    for name in ("reader1", "reader2"):
        with _backend(tmp_path, name).open("op", 0) as store:
            assert (store.version, store.get(b"k")) == (1, b"changelog")
    assert _backend(tmp_path, "v").verify(deep=True).ok
