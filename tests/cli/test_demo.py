"""The demo: end to end as a user runs it (a subprocess of the CLI), and its parts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from statekeeper import StateBackend, StoreConfig
from statekeeper.cli.demo import DemoError, DemoOptions
from statekeeper.cli.demo._clicks import Click, batch_clicks, write_batch
from statekeeper.cli.demo._reference import compare, expected_sessions
from statekeeper.cli.demo._workdir import MARKER_FILE, prepare

PARTITIONS = 3
BATCHES = 4


@pytest.mark.spark
@pytest.mark.slow
def test_demo_crashes_restores_and_passes_its_equality_check(tmp_path: Path) -> None:
    """A small demo exits 0 and prints PASSED; its driver was really SIGKILLed mid-run, the
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
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr

    passed = re.search(r"^equality check: PASSED \((\d+) users, (\d+) sessions\)$", out, re.M)
    assert passed is not None, out
    assert 0 < int(passed[1]) <= 40
    assert int(passed[2]) > int(passed[1])  # sessions did end and start again

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


def test_the_reference_sessionizes_by_event_time_gaps() -> None:
    """Two clicks 60 s apart share a session, a 121 s gap starts the next; only sessions
    followed by another one are closed (the sink's rows)."""
    clicks = [
        Click("a", 1000, "home", 1),
        Click("a", 1181, "cart", 3),  # out of order on purpose
        Click("a", 1060, "home", 2),
        Click("b", 5000, "help", 4),
    ]
    expected = expected_sessions(clicks, gap_s=120)
    assert expected.closed == [("a", 1, 1000, 1060, 2)]
    assert expected.summary == {
        "a": {"sessions": 2, "events": 3, "start": 1181, "last_seen": 1181, "open_events": 1},
        "b": {"sessions": 1, "events": 1, "start": 5000, "last_seen": 5000, "open_events": 1},
    }
    assert expected.pages == {"a": {"home": 2, "cart": 1}, "b": {"help": 1}}
    assert expected.sessions == 3

    outcome = compare(expected, [], expected.summary, expected.pages)
    assert outcome.differences == ["sink lacks 1x session ('a', 1, 1000, 1060, 2)"]


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_batch_files_hold_the_generated_clicks(tmp_path: Path, fmt: str) -> None:
    """Every format round-trips the batch's clicks; the generator is deterministic, keeps
    each batch in its own event-time window, and leaves no temporary file behind."""
    import pandas as pd

    clicks = batch_clicks(seed=3, batch=2, keys=30)
    assert clicks == batch_clicks(seed=3, batch=2, keys=30)
    assert clicks != batch_clicks(seed=4, batch=2, keys=30)
    assert max(c.ts for c in batch_clicks(seed=3, batch=1, keys=30)) < min(c.ts for c in clicks)
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
    """A root outside the demo folder that holds only the demo's operator is emptied; one
    that holds another operator is refused and kept."""
    root = tmp_path / "root"
    config = StoreConfig(local_dir=str(tmp_path / "copies"))
    with StateBackend(str(root), config=config) as backend:
        backend.register("sessions", 2)
        with backend.open("sessions", 0) as store:
            store.put(b"k", b"v")
            store.commit()
    options = DemoOptions(directory=str(tmp_path / "demo"), root=str(root))
    with pytest.raises(DemoError, match="previous demo run"):
        prepare(DemoOptions(directory=str(tmp_path / "demo"), root=str(root), fresh=False))
    prepare(options)
    with StateBackend(str(root), config=config) as backend:
        assert backend.blobs.list("") == []
        backend.register("counts", 1)
    with pytest.raises(DemoError, match=r"operators \['counts'\]"):
        prepare(options)
    with StateBackend(str(root), config=config) as backend:
        assert backend.operators() == {"counts": 1}
