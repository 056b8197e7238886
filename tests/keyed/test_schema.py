"""Schema evolution of state values, on a real store: compatible changes read with defaults,
migrations on read, new versions written lazily, incompatible changes refused at declaration
before anything is touched; undeclared states keep their bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from statekeeper import ConfigMismatchError, StateBackend, StateStore, StoreConfig
from statekeeper.cli import cli
from statekeeper.keyed import (
    DefaultCodec,
    PickleCodec,
    StatefulProcessor,
    StatefulProcessorHandle,
    encode_key,
    iter_state,
    stored_schema_version,
)
from statekeeper.keyed._layout import (
    META_KEY,
    NO_TTL,
    OperatorRecord,
    StateDecl,
    state_prefix,
    unwrap,
)
from statekeeper.keyed._shapes import RecordedSchema
from statekeeper.keyed._values import SCHEMA_FORMAT
from statekeeper.keyed.testing import ProcessorTester

OUT = pa.schema([("k", pa.string()), ("n", pa.int64())])


@dataclass
class ProfileV1:
    name: str
    visits: int


@dataclass
class ProfileAdded:  # v2: a field with a default, an Optional one, visits widened to float
    name: str
    visits: float
    tags: list[str] = field(default_factory=list)
    email: str | None = None


@dataclass
class ProfileRenamed:  # v2: name -> full_name, needs a migration
    full_name: str
    visits: int


@dataclass
class ProfileRetyped:  # v2: visits becomes a str: incompatible without a migration
    name: str
    visits: str


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[StateBackend]:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with StateBackend(str(tmp_path / "root"), config=config) as backend:
        yield backend


def _handle(store: StateStore) -> StatefulProcessorHandle:
    return StatefulProcessorHandle(store, now_ms=0, batch_id=store.version, partition=0)


def _batch(backend: StateBackend, declare: Any, writes: dict[str, Any] | None = None) -> None:
    """One committed batch: declare the state ``p`` (``declare(handle)``), write ``writes``
    (key -> value) through it, record the operator."""
    with backend.open("op", 0) as store:
        handle = _handle(store)
        state = declare(handle)
        handle.record_operator(["k"], key_schema=None, operator="op")
        for key, value in (writes or {}).items():
            handle.set_key((key,))
            state.update(value)
        store.commit()


def _read(backend: StateBackend, declare: Any, keys: list[str]) -> dict[str, Any]:
    with backend.open("op", 0) as store:
        handle = _handle(store)
        state = declare(handle)
        found = {}
        for key in keys:
            handle.set_key((key,))
            found[key] = state.get()
        store.abort()
    return found


def _versions(backend: StateBackend, keys: list[str]) -> dict[str, int | None]:
    """The schema version the value of ``p`` of each key was written in, from its bytes."""
    with backend.open("op", 0) as store:
        raw = {k: store.get(state_prefix("p") + encode_key((k,))) for k in keys}
    return {k: stored_schema_version(unwrap(v or b"")[1]) for k, v in raw.items()}


def _record(backend: StateBackend) -> dict[str, Any]:
    with backend.open("op", 0) as store:
        doc: dict[str, Any] = json.loads(store.get(META_KEY) or b"")
    return doc


def v1(handle: StatefulProcessorHandle) -> Any:
    return handle.value_state("p", schema=ProfileV1, version=1)


def test_an_added_field_reads_its_default_and_is_written_lazily(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3), "b": ProfileV1("Bob", 1)})

    def v2(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state("p", schema=ProfileAdded, version=2)

    assert _read(backend, v2, ["a", "b"]) == {
        "a": ProfileAdded("Ann", 3.0, [], None),
        "b": ProfileAdded("Bob", 1.0, [], None),
    }
    assert type(_read(backend, v2, ["a"])["a"].visits) is float  # widened on read
    assert _versions(backend, ["a", "b"]) == {"a": 1, "b": 1}  # reading rewrote nothing

    _batch(backend, v2, {"b": ProfileAdded("Bob", 2.5, ["x"], "b@x")})
    assert _versions(backend, ["a", "b"]) == {"a": 1, "b": 2}  # only the written key moved
    assert _read(backend, v2, ["a", "b"])["b"] == ProfileAdded("Bob", 2.5, ["x"], "b@x")
    schemas = _record(backend)["states"]["p"]["schemas"]
    assert [s["version"] for s in schemas] == [1, 2]
    assert schemas[1]["fields"][3] == {"name": "email", "type": "string", "nullable": True}
    assert _record(backend)["formatVersion"] == 3


def test_a_rename_with_a_migration_is_applied_on_read(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3), "b": ProfileV1("Bob", 1)})
    calls: list[tuple[dict[str, Any], int]] = []

    def migrate(old: dict[str, Any], version: int) -> Any:
        calls.append((old, version))
        return {"full_name": old["name"], "visits": old["visits"]}

    def v2(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state("p", schema=ProfileRenamed, version=2, migrate=migrate)

    assert _read(backend, v2, ["a", "b"]) == {
        "a": ProfileRenamed("Ann", 3),
        "b": ProfileRenamed("Bob", 1),
    }
    assert calls == [({"name": "Ann", "visits": 3}, 1), ({"name": "Bob", "visits": 1}, 1)]
    _batch(backend, v2, {"a": ProfileRenamed("Ann Lee", 4)})
    assert _versions(backend, ["a", "b"]) == {"a": 2, "b": 1}
    calls.clear()
    assert _read(backend, v2, ["a", "b"]) == {
        "a": ProfileRenamed("Ann Lee", 4),
        "b": ProfileRenamed("Bob", 1),
    }
    assert [version for _, version in calls] == [1]  # only the old value was migrated


def test_an_incompatible_change_is_refused_at_declaration(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    before = _record(backend)
    with backend.open("op", 0) as store:
        version = store.version
        with pytest.raises(ConfigMismatchError) as caught:
            _handle(store).value_state("p", schema=ProfileRetyped, version=2)
        store.abort()
    message = str(caught.value)
    assert "state 'p'" in message
    assert "version 1 (name string not null, visits bigint not null)" in message  # stored
    assert "version 2 (name string not null, visits string not null)" in message  # declared
    assert "field 'visits' changes type from bigint to string" in message
    # Nothing was touched: the old processor goes on from the same version
    assert _record(backend) == before
    _batch(backend, v1, {"b": ProfileV1("Bob", 1)})
    assert _read(backend, v1, ["a", "b"]) == {"a": ProfileV1("Ann", 3), "b": ProfileV1("Bob", 1)}
    with backend.open("op", 0) as store:
        assert store.version == version + 1


@pytest.mark.parametrize(
    ("declare", "expected"),
    [
        (
            lambda h: h.value_state("p", schema=ProfileRenamed, version=2),
            "field 'full_name' is added without a default and is not nullable",
        ),
        (
            lambda h: h.value_state("p", schema=ProfileAdded, version=1),
            "a changed schema needs a higher version",
        ),
        (lambda h: h.value_state("p"), "declares the state without a schema"),
    ],
)
def test_other_unreadable_changes_are_refused(
    backend: StateBackend, declare: Any, expected: str
) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    with (
        backend.open("op", 0) as store,
        pytest.raises(ConfigMismatchError, match=expected) as caught,
    ):
        declare(_handle(store))
    assert "state 'p'" in str(caught.value)


def test_a_version_never_goes_down(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    _batch(backend, lambda h: h.value_state("p", schema=ProfileAdded, version=2))
    with (
        backend.open("op", 0) as store,
        pytest.raises(ConfigMismatchError, match="schema versions never go down") as caught,
    ):
        v1(_handle(store))
    assert "version 2 (name string not null, visits double not null, tags" in str(caught.value)


def test_every_stored_version_must_stay_readable(backend: StateBackend) -> None:
    """v3 re-adds a field that v2 dropped, as another type: v1's values would misread."""

    @dataclass
    class Dropped:
        name: str

    @dataclass
    class ReAdded:
        name: str
        visits: str = ""

    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    _batch(backend, lambda h: h.value_state("p", schema=Dropped, version=2), {"b": Dropped("B")})
    with (
        backend.open("op", 0) as store,
        pytest.raises(ConfigMismatchError, match="values stored with schema version 1"),
    ):
        _handle(store).value_state("p", schema=ReAdded, version=3)


def test_a_state_without_a_schema_adopts_one_through_a_migration(backend: StateBackend) -> None:
    _batch(backend, lambda h: h.value_state("p"), {"a": ("Ann", 3)})
    with (
        backend.open("op", 0) as store,
        pytest.raises(ConfigMismatchError, match="written before it had a schema"),
    ):
        v1(_handle(store))

    def adopt(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state(
            "p", schema=ProfileV1, migrate=lambda old, version: ProfileV1(*old)
        )

    assert _read(backend, adopt, ["a"]) == {"a": ProfileV1("Ann", 3)}
    _batch(backend, adopt, {"b": ProfileV1("Bob", 1)})
    assert _versions(backend, ["a", "b"]) == {"a": None, "b": 1}
    schemas = _record(backend)["states"]["p"]["schemas"]
    assert (schemas[0]["version"], schemas[0]["fields"]) == (0, [])
    with backend.open("op", 0) as store:
        values = {e.key[0]: e.value for e in iter_state(store)}
    assert values == {"a": ("Ann", 3), "b": {"name": "Bob", "visits": 1}}
    # "a" still has no schema version: dropping the migration is refused, also later on
    for schema, version in ((ProfileV1, 1), (ProfileAdded, 2)):
        with (
            backend.open("op", 0) as store,
            pytest.raises(ConfigMismatchError, match="written before it had a schema"),
        ):
            _handle(store).value_state("p", schema=schema, version=version)


def test_a_migration_stays_needed_while_old_values_remain(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})

    def renamed(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state(
            "p", schema=ProfileRenamed, version=2, migrate=lambda d, v: ProfileRenamed(*d.values())
        )

    _batch(backend, renamed, {"b": ProfileRenamed("Bob", 1)})
    with (
        backend.open("op", 0) as store,
        pytest.raises(ConfigMismatchError, match="values stored with schema version 1") as caught,
    ):
        _handle(store).value_state("p", schema=ProfileRenamed, version=2)
    assert "field 'full_name' is added without a default" in str(caught.value)


def test_undeclared_states_keep_their_bytes_and_record(backend: StateBackend) -> None:
    _batch(backend, lambda h: h.value_state("p"), {"a": {"name": "Ann", "visits": 3}})
    with backend.open("op", 0) as store:
        values = [v for k, v in store.scan() if k != META_KEY]
        record = store.get(META_KEY)
    assert values == [NO_TTL + DefaultCodec().encode({"name": "Ann", "visits": 3})]
    assert values == [
        b"\x00\x01\x0a\x02\x06\x04name\x06\x03Ann\x06\x06visits\x03" + bytes(7) + b"\x03"
    ]
    assert record == (
        b'{"format":"statekeeper.spark.operator","formatVersion":1,"keySchema":null,'
        b'"keys":["k"],"states":{"p":{"codec":"default","kind":"value","ttlMs":null}}}'
    )


def test_a_store_written_before_schemas_still_reads(backend: StateBackend) -> None:
    """Literal bytes of a store written by the release before schemas: a record of format 1
    and a value of the default codec, read as they were, then adopted by a schema."""
    record = (
        b'{"format":"statekeeper.spark.operator","formatVersion":1,"keySchema":null,'
        b'"keys":["k"],"states":{"p":{"codec":"default","kind":"value","ttlMs":null}}}'
    )
    value = b"\x00\x01\x0a\x02\x06\x04name\x06\x03Ann\x06\x06visits\x03" + bytes(7) + b"\x03"
    with backend.open("op", 0) as store:
        store.put(META_KEY, record)
        store.put(state_prefix("p") + encode_key(("a",)), value)
        store.commit()
    plain = {"name": "Ann", "visits": 3}
    assert _read(backend, lambda h: h.value_state("p"), ["a"]) == {"a": plain}
    with backend.open("op", 0) as store:
        assert [(e.key, e.value) for e in iter_state(store)] == [(("a",), plain)]

    def adopt(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state("p", schema=ProfileV1, migrate=lambda old, v: old)

    assert _read(backend, adopt, ["a"]) == {"a": ProfileV1("Ann", 3)}


def test_a_schema_value_costs_two_bytes_over_the_field_list(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    with backend.open("op", 0) as store:
        (value,) = [v for k, v in store.scan() if k != META_KEY]
    assert value == NO_TTL + b"\x02\x01" + DefaultCodec().encode(["Ann", 3])


def test_map_values_and_list_elements_evolve_per_entry(backend: StateBackend) -> None:
    def old(handle: StatefulProcessorHandle) -> tuple[Any, Any]:
        return (
            handle.map_state("m", schema=ProfileV1),
            handle.list_state("l", schema=ProfileV1, codec=PickleCodec()),
        )

    def new(handle: StatefulProcessorHandle) -> tuple[Any, Any]:
        def migrate(d: dict[str, Any], version: int) -> ProfileRenamed:
            return ProfileRenamed(d["name"].upper(), d["visits"])

        return (
            handle.map_state("m", schema=ProfileAdded, version=2),
            handle.list_state(
                "l", schema=ProfileRenamed, version=2, codec=PickleCodec(), migrate=migrate
            ),
        )

    with backend.open("op", 0) as store:
        handle = _handle(store)
        m, lst = old(handle)
        handle.record_operator(["k"], key_schema=None, operator="op")
        handle.set_key(("a",))
        m.put("x", ProfileV1("X", 1))
        lst.extend([ProfileV1("p", 1), ProfileV1("q", 2)])
        store.commit()
    with backend.open("op", 0) as store:
        handle = _handle(store)
        m, lst = new(handle)
        handle.record_operator(["k"], key_schema=None, operator="op")
        handle.set_key(("a",))
        assert m.get("x") == ProfileAdded("X", 1.0)
        m.put("y", {"name": "Y", "visits": 2.0})  # a dict of the fields; defaults filled
        assert dict(m.items()) == {"x": ProfileAdded("X", 1.0), "y": ProfileAdded("Y", 2.0)}
        lst.append(ProfileRenamed("R", 3))
        assert lst.get() == [
            ProfileRenamed("P", 1),
            ProfileRenamed("Q", 2),
            ProfileRenamed("R", 3),
        ]
        store.commit()
    with backend.open("op", 0) as store:
        by_state: dict[str, list[int | None]] = {}
        for entry in iter_state(store, allow_pickle=True):
            by_state.setdefault(entry.state, []).append(entry.value.get("visits"))
        versions = sorted(
            stored_schema_version(unwrap(v)[1]) or 0
            for k, v in store.scan()
            if k != META_KEY and len(v) > 8
        )
    assert versions == [1, 1, 1, 2, 2]  # x, p, q old; y, r new
    assert by_state == {"l": [1, 2, 3], "m": [1, 2.0]}


def test_tools_decode_a_mixed_store_with_the_recorded_schemas(backend: StateBackend) -> None:
    """iter_state (read_state, statekeeper inspect) needs no processor: each value is a dict
    of the fields of the version it was written in."""
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})

    def v2(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state(
            "p",
            schema=ProfileRenamed,
            version=2,
            migrate=lambda d, v: ProfileRenamed(d["name"], d["visits"]),
        )

    _batch(backend, v2, {"b": ProfileRenamed("Bob", 1)})
    with backend.open("op", 0) as store:
        values = {e.key[0]: e.value for e in iter_state(store)}
    assert values == {"a": {"name": "Ann", "visits": 3}, "b": {"full_name": "Bob", "visits": 1}}


def test_a_struct_type_schema_reads_dicts(tmp_path: Path) -> None:
    types = pytest.importorskip("pyspark.sql.types")
    v1_type = types.StructType(
        [
            types.StructField("name", types.StringType(), False),
            types.StructField("n", types.IntegerType()),
        ]
    )
    v2_type = types.StructType(
        [
            types.StructField("n", types.LongType()),
            types.StructField("name", types.StringType(), False),
            types.StructField("tags", types.ArrayType(types.StringType())),
        ]
    )

    class Counter(StatefulProcessor):
        def __init__(self, schema: Any, version: int) -> None:
            self.schema, self.version = schema, version

        def init(self, handle: Any) -> None:
            self.state = handle.value_state("p", schema=self.schema, version=self.version)

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            old = self.state.get() or {"name": key[0], "n": 0}
            self.state.update({"name": old["name"], "n": old["n"] + len(rows)})
            yield {"k": key[0], "n": old["n"] + len(rows)}

    def tester(processor: StatefulProcessor) -> ProcessorTester:
        return ProcessorTester(processor, keys="k", output_schema=OUT, directory=tmp_path)

    with tester(Counter(v1_type, 1)) as first:
        assert first.run([{"k": "a"}, {"k": "b"}]) == [{"k": "a", "n": 1}, {"k": "b", "n": 1}]
    with tester(Counter(v2_type, 2)) as second:  # the same root, a restarted processor
        assert second.run([{"k": "a"}]) == [{"k": "a", "n": 2}]
        values = {e.key[0]: e.value for e in second.state()}
    assert values == {"a": {"n": 2, "name": "a", "tags": None}, "b": {"name": "b", "n": 1}}
    retyped = types.StructType([types.StructField("n", types.StringType())])
    with (
        tester(Counter(retyped, 3)) as third,
        pytest.raises(ConfigMismatchError, match="changes type from int to string"),
    ):
        third.run([{"k": "a"}])


def test_bad_declarations_and_values_are_refused(backend: StateBackend) -> None:
    @dataclass
    class Nested:
        inner: ProfileV1

    with backend.open("op", 0) as store:
        h = _handle(store)
        with pytest.raises(
            TypeError, match="must be a dataclass, a pyspark StructType or a pyarrow Schema"
        ):
            h.value_state("a", schema=dict)
        with pytest.raises(TypeError, match=r"field 'inner' of Nested: .* has no schema type"):
            h.value_state("b", schema=Nested)
        with pytest.raises(ValueError, match="version must be from 1"):
            h.value_state("c", schema=ProfileV1, version=0)
        with pytest.raises(TypeError, match="version= and migrate= need a schema="):
            h.value_state("d", version=2)
        with pytest.raises(TypeError, match="needs the DefaultCodec or the PickleCodec"):
            h.value_state("e", schema=ProfileV1, codec=_Custom())
        state = h.value_state("f", schema=ProfileV1)
        h.set_key(("a",))
        with pytest.raises(TypeError, match=r"must be a ProfileV1 or a dict .* got a tuple"):
            state.update(("Ann", 3))
        with pytest.raises(TypeError, match="field 'name' is None, but"):
            state.update(ProfileV1(None, 3))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"fields \['nmae'\] that its schema does not"):
            state.update({"nmae": "Ann", "visits": 3})
        with pytest.raises(TypeError, match="lacks field 'name', which has no default"):
            state.update({"visits": 3})
        assert list(store.scan()) == []


class _Custom:
    name = "custom"

    def encode(self, value: Any) -> bytes:
        return b""

    def decode(self, data: bytes) -> Any:
        return None


def test_the_format_doc_states_the_stored_form() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "format.md").read_text()
    start = doc.index("## State values with a schema")
    section = doc[start : doc.index("\n## ", start + 1)]
    assert f"0x{SCHEMA_FORMAT:02x} <schema version: varint>" in section
    example = section.split("```json\n")[1].split("```")[0]
    decl = json.loads("{" + example + "}")["profile"]
    schemas = tuple(RecordedSchema.from_json(s) for s in decl["schemas"])
    record = OperatorRecord(
        ("k",), None, {"profile": StateDecl("value", None, "default", schemas=schemas)}
    )
    stored = json.loads(record.to_bytes())
    assert stored["states"]["profile"] == decl
    assert f"`formatVersion` is {stored['formatVersion']} once any state has a schema" in section


def test_a_pyarrow_schema_records_what_the_same_dataclass_records(backend: StateBackend) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    same = pa.schema(
        [pa.field("name", pa.string(), nullable=False), pa.field("visits", pa.int64(), False)]
    )
    assert _read(backend, lambda h: h.value_state("p", schema=same), ["a"]) == {
        "a": {"name": "Ann", "visits": 3}
    }
    widened = pa.schema(
        [
            pa.field("visits", pa.float64(), nullable=False),
            pa.field("name", pa.string(), nullable=False),
            pa.field("seen", pa.list_(pa.timestamp("us", tz="UTC"))),
        ]
    )

    def v2(handle: StatefulProcessorHandle) -> Any:
        return handle.value_state("p", schema=widened, version=2)

    assert _read(backend, v2, ["a"]) == {"a": {"visits": 3.0, "name": "Ann", "seen": None}}
    _batch(backend, v2, {"b": {"visits": 1.5, "name": "Bob"}})
    fields = _record(backend)["states"]["p"]["schemas"][1]["fields"]
    assert fields[2] == {"name": "seen", "type": "array<timestamp>", "nullable": True}
    retyped = pa.schema([pa.field("visits", pa.string())])
    with backend.open("op", 0) as store, pytest.raises(ConfigMismatchError) as caught:
        _handle(store).value_state("p", schema=retyped, version=3)
    assert "field 'visits' changes type from bigint to string" in str(caught.value)


def test_a_schema_state_with_a_ttl(backend: StateBackend) -> None:
    with backend.open("op", 0) as store:
        handle = _handle(store)
        state = handle.value_state("p", schema=ProfileV1, ttl=10)
        handle.set_key(("a",))
        state.update(ProfileV1("Ann", 3))
        assert state.get() == ProfileV1("Ann", 3)
        store.commit()
    with backend.open("op", 0) as store:
        late = StatefulProcessorHandle(store, now_ms=10_000, batch_id=1, partition=0)
        state = late.value_state("p", schema=ProfileV1, ttl=10)
        late.set_key(("a",))
        assert state.get() is None
        assert late.expire() == 1


def test_inspect_shows_each_value_in_the_version_it_was_written_in(
    backend: StateBackend, tmp_path: Path
) -> None:
    _batch(backend, v1, {"a": ProfileV1("Ann", 3)})
    _batch(
        backend,
        lambda h: h.value_state("p", schema=ProfileAdded, version=2),
        {"b": {"name": "B", "visits": 1}},
    )
    args = ["inspect", str(tmp_path / "root"), "op", "-p", "0", "--json", "--limit", "0"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    values = {
        tuple(i["state"]["key"]): i["value"]
        for i in json.loads(result.stdout)["items"]
        if i["value_format"] == "decoded"
    }
    assert values == {
        ("a",): {"name": "Ann", "visits": 3},
        ("b",): {"name": "B", "visits": 1.0, "tags": [], "email": None},
    }
