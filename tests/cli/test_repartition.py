"""``statekeeper repartition``: the command, its errors, and SIGKILL at random points."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from tests.cli.conftest import one_error_line, run
from tests.test_repartition import OP, build_root, check_layout, config, state_of

REPO = Path(__file__).resolve().parents[2]
SEEDS = range(8)

# A child that runs the library with a blob store SIGKILLing the process at its n-th put.
_PUT_CHILD = """
import sys
from statekeeper.repartition import repartition
from statekeeper.storage import open_blob_store
from tests.blobstores import FaultyBlobStore
from tests.test_repartition import config
from pathlib import Path
root, work, n, partitions = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
blobs = FaultyBlobStore(open_blob_store(root), fail_at=n, kind="kill", op="put")
repartition(blobs, "counts", partitions=partitions, config=config(work, "child"))
"""


def test_repartition_prints_the_report_as_json_and_for_people(tmp_path: Path) -> None:
    root, everything = build_root(tmp_path, 4)
    result = run("repartition", root, OP, "--partitions", "7", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["root"].endswith("root")
    assert (doc["operator"], doc["source"]) == (OP, OP)
    assert (doc["from_partitions"], doc["partitions"], doc["version"]) == (4, 7, 3)
    assert doc["bytes_uploaded"] > 0
    assert doc["bytes_reused"] > 0
    assert doc["new_store_bytes"] == doc["bytes_uploaded"] + doc["bytes_reused"]
    check_layout(state_of(root, tmp_path, "read"), everything)

    result = run("repartition", root, OP, "--partitions", "2", "--to", "merged")
    assert result.exit_code == 0, result.output
    assert f"repartitioned {OP} (7 partitions) -> merged (2 partitions) at version 3" in (
        result.stdout
    )
    assert "restart the query with partitions=2 and name='merged'" in result.stdout
    check_layout(state_of(root, tmp_path, "merged", "merged"), everything)


def test_bad_requests_fail_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """Every request the root refuses before any work is bad input (exit 2), not a problem
    found (exit 1), and changes nothing."""
    root, _ = build_root(tmp_path, 2, batches=1)
    before = _metadata(root)
    for args, message in [
        (("nope", "--partitions", "3"), "operator 'nope' is not in the root"),
        ((OP, "--partitions", "2"), "already has 2 partitions"),
        ((OP, "--partitions", "5000"), "4096 key groups, so at most 4096 partitions"),
        ((OP, "--partitions", "3", "--to", "_bad"), "operator name must be"),
        ((OP, "--partitions", "3", "--to", OP), f"operator {OP!r} exists in the root"),
    ]:
        result = run("repartition", root, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in one_error_line(result)
    result = run("repartition", root, OP, "--partitions", "0")
    assert result.exit_code == 2
    assert "--partitions" in result.stderr
    assert _metadata(root) == before


def _metadata(root: str) -> bytes:
    return (Path(root) / layout.ROOT_METADATA).read_bytes()


def _child_env(tmp: Path) -> dict[str, str]:
    """The environment of a child that may be killed: its temporary folders (the
    repartition's work folder) in ``tmp``, not left in the system's."""
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def _kill_cli(root: str, rng: random.Random, duration: float, tmp: Path) -> bool:
    """Run ``statekeeper repartition`` and SIGKILL it after a seeded delay; True if killed."""
    command = [sys.executable, "-m", "statekeeper", "repartition", root, OP,
               "--partitions", "7", "--json"]  # fmt: skip
    child = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env(tmp)
    )
    try:
        child.wait(timeout=rng.uniform(0.1, duration))
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=300)
    assert child.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
    return child.returncode == -signal.SIGKILL


def _kill_at_put(root: str, work: Path, rng: random.Random) -> bool:
    """Run the library in a child that SIGKILLs itself at a seeded blob write."""
    command = [sys.executable, "-c", _PUT_CHILD, root, str(work), str(rng.randint(1, 80)), "7"]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, timeout=300, check=False,
        env=_child_env(work / "tmp"),
    )  # fmt: skip
    assert done.returncode in (0, -signal.SIGKILL), done.stderr.decode()[-2000:]
    return done.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_at_random_points_leaves_the_root_as_it_was_or_done(tmp_path: Path) -> None:
    """Killed before its commit point, a repartition leaves the root byte for byte as it
    was and every store with the same state; killed after it, the next opener finishes it.
    Either way the state is exactly what it was, and a new run completes."""
    pristine, everything = build_root(tmp_path, 4)
    before = _metadata(pristine)
    probe = _copy(pristine, tmp_path / "probe")
    started = time.monotonic()
    assert run("repartition", probe, OP, "--partitions", "7").exit_code == 0
    duration = time.monotonic() - started + 1.5  # and the child's start-up
    outcomes = []
    for seed in SEEDS:
        rng = random.Random(seed)
        root = _copy(pristine, tmp_path / f"root{seed}")
        if seed % 2:
            killed = _kill_at_put(root, tmp_path / f"work{seed}", rng)
        else:
            killed = _kill_cli(root, rng, duration, tmp_path / f"tmp{seed}")
        with sk.StateBackend(root, config=config(tmp_path, f"check{seed}")) as backend:
            count = backend.operators()[OP]
        outcomes.append((killed, count))
        if count == 4:
            assert _metadata(root) == before, f"seed {seed}: the root metadata changed"
        check_layout(state_of(root, tmp_path, f"state{seed}"), everything, built=4)
        if count == 4:  # a new run completes over what the killed one left
            assert run("repartition", root, OP, "--partitions", "7").exit_code == 0
            check_layout(state_of(root, tmp_path, f"rerun{seed}"), everything)
        result = run("verify", root, "--json")
        assert json.loads(result.stdout)["ok"], result.stdout
    assert any(killed and count == 4 for killed, count in outcomes), outcomes


def _copy(root: str, to: Path) -> str:
    shutil.copytree(root, to)
    return str(to)
