"""Suite ``corruption``: damage one blob of a seeded kind in a small root, then read it.

The template root (built once per process) holds four stores: ``cl/0``, ``cl/1`` committed
in changelog mode with snapshots at versions 4 and 8, ``sn/0``, ``sn/1`` in snapshot mode;
10 versions each, a gc run, so every blob kind is there. Each trial copies it, picks a
blob of a seeded kind (changelog, snapshot index, snapshot file, store manifest, commit
metrics, root metadata) among those the newest manifest names, and a seeded damage: flip
one byte, truncate, delete, or replace it with the same kind of blob of another store (for
root metadata: another root's).

Expected: ``verify(deep=True)`` reports a problem naming the blob or its store (or the
backend refuses the root with an error naming the blob), and every version that was
retained opens, from a fresh local folder, with exactly its content or raises
CorruptStateError/StateNotFoundError naming the blob. Never wrong content, never another
exception. Two damages cannot be seen by design: deleting the newest manifest rolls the
store back to the one before (the last commit was never named); the rolled-back version
must then be not found, every other one exact. And deleting a commit-metrics blob leaves
what a failed metrics write leaves (they are written best effort, are not state, and nothing
names them): verify may find the root clean, and every version must open exact.
"""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
from pathlib import Path

import statekeeper as sk
from statekeeper import layout
from statekeeper.errors import CorruptStateError, StateNotFoundError
from statekeeper.snapshot import iter_files, load_index
from statekeeper.storage import LocalBlobStore
from tests.blobstores import store_history
from tests.faults.common import Trial, apply, expected, read_all, warnings_logged

NAME = "corruption"
EXPECTED = "verify names it; opens exact or named error"
VERSIONS = 10
STORES = [("cl", 0), ("cl", 1), ("sn", 0), ("sn", 1)]
KINDS = ["changelog", "snapshot index", "snapshot file", "store manifest", "metrics", "root"]
DAMAGES = ["flip", "truncate", "delete", "replace"]
_TEMPLATES: dict[str, Path] = {}


def config(local_dir: Path, mode: str) -> sk.StoreConfig:
    return sk.StoreConfig(
        local_dir=str(local_dir), mode=mode,  # type: ignore[arg-type]
        snapshot_every=10_000, retain_versions=6, write_buffer_mb=1, io_threads=2,
    )  # fmt: skip


def _build(root: Path, local: Path, versions: int) -> None:
    for operator, mode in (("cl", "changelog"), ("sn", "snapshot")):
        with sk.StateBackend(str(root), config=config(local, mode)) as backend:
            for partition in (0, 1):
                with backend.open(operator, partition, partitions=2) as store:
                    for version in range(1, versions + 1):
                        apply(store, version)
                        store.commit()
                        if mode == "changelog" and version % 4 == 0:
                            store.snapshot_now()
            backend.gc()


def template() -> Path:
    """The folder holding ``a`` (the root the trials damage) and ``b`` (another root)."""
    if "dir" not in _TEMPLATES:
        tmp = Path(tempfile.mkdtemp(prefix="sk-faults-template-"))
        atexit.register(shutil.rmtree, tmp, True)
        _build(tmp / "a", tmp / "local", VERSIONS)
        _build(tmp / "b", tmp / "local-b", 2)
        _TEMPLATES["dir"] = tmp
    return _TEMPLATES["dir"]


def _live_blobs(backend: sk.StateBackend, kind: str, operator: str, partition: int) -> list[str]:
    """The blobs of ``kind`` of one store that its newest manifest names, in an order that
    does not depend on random names."""
    blobs = backend.blobs
    if kind == "root":
        return [layout.ROOT_METADATA]
    if kind == "metrics":
        return sorted(m.key for m in blobs.list(layout.metrics_prefix(operator, partition)))
    if kind == "store manifest":
        return [max(m.key for m in blobs.list(layout.manifest_prefix(operator, partition)))]
    history = store_history(backend, operator, partition)
    if kind == "changelog":
        return sorted(history.changelog_key(v) for v in history.changelogs)
    if kind == "snapshot index":
        return sorted(history.index_key(v) for v in history.snapshots)
    # Blob ids are random: order the files by (snapshot, path, chunk) so a seed picks the
    # same file of a rebuilt template.
    files: dict[str, None] = {}
    for version in sorted(history.snapshots):
        index = load_index(blobs, operator, partition, version, key=history.index_key(version))
        for _, entry in sorted(iter_files(index.dir_index), key=lambda item: item[0]):
            for blob in entry.blobs:
                files.setdefault(layout.file_blob_key(operator, partition, blob.blob_id))
    return list(files)


def _pick(rng: random.Random, backend: sk.StateBackend, kind: str) -> tuple[str, str, int]:
    """(key, operator, partition) of a seeded live blob of ``kind``."""
    stores = [s for s in STORES if _live_blobs(backend, kind, *s)]
    operator, partition = rng.choice(stores)
    return rng.choice(_live_blobs(backend, kind, operator, partition)), operator, partition


def _replacement(
    backend: sk.StateBackend, kind: str, key: str, store: tuple[str, int]
) -> bytes | None:
    """A blob of the same kind from another store (the other partition) or another root,
    whose bytes differ from the blob's; ``None`` if there is none."""
    if kind == "root":
        return (template() / "b" / layout.ROOT_METADATA).read_bytes()
    candidates = _live_blobs(backend, kind, store[0], 1 - store[1])
    # The same version's blob first: the most plausible mix-up.
    version = layout.commit_blob_version(key)
    candidates.sort(key=lambda k: layout.commit_blob_version(k) != version)
    original = backend.blobs.get(key)
    for candidate in candidates:
        data = backend.blobs.get(candidate)
        if data != original:
            return data
    return None


def _damage(
    rng: random.Random, blobs: LocalBlobStore, key: str, damage: str, other: bytes | None
) -> None:
    data = blobs.get(key)
    if damage == "delete":
        blobs.delete_many([key])
    elif damage == "flip":
        at = rng.randrange(len(data))
        blobs.put(key, data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :],
                  overwrite=True)  # fmt: skip
    elif damage == "truncate":
        blobs.put(key, data[: rng.randrange(len(data))], overwrite=True)
    else:
        assert other is not None
        blobs.put(key, other, overwrite=True)


def _verify(trial: Trial, root: Path, key: str, store: str, mode: str) -> str:
    """How verify (or the backend, refusing the root) reported the damage."""
    try:
        with sk.StateBackend(str(root), config=config(root.parent / "verify", mode)) as backend:
            report = backend.verify(deep=True)
    except (CorruptStateError, StateNotFoundError, sk.ConfigMismatchError) as exc:
        return "refused, named" if key in str(exc) else f"refused: {exc}"[:120]
    if any(p.blob == key or key in p.message for p in report.problems):
        return "named"
    if any(p.store == store for p in report.problems):
        return "store named"
    return "clean" if not report.problems else f"other: {report.problems[0].message[:80]}"


def _open_version(root: Path, local: Path, operator: str, partition: int, version: int) -> str:
    """``exact``, ``fallback`` (exact, with a warning naming the damage), or ``error <exc>``;
    raises AssertionError for wrong content."""
    mode = "changelog" if operator == "cl" else "snapshot"
    with warnings_logged() as warnings:
        try:
            with (
                sk.StateBackend(str(root), config=config(local, mode)) as backend,
                backend.open(operator, partition, version=version) as store,
            ):
                state = read_all(store)
        except (CorruptStateError, StateNotFoundError) as exc:
            return f"error {type(exc).__name__}: {exc}"
    if state != expected(operator, partition, version):
        raise AssertionError(f"{operator}/{partition} version {version} opened with wrong content")
    return "fallback" if warnings else "exact"


def _open_all(trial: Trial, root: Path, key: str, stores: dict[tuple[str, int], list[int]],
              rollback: bool) -> str:  # fmt: skip
    """Open every retained version of ``stores``; the worst outcome (error, fallback, exact)."""
    seen: set[str] = set()
    for (operator, partition), versions in stores.items():
        for version in versions:
            local = root.parent / f"open-{operator}{partition}-{version}"
            outcome = _open_version(root, local, operator, partition, version)
            seen.add(outcome.split()[0])
            where = f"{operator}/{partition} version {version}"
            if rollback and outcome.startswith("error"):
                trial.check(
                    version == versions[-1] and "StateNotFoundError" in outcome,
                    f"{where} after the newest manifest was deleted: {outcome}",
                )
            elif outcome.startswith("error"):
                trial.check(key in outcome, f"{where}: the error does not name {key}: {outcome}")
    return next(
        label for label in ("error", "fallback", "exact", "none") if label in seen | {"none"}
    )


def run_trial(seed: int, work: Path) -> Trial:
    rng = random.Random(f"{NAME}-{seed}")
    kind, damage = rng.choice(KINDS), rng.choice(DAMAGES)
    root = work / "root"
    shutil.copytree(template() / "a", root)
    with sk.StateBackend(str(root), config=config(work / "pick", "changelog")) as backend:
        key, operator, partition = _pick(rng, backend, kind)
        retained = {s: backend.versions(*s) for s in STORES}
        other = (
            _replacement(backend, kind, key, (operator, partition)) if damage == "replace" else None
        )
    if damage == "replace" and other is None:
        damage = "truncate"  # every blob of its kind elsewhere is byte for byte the same
    trial = Trial(NAME, seed, attack=f"{kind}, {damage}")
    _damage(rng, LocalBlobStore(str(root)), key, damage, other)
    store = f"{operator}/{partition}"
    verdict = _verify(trial, root, key, store, "changelog" if operator == "cl" else "snapshot")
    rollback = kind == "store manifest" and damage == "delete"
    unseen = rollback or (kind == "metrics" and damage == "delete")  # see the docstring
    if not unseen and verdict not in ("named", "store named", "refused, named"):
        trial.fail(f"verify did not report damaged {key}: {verdict}")
    stores = (
        retained if kind == "root" else {(operator, partition): retained[(operator, partition)]}
    )
    worst = _open_all(trial, root, key, stores, rollback)
    trial.observed = f"{verdict.split(':')[0]}, {worst}"
    if trial.failure is not None:
        trial.fail("")
        trial.failure = f"{kind} {damage} of {key}: {trial.failure}"
    return trial
