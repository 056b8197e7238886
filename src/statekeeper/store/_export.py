"""Export: a store at a version as a plain RocksDB directory that any RocksDB tool opens.

The directory holds exactly the store's keys and values (not the working copy's internal
version label). It is written beside its final place, together with the working copy it is
restored into (on the disk the caller chose, not in the system temp folder), and renamed
into place only when complete, so an interrupted export leaves no half-written target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from statekeeper.store._state_store import RestoreInfo, StateStore

__all__ = ["ExportInfo", "prepare_target", "publish", "staging_dir", "write_db"]

_BATCH_ITEMS = 10_000
_BATCH_BYTES = 4 * 1024 * 1024

Progress = Callable[[int], None]
"""Called with the number of items written since the previous call."""


@dataclass(frozen=True, slots=True)
class ExportInfo:
    """What :meth:`StateBackend.export` wrote.

    Attributes:
        path: the RocksDB directory.
        version: the version exported.
        keys: items written.
        bytes: key and value bytes written.
        restore: how the store was brought to ``version`` (snapshot, changelogs, bytes).
    """

    path: str
    version: int
    keys: int
    bytes: int
    restore: RestoreInfo


def prepare_target(to: str | os.PathLike[str]) -> Path:
    """The absolute target path, checked to be absent or an empty directory.

    Raises:
        FileExistsError: the target exists and is not an empty directory (a symbolic link
            is refused too: the database is moved into place, which would replace the link,
            not fill the folder it points to), or a parent of it is not a directory.
    """
    target = Path(to).absolute()
    if target.is_symlink():
        raise FileExistsError(
            f"export target {target} is a symbolic link (to {os.readlink(target)}): give the "
            "folder itself"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"export target {target} exists and is not an empty directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise FileExistsError(
            f"cannot make the folder of export target {target}: {exc.filename} is not a directory"
        ) from exc
    return target


def staging_dir(target: Path) -> Path:
    """A new hidden folder beside ``target`` for the working copy and the database."""
    return Path(tempfile.mkdtemp(prefix=".statekeeper-export-", dir=target.parent))


def publish(staging: Path, target: Path) -> None:
    """Move the finished database into place and drop the staging folder."""
    try:
        if target.exists():
            target.rmdir()
        os.replace(staging / "db", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_db(store: StateStore, path: Path, progress: Progress | None) -> tuple[int, int]:
    """Copy every item of ``store`` into a new RocksDB at ``path``; returns (keys, bytes)."""
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True))
    keys = size = 0
    try:
        batch, batch_items, batch_bytes = rocksdict.WriteBatch(raw_mode=True), 0, 0
        for key, value in store.scan():
            batch.put(key, value)
            batch_items += 1
            batch_bytes += len(key) + len(value)
            if batch_items >= _BATCH_ITEMS or batch_bytes >= _BATCH_BYTES:
                db.write(batch)
                if progress is not None:
                    progress(batch_items)
                keys, size = keys + batch_items, size + batch_bytes
                batch, batch_items, batch_bytes = rocksdict.WriteBatch(raw_mode=True), 0, 0
        db.write(batch)
        if progress is not None:
            progress(batch_items)
        db.flush(wait=True)
    finally:
        db.close()
    return keys + batch_items, size + batch_bytes
