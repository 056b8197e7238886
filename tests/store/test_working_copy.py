"""The working copy's label and undo record, its share of the process's RocksDB memory and
its removal, on a real RocksDB."""

from __future__ import annotations

import bisect
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import rocksdict
from hypothesis import given, settings
from hypothesis import strategies as st

from statekeeper.changelog import Columns
from statekeeper.errors import StateKeeperError
from statekeeper.store import _label, _rocks, _working_copy
from statekeeper.store._label import decode_undo, encode_undo, pack_label, parse_label
from statekeeper.store._rocks import SHARED_MEMORY, SharedMemory
from statekeeper.store._working_copy import (
    WorkingCopy,
    remove_unused_copy,
    unmark_copy,
    upload_journal_path,
)

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


# -- the commit's write ------------------------------------------------------------------------


@pytest.mark.parametrize("deletes", [False, True])
def test_columns_apply_as_their_pairs_do_with_the_same_undo_record(
    tmp_path: Path, deletes: bool
) -> None:
    """A commit hands its encoded columns to the copy: the data, the label and the undo
    record are those of applying the same changes as pairs."""
    base = [(b"k%03d" % i, b"old%d" % i) for i in range(0, 40, 2)]
    changes = [(b"k%03d" % i, None if deletes and i % 3 == 0 else b"new%d" % i) for i in range(30)]
    copies = []
    for name, form in (("pairs", changes), ("columns", Columns.of(changes))):
        copy = WorkingCopy(
            str(tmp_path / name), write_buffer_mb=1, memory_mb=64, checkpoint_interval_s=60
        )
        copy.apply(base, version=1, root_id=ROOT, attempt="A1")
        copy.apply(form, version=2, root_id=ROOT, attempt="A2", undo=True)
        copies.append(copy)
    pairs, columns = copies
    assert _items(columns) == _items(pairs)
    expected = dict(base)
    for key, value in changes:
        if value is None:
            expected.pop(key, None)
        else:
            expected[key] = value
    assert _items(columns) == expected
    assert (columns.version, columns.attempt, columns.can_step_back) == (2, "A2", True)
    assert columns._raw_label() == pairs._raw_label()  # the same label and undo record
    assert columns.step_back(version=1, attempt="A1")
    assert _items(columns) == dict(base)
    for copy in copies:
        copy.close()


@pytest.mark.parametrize("order", ["ascending", "any"])
@pytest.mark.parametrize(
    ("asked", "limit"),
    [
        ("every key", 4),  # one ordered read of the whole range
        ("every third key", 4),  # dense enough to read in order, with gaps
        ("every third key", 1),  # the read stops at its limit: the rest key by key
        ("every fiftieth key", 4),  # sparse: key by key
    ],
)
def test_multi_get_answers_as_gets_do_whichever_way_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str, limit: int, order: str
) -> None:
    """Keys present and absent, repeated, before and after every item, ascending or in no
    order, in a memtable and in SST files: the answers are those of one get per key,
    whether multi_get reads the range in order or key by key, and wherever an ordered read
    stops."""
    monkeypatch.setattr(_working_copy, "_SCAN_LIMIT", limit)
    monkeypatch.setattr(_working_copy, "_SCAN_GRACE", 100)
    copy = _copy(tmp_path)
    present = [b"k%05d" % i for i in range(0, 6000, 2)]
    copy.apply([(k, k[::-1]) for k in present[:2000]], version=1, root_id=ROOT, attempt="A1")
    copy.flush()
    copy.apply([(k, k[::-1]) for k in present[2000:]], version=2, root_id=ROOT, attempt="A2")
    step = {"every key": 1, "every third key": 3, "every fiftieth key": 50}[asked]
    keys = [b"k%05d" % i for i in range(0, 6001, step)]  # odd ones are absent
    keys = [*reversed(keys), keys[7], keys[7], b"zz", b"a", keys[-1]]
    if order == "ascending":
        keys.sort()
    expected = [copy.get(k) for k in keys]
    db = copy._db
    counted = _CountingGets(db)
    copy._db = counted  # type: ignore[assignment]
    assert copy.multi_get(keys) == expected
    copy._db = db
    # The way it read: in order (no get per key), partly (gets past the limit), key by key.
    if step == 50:
        assert counted.gets == len(keys)
    elif limit == 1:  # 1.5 items per key: the pass stops a little after its grace
        assert 0 < counted.gets < len(keys) - 100
    else:
        assert counted.gets == 0
    assert copy.multi_get([]) == []
    copy.close()


_KEYS = st.binary(min_size=1, max_size=3)


@settings(max_examples=200)
@given(
    writes=st.lists(
        st.lists(st.tuples(_KEYS, st.one_of(st.none(), st.binary(max_size=4))), max_size=30),
        min_size=1,
        max_size=3,
    ),
    asked=st.lists(_KEYS, min_size=1, max_size=40),
    per_key=st.integers(0, 3),
    grace=st.integers(0, 8),
)
def test_read_values_answers_a_prefix_of_the_keys_as_gets_do(
    writes: list[list[tuple[bytes, bytes | None]]], asked: list[bytes], per_key: int, grace: int
) -> None:
    """Puts and deletes over several flushed files and a memtable, keys asked in ascending
    order with repeats: the keys the pass answers are a prefix, answered as gets answer
    them, and it stops where it would step over more items than it was allowed."""
    with tempfile.TemporaryDirectory() as tmp:
        db = rocksdict.Rdict(tmp, rocksdict.Options(raw_mode=True))
        try:
            for batch in writes:
                for key, value in batch:
                    if value is None:
                        db.delete(key)
                    else:
                        db.put(key, value)
                db.flush()
            db.put(b"\x00", b"memtable")  # and one item in the memtable
            asked.sort()
            values, answered = _rocks.read_values(db, asked, per_key, grace)
            assert len(values) == answered <= len(asked)
            assert values == [db.get(k) for k in asked[:answered]]
            # To answer key n it steps over the items from the first key asked up to key n:
            # it stops at the first n for which those are more than grace + per_key * n.
            live = [k for k, _ in _rocks.read_range(db, asked[0], asked[-1], 1 << 20)]
            over = (
                n for n, k in enumerate(asked) if bisect.bisect_left(live, k) > grace + per_key * n
            )
            assert answered == next(over, len(asked))
        finally:
            db.close()


def test_multi_get_in_order_reads_in_order_where_unordered_keys_would_not(
    tmp_path: Path,
) -> None:
    """A third of the keys, ascending, are read in one ordered pass (no sort to pay for);
    the same keys in no order are read key by key."""
    copy = _copy(tmp_path)
    copy.apply([(b"k%05d" % i, b"v") for i in range(3000)], version=1, root_id=ROOT, attempt="A1")
    copy.flush()
    keys = [b"k%05d" % i for i in range(0, 3000, 3)]
    db = copy._db
    for asked, gets in ((keys, 0), (keys[::-1], len(keys))):
        counted = _CountingGets(db)
        copy._db = counted  # type: ignore[assignment]
        assert copy.multi_get(asked) == [b"v"] * len(keys)
        assert counted.gets == gets
    copy._db = db
    copy.close()


def test_multi_get_reads_in_order_when_overwrites_inflate_the_key_count(
    tmp_path: Path,
) -> None:
    """RocksDB's key count adds up a key once per file that holds it: overwritten in three
    flushed versions, 3,000 keys count as about 9,000. Half of them, ascending, are still
    read in one ordered pass."""
    copy = _copy(tmp_path)
    keys = [b"k%05d" % i for i in range(3000)]
    for version in range(1, 4):
        value = b"v%d" % version
        copy.apply([(k, value) for k in keys], version=version, root_id=ROOT, attempt="A")
        copy.flush()
    assert copy._db.property_int_value("rocksdb.estimate-num-keys") >= 3 * 3000 - 100
    db = copy._db
    counted = _CountingGets(db)
    copy._db = counted  # type: ignore[assignment]
    assert copy.multi_get(keys[::2]) == [b"v3"] * 1500
    assert counted.gets == 0
    copy._db = db
    copy.close()


@pytest.mark.parametrize("chunk", [1, 2, 1024])
def test_scan_returns_exactly_the_items_under_a_prefix_after_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Prefixes that end in 0xFF or are all 0xFF, ``after`` and ``start`` keys inside,
    before and past the prefix's range, and chunk edges anywhere: the items are those of a
    filter over every item."""
    monkeypatch.setattr(_rocks, "SCAN_CHUNK", chunk)
    copy = _copy(tmp_path)
    keys = [b"a", b"a\x00", b"a\xff", b"a\xff\x00", b"a\xff\xff", b"b", b"\xff", b"\xff\xff\x01"]
    keys += [b"k%03d" % i for i in range(40)]
    copy.apply([(k, k * 2) for k in keys], version=1, root_id=ROOT, attempt="A1")
    every = sorted((k, k * 2) for k in keys)
    bounds = [None, b"", b"a\xff", b"k010", b"k039", b"zz"]
    for prefix in [b"", b"a", b"a\xff", b"\xff", b"\xff\xff", b"k0", b"z"]:
        for after, start in itertools.product(bounds, bounds):
            expected = [
                (k, v)
                for k, v in every
                if k.startswith(prefix)
                and (after is None or k > after)
                and (start is None or k >= start)
            ]
            got = list(copy.scan(prefix, after=after, start=start))
            assert got == expected, (prefix, after, start)
    copy.close()


class _CountingGets:
    """A RocksDB handle that counts point reads."""

    def __init__(self, db: rocksdict.Rdict) -> None:
        self._db = db
        self.gets = 0

    def get(self, key: bytes) -> bytes | None:
        self.gets += 1
        return self._db.get(key)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


def test_a_write_behind_is_seen_by_every_later_call_from_any_thread(tmp_path: Path) -> None:
    """A commit's write runs on a helper thread after the commit returns; reads, labels,
    checkpoints (the snapshot thread) and close all wait for it, so none sees the version
    before it, and the undo record is the one of the new version's parent."""
    copy = _copy(tmp_path)
    copy.apply([(b"a", b"1")], version=1, root_id=ROOT, attempt="A1")
    columns = Columns.of([(b"a", b"2"), (b"b", b"2")])
    copy.write_behind(columns, version=2, root_id=ROOT, attempt="A2")
    with ThreadPoolExecutor(1) as pool:  # another thread: the snapshot's checkpoint
        assert pool.submit(copy.checkpoint, str(tmp_path / "cp")).result() == (2, "A2")
    assert (copy.version, copy.attempt, _items(copy)) == (2, "A2", {b"a": b"2", b"b": b"2"})
    copy.write_behind(Columns.of([(b"c", b"3")]), version=3, root_id=ROOT, attempt="A3")
    copy.close()  # waits, then flushes: the write is on disk
    copy = _copy(tmp_path)
    assert (copy.version, _items(copy)) == (3, {b"a": b"2", b"b": b"2", b"c": b"3"})
    assert copy.step_back(version=2, attempt="A2")
    assert _items(copy) == {b"a": b"2", b"b": b"2"}
    copy.close()


def test_a_failed_write_behind_is_raised_by_every_later_call_and_close_still_works(
    tmp_path: Path,
) -> None:
    copy = _copy(tmp_path)
    copy.apply([(b"a", b"1")], version=1, root_id=ROOT, attempt="A1")
    # A value RocksDB's write batch refuses: the helper's write fails before writing.
    bad = Columns.trusted([b"a"], ["not bytes"])  # type: ignore[list-item]
    copy.write_behind(bad, version=2, root_id=ROOT, attempt="A2")
    for _ in range(2):
        with pytest.raises(StateKeeperError, match="the write of version 2 to the local"):
            copy.get(b"a")
    copy.close()  # logs the failure, releases the database
    copy = _copy(tmp_path)
    assert (copy.version, _items(copy)) == (1, {b"a": b"1"})
    copy.close()


# The same failure once the main thread has returned: the write then runs in the
# committing thread itself, and must still not pass for the helper's own call.
EXITING_WRITE_CHILD = r"""
import sys, threading
from statekeeper.changelog import Columns
from statekeeper.errors import StateKeeperError
from statekeeper.store._working_copy import WorkingCopy
def work():
    threading.main_thread().join()
    copy = WorkingCopy(sys.argv[1], write_buffer_mb=1, memory_mb=64, checkpoint_interval_s=60)
    copy.apply([(b"a", b"1")], version=1, root_id="r" * 32, attempt="A1")
    bad = Columns.trusted([b"a"], ["not bytes"])
    copy.write_behind(bad, version=2, root_id="r" * 32, attempt="A2")
    for _ in range(2):
        try:
            copy.get(b"a")
        except StateKeeperError as exc:
            print("raised:", exc, flush=True)
    copy.close()
threading.Thread(target=work).start()
"""


def test_a_write_behind_run_in_the_committing_thread_at_exit_still_raises(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EXITING_WRITE_CHILD, str(tmp_path / "copy")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr
    assert all("raised: the write of version 2 to the local" in line for line in lines)
    copy = _copy(tmp_path)
    assert (copy.version, _items(copy)) == (1, {b"a": b"1"})
    copy.close()


def _ssts(copy: WorkingCopy) -> list[str]:
    return [name for name in os.listdir(copy.path) if name.endswith(".sst")]


def test_a_due_flush_runs_in_the_background_and_makes_the_version_durable(
    tmp_path: Path,
) -> None:
    """The periodic flush is started, not waited for (the disk has room); it still writes
    the version: a copy closed without flushing afterwards reopens at that version."""
    copy = WorkingCopy(
        str(tmp_path / "copy"), write_buffer_mb=16, memory_mb=64, checkpoint_interval_s=0
    )
    copy.apply([(b"a", b"1"), (b"b", b"2")], version=1, root_id=ROOT, attempt="A1")
    assert _ssts(copy) == []
    assert copy.flush_if_due()
    deadline = time.monotonic() + 60
    while not _ssts(copy) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _ssts(copy), "the background flush never wrote a table file"
    copy.close(flush=False)
    again = WorkingCopy(
        str(tmp_path / "copy"), write_buffer_mb=16, memory_mb=64, checkpoint_interval_s=60
    )
    assert (again.version, _items(again)) == (1, {b"a": b"1", b"b": b"2"})
    again.close()


_COMPACTING = """
import json, os, sys, time
from statekeeper.store._working_copy import WorkingCopy
copy = WorkingCopy(sys.argv[1], write_buffer_mb=1, memory_mb=64, checkpoint_interval_s=1e9)
for version in range(1, 7):  # six level-0 files: beyond the compaction trigger (4)
    copy.apply([(b"%06d" % k, os.urandom(100)) for k in range(5000)], version=version,
               root_id="r" * 32, attempt="a")
    copy.flush()
nice = {}
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as fh:
            stat = fh.read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        nice[comm] = int(stat[stat.rindex(")") + 2 :].split()[16])
    if nice.get("rocksdb:low") == 19:
        break
    time.sleep(0.05)
options = max(n for n in os.listdir(sys.argv[1]) if n.startswith("OPTIONS-"))
with open(os.path.join(sys.argv[1], options)) as fh:
    text = fh.read()
copy.close()
print(json.dumps({"nice": nice, "options": text}))
"""


def test_background_work_stays_off_the_commit_path(tmp_path: Path) -> None:
    """RocksDB's compactions run at low CPU priority, its flushes at normal priority, and
    the options RocksDB records say writes are not slowed before 48 level-0 files."""
    out = subprocess.run(
        [sys.executable, "-c", _COMPACTING, str(tmp_path / "copy")],
        capture_output=True, text=True, check=True, timeout=180,
    )  # fmt: skip
    found = json.loads(out.stdout)
    assert found["nice"].get("rocksdb:low") == 19, found["nice"]
    assert found["nice"].get("rocksdb:high", 0) == 0, found["nice"]
    options = found["options"]
    for line in (
        "level0_slowdown_writes_trigger=48",
        "level0_stop_writes_trigger=96",
        "max_write_buffer_number=4",
        "bytes_per_sync=1048576",
    ):
        assert line in options, line


# -- the process's shared RocksDB memory ------------------------------------------------------


def test_the_shared_memory_grows_to_the_largest_budget_and_never_shrinks() -> None:
    shared = SharedMemory()
    cache, buffers = shared.reserve(8)
    assert (shared.memory_mb, buffers.get_buffer_size()) == (8, 4 << 20)
    assert shared.reserve(16) == (cache, buffers)  # the same objects, resized
    assert (shared.memory_mb, buffers.get_buffer_size()) == (16, 8 << 20)
    shared.reserve(4)
    assert (shared.memory_mb, buffers.get_buffer_size()) == (16, 8 << 20)


# A fresh process: the memory of the test process is already shared at some other size.
_WRITER = """
import json, os, sys
from statekeeper.store._rocks import SHARED_MEMORY
from statekeeper.store._working_copy import WorkingCopy
folder, memory_mb = sys.argv[1], int(sys.argv[2])
copies = [WorkingCopy(os.path.join(folder, str(i)), write_buffer_mb=64, memory_mb=memory_mb,
                      checkpoint_interval_s=1e9) for i in range(4)]
peak = 0
for version in range(1, 4):
    for copy in copies:
        changes = [(b"%d-%06d" % (version, k), os.urandom(100)) for k in range(7000)]
        copy.apply(changes, version=version, root_id="r" * 32, attempt="a")
        peak = max(peak, SHARED_MEMORY.usage()[1])
        assert dict(copy.scan(b"%d-" % version)) == dict(changes)
ssts = [sum(n.endswith(".sst") for n in os.listdir(c.path)) for c in copies]
print(json.dumps({"peak": peak, "bound": SHARED_MEMORY.buffers.get_buffer_size(), "ssts": ssts}))
for copy in copies:
    copy.close()
"""


def _memtables(folder: Path, memory_mb: int) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _WRITER, str(folder), str(memory_mb)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    result: dict[str, int] = json.loads(out.stdout)
    return result


def test_the_memtables_of_all_copies_stay_within_the_process_budget(tmp_path: Path) -> None:
    """Four copies, three commits of ~0.8 MB each: with a 4 MB budget (2 MB of memtables)
    the memtables are flushed as they go; with a large one they hold everything."""
    commit = 7000 * 110
    small = _memtables(tmp_path / "small", 4)
    assert small["bound"] == 2 << 20
    assert small["peak"] <= small["bound"] + 2 * commit, small
    assert all(n > 0 for n in small["ssts"]), small  # every copy was flushed
    large = _memtables(tmp_path / "large", 1024)
    assert large["peak"] > 12 * commit, large  # all twelve commits still in memtables
    assert large["ssts"] == [0, 0, 0, 0], large


# -- removing an unused copy ------------------------------------------------------------------

_HOLDER = """
import sys
from statekeeper.store._working_copy import WorkingCopy
copy = WorkingCopy(sys.argv[1], write_buffer_mb=1, memory_mb=8, checkpoint_interval_s=60)
print("open", flush=True)
sys.stdin.readline()
copy.close()
"""


def test_an_unused_copy_is_removed_with_what_lies_beside_it(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    _at_v2(copy)
    copy.set_lineage("ckpt", 2)
    journal = upload_journal_path(copy.path)
    journal.write_text("{}\n")
    os.makedirs(f"{copy.path}.checkpoints/stale")
    assert not remove_unused_copy(copy.path)  # open in this process
    assert os.path.isdir(copy.path)
    copy.close()
    lock = f"{copy.path}.lock"
    Path(lock).write_text("kept")
    assert remove_unused_copy(copy.path)
    assert not os.path.exists(copy.path)
    assert not os.path.exists(copy.lineage_path)
    assert not journal.exists()
    assert not os.path.exists(f"{copy.path}.checkpoints")
    assert Path(lock).read_text() == "kept"  # lock files are never deleted
    fresh = _copy(tmp_path)
    assert (_items(fresh), fresh.version) == ({}, None)  # opens afresh
    fresh.close()


def test_a_destroyed_copy_takes_its_lineage_and_upload_journal_with_it(tmp_path: Path) -> None:
    """A restore that replaces a copy destroys it: a journal of its files would only make
    the next upload from the new database at that path check files it cannot resume."""
    copy = _copy(tmp_path)
    _at_v2(copy)
    copy.set_lineage("ckpt", 2)
    upload_journal_path(copy.path).write_text("{}\n")
    copy.destroy()
    assert not os.path.exists(copy.path)
    assert not os.path.exists(copy.lineage_path)
    assert not upload_journal_path(copy.path).exists()


def test_lineage_records_written_by_two_threads_at_once_do_not_collide(tmp_path: Path) -> None:
    """A background snapshot and ``snapshot_now`` may finish together: both record the
    lineage. Through one temporary file, one thread's rename found the file gone
    (``FileNotFoundError`` out of ``snapshot_now``, 6 times in 30 commits)."""
    copy = _copy(tmp_path)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def record(name: str) -> None:
        start.wait()
        try:
            for version in range(300):
                copy.set_lineage(name, version)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=record, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert copy.lineage in {("a", 299), ("b", 299)}
    copy.close()


def test_a_lineage_record_holds_only_for_the_database_it_was_written_for(
    tmp_path: Path,
) -> None:
    """A snapshot ending after its copy was set aside (or closed and rebuilt by another
    backend) writes its record beside whatever database is at the path by then; read for
    that database, it must not hold (its files would be trusted by name against another
    database's). A copy reopened as it is keeps its record; one whose files a restore
    replaces (``unmark_copy``) does not."""
    copy = _copy(tmp_path)
    copy.set_lineage("a" * 32, 3)
    copy.close()
    copy = _copy(tmp_path)
    assert copy.lineage == ("a" * 32, 3)  # the same database, reopened
    copy.close()
    copy.set_lineage("b" * 32, 4)  # a late snapshot of the closed copy: still its database
    copy = _copy(tmp_path)
    assert copy.lineage == ("b" * 32, 4)
    old = copy
    old.set_aside("test")
    new = _copy(tmp_path)  # a new database at the path
    old.set_lineage("c" * 32, 5)  # the set-aside copy's snapshot ends late
    assert new.lineage is None
    new.close()
    unmark_copy(new.path)  # a restore replaces its files in place
    old_record = Path(new.lineage_path).read_text()
    restored = _copy(tmp_path)
    Path(restored.lineage_path).write_text(old_record)
    assert restored.lineage is None
    restored.close()
    stale = _copy(tmp_path)  # closed, its snapshot still uploading
    stale.close()
    discarded = _copy(tmp_path)  # another backend discards the database (a re-run)
    discarded.destroy()
    fresh = _copy(tmp_path)
    stale.set_lineage("d" * 32, 6)  # found by review: this one was trusted
    assert fresh.lineage is None
    fresh.close()


def test_a_copy_open_in_another_process_is_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "copy")
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "open"
        assert not remove_unused_copy(path)
        assert os.path.isdir(path)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
    assert remove_unused_copy(path)
    assert not os.path.exists(path)


def test_a_copy_made_with_other_options_reopens_with_todays(tmp_path: Path) -> None:
    """rocksdict opens an existing database's column family with the options its OPTIONS
    file recorded unless it is given them: a copy created under other settings (here
    RocksDB's defaults, as by an older release) must reopen with today's stall triggers and
    read through the process's shared block cache, or the memory bound does not hold."""
    path = tmp_path / "copy"
    old = rocksdict.Options(raw_mode=True)
    old.create_if_missing(True)
    db = rocksdict.Rdict(str(path), old)
    keys = [b"k%08d" % i for i in range(50_000)]
    for key in keys:
        db[key] = b"v" * 100
    db.flush()
    db.close()
    copy = _copy(tmp_path)
    try:
        cache = SHARED_MEMORY.cache
        assert cache is not None
        before = cache.get_usage()
        assert copy.multi_get(keys[::50]) == [b"v" * 100] * len(keys[::50])
        assert cache.get_usage() > before  # the blocks read landed in the shared cache
    finally:
        copy.close()
    newest = max(n for n in os.listdir(path) if n.startswith("OPTIONS-"))
    assert "level0_slowdown_writes_trigger=48" in (path / newest).read_text()
