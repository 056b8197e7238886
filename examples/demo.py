"""The statekeeper demo as a script: ``python examples/demo.py [options]``.

The same as ``statekeeper demo`` (and ``make demo``); the pipeline lives in the installed
package (:mod:`statekeeper.cli.demo`) because Spark's Python workers import its stateful
processor from there. ``python examples/demo.py --help`` lists the options.
"""

from __future__ import annotations

import sys

from statekeeper.cli import main

if __name__ == "__main__":
    main(["demo", *sys.argv[1:]])
