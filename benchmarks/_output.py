"""What every benchmark does with its summary: print it, and write it to ``--out`` if given.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path`` and
they import this module by its plain name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(summary: dict[str, Any], out: Path | None) -> None:
    """Print ``summary`` as indented JSON; with ``out``, also write it there (folders made),
    so the printed and the written documents are the same."""
    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
