"""Declared schemas of state values: recorded per version, checked when declared, migrated
on read, written in the new version lazily.

A state declared with ``schema=`` (a dataclass, a Spark ``StructType`` or a pyarrow
``Schema``) and ``version=``
stores each value (after the TTL bytes of ``_layout``) as::

    0x02 <schema version: varint> <the codec's bytes of the list of field values>

the fields in the order the operator record lists for that version. The record keeps the
field list (name, type, nullability) of **every** version the state was declared with, so a
reader decodes any value without the processor, and the store is never rewritten when a
schema changes: a value moves to the declared version when its key is next written. Only
the version costs bytes per value (one byte below version 128); field names live in the
record. States declared without a schema keep their values' bytes (the codec's, starting
``0x01`` or ``0x80``) and their record entries exactly as before.

Compatibility is decided when the processor declares the state (in ``init``, before any
value is read or written), against every version the record holds, because values of any
of them may still be stored; a change that cannot be read raises
:class:`~statekeeper.errors.ConfigMismatchError` naming the state and both schemas, so
nothing committed is touched and the processor can be fixed and restarted. The rules are in
:meth:`statekeeper.keyed.StatefulProcessorHandle.value_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statekeeper.errors import ConfigMismatchError, CorruptStateError
from statekeeper.keyed._shapes import RecordedSchema, Shape, shape_of
from statekeeper.keyed._values import (
    SCHEMA_FORMAT,
    Codec,
    DefaultCodec,
    PickleCodec,
    read_varint,
    varint,
)

__all__ = [
    "SCHEMA_FORMAT",
    "Migrate",
    "SchemaCodec",
    "declare_schema",
    "decode_recorded",
    "stored_schema_version",
]

_MAX_VERSION = 2**31 - 1

UNVERSIONED = RecordedSchema(0, ())
"""Recorded when a state that held values without a schema adopts one: such values may
remain (they have no ``0x02``), and only a migration reads them."""

Migrate = Callable[[Any, int], Any]
"""``migrate(old value as a dict of its version's fields, that version) -> new value``."""

_INTS = ("tinyint", "smallint", "int", "bigint")
_FLOATS = ("float", "double")


def _none() -> None:
    return None


# -- compatibility -------------------------------------------------------------------------


def _widens(old: str, new: str) -> bool:
    """True if every value of type ``old`` reads as type ``new`` without a migration."""
    if old == new or new == "any":
        return True
    if old in _INTS:
        return (new in _INTS and _INTS.index(new) > _INTS.index(old)) or new == "double"
    return old == "float" and new == "double"


def _problems(old: RecordedSchema, shape: Shape) -> list[str]:
    """Why values of ``old`` cannot be read as the declared fields (empty: they can)."""
    stored = {f.name: f for f in old.fields}
    found = []
    for f in shape.fields:
        was = stored.get(f.name)
        if was is None:
            if f.name not in shape.defaults:
                found.append(f"field {f.name!r} is added without a default and is not nullable")
        elif not _widens(was.type, f.type):
            found.append(f"field {f.name!r} changes type from {was.type} to {f.type}")
        elif was.nullable and not f.nullable:
            found.append(f"field {f.name!r} may be null in version {old.version} but not now")
    return found


def _check(
    state: str,
    history: tuple[RecordedSchema, ...],
    declared: RecordedSchema,
    shape: Shape,
    migrate: Migrate | None,
) -> tuple[RecordedSchema, ...]:
    """The schema versions to record, once ``declared`` is known to read every stored one.

    Raises:
        ConfigMismatchError: it cannot.
    """
    newest = history[-1] if history else declared
    if declared.version < newest.version:
        raise ConfigMismatchError(
            f"state {state!r}: the store holds values up to schema {newest}, but the processor "
            f"declares schema {declared}: schema versions never go down (version "
            f"{declared.version} cannot read what version {newest.version} wrote)"
        )
    if declared.version == newest.version and declared.fields != newest.fields:
        raise ConfigMismatchError(
            f"state {state!r}: the store records schema {newest}, but the processor "
            f"declares schema {declared}: a changed schema needs a higher version (and "
            "a migrate= function unless the change is compatible)"
        )
    # Keys not written since keep older versions: each must stay readable, also when a
    # version declared earlier with a migration is declared again without one.
    for old in history if migrate is None else ():
        if old.version == 0:
            raise ConfigMismatchError(
                f"state {state!r} may hold values written before it had a schema: declaring "
                f"schema {declared} for it needs migrate= (called with from_version=0)"
            )
        found = [] if old.version == declared.version else _problems(old, shape)
        if found:
            raise ConfigMismatchError(
                f"state {state!r}: values stored with schema {old} cannot be read as the "
                f"declared schema {declared} without a migration: {'; '.join(found)}. "
                "Pass migrate=, or make the change compatible (see value_state)"
            )
    if history and declared.version == newest.version:
        return history
    return (*history, declared)


def declare_schema(
    state: str,
    codec: Codec,
    schema: Any,
    *,
    version: int | None,
    migrate: Migrate | None,
    stored: tuple[RecordedSchema, ...] | None,
) -> Codec:
    """The codec a state declared with these arguments reads and writes through.

    Args:
        state: the state's name (for errors).
        codec: the declared codec.
        schema: the declared schema, or ``None``.
        version: the declared schema version (1 if ``None``).
        migrate: the declared migration, or ``None``.
        stored: the schema versions the store's record holds for the state; ``None`` if the
            record does not know the state (an empty tuple: it holds values without a schema).

    Raises:
        TypeError, ValueError: malformed arguments.
        ConfigMismatchError: the declared schema cannot read what the store holds.
    """
    if schema is None:
        if version is not None or migrate is not None:
            raise TypeError(f"state {state!r}: version= and migrate= need a schema=")
        if stored:
            raise ConfigMismatchError(
                f"state {state!r}: the store records schema {stored[-1]}, but the processor "
                "declares the state without a schema: declare it with schema= and version= "
                "(its values carry their schema version)"
            )
        return codec
    if not isinstance(codec, DefaultCodec | PickleCodec):
        raise TypeError(
            f"state {state!r}: a schema needs the DefaultCodec or the PickleCodec, got {codec!r}"
        )
    version = 1 if version is None else version
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"state {state!r}: version must be an int, got {version!r}")
    if not 1 <= version <= _MAX_VERSION:
        raise ValueError(
            f"state {state!r}: version must be from 1 to {_MAX_VERSION}, got {version}"
        )
    if migrate is not None and not callable(migrate):
        raise TypeError(f"state {state!r}: migrate must be callable, got {migrate!r}")
    shape = shape_of(state, schema)
    declared = RecordedSchema(version, shape.fields)
    if stored is not None and not stored:
        stored = (UNVERSIONED,)  # the state holds values written without a schema
    history = _check(state, stored or (), declared, shape, migrate)
    return SchemaCodec(state, codec, shape, history, version, migrate)


# -- values --------------------------------------------------------------------------------


class SchemaCodec:
    """Reads values of every recorded version as the declared type; writes the declared one."""

    def __init__(
        self,
        state: str,
        inner: Codec,
        shape: Shape,
        history: tuple[RecordedSchema, ...],
        version: int,
        migrate: Migrate | None,
    ) -> None:
        """Wrap ``inner``; see :func:`declare_schema`."""
        self.name = inner.name
        self.recorded = history
        """Every schema version the operator record keeps for the state, ascending."""
        self.version = version
        self._state = state
        self._inner = inner
        self._shape = shape
        self._migrate = migrate
        header = bytearray((SCHEMA_FORMAT,))
        varint(version, header)
        self._header = bytes(header)
        self._plans: dict[int, Callable[[list[Any]], Any]] = {}

    def encode(self, value: Any) -> bytes:
        """The bytes of ``value`` in the declared version.

        Raises:
            TypeError: ``value`` is not of the declared schema, or its codec cannot encode it.
        """
        return self._header + self._inner.encode(self._shape.values(value, "a value"))

    def decode(self, data: bytes) -> Any:
        """``data`` as the declared type: migrated or given defaults if an older version.

        Raises:
            CorruptStateError: malformed bytes, or a version the record does not hold.
            TypeError: a migration returned something that is not of the declared schema.
            Exception: whatever the migration raises.
        """
        if data[:1] != self._header[:1]:
            return self._unversioned(data)
        version, start = _read_version(data)
        values = self._inner.decode(data[start:])
        if not isinstance(values, list):
            raise CorruptStateError(f"a value of state {self._state!r} does not hold a field list")
        if version == self.version:
            if len(values) != len(self._shape.names):
                raise CorruptStateError(
                    f"a value of state {self._state!r} holds {len(values)} fields, its schema "
                    f"version {version} has {len(self._shape.names)}"
                )
            return self._shape.build(values)
        plan = self._plans.get(version)
        if plan is None:
            plan = self._plans[version] = self._plan(version)
        return plan(values)

    def _unversioned(self, data: bytes) -> Any:
        if self._migrate is None:
            raise CorruptStateError(
                f"a value of state {self._state!r} carries no schema version (first byte "
                f"0x{data[:1].hex() or '--'}), and the state declares no migrate= for values "
                "written before it had a schema"
            )
        return self._shape.coerce(self._migrate(self._inner.decode(data), 0), "migrate's result")

    def _plan(self, version: int) -> Callable[[list[Any]], Any]:
        """How values of an older ``version`` become the declared type."""
        old = next((s for s in self.recorded if s.version == version), None)
        if old is None or not 0 < version < self.version:
            raise CorruptStateError(
                f"a value of state {self._state!r} has schema version {version}, which the "
                f"operator record does not hold (it holds {[s.version for s in self.recorded]})"
            )
        names, shape, migrate, state = old.names, self._shape, self._migrate, self._state
        # Without a migration, declare_schema made sure every declared field is in ``old``
        # (perhaps narrower) or has a default.
        position = {name: i for i, name in enumerate(names)}
        types_of = {f.name: f.type for f in old.fields}
        steps: list[tuple[int, Callable[[], Any], bool]] = []
        for f in shape.fields if migrate is None else ():
            i = position.get(f.name, -1)
            to_float = i >= 0 and f.type in _FLOATS and types_of[f.name] not in _FLOATS
            steps.append((i, _none if i >= 0 else shape.defaults[f.name], to_float))

        def read(values: list[Any]) -> Any:
            if len(values) != len(names):
                raise CorruptStateError(
                    f"a value of state {state!r} holds {len(values)} fields, its schema "
                    f"version {version} has {len(names)}"
                )
            if migrate is not None:
                old_value = dict(zip(names, values, strict=True))
                return shape.coerce(migrate(old_value, version), "migrate's result")
            out = []
            for i, default, to_float in steps:
                if i < 0:
                    out.append(default())
                else:
                    value = values[i]
                    out.append(float(value) if to_float and value is not None else value)
            return shape.build(out)

        return read


def decode_recorded(payload: bytes, codec: Codec, schemas: tuple[RecordedSchema, ...]) -> Any:
    """A value of a state recorded with ``schemas``, without its processor: a dict of the
    fields of the version it was written in (a value written before the state had a schema
    as ``codec`` decodes it).

    Raises:
        CorruptStateError: malformed bytes, or a version the record does not hold.
    """
    if payload[:1] != bytes((SCHEMA_FORMAT,)):
        return codec.decode(payload)
    version, start = _read_version(payload)
    schema = next((s for s in schemas if s.version == version), None)
    if schema is None:
        raise CorruptStateError(
            f"a state value has schema version {version}, which the operator record does not "
            f"hold (it holds {[s.version for s in schemas]})"
        )
    values = codec.decode(payload[start:])
    if not isinstance(values, list) or len(values) != len(schema.fields):
        raise CorruptStateError(f"a state value does not hold the fields of schema {schema}")
    return dict(zip(schema.names, values, strict=True))


def stored_schema_version(payload: bytes) -> int | None:
    """The schema version a stored value (its codec bytes, after the TTL bytes) was written
    in; ``None`` for a value without one.

    Raises:
        CorruptStateError: a malformed version.
    """
    if payload[:1] != bytes((SCHEMA_FORMAT,)):
        return None
    return _read_version(payload)[0]


def _read_version(data: bytes) -> tuple[int, int]:
    """The schema version after the format byte, and where the codec's bytes start."""
    try:
        return read_varint(memoryview(data), 1)
    except (IndexError, ValueError) as exc:
        raise CorruptStateError(f"a state value's schema version is malformed: {exc}") from exc
