"""The synthetic clickstream: deterministic events, one input file per micro-batch.

Batch ``b`` holds events whose event time lies in ``[T0 + b * SPAN_S, T0 + (b + 1) * SPAN_S)``,
apart from stragglers (within a file they are shuffled: the processor sorts them). About
half of the users are active in a batch, each with one or two bursts of clicks a few
seconds apart; bursts are minutes apart, so sessions end within batches and also run on
across them, and users who stop clicking leave sessions that only the watermark closes.

From batch 1 on, about :data:`STRAGGLERS` of a batch's clicks are **stragglers**: clicks
of random users whose event time lies in the two windows before the batch's. With the
demo's watermark delay some of them are late (dropped), the others arrive out of order
and extend, merge or open sessions in the past.
"""

from __future__ import annotations

import csv
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from statekeeper.cli.demo._options import FileFormat

__all__ = ["INPUT_SCHEMA", "SPAN_S", "STRAGGLERS", "T0", "Click", "batch_clicks", "write_batch"]

INPUT_SCHEMA = "user string, ts long, page string, event_id long"
T0 = 1_700_000_000
SPAN_S = 900
_ACTIVE = 0.5
STRAGGLERS = 0.03
_PAGES = ("home", "search", "product", "cart", "checkout", "account", "help", "deals")
_PAGE_WEIGHTS = (30, 22, 20, 9, 4, 6, 3, 6)
_IDS_PER_BATCH = 10_000_000
# Files get modification times a second apart in batch order (the order Spark's file
# source reads them in), counted from a fixed point in the past of this run.
_MTIME_BASE = time.time() - 24 * 3600


class Click(NamedTuple):
    """One click of one user."""

    user: str
    ts: int
    """Event time, seconds since the epoch."""
    page: str
    event_id: int


def batch_clicks(seed: int, batch: int, keys: int) -> list[Click]:
    """The events of batch ``batch``: the same for the same arguments, in any process."""
    rng = random.Random(f"statekeeper-demo:{seed}:{batch}")
    start, end = T0 + batch * SPAN_S, T0 + (batch + 1) * SPAN_S
    clicks: list[Click] = []
    for u in range(keys):
        if rng.random() >= _ACTIVE:
            continue
        user = f"user-{u:05d}"
        t = start + rng.randrange(SPAN_S // 3)
        for _ in range(rng.choice((1, 1, 2))):
            for _ in range(rng.randint(1, 6)):
                if t >= end:
                    break
                page = rng.choices(_PAGES, _PAGE_WEIGHTS)[0]
                clicks.append(Click(user, t, page, batch * _IDS_PER_BATCH + len(clicks)))
                t += rng.randint(5, 90)
            t += rng.randint(150, 420)
    if batch > 0:
        early = max(T0, start - 2 * SPAN_S)
        for _ in range(round(len(clicks) * STRAGGLERS)):
            user = f"user-{rng.randrange(keys):05d}"
            page = rng.choices(_PAGES, _PAGE_WEIGHTS)[0]
            t = rng.randrange(early, start)
            clicks.append(Click(user, t, page, batch * _IDS_PER_BATCH + len(clicks)))
    rng.shuffle(clicks)
    return clicks


def write_batch(folder: Path, batch: int, clicks: Sequence[Click], fmt: FileFormat) -> Path:
    """Write one batch's file atomically (a hidden temporary file, then a rename).

    Spark's file source skips names starting with ``.``, so it never sees a partial file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"clicks-{batch:05d}.{fmt}"
    tmp = folder / f".clicks-{batch:05d}.{fmt}.tmp"
    if fmt == "json":
        tmp.write_text("".join(json.dumps(c._asdict()) + "\n" for c in clicks), "utf-8")
    elif fmt == "csv":
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(Click._fields)
            writer.writerows(clicks)
    else:
        _write_parquet(tmp, clicks)
    mtime = _MTIME_BASE + batch
    os.utime(tmp, (mtime, mtime))
    tmp.rename(path)
    return path


def _write_parquet(path: Path, clicks: Sequence[Click]) -> None:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    table = pa.table(
        {
            "user": pa.array([c.user for c in clicks], pa.string()),
            "ts": pa.array([c.ts for c in clicks], pa.int64()),
            "page": pa.array([c.page for c in clicks], pa.string()),
            "event_id": pa.array([c.event_id for c in clicks], pa.int64()),
        }
    )
    pq.write_table(table, path)
