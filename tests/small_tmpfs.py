"""Run a Python script in a child process whose ``local`` folder is a real, tiny tmpfs.

The child runs in a private mount namespace (``unshare --user --map-root-user --mount``: no
root needed where user namespaces are allowed, nothing left mounted afterwards) with an
8 MiB tmpfs mounted on ``local``, so RocksDB meets a real ``ENOSPC`` once the script fills
it; no call is patched. The script gets ``sys.argv[1:] == [root, local, repo]`` and prints
one ``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def fill(path: str) -> int:
    """Write random bytes to a new file at ``path`` until the file system is full; returns
    the error number that stopped it (``ENOSPC``, 28)."""
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(os.urandom(1 << 16))
                fh.flush()
        except OSError as exc:
            return exc.errno or 0


def run_on_small_tmpfs(script: str, root: Path, local: Path) -> dict[str, object]:
    """The ``RESULT`` of ``script`` run with ``local`` on an 8 MiB tmpfs; skips the test
    where no private tmpfs can be mounted."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is needed to mount a small private tmpfs")
    local.mkdir(parents=True)
    mount = 'mount -t tmpfs -o size=8m tmpfs "$1" && exec "$2" -c "$3" "$4" "$1" "$5"'
    repo = str(Path(__file__).parents[1])
    child = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", mount, "sh",
         str(local), sys.executable, script, str(root), repo],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if child.returncode != 0 and "RESULT" not in child.stdout and "mount" in child.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {child.stderr.strip()[-300:]}")
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child failed ({child.returncode}): {child.stderr[-3000:]}"
    result: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return result
