"""``python -m statekeeper``: the command line."""

from __future__ import annotations

from statekeeper.cli import main

if __name__ == "__main__":
    main()
