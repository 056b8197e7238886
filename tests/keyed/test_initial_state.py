"""Initial state through the processor test harness (the Spark task's path): applied once, in
the first batch, before the input, in both row forms; bad input refused before any state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from statekeeper import StateKeeperError
from statekeeper.keyed import StatefulProcessor, StatefulProcessorHandle, TimerValues
from statekeeper.keyed.testing import ProcessorTester

OUT = pa.schema([("k", pa.string()), ("n", pa.int64())])
INITIAL = [{"k": "a", "n": 10}, {"k": "b", "n": 5}, {"k": "a", "n": 1}]


class Seeded(StatefulProcessor):
    """A running sum seeded by the initial rows (all of a key's rows are summed); records
    what it saw in the order it saw it."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.total = handle.value_state("total")
        self.seen = handle.list_state("seen")

    def handle_initial_state(self, key: tuple[Any, ...], rows: Any, timer_values: Any) -> None:
        self.total.update((self.total.get() or 0) + sum(r.n for r in rows))
        self.seen.append(f"initial:{len(rows)}@{timer_values.processing_time_ms}")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        total = (self.total.get() or 0) + sum(r.n for r in rows)
        self.total.update(total)
        self.seen.append(f"input:{len(rows)}")
        yield (key[0], total)


class SeededPandas(Seeded):
    """The same with pandas DataFrames."""

    rows = "pandas"

    def handle_initial_state(self, key: tuple[Any, ...], rows: Any, timer_values: Any) -> None:
        self.total.update((self.total.get() or 0) + int(rows["n"].sum()))
        self.seen.append(f"initial:{len(rows)}@{timer_values.processing_time_ms}")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        total = (self.total.get() or 0) + int(rows["n"].sum())
        self.total.update(total)
        self.seen.append(f"input:{len(rows)}")
        yield (key[0], total)


def _values(tester: ProcessorTester, name: str) -> dict[Any, Any]:
    found: dict[Any, Any] = {}
    for entry in tester.state(name):
        if entry.kind == "value":
            found[entry.key[0]] = entry.value
        else:
            found.setdefault(entry.key[0], []).append(entry.value)
    return found


@pytest.mark.parametrize("processor", [Seeded(), SeededPandas()], ids=["row", "pandas"])
def test_initial_state_is_applied_once_before_the_first_batch_input(
    processor: StatefulProcessor,
) -> None:
    with ProcessorTester(processor, keys="k", output_schema=OUT, initial_state=INITIAL) as t:
        t.processing_time_ms = 7
        # a has input and initial rows, b initial rows only, c input only
        assert t.run([{"k": "a", "n": 1}, {"k": "c", "n": 2}]) == [
            {"k": "a", "n": 12},
            {"k": "c", "n": 2},
        ]
        assert t.stats.initial_rows == 3
        assert _values(t, "total") == {"a": 12, "b": 5, "c": 2}
        # several rows of a key: one call with all of them, before the key's input
        assert _values(t, "seen") == {
            "a": ["initial:2@7", "input:1"],
            "b": ["initial:1@7"],
            "c": ["input:1"],
        }
        assert t.run([{"k": "a", "n": 1}, {"k": "b", "n": 1}]) == [
            {"k": "a", "n": 13},
            {"k": "b", "n": 6},
        ]
        assert t.stats.initial_rows == 0  # batch 1: not again
        assert _values(t, "seen")["a"] == ["initial:2@7", "input:1", "input:1"]


def test_initial_state_without_input_in_the_first_batch_is_applied() -> None:
    table = pa.table({"k": ["a"], "n": [3]})
    with ProcessorTester(Seeded(), keys="k", output_schema=OUT, initial_state=table) as t:
        assert t.run([]) == []
        assert _values(t, "total") == {"a": 3}
        assert t.run([{"k": "a", "n": 1}]) == [{"k": "a", "n": 4}]


def test_a_failed_first_batch_applies_the_initial_state_once_when_run_again() -> None:
    class FailsOnce(Seeded):
        failed: list[bool] = []  # noqa: RUF012 - shared across the tester's copies on purpose

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            if not self.failed:
                self.failed.append(True)
                raise RuntimeError("boom")
            yield from super().handle_input_rows(key, rows)

    with ProcessorTester(FailsOnce(), keys="k", output_schema=OUT, initial_state=INITIAL) as t:
        with pytest.raises(RuntimeError, match="boom"):
            t.run([{"k": "a", "n": 1}])
        assert t.batch_id == 0  # nothing committed
        assert t.run([{"k": "a", "n": 1}]) == [{"k": "a", "n": 12}]
        assert _values(t, "total") == {"a": 12, "b": 5}


class RegistersTimer(Seeded):
    def handle_initial_state(self, key: tuple[Any, ...], rows: Any, timer_values: Any) -> None:
        self.handle.register_timer(1_000)


def test_initial_state_may_register_timers_that_fire_later() -> None:
    class Fires(RegistersTimer):
        def handle_expired_timer(self, key: Any, timer_values: Any, info: Any) -> Iterator[Any]:
            yield (key[0], info.expiry_time_ms)

    with ProcessorTester(
        Fires(), keys="k", output_schema=OUT, time_mode="processing_time", initial_state=INITIAL
    ) as t:
        t.processing_time_ms = 10
        assert t.run([]) == []
        assert t.timers() == [(("a",), 1_000), (("b",), 1_000)]
        t.processing_time_ms = 1_000
        assert t.run([]) == [{"k": "a", "n": 1_000}, {"k": "b", "n": 1_000}]


def test_bad_initial_state_is_refused_before_any_state() -> None:
    with pytest.raises(ValueError, match=r"key columns \['k'\]; it lacks \['k'\]"):
        ProcessorTester(Seeded(), keys="k", output_schema=OUT, initial_state=[{"key": "a"}])

    class Plain(StatefulProcessor):
        def init(self, handle: StatefulProcessorHandle) -> None:
            pass

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            return iter(())

    with pytest.raises(ValueError, match="does not define handle_initial_state"):
        ProcessorTester(Plain(), keys="k", output_schema=OUT, initial_state=INITIAL)


def test_timers_from_the_initial_state_without_a_time_mode_commit_nothing() -> None:
    with ProcessorTester(RegistersTimer(), keys="k", output_schema=OUT, initial_state=INITIAL) as t:
        with pytest.raises(StateKeeperError, match="needs an operator with a time mode"):
            t.run([{"k": "a", "n": 1}])
        assert t.batch_id == 0  # nothing committed


def test_an_initial_state_handler_that_yields_is_refused() -> None:
    class Yields(Seeded):
        def handle_initial_state(  # type: ignore[override]
            self, key: tuple[Any, ...], rows: Any, timer_values: TimerValues
        ) -> Iterator[Any]:
            yield (key[0], 1)

    with ProcessorTester(Yields(), keys="k", output_schema=OUT, initial_state=INITIAL) as t:
        with pytest.raises(TypeError, match="must return None: it emits no rows"):
            t.run([])
        assert t.batch_id == 0
