"""The working copy's label and undo record, on a real RocksDB."""

from __future__ import annotations

from pathlib import Path

import pytest

from statekeeper.store import _label
from statekeeper.store._label import decode_undo, encode_undo, pack_label, parse_label
from statekeeper.store._working_copy import WorkingCopy

ROOT = "r" * 32


def _copy(tmp_path: Path) -> WorkingCopy:
    return WorkingCopy(
        str(tmp_path / "copy"), write_buffer_mb=1, memory_mb=64, checkpoint_interval_s=60
    )


def _items(copy: WorkingCopy) -> dict[bytes, bytes]:
    return dict(copy.scan(b""))


def _at_v2(copy: WorkingCopy) -> None:
    copy.apply([(b"a", b"1"), (b"b", b"1")], version=1, root_id=ROOT, attempt="A1", undo=True)
    copy.apply([(b"a", b"2"), (b"b", None), (b"c", b"2")], version=2, root_id=ROOT,
               attempt="A2", undo=True)  # fmt: skip


def test_step_back_restores_the_parent_exactly_and_survives_a_reopen(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    _at_v2(copy)
    copy.close()
    copy = _copy(tmp_path)
    assert copy.can_step_back
    assert copy.step_back(version=1, attempt="A1")
    assert (copy.version, copy.attempt, copy.can_step_back) == (1, "A1", False)
    assert _items(copy) == {b"a": b"1", b"b": b"1"}
    copy.close()


@pytest.mark.parametrize(("version", "attempt"), [(1, "other"), (0, "A1"), (2, "A2")])
def test_step_back_refuses_any_other_target(tmp_path: Path, version: int, attempt: str) -> None:
    copy = _copy(tmp_path)
    _at_v2(copy)
    assert not copy.step_back(version=version, attempt=attempt)
    assert (copy.version, copy.attempt) == (2, "A2")
    assert _items(copy) == {b"a": b"2", b"c": b"2"}
    copy.close()


def test_mark_clean_keeps_the_undo_record(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    copy.apply([(b"a", b"1")], version=1, root_id=ROOT, attempt="A1", undo=True)
    copy.apply([(b"a", b"2")], version=2, root_id=ROOT, attempt="A2", dirty=True, undo=True)
    assert copy.version is None  # dirty: not a committed version yet
    copy.mark_clean()
    assert copy.version == 2
    assert copy.step_back(version=1, attempt="A1")
    assert copy.get(b"a") == b"1"
    copy.close()


def test_a_commit_too_large_for_an_undo_record_keeps_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_label, "MAX_UNDO_BYTES", 100)
    copy = _copy(tmp_path)
    big = [(b"k%d" % i, b"x" * 50) for i in range(10)]
    copy.apply(big, version=1, root_id=ROOT, attempt="A1", undo=True)
    copy.apply([(k, b"y") for k, _ in big], version=2, root_id=ROOT, attempt="A2", undo=True)
    assert not copy.can_step_back
    assert not copy.step_back(version=1, attempt="A1")
    copy.close()


@pytest.mark.parametrize("changed", [_label.MAX_UNDO_KEYS, _label.MAX_UNDO_KEYS + 1])
def test_a_commit_of_many_keys_keeps_no_undo_record(tmp_path: Path, changed: int) -> None:
    """Reading every old value would cost the commit more than a rare re-run saves."""
    copy = _copy(tmp_path)
    copy.apply([(b"k", b"v")], version=1, root_id=ROOT, attempt="A1", undo=True)
    many = [(b"k%06d" % i, b"v") for i in range(changed)]
    copy.apply(many, version=2, root_id=ROOT, attempt="A2", undo=True)
    assert copy.can_step_back is (changed <= _label.MAX_UNDO_KEYS)
    copy.close()


def test_a_replay_keeps_no_undo_record(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    copy.apply([(b"a", b"1")], version=1, root_id=ROOT, attempt="A1")
    assert not copy.can_step_back
    copy.close()


def test_undo_records_round_trip_and_garbage_is_no_record() -> None:
    record = encode_undo(7, "A7", [(b"k", b"v"), (b"gone", None), (b"e", b"")])
    assert record is not None
    undo = decode_undo(record)
    assert undo is not None
    assert (undo.parent_version, undo.parent_attempt) == (7, "A7")
    assert undo.changes == [(b"k", b"v"), (b"gone", None), (b"e", b"")]
    assert decode_undo(record[:-1]) is None
    assert decode_undo(record + b"x") is None
    assert decode_undo(b"not an undo record") is None


def test_labels_of_statekeeper_0_1_and_with_undo_parse() -> None:
    legacy, undo = parse_label(pack_label(3, dirty=False, root_id=ROOT, attempt=""))
    assert (legacy.version, legacy.attempt, undo) == (3, "format1", None)
    record = encode_undo(2, "A2", [(b"k", None)])
    label, raw = parse_label(pack_label(3, dirty=True, root_id=ROOT, attempt="A3", undo=record))
    assert (label.version, label.dirty, label.root_id, label.attempt) == (3, True, ROOT, "A3")
    assert label.has_undo
    assert raw == record
