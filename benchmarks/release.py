"""Sources of an earlier statekeeper release, taken from this repository's git history.

Used to run the release itself side by side with the working tree (``commit.py`` compares the
0.1.0 commit protocol with the current one) and to write fixtures as it wrote them
(``tests/fixtures/make_root_0_1.py``).

    .venv/bin/python benchmarks/release.py DEST [--commit f179d03]   # prints DEST/src
"""

from __future__ import annotations

import argparse
import subprocess
import tarfile
from pathlib import Path

RELEASE_0_1 = "f179d03"
"""The last commit of format 1: statekeeper 0.1.0's on-storage format and commit protocol."""


def extract(dest: Path, commit: str = RELEASE_0_1) -> Path:
    """Write ``src/statekeeper`` as of ``commit`` under ``dest``; return the ``src`` folder to
    put on ``PYTHONPATH``.

    Raises:
        subprocess.CalledProcessError: not in a git checkout, or ``commit`` is unknown.
    """
    here = Path(__file__).resolve().parent
    repo = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=here, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "src.tar"
    subprocess.run(
        ["git", "archive", "-o", str(archive), commit, "src/statekeeper"], cwd=repo, check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest / "src"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--commit", default=RELEASE_0_1)
    args = parser.parse_args()
    print(extract(args.dest, args.commit))
