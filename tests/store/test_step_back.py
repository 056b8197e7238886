"""Re-runs are cheap: a working copy one commit ahead steps back without a download.

A re-run of batch ``b`` opens version ``b`` on the host whose copy already holds ``b + 1`` of
the failed attempt; the copy applies the undo record its last commit kept (written in the
same WriteBatch as that commit) instead of downloading a snapshot and changelogs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.blobstores import RecordingBlobStore

V1 = {b"a": b"a1", b"b": b"b1", b"c": b"c1"}
V2_CHANGES: dict[bytes, bytes | None] = {b"a": b"a2", b"b": None, b"d": b"d2"}


def _backend(
    blobs: RecordingBlobStore | str, local: Path, mode: str = "changelog"
) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(local), snapshot_every=10_000, mode=mode)  # type: ignore[arg-type]
    return sk.StateBackend(blobs, config=config)


def _commit(
    store: sk.StateStore, changes: dict[bytes, bytes | None], order: tuple[int, ...]
) -> None:
    for key, value in changes.items():
        if value is None:
            store.delete(key)
        else:
            store.put(key, value)
    store.commit(order=order)  # type: ignore[arg-type]


def _downloads(recorder: RecordingBlobStore) -> list[str]:
    """Keys of state blobs read (changelogs, snapshot indexes and files), not manifests."""
    state = ("/changelog/", "/snapshot/", "/files/")
    return [key for op, key in recorder.calls if op in ("get", "get_range") and any(
        part in key for part in state
    )]  # fmt: skip


@pytest.mark.parametrize("mode", ["changelog", "snapshot"])
def test_a_re_run_steps_the_copy_back_without_downloading(tmp_path: Path, mode: str) -> None:
    recorder = RecordingBlobStore(LocalBlobStore(str(tmp_path / "root")))
    backend = _backend(recorder, tmp_path / "host", mode)
    with backend.open("op", 0) as store:
        _commit(store, dict(V1), (1, 0, 0, 0))
        _commit(store, V2_CHANGES, (1, 1, 0, 0))  # batch 1: the sink failed after this
    recorder.reset()
    with backend.open("op", 0, version=1) as store:  # the re-run of batch 1
        assert _downloads(recorder) == []
        assert store.restore_info.base_kind == "local"
        assert store.restore_info.bytes_downloaded == 0
        assert dict(store.scan()) == V1
        _commit(store, {b"a": b"rerun", b"e": b"e2"}, (2, 0, 0, 0))  # other content
    with _backend(str(tmp_path / "root"), tmp_path / "fresh", mode).open("op", 0) as store:
        assert store.version == 2
        assert dict(store.scan()) == {**V1, b"a": b"rerun", b"e": b"e2"}
    with backend.open("op", 0) as store:  # the re-run host agrees, without a download
        assert dict(store.scan()) == {**V1, b"a": b"rerun", b"e": b"e2"}


def test_a_copy_holding_a_replaced_attempt_steps_back_and_replays_only_the_winner(
    tmp_path: Path,
) -> None:
    recorder = RecordingBlobStore(LocalBlobStore(str(tmp_path / "root")))
    slow = _backend(recorder, tmp_path / "slow")
    with slow.open("op", 0) as store:
        _commit(store, dict(V1), (1, 0, 0, 0))
        _commit(store, V2_CHANGES, (1, 1, 0, 0))
    with _backend(str(tmp_path / "root"), tmp_path / "other").open("op", 0, version=1) as store:
        _commit(store, {b"c": b"winner"}, (2, 0, 0, 0))  # another host re-ran batch 1
    recorder.reset()
    with slow.open("op", 0) as store:
        assert store.version == 2
        assert dict(store.scan()) == {**V1, b"c": b"winner"}
        assert store.restore_info.base_kind == "local"
        downloaded = _downloads(recorder)
    assert len(downloaded) == 1, downloaded
    assert "/changelog/" in downloaded[0]


def test_a_copy_two_commits_ahead_is_rebuilt_not_stepped_back(tmp_path: Path) -> None:
    backend = _backend(str(tmp_path / "root"), tmp_path / "host")
    with backend.open("op", 0) as store:
        _commit(store, dict(V1), (1, 0, 0, 0))
        _commit(store, V2_CHANGES, (1, 1, 0, 0))
        _commit(store, {b"z": b"z3"}, (1, 2, 0, 0))
    with backend.open("op", 0, version=1) as store:  # only one step is kept
        assert store.restore_info.base_kind != "local"
        assert dict(store.scan()) == V1
