"""``python -m statekeeper`` and the ``statekeeper`` console script: the command line.

The command line needs the ``cli`` extra (click, rich); executors that only run pipelines
do not. Without it, this says how to install it instead of failing with an import error.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["main"]

_CLI_NEEDS = ("click", "rich")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line; exits the process (2 with an install hint if click or rich
    is missing)."""
    missing = [name for name in _CLI_NEEDS if _absent(name)]
    if missing:
        sys.stderr.write(
            f"statekeeper: the command line needs {' and '.join(missing)}, which are not "
            "installed: pip install 'statekeeper[cli]'\n"
        )
        sys.exit(2)
    from statekeeper.cli import main as run

    run(argv)


def _absent(name: str) -> bool:
    # A module set to None in sys.modules cannot be imported, whatever find_spec says.
    if name in sys.modules:
        return sys.modules[name] is None
    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    main()
