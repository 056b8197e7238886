"""Lightweight input rows of the Row form: tuples with named access, built in bulk.

A row class is a :func:`collections.namedtuple` per column list, so ``row.v`` is the C
accessor namedtuples have and building a row is one ``tuple.__new__``; ``row["v"]`` works
for every column (also names that are not identifiers, which namedtuple renames), and
``asDict()`` returns the row as a dict, as on ``pyspark.sql.Row``. Rows pickle as rows
(the class is rebuilt from the column names), so a processor may keep them in a state that
uses :class:`~statekeeper.PickleCodec`.
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = ["build_rows", "row_class"]


@functools.lru_cache(maxsize=256)
def row_class(names: tuple[str, ...]) -> type[tuple[Any, ...]]:
    """The row class of a column list (one class per distinct list, cached).

    Raises:
        ValueError: a column name repeats.
    """
    if len(set(names)) != len(names):
        raise ValueError(f"row columns repeat: {list(names)}")
    base = collections.namedtuple("Row", names, rename=True)  # type: ignore[misc]
    index = {name: i for i, name in enumerate(names)}
    getitem = tuple.__getitem__

    class Row(base):
        """One input row: ``row.column``, ``row["column"]``, ``row[0]``, ``row.asDict()``."""

        __slots__ = ()
        __fields__: ClassVar[list[str]] = list(names)

        def __getitem__(self, item: Any) -> Any:
            if type(item) is str:
                try:
                    return getitem(self, index[item])
                except KeyError:
                    raise KeyError(f"no column {item!r}; the row has {list(names)}") from None
            return getitem(self, item)

        def asDict(self) -> dict[str, Any]:
            """The row as ``{column: value}``."""
            return dict(zip(names, self, strict=True))

        def __repr__(self) -> str:
            pairs: list[tuple[str, Any]] = list(zip(names, self, strict=True))
            inner = ", ".join(f"{n}={v!r}" for n, v in pairs)
            return f"Row({inner})"

        def __reduce__(self) -> tuple[Any, ...]:
            return _rebuild, (names, tuple(self))

    Row.__qualname__ = "Row"
    return Row


def _rebuild(names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    return tuple.__new__(row_class(names), values)


def build_rows(names: Sequence[str], columns: Sequence[Sequence[Any]]) -> list[Any]:
    """Rows of ``columns`` (one Python list per column, all of one length), in order.

    Raises:
        ValueError: a column name repeats.
    """
    cls = row_class(tuple(names))
    if not columns:
        return []
    return list(map(tuple.__new__, itertools.repeat(cls), zip(*columns, strict=True)))
