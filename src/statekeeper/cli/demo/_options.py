"""The demo's options, the folders it uses, and how its micro-batches split into phases."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["FORMATS", "OPERATOR", "DemoError", "DemoOptions", "DemoPaths", "PhasePlan"]

FileFormat = Literal["json", "csv", "parquet"]
FORMATS: tuple[FileFormat, ...] = ("json", "csv", "parquet")
MIN_BATCHES = 4
OPERATOR = "sessions"
"""The stateful operator's name in the checkpoint root."""


class DemoError(Exception):
    """The demo cannot run (its folder or root is not its own) or a phase of it failed."""


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What to run: sizes, where things live, and the sessionization gap.

    Attributes:
        keys: users in the synthetic clickstream (about half are active per batch).
        batches: micro-batches (one input file each), at least 4: the crash phase, the
            restart on the same local directory and the cold restart each need some.
        directory: the demo's own folder (input, sink, Spark checkpoint, logs and, unless
            given elsewhere, the checkpoint root and local working copies).
        root: the checkpoint root URI (``s3://...`` etc.); ``<directory>/state`` if ``None``.
        local_dir: where local working copies go; ``<directory>/local`` if ``None``.
        storage_options: object store options of ``root``.
        file_format: format of the input files.
        partitions: state partitions of the operator.
        gap_s: event-time seconds of inactivity that end a session.
        delay_s: event-time seconds the watermark trails the largest event time seen.
        seed: seed of the clickstream generator.
        fresh: wipe what a previous demo run left (else refuse to run over it).
    """

    keys: int = 2000
    batches: int = 8
    directory: str = "demo-state"
    root: str | None = None
    local_dir: str | None = None
    storage_options: dict[str, str] = field(default_factory=dict)
    file_format: FileFormat = "json"
    partitions: int = 4
    gap_s: int = 120
    delay_s: int = 300
    seed: int = 7
    fresh: bool = True

    def __post_init__(self) -> None:
        for name in ("keys", "partitions", "gap_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.delay_s, bool) or not isinstance(self.delay_s, int) or self.delay_s < 0:
            raise ValueError(f"delay_s must be an int >= 0, got {self.delay_s!r}")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int):
            raise ValueError(f"batches must be an int, got {self.batches!r}")
        if self.batches < MIN_BATCHES:
            raise ValueError(
                f"batches must be at least {MIN_BATCHES} (a crash phase, a restart and a "
                f"cold restart), got {self.batches}"
            )
        if self.file_format not in FORMATS:
            raise ValueError(f"file_format must be one of {FORMATS}, got {self.file_format!r}")

    def to_json(self) -> str:
        """The options as JSON (to hand them to the driver child process)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoOptions:
        """Options from :meth:`to_json`."""
        doc: dict[str, Any] = json.loads(text)
        return cls(**doc)

    def paths(self) -> DemoPaths:
        """The folders of this run, as absolute paths."""
        base = Path(self.directory).resolve()
        local = Path(self.local_dir).resolve() / "statekeeper-demo" if self.local_dir else None
        return DemoPaths(base=base, local=local or base / "local", root_option=self.root)

    def plan(self) -> PhasePlan:
        """Which input files each phase adds, and after which batch the driver is killed."""
        crash_files = max(2, self.batches // 2)
        restart_end = crash_files + max(1, (self.batches - crash_files) // 2)
        return PhasePlan(
            crash=(0, crash_files),
            restart=(crash_files, restart_end),
            cold=(restart_end, self.batches),
            kill_after=crash_files - 2,
        )


@dataclass(frozen=True)
class PhasePlan:
    """Input files ``[start, end)`` written before each phase.

    The crash phase has its files processed one per micro-batch; the driver is killed once
    batch ``kill_after`` is done, while the next one runs.
    """

    crash: tuple[int, int]
    restart: tuple[int, int]
    cold: tuple[int, int]
    kill_after: int


@dataclass(frozen=True)
class DemoPaths:
    """Every folder of one demo run."""

    base: Path
    local: Path
    """Parent of the local working copy folders this run creates (and wipes)."""
    root_option: str | None = None

    @property
    def root(self) -> str:
        """The checkpoint root URI or absolute path."""
        if self.root_option is None:
            return str(self.base / "state")
        if "://" in self.root_option:
            return self.root_option
        return os.path.abspath(self.root_option)

    @property
    def root_is_inside(self) -> bool:
        """True if the root lies in the demo folder (it is wiped with it)."""
        if "://" in self.root:
            return False
        return Path(self.root).resolve().is_relative_to(self.base)

    @property
    def input(self) -> Path:
        """Where the generator writes the clickstream files."""
        return self.base / "input"

    @property
    def output(self) -> Path:
        """The Parquet sink of closed sessions."""
        return self.base / "output"

    @property
    def checkpoint(self) -> Path:
        """The streaming query's checkpointLocation (offsets, commits, sink metadata)."""
        return self.base / "spark-checkpoint"

    @property
    def logs(self) -> Path:
        """Spark logs and the crashed driver's stderr."""
        return self.base / "logs"

    @property
    def monitor(self) -> Path:
        """Local copies of the driver-side monitor that counts open sessions."""
        return self.base / "monitor"

    def local_copies(self, name: str) -> str:
        """A local_dir for working copies: ``working`` (crash and restart), ``cold``, ..."""
        return str(self.local / name)
