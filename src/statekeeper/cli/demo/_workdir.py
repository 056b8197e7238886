"""Starting clean: wipe what a previous demo run left, and nothing that is not the demo's.

The demo folder carries a marker file; a non-empty folder without it is refused. A root
outside the folder (``--root s3://...``) carries a marker blob the demo writes into it
(``_demo/root``: no operator name starts with ``_``): a non-empty root without it is
refused, since a root of a real pipeline may well hold an operator named like the demo's.
Local working copies given with ``--local-dir`` live in a ``statekeeper-demo`` folder of
their own there.
"""

from __future__ import annotations

import shutil

from statekeeper import layout
from statekeeper.cli.demo._options import OPERATOR, DemoError, DemoOptions, DemoPaths
from statekeeper.config import StoreConfig
from statekeeper.store import StateBackend

__all__ = ["MARKER_FILE", "ROOT_MARKER", "prepare"]

MARKER_FILE = ".statekeeper-demo"
ROOT_MARKER = "_demo/root"
"""The blob that marks a root outside the demo folder as the demo's own."""


def prepare(options: DemoOptions) -> None:
    """Make the demo folder, local copies folder and root empty (or refuse).

    Raises:
        DemoError: something there is not the demo's, or ``fresh`` is off and a previous
            run's files are there.
    """
    paths = options.paths()
    _prepare_folder(paths, options.fresh)
    if paths.local.exists():
        _refuse_unless_fresh(options.fresh, str(paths.local))
        shutil.rmtree(paths.local)
    if not paths.root_is_inside:
        _wipe_root(options, paths)
    paths.base.mkdir(parents=True, exist_ok=True)
    (paths.base / MARKER_FILE).write_text(
        "A statekeeper demo folder: `statekeeper demo` wipes and rebuilds it.\n", "utf-8"
    )


def _prepare_folder(paths: DemoPaths, fresh: bool) -> None:
    folder = paths.base
    if not folder.exists() or not any(folder.iterdir()):
        return
    if not (folder / MARKER_FILE).exists():
        raise DemoError(
            f"{folder} is not empty and is not a demo folder (it has no {MARKER_FILE} file): "
            "give another --dir, the demo wipes its folder at the start"
        )
    _refuse_unless_fresh(fresh, str(folder))
    shutil.rmtree(folder)


def _refuse_unless_fresh(fresh: bool, what: str) -> None:
    if not fresh:
        raise DemoError(f"{what} holds a previous demo run; run with --fresh to wipe it")


def _wipe_root(options: DemoOptions, paths: DemoPaths) -> None:
    config = StoreConfig(local_dir=str(paths.local / "wipe"))
    with StateBackend(
        paths.root, config=config, storage_options=options.storage_options or None
    ) as backend:
        keys = [meta.key for meta in backend.blobs.list("")]
        operators = sorted(backend.operators()) if layout.ROOT_METADATA in keys else []
        if keys and ROOT_MARKER not in keys:
            what = f"operators {operators}" if operators else "files of no statekeeper root"
            raise DemoError(
                f"the root {backend.blobs.uri} holds {what} and no {ROOT_MARKER} marker: the "
                "demo only wipes a root it created itself; give another --root"
            )
        others = [name for name in operators if name != OPERATOR]
        if others:
            raise DemoError(
                f"the root {backend.blobs.uri} holds operators {others}: the demo only wipes "
                f"a root that holds nothing but its own operator {OPERATOR!r}; give another "
                "--root"
            )
        if keys:
            _refuse_unless_fresh(options.fresh, f"the root {backend.blobs.uri}")
            backend.blobs.delete_many([k for k in keys if k != ROOT_MARKER])
            backend.blobs.delete_many([ROOT_MARKER])  # last: a wipe cut short is redone
        backend.blobs.put(
            ROOT_MARKER, b"A statekeeper demo root: `statekeeper demo` wipes and rebuilds it.\n"
        )
