"""A short slice of the randomized fault suites (``make soak`` runs many more seeds).

The corruption seeds are chosen to cover changelogs, snapshot indexes, snapshot files, store
manifests, commit metrics and root metadata (flipped, deleted: seed 2, replaced by another
root's: seed 1001).
"""

from __future__ import annotations

import pytest

from tests.faults import __main__ as runner
from tests.faults.common import Trial, repro

# changelog replace, snapshot file delete, store manifest truncate, snapshot index truncate,
# root metadata flip (refused naming the blob), commit metrics truncate, root metadata deleted
# and replaced, commit metrics replaced by another store's
CORRUPTION_SEEDS = [0, 1, 5, 10, 1006, 15, 2, 1001, 1030]


def _run(suite: str, seed: int) -> Trial:
    trial = runner.run_one(suite, seed)
    assert trial.failure is None, f"{trial.failure}\n{''.join(trial.notes)}\n{repro(suite, seed)}"
    assert trial.attack != "?"
    assert trial.observed != "?"
    return trial


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_trial(seed: int) -> None:
    trial = _run("sigkill", seed)
    assert "killed" in trial.observed or "finished" in trial.observed


@pytest.mark.slow
@pytest.mark.parametrize("seed", CORRUPTION_SEEDS)
def test_corruption_trial(seed: int) -> None:
    _run("corruption", seed)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_s3_trial(seed: int) -> None:
    _run("s3", seed)


def test_a_failing_trial_prints_its_reproduction_and_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(seed: int, work: object) -> Trial:
        trial = Trial("fake", seed, attack="an attack", observed="seen")
        trial.check(seed != 8, "seed 8 breaks")
        return trial

    monkeypatch.setitem(runner.SUITES, "fake", (run, "nothing breaks"))
    assert runner.soak(["fake"], [7]) == 0
    assert runner.soak(["fake"], [7, 8, 9]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {repro('fake', 8)}   # seed 8 breaks" in out
    rows = [line for line in out.splitlines() if line.startswith("fake") and "an attack" in line]
    row = rows[-1]  # the table of the second run
    assert row.split()[-2:] == ["1", row.split()[-1]]  # one failure among three trials
    assert "seen 3" in row
    assert "nothing breaks" in row
