"""The demo: end to end as a user runs it (a subprocess of the CLI), and its parts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statekeeper import StateBackend, StoreConfig
from statekeeper.cli.demo import DemoError, DemoOptions
from statekeeper.cli.demo._clicks import SPAN_S, T0, Click, batch_clicks, write_batch
from statekeeper.cli.demo._reference import (
    Found,
    compare,
    expected_sessions,
    state_of,
    watermarks_ms,
)
from statekeeper.cli.demo._sessionizer import Sessionizer, merge_click
from statekeeper.cli.demo._workdir import MARKER_FILE, ROOT_MARKER, prepare

PARTITIONS = 3
BATCHES = 4


@pytest.mark.spark
@pytest.mark.slow
def test_demo_crashes_restores_and_passes_its_equality_check(tmp_path: Path) -> None:
    """A small demo exits 0 and prints PASSED, its timers closed sessions and it dropped the
    late clicks the reference drops; its driver was really SIGKILLed mid-run, the
    restart opened every partition (from its local working copy, or from the root if the
    copy was ahead of the re-run batch), the cold phase restored every partition from the
    root, which ends at version ``batches`` in every partition and verifies clean."""
    root, demo_dir = tmp_path / "root", tmp_path / "demo"
    command = [
        sys.executable, "-m", "statekeeper", "demo", "--keys", "40", "--batches", str(BATCHES),
        "--partitions", str(PARTITIONS), "--format", "parquet", "--dir", str(demo_dir),
        "--root", str(root), "--local-dir", str(tmp_path / "local"),
    ]  # fmt: skip
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    # The timeout catches a hang: the demo took 8 min on 2 cores at load average 20.
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path, check=False
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr

    passed = re.search(r"^equality check: PASSED \((\d+) users, (\d+) sessions\)$", out, re.M)
    assert passed is not None, out
    assert 0 < int(passed[1]) <= 40
    assert int(passed[2]) > int(passed[1])  # sessions did end and start again
    # the stream's late rows and timer-closed sessions are the reference's
    reference = re.search(r"clicks \(pandas\), (\d+) of them late: (\d+) sessions closed", out)
    stream = re.search(r"(\d+) late rows dropped, (\d+) sessions closed by timers", out)
    assert reference is not None, out
    assert stream is not None, out
    assert stream.groups() == reference.groups()
    assert int(stream[2]) > 0

    crash = re.search(r"CRASH: killed the driver \(pid (\d+)\)", out)
    assert crash is not None, out
    with pytest.raises(ProcessLookupError):
        os.kill(int(crash[1]), 0)  # gone (and reaped) before the demo went on
    assert "the driver's exit status is -9" in out
    restart = re.search(r"restore after the crash \(batch \d+\): (\d+) of (\d+) stores reused "
                        r"locally, (\d+) from the root", out)  # fmt: skip
    assert restart is not None, out
    assert int(restart[1]) + int(restart[3]) == int(restart[2]) == PARTITIONS
    cold = rf"restore empty local dir \(batch \d+\): 0 of {PARTITIONS} stores reused locally, "
    assert re.search(cold + rf"{PARTITIONS} from the root", out), out
    assert re.search(r"verify: \d+ blobs checked, no problems", out), out

    with StateBackend(root) as backend:
        latest = [backend.versions("sessions", p)[-1] for p in range(PARTITIONS)]
    assert latest == [BATCHES] * PARTITIONS
    assert (tmp_path / "local" / "statekeeper-demo" / "working").is_dir()
    assert (demo_dir / MARKER_FILE).is_file()


def test_the_reference_closes_sessions_at_the_watermark_and_drops_late_clicks() -> None:
    """Batch b's watermark is the newest click of batches before b minus the delay; a click
    at or before the previous batch's watermark is dropped; a session is in the sink once
    the last watermark reaches its last click + gap, else open in the state."""
    batches = [
        [Click("a", 1000, "home", 1), Click("a", 1060, "home", 2), Click("b", 1100, "help", 3)],
        [Click("a", 1181, "cart", 4), Click("c", 1500, "home", 5)],  # a: 121 s later
        [Click("b", 1150, "home", 6), Click("c", 1550, "deals", 7)],  # b: in time (W0 = 0)
        # late against W2 = 1500 - 100 = 1400 s: b's 1100 (dropped), not d's 1451
        [Click("b", 1100, "help", 8), Click("d", 1451, "home", 9), Click("a", 1700, "home", 10)],
    ]
    assert watermarks_ms(batches, delay_s=100) == [0, 1_000_000, 1_400_000, 1_450_000]
    expected = expected_sessions(batches, gap_s=120, delay_s=100)
    assert expected.late == 1
    assert expected.watermark_ms == 1_450_000
    # (1060 + 120) and (1150 + 120) s are at or before 1450 s; 1181 + 120 is too
    assert expected.closed == [("a", 1, 1000, 1060, 2), ("a", 2, 1181, 1181, 1),
                               ("b", 1, 1100, 1150, 2)]  # fmt: skip
    assert expected.open == {"a": [[1700, 1700, 1]], "c": [[1500, 1550, 2]], "d": [[1451, 1451, 1]]}
    assert expected.summary == {
        "a": {"sessions": 2, "events": 4},
        "b": {"sessions": 1, "events": 2},
        "c": {"sessions": 0, "events": 2},
        "d": {"sessions": 0, "events": 1},
    }
    assert expected.pages["b"] == {"help": 1, "home": 1}
    assert expected.sessions == 6

    assert expected.timers == {"a": [1_820_000], "c": [1_670_000], "d": [1_571_000]}

    found = Found(
        dict(expected.summary), dict(expected.open), dict(expected.pages), dict(expected.timers)
    )
    assert compare(expected, expected.closed, found).passed
    found.open["c"] = [[1500, 1550, 3]]
    del found.timers["d"]
    outcome = compare(expected, expected.closed[1:], found)
    assert outcome.differences == [
        "sink lacks 1x session ('a', 1, 1000, 1060, 2)",
        "state 'open' of c: expected [[1500, 1550, 2]], found [[1500, 1550, 3]]",
        "state 'timers' lacks user d: [1571000]",
    ]


def test_state_of_reads_read_state_rows_timers_included() -> None:
    """Rows as ``read_state`` returns them: JSON values and map keys, timers as rows of
    state ``$timer`` with their expiry in ``entry`` and no value."""
    rows = [
        {"user": "a", "state": "summary", "entry": None, "value": '{"sessions": 1, "events": 3}'},
        {"user": "a", "state": "open", "entry": None, "value": "[[10, 20, 2]]"},
        {"user": "a", "state": "pages", "entry": '"home"', "value": "3"},
        {"user": "a", "state": "$timer", "entry": "140000", "value": None},
        {"user": "a", "state": "$timer", "entry": "9000", "value": None},
    ]
    found = state_of(rows)
    assert found == Found(
        summary={"a": {"sessions": 1, "events": 3}},
        open={"a": [[10, 20, 2]]},
        pages={"a": {"home": 3}},
        timers={"a": [9000, 140000]},
    )


def test_a_click_joins_bridges_or_opens_sessions() -> None:
    """A click within the gap of a session extends it (before or after), one that bridges
    two merges them, any other opens its own; the list stays sorted."""
    sessions = [[100, 200, 3], [500, 600, 2]]
    assert merge_click(sessions, 250, 60) == [[100, 250, 4], [500, 600, 2]]
    assert merge_click(sessions, 50, 60) == [[50, 200, 4], [500, 600, 2]]
    assert merge_click([[100, 200, 3], [300, 400, 1]], 250, 60) == [[100, 400, 5]]
    assert merge_click(sessions, 350, 60) == [[100, 200, 3], [350, 350, 1], [500, 600, 2]]
    assert merge_click([], 7, 60) == [[7, 7, 1]]


def _events(clicks: list[Click]) -> Any:
    import pyarrow as pa

    return pa.table(
        {
            "user": pa.array([c.user for c in clicks], pa.string()),
            "ts": pa.array([c.ts for c in clicks], pa.int64()),
            "page": pa.array([c.page for c in clicks], pa.string()),
            "event_id": pa.array([c.event_id for c in clicks], pa.int64()),
            "event_time": pa.array([c.ts * 1000 for c in clicks], pa.timestamp("ms")),
        }
    )


def test_the_sessionizer_equals_the_reference_batch_by_batch() -> None:
    """The demo's processor, run by the same runner as a Spark task (ProcessorTester) over
    the generator's batches with stragglers, emits exactly the reference's closed sessions
    and leaves exactly its open state, with late clicks dropped, out-of-order clicks
    accepted and sessions of users who stopped clicking closed by timers."""
    import pyarrow as pa

    from statekeeper.keyed.testing import ProcessorTester

    schema = pa.schema(
        [(n, pa.string() if n == "user" else pa.int64())
         for n in ("user", "session", "start_ts", "end_ts", "events")]
    )  # fmt: skip
    batches = [batch_clicks(seed=7, batch=b, keys=120) for b in range(7)]
    sink: list[tuple[Any, ...]] = []
    late = 0
    found = Found()
    with ProcessorTester(
        Sessionizer(gap_s=120), keys="user", output_schema=schema, time_mode="event_time",
        event_time_column="event_time", watermark_delay=300,
    ) as tester:  # fmt: skip
        for clicks in batches:
            sink += [tuple(r.values()) for r in tester.run(_events(clicks))]
            late += tester.stats.late_rows
            assert tester.stats.timers_fired == tester.stats.rows_out
        for entry in tester.state():
            if entry.state == "pages":
                found.pages.setdefault(entry.key[0], {})[entry.entry] = entry.value
            else:
                getattr(found, entry.state)[entry.key[0]] = entry.value
        for key, expiry in tester.timers():
            found.timers.setdefault(key[0], []).append(expiry)
    for expiries in found.timers.values():
        expiries.sort()
    expected = expected_sessions(batches, gap_s=120, delay_s=300)
    assert compare(expected, sink, found).differences == []  # timers included
    assert late == expected.late > 0
    assert len(expected.closed) > 100
    # users who stopped clicking: their last session was closed by the watermark alone
    active_last = {c.user for c in batches[-1]}
    assert any(row[0] not in active_last and row[0] not in expected.open for row in sink)
    # stragglers out of order: some accepted click is older than a click of an earlier batch
    seen: dict[str, int] = {}
    older = 0
    for clicks in batches:
        older += sum(c.ts < seen.get(c.user, 0) for c in clicks)
        for c in clicks:
            seen[c.user] = max(seen.get(c.user, 0), c.ts)
    assert older > expected.late


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_batch_files_hold_the_generated_clicks(tmp_path: Path, fmt: str) -> None:
    """Every format round-trips the batch's clicks; the generator is deterministic, keeps
    each batch in its own event-time window but for a few stragglers from the two windows
    before it (none in batch 0), and leaves no temporary file behind."""
    import pandas as pd

    clicks = batch_clicks(seed=3, batch=2, keys=30)
    assert clicks == batch_clicks(seed=3, batch=2, keys=30)
    assert clicks != batch_clicks(seed=4, batch=2, keys=30)
    start = T0 + 2 * SPAN_S
    stragglers = [c for c in clicks if c.ts < start]
    assert 0 < len(stragglers) < len(clicks) / 10
    assert all(start - 2 * SPAN_S <= c.ts for c in stragglers)
    assert all(c.ts < start + SPAN_S for c in clicks)
    assert all(T0 <= c.ts < T0 + SPAN_S for c in batch_clicks(seed=3, batch=0, keys=30))
    path = write_batch(tmp_path, 2, clicks, fmt)  # type: ignore[arg-type]
    if fmt == "json":
        frame = pd.read_json(path, lines=True)
    elif fmt == "csv":
        frame = pd.read_csv(path)
    else:
        frame = pd.read_parquet(path)
    assert [Click(*row) for row in frame.itertuples(index=False)] == clicks
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("batches", range(4, 12))
def test_every_phase_gets_input(batches: int) -> None:
    """The crash phase has two files or more (one finishes, one is cut short); the restart
    and the cold phase each add at least one; together they cover every batch once."""
    plan = DemoOptions(batches=batches).plan()
    assert plan.crash[0] == 0
    assert plan.crash[1] >= 2
    assert plan.crash[1] == plan.restart[0] < plan.restart[1] == plan.cold[0] < plan.cold[1]
    assert plan.cold[1] == batches
    assert plan.kill_after == plan.crash[1] - 2


def test_prepare_wipes_a_previous_run_and_refuses_other_folders(tmp_path: Path) -> None:
    """A demo folder is wiped (or, with fresh=False, refused); a folder that is not one is
    never touched."""
    folder = tmp_path / "demo"
    options = DemoOptions(directory=str(folder))
    prepare(options)
    (folder / "input").mkdir()
    with pytest.raises(DemoError, match="previous demo run"):
        prepare(DemoOptions(directory=str(folder), fresh=False))
    prepare(options)
    assert sorted(p.name for p in folder.iterdir()) == [MARKER_FILE]

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(DemoError, match="not a demo folder"):
        prepare(DemoOptions(directory=str(other)))
    assert (other / "notes.txt").read_text() == "keep me"


def test_options_are_checked() -> None:
    """Too few batches for the three phases, and unknown formats, are refused."""
    with pytest.raises(ValueError, match="at least 4"):
        DemoOptions(batches=3)
    with pytest.raises(ValueError, match="file_format"):
        DemoOptions(file_format="xml")  # type: ignore[arg-type]
    assert DemoOptions.from_json(DemoOptions(keys=5).to_json()) == DemoOptions(keys=5)


def test_prepare_wipes_an_outside_root_only_if_it_is_the_demos(tmp_path: Path) -> None:
    """A root outside the demo folder is wiped only if the demo marked it as its own and it
    holds nothing but the demo's operator. A real pipeline's root whose operator is named
    like the demo's ("sessions", as in the README) is refused and kept."""
    root = tmp_path / "root"
    config = StoreConfig(local_dir=str(tmp_path / "copies"))
    with StateBackend(str(root), config=config) as backend:
        backend.register("sessions", 2)
        with backend.open("sessions", 0) as store:
            store.put(b"k", b"important")
            store.commit()
    options = DemoOptions(directory=str(tmp_path / "demo"), root=str(root))
    with pytest.raises(DemoError, match=r"holds operators \['sessions'\] and no _demo/root"):
        prepare(options)
    with StateBackend(str(root), config=config) as backend, backend.open("sessions", 0) as store:
        assert store.get(b"k") == b"important"  # nothing was deleted

    demo_root = tmp_path / "demo-root"
    options = DemoOptions(directory=str(tmp_path / "demo"), root=str(demo_root))
    prepare(options)  # an empty root: the demo marks it as its own
    with StateBackend(str(demo_root), config=config) as backend:
        assert [m.key for m in backend.blobs.list("")] == [ROOT_MARKER]
        with backend.open("sessions", 0, partitions=2) as store:  # what a demo run writes
            store.put(b"k", b"v")
            store.commit()
    with pytest.raises(DemoError, match="previous demo run"):
        prepare(DemoOptions(directory=str(tmp_path / "demo"), root=str(demo_root), fresh=False))
    prepare(options)
    with StateBackend(str(demo_root), config=config) as backend:
        assert [m.key for m in backend.blobs.list("")] == [ROOT_MARKER]
        backend.register("counts", 1)
    with pytest.raises(DemoError, match=r"operators \['counts'\]"):
        prepare(options)
    with StateBackend(str(demo_root), config=config) as backend:
        assert backend.operators() == {"counts": 1}
