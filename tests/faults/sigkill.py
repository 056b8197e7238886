"""Suite ``sigkill``: a child commits to a local root and is SIGKILLed at a seeded moment.

Each trial draws a mode (changelog or snapshot), a way to die (after a seeded delay, or at
the n-th blob call through :class:`tests.blobstores.FaultyBlobStore`) and runs two rounds on
the same root and local folder (the second restores what the first left). After each round
a fresh process-level backend checks: the newest version is the last acknowledged one (or
the one after it, whose commit landed but whose ack was not printed), every retained version
opens with exactly its content, the newest ``RETAIN`` versions are all there,
``verify(deep=True)`` finds no problem (expired leftovers of a killed GC are not problems);
after the last round a new commit works, through the child's local copy.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import statekeeper as sk
from tests.faults._child import OPERATOR, RETAIN, config
from tests.faults.common import Trial, apply, expected, read_all

NAME = "sigkill"
EXPECTED = "acked exact, verify ok, recommit ok"
REPO = Path(__file__).resolve().parents[2]
ROUNDS = 2


@dataclass
class _Round:
    acks: list[int]
    killed: bool
    stderr: str


def _run_child(root: Path, local: Path, mode: str, rng: random.Random, way: str) -> _Round:
    kill_at = rng.randint(1, 250) if way == "call" else 0
    command = [sys.executable, "-m", "tests.faults._child", str(root), str(local), mode,
               str(kill_at), "25" if way == "call" else "400"]  # fmt: skip
    child = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if way == "delay":
        try:
            child.wait(timeout=rng.uniform(0.4, 2.5))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
    out, err = child.communicate(timeout=120)
    # Only lines ended by a newline count: a SIGKILL can land while "ack N" is half written
    # (seen as a bare "ack "), and an ack the child did not finish printing was never made.
    whole = out.split("\n")[:-1]
    acks = [int(line.split()[1]) for line in whole if line.startswith("ack ")]
    killed = child.returncode == -signal.SIGKILL
    if not killed and child.returncode != 0:
        raise AssertionError(f"child exited {child.returncode}: {err[-1500:]}")
    return _Round(acks, killed, err)


def _check_versions(trial: Trial, backend: sk.StateBackend, latest: int) -> None:
    versions = backend.versions(OPERATOR, 0)
    trial.check(not versions or max(versions) == latest, f"versions {versions} but latest {latest}")
    wanted = set(range(max(1, latest - RETAIN + 1), latest + 1))
    trial.check(wanted <= set(versions), f"retained versions missing: {wanted - set(versions)}")
    for version in sorted(set(versions[-RETAIN - 1 :]) | set(versions[:1])):
        with backend.open(OPERATOR, 0, version=version) as store:
            if read_all(store) != expected(OPERATOR, 0, version):
                trial.fail(f"version {version} opens with wrong content")


def _check(trial: Trial, root: Path, check_dir: Path, last_ack: int, mode: str) -> tuple[int, bool]:
    """Check the root after a kill; returns (latest version, verify saw expired leftovers)."""
    backend = sk.StateBackend(str(root), config=config(str(check_dir), mode))
    try:
        with backend.open(OPERATOR, 0) as store:
            latest = store.version
            trial.check(
                last_ack <= latest <= last_ack + 1,
                f"latest version {latest} after last ack {last_ack}",
            )
            trial.check(read_all(store) == expected(OPERATOR, 0, latest), f"latest {latest} wrong")
        _check_versions(trial, backend, latest)
        report = backend.verify(deep=True)
        trial.check(report.ok, f"verify: {[p.message for p in report.problems][:3]}")
        return latest, bool(report.expired)
    finally:
        backend.close()


def _recommit(trial: Trial, root: Path, local: Path, check_dir: Path, mode: str) -> None:
    """A new commit through the killed child's local copy works and reads back fresh."""
    with (
        sk.StateBackend(str(root), config=config(str(local), mode)) as backend,
        backend.open(OPERATOR, 0) as store,
    ):
        version = store.version + 1
        apply(store, version)
        trial.check(store.commit().version == version, "recommit got another version")
    with (
        sk.StateBackend(str(root), config=config(str(check_dir), mode)) as backend,
        backend.open(OPERATOR, 0) as store,
    ):
        trial.check(store.version == version, f"recommitted {version}, read {store.version}")
        trial.check(read_all(store) == expected(OPERATOR, 0, version), "recommit content")


def run_trial(seed: int, work: Path) -> Trial:
    rng = random.Random(f"{NAME}-{seed}")
    mode, way = rng.choice(["changelog", "snapshot"]), rng.choice(["delay", "call"])
    attack = f"{mode}, kill {'after a delay' if way == 'delay' else 'at a blob call'}"
    trial = Trial(NAME, seed, attack=attack)
    root, local = work / "root", work / "local"
    last_ack, labels = 0, set()
    for round_ in range(ROUNDS):
        ran = _run_child(root, local, mode, rng, way)
        last_ack = ran.acks[-1] if ran.acks else last_ack
        labels.add("killed" if ran.killed else "finished")
        latest, expired = _check(trial, root, work / f"check{round_}", last_ack, mode)
        if latest == last_ack + 1:
            labels.add("+unacked")
        if expired:
            labels.add("+expired")
        last_ack = max(last_ack, latest)  # the landed commit is now the one to build on
        if trial.failure is not None:
            trial.failure = f"round {round_}: {trial.failure}"
            break
    else:
        _recommit(trial, root, local, work / "recommit", mode)
    trial.observed = " ".join(sorted(labels))
    return trial
