"""Small pure helpers for showing numbers, bytes, items and trends in a terminal."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = [
    "block_plot",
    "bucket",
    "human_bytes",
    "percentile",
    "print_tables",
    "show_bytes",
    "shown",
    "shown_key",
    "version_ranges",
]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# Eighths of a cell, from empty to full: a column of ``height`` cells shows 8 * height levels.
_BLOCKS = " ▁▂▃▄▅▆▇█"


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def show_bytes(data: bytes) -> tuple[str, str]:
    """How to show raw bytes: ``("text", s)`` if printable UTF-8, else ``("hex", hex)``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "hex", data.hex()
    if text.isprintable():
        return "text", text
    return "hex", data.hex()


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (``q`` in (0, 100]) of a non-empty sequence.

    Raises:
        ValueError: ``values`` is empty or ``q`` is out of range.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def bucket(values: Sequence[float], width: int) -> list[float]:
    """At most ``width`` values: consecutive runs merged by their maximum (peaks stay seen)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if len(values) <= width:
        return list(values)
    out: list[float] = []
    for i in range(width):
        start = i * len(values) // width
        end = (i + 1) * len(values) // width
        out.append(max(values[start:end]))
    return out


def block_plot(values: Sequence[float], height: int = 4) -> list[str]:
    """Rows (top first) of a column chart: one column per value, ``height`` cells tall.

    Columns are scaled to the largest value; any value above zero shows at least a sliver,
    so a small commit is told apart from an empty one.
    """
    if height < 1:
        raise ValueError(f"height must be >= 1, got {height}")
    top = max(values, default=0.0)
    levels = [0 if top <= 0 or v <= 0 else max(1, round(v / top * 8 * height)) for v in values]
    rows = []
    for row in range(height - 1, -1, -1):
        floor = row * 8
        rows.append("".join(_BLOCKS[min(8, max(0, lv - floor))] for lv in levels))
    return rows


def version_ranges(versions: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts: list[str] = []
    ordered = sorted(versions)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def shown_key(item: dict[str, Any]) -> Text:
    """An item of ``data``'s or ``diff``'s JSON: a decoded entry as ``state key [entry]``,
    any other item as its raw key."""
    state = item.get("state")
    if state is None:
        return shown(item["key"], item["key_format"])
    text = f"{state['name']} {json.dumps(state['key'], ensure_ascii=False)}"
    if state["entry"] is not None:
        text += f" [{json.dumps(state['entry'], ensure_ascii=False)}]"
    return Text(text)


def shown(value: object, fmt: str) -> Text:
    """A key or value of such an item in its format (``hex``, ``decoded`` or text)."""
    if fmt == "hex":
        return Text(f"0x{value}", style="dim")
    if fmt == "decoded" and not isinstance(value, str):
        return Text(json.dumps(value, ensure_ascii=False))
    return Text(str(value))


def print_tables(
    console: Console, columns: Sequence[str], rows: Iterator[Sequence[RenderableType]], what: str
) -> None:
    """Print ``rows`` as tables of at most :data:`TABLE_ROWS` rows (the header on the first
    only), then how many there were (``"<n> <what>"``): a long listing is printed as it is
    read, never held whole."""
    count = 0
    while chunk := list(itertools.islice(rows, TABLE_ROWS)):
        table = Table(*columns, show_header=not count)
        for column in table.columns:
            column.overflow = "fold"
        for row in chunk:
            table.add_row(*row)
        console.print(table)
        count += len(chunk)
    console.print(Text(f"{count} {what}"))


TABLE_ROWS = 1000
