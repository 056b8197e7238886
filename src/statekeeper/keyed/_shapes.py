"""What a declared state schema is made of: its recorded fields, and how declared values
(dataclass instances, or dicts for a ``StructType`` or a pyarrow ``Schema``) become field
lists and back.

Field types are recorded as Spark's simple type names (``bigint``, ``double``, ``string``,
``array<string>``, ...), whichever way the schema was declared, so a dataclass, a
``StructType`` and a pyarrow schema with the same fields record the same schema; ``_schema``
compares them. pyspark and pyarrow are never imported here: their schemas are read through
their public attributes (``jsonValue()``; ``name``, ``type``, ``nullable`` of each field).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Union

__all__ = ["RecordedSchema", "SchemaField", "Shape", "shape_of"]

_PY_TYPES: dict[Any, str] = {
    bool: "boolean",
    int: "bigint",
    float: "double",
    str: "string",
    bytes: "binary",
    dt.datetime: "timestamp",
    dt.date: "date",
    dt.time: "time",
    dt.timedelta: "interval",
    Decimal: "decimal",
}
_SPARK_TYPES = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint"}
_ARROW_TYPES = {
    "int8": "tinyint",
    "int16": "smallint",
    "int32": "int",
    "int64": "bigint",
    "float": "float",
    "double": "double",
    "bool": "boolean",
    "string": "string",
    "large_string": "string",
    "binary": "binary",
    "large_binary": "binary",
    "date32[day]": "date",
}


@dataclass(frozen=True, slots=True)
class SchemaField:
    """One field of a recorded schema."""

    name: str
    type: str
    """Spark's simple type names (``bigint``, ``double``, ``string``, ``array<string>``,
    ``map<string,bigint>``, ...), ``any`` for an unchecked field."""
    nullable: bool

    def __str__(self) -> str:
        return f"{self.name} {self.type}{'' if self.nullable else ' not null'}"


@dataclass(frozen=True, slots=True)
class RecordedSchema:
    """The fields of one schema version of a state, as the operator record keeps them."""

    version: int
    fields: tuple[SchemaField, ...]

    def __str__(self) -> str:
        return f"version {self.version} ({', '.join(map(str, self.fields))})"

    @property
    def names(self) -> tuple[str, ...]:
        """The field names, in stored order."""
        return tuple(f.name for f in self.fields)

    def to_json(self) -> dict[str, Any]:
        """The JSON form in the operator record."""
        return {
            "version": self.version,
            "fields": [
                {"name": f.name, "type": f.type, "nullable": f.nullable} for f in self.fields
            ],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RecordedSchema:
        """Parse :meth:`to_json`'s form.

        Raises:
            ValueError, KeyError, TypeError: not such a document.
        """
        version = doc["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"schema version must be an int >= 0, got {version!r}")
        fields = tuple(
            SchemaField(str(f["name"]), str(f["type"]), bool(f["nullable"])) for f in doc["fields"]
        )
        if version == 0 and fields:
            raise ValueError("schema version 0 (values without a schema) has no fields")
        return cls(version, fields)


class Shape:
    """How declared values map to field lists: a dataclass, or dicts (a ``StructType``)."""

    def __init__(
        self,
        state: str,
        fields: tuple[SchemaField, ...],
        cls: type | None,
        defaults: dict[str, Callable[[], Any]],
    ) -> None:
        self.state = state
        self.fields = fields
        self.names = tuple(f.name for f in fields)
        self.cls = cls
        self.defaults = defaults
        """Fields a value of an older version may lack: those with a default, or nullable."""
        self._required = [i for i, f in enumerate(fields) if not f.nullable]
        self._positional = cls is not None and not any(
            f.kw_only for f in dataclasses.fields(cls) if f.init
        )

    def build(self, values: list[Any]) -> Any:
        """The declared value of field values in declared order."""
        if self.cls is None:
            return dict(zip(self.names, values, strict=True))
        if self._positional:
            return self.cls(*values)
        return self.cls(**dict(zip(self.names, values, strict=True)))

    def coerce(self, value: Any, what: str) -> Any:
        """``value`` (the declared type, or a mapping of field names) as the declared type.

        Raises:
            TypeError: neither, or a mapping without a field that has no default.
        """
        if self.cls is not None and isinstance(value, self.cls):
            return value
        return self.build(self.values(value, what))

    def values(self, value: Any, what: str) -> list[Any]:
        """The field values of ``value`` in declared order (a mapping may leave out fields
        with defaults).

        Raises:
            TypeError: not the declared type or a mapping, an unknown or missing field, or
                ``None`` in a field that is not nullable.
        """
        if self.cls is not None and isinstance(value, self.cls):
            out = [getattr(value, name) for name in self.names]
        else:
            out = self._from_mapping(value, what)
        for i in self._required:
            if out[i] is None:
                raise TypeError(
                    f"{what} of state {self.state!r}: field {self.names[i]!r} is None, but "
                    "the schema says it is not nullable"
                )
        return out

    def _from_mapping(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, Mapping):
            as_dict = getattr(value, "asDict", None)  # a pyspark Row
            if not callable(as_dict):
                expected = "a dict" if self.cls is None else f"a {self.cls.__name__} or a dict"
                raise TypeError(
                    f"{what} of state {self.state!r} must be {expected} (its declared "
                    f"schema), got a {type(value).__name__}"
                )
            value = as_dict()
        unknown = set(value) - set(self.names)
        if unknown:
            raise TypeError(
                f"{what} of state {self.state!r} has fields {sorted(unknown)} that its schema "
                f"does not declare (fields: {list(self.names)})"
            )
        out = []
        for name in self.names:
            if name in value:
                out.append(value[name])
            elif name in self.defaults:
                out.append(self.defaults[name]())
            else:
                raise TypeError(
                    f"{what} of state {self.state!r} lacks field {name!r}, which has no default"
                )
        return out


def shape_of(state: str, schema: Any) -> Shape:
    """The shape of a declared ``schema``.

    Raises:
        TypeError: not a dataclass, a ``StructType`` or a pyarrow ``Schema``, or a field type
            without a schema type.
    """
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return _dataclass_shape(state, schema)
    json_value = getattr(schema, "jsonValue", None)
    doc = json_value() if callable(json_value) else None
    if isinstance(doc, dict) and doc.get("type") == "struct":
        fields = tuple(
            SchemaField(f["name"], _spark_type(f["type"]), bool(f["nullable"]))
            for f in doc["fields"]
        )
    elif type(schema).__module__.startswith("pyarrow") and hasattr(schema, "names"):
        fields = tuple(
            SchemaField(f.name, _field_type(state, f.name, f.type), bool(f.nullable))
            for f in schema
        )
    else:
        raise TypeError(
            f"state {state!r}: schema must be a dataclass, a pyspark StructType or a "
            f"pyarrow Schema, got {schema!r}"
        )
    defaults = {f.name: _none for f in fields if f.nullable}
    return Shape(state, _unique(state, fields), None, defaults)


def _none() -> None:
    return None


def _dataclass_shape(state: str, cls: type) -> Shape:
    hints = typing.get_type_hints(cls)
    fields: list[SchemaField] = []
    defaults: dict[str, Callable[[], Any]] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue  # computed in __post_init__, not part of the stored value
        try:
            kind, nullable = _py_type(hints[f.name])
        except TypeError as exc:
            raise TypeError(f"state {state!r}: field {f.name!r} of {cls.__name__}: {exc}") from None
        fields.append(SchemaField(f.name, kind, nullable))
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = _constant(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory
        elif nullable:
            defaults[f.name] = _none
    return Shape(state, tuple(fields), cls, defaults)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _py_type(hint: Any) -> tuple[str, bool]:
    """The schema type of a dataclass field's annotation, and whether it is nullable.

    Raises:
        TypeError: a type values cannot be checked as.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return _py_type(rest[0])[0], True
        raise TypeError(f"a union {hint!r} has no schema type: use one type or Optional[...]")
    if hint is Any:
        return "any", True
    if hint in _PY_TYPES:
        return _PY_TYPES[hint], False
    if hint in (list, tuple) or (origin in (list, tuple) and not args):
        return "array<any>", False
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"array<{_py_type(args[0])[0]}>", False
    if hint is dict or (origin is dict and not args):
        return "map<any,any>", False
    if origin is dict:
        return f"map<{_py_type(args[0])[0]},{_py_type(args[1])[0]}>", False
    raise TypeError(
        f"{hint!r} has no schema type: use bool, int, float, str, bytes, datetime, date, time, "
        "timedelta, Decimal, list[...], tuple[..., ...], dict[..., ...], Optional[...] or Any"
    )


def _spark_type(doc: Any) -> str:
    """Spark's simple type name of a data type's JSON form."""
    if isinstance(doc, str):
        if doc.startswith(("char(", "varchar(")):
            return "string"
        return _SPARK_TYPES.get(doc, doc)
    kind = doc["type"]
    if kind == "array":
        return f"array<{_spark_type(doc['elementType'])}>"
    if kind == "map":
        return f"map<{_spark_type(doc['keyType'])},{_spark_type(doc['valueType'])}>"
    if kind == "struct":
        inner = ",".join(f"{f['name']}:{_spark_type(f['type'])}" for f in doc["fields"])
        return f"struct<{inner}>"
    raise TypeError(f"a Spark type {doc!r} has no schema type")


def _field_type(state: str, name: str, arrow_type: Any) -> str:
    try:
        return _arrow_type(arrow_type)
    except TypeError as exc:
        raise TypeError(f"state {state!r}: field {name!r}: {exc}") from None


def _arrow_type(arrow_type: Any) -> str:
    """Spark's simple type name of a pyarrow data type (as Spark maps Arrow types).

    Raises:
        TypeError: a type without one.
    """
    text = str(arrow_type)
    if text in _ARROW_TYPES:
        return _ARROW_TYPES[text]
    if text.startswith("timestamp["):
        return "timestamp" if "tz=" in text else "timestamp_ntz"
    if text.startswith("decimal"):
        return f"decimal({arrow_type.precision},{arrow_type.scale})"
    if text.startswith("map<"):
        return f"map<{_arrow_type(arrow_type.key_type)},{_arrow_type(arrow_type.item_type)}>"
    if text.startswith(("list<", "large_list<", "fixed_size_list<")):
        return f"array<{_arrow_type(arrow_type.value_type)}>"
    if text.startswith("struct<"):
        inner = (arrow_type.field(i) for i in range(arrow_type.num_fields))
        return "struct<" + ",".join(f"{f.name}:{_arrow_type(f.type)}" for f in inner) + ">"
    raise TypeError(f"the pyarrow type {text} has no schema type")


def _unique(state: str, fields: tuple[SchemaField, ...]) -> tuple[SchemaField, ...]:
    names = [f.name for f in fields]
    if len(set(names)) != len(names) or not names:
        raise TypeError(f"state {state!r}: a schema needs fields with distinct names, got {names}")
    return fields
