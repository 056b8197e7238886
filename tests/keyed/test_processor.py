"""What a processor's ``init`` declares, learnt on the driver (``declared_ttls``): on a copy,
with a handle that only takes declarations and checks them as the real handle does."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from statekeeper.errors import StateKeeperError
from statekeeper.keyed import PickleCodec, StatefulProcessor, declared_ttls


class Declares(StatefulProcessor):
    """Declares one state of each kind; ``init`` sets attributes, ``close`` counts."""

    rows = "row"
    closed = 0

    def __init__(self, **ttl: Any) -> None:
        self.ttl = ttl

    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count", ttl=self.ttl.get("count"))
        self.seen = handle.map_state("seen", ttl=self.ttl.get("seen"), codec=PickleCodec())
        self.log = handle.list_state("log", ttl=self.ttl.get("log"))

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        return iter(())

    def close(self) -> None:
        type(self).closed += 1


def test_the_ttls_of_every_state_on_a_copy_then_close() -> None:
    processor = Declares(seen=2, log=dt.timedelta(hours=1))
    closed = Declares.closed
    assert declared_ttls(processor, None) == {"count": None, "seen": 2000, "log": 3_600_000}
    assert declared_ttls(Declares(), None) == {"count": None, "seen": None, "log": None}
    assert not hasattr(processor, "count"), "init ran on the processor, not on a copy"
    assert Declares.closed == closed + 2  # init then close, as Spark's driver does


class AsksTheBatch(Declares):
    def init(self, handle: Any) -> None:
        super().init(handle)
        self.first = handle.batch_id == 0


class ReadsAState(Declares):
    def init(self, handle: Any) -> None:
        super().init(handle)
        self.count.get()


class NeedsATask(Declares):
    def init(self, handle: Any) -> None:
        raise RuntimeError("init runs in tasks only")


class Unpicklable(Declares):
    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("cannot copy")


@pytest.mark.parametrize("processor", [AsksTheBatch(), ReadsAState(), NeedsATask(), Unpicklable()])
def test_anything_but_declarations_means_unknown(processor: StatefulProcessor) -> None:
    assert declared_ttls(processor, None) is None


class Declared(StatefulProcessor):
    def __init__(self, **args: Any) -> None:
        self.args = args

    def init(self, handle: Any) -> None:
        handle.value_state(**self.args)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        return iter(())


@pytest.mark.parametrize(
    ("time_mode", "args", "error", "message"),
    [
        (None, {"name": "a b"}, ValueError, "state name must be"),
        (None, {"name": "x", "ttl": -5}, ValueError, "ttl must be a positive duration"),
        (None, {"name": "x", "ttl": "1h"}, TypeError, "ttl must be seconds or a timedelta"),
        (None, {"name": "x", "ttl": 1, "ttl_on": "wall"}, ValueError, "ttl_on must be"),
        (None, {"name": "x", "ttl": 1, "ttl_on": "event_time"}, ValueError, "time_mode=None"),
        ("event_time", {"name": "x", "ttl_on": "event_time"}, ValueError, "no ttl was given"),
        (None, {"name": "x", "codec": object()}, TypeError, "codec must have name"),
        (None, {"name": "x", "version": 2}, TypeError, "version= and migrate= need a schema="),
    ],
)
def test_a_malformed_declaration_raises_the_handles_error(
    time_mode: str | None, args: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        declared_ttls(Declared(**args), time_mode)


class TwoKinds(StatefulProcessor):
    """Declares ``x`` as a value state with a TTL, then again as an ``again`` state."""

    def __init__(self, again: str) -> None:
        self.again = again

    def init(self, handle: Any) -> None:
        handle.value_state("x", ttl=1)
        getattr(handle, f"{self.again}_state")("x")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        return iter(())


@pytest.mark.parametrize("again", ["map", "list"])
def test_a_name_declared_as_two_kinds_raises_the_handles_error(again: str) -> None:
    with pytest.raises(StateKeeperError, match="state 'x' is already declared as a value state"):
        declared_ttls(TwoKinds(again), None)


def test_a_name_declared_again_as_the_same_kind_keeps_the_last_ttl() -> None:
    assert declared_ttls(TwoKinds("value"), None) == {"x": None}


def test_a_sound_event_time_declaration_passes() -> None:
    declared = Declared(name="x", ttl=10, ttl_on="event_time")
    assert declared_ttls(declared, "event_time") == {"x": 10_000}
