"""State handles: value, map and list state of the current grouping key, with optional TTL.

A handle reads and writes the partition's :class:`~statekeeper.StateStore` directly; writes
become durable when the task commits the micro-batch.

**TTL** runs on one of two clocks, chosen per state (``ttl_on=``); both are the same on
every re-run of a batch, so re-runs write identical state:

* ``"processing_time"`` (the default, Spark's only kind): an entry expires ``ttl`` after its
  last write, measured with micro-batch timestamps.
* ``"event_time"`` (an operator with ``time_mode="event_time"`` only; Spark has no such
  TTL): a write stamps the entry with the largest event time seen so far (earlier batches
  and the whole current one), and the entry expires once the batch's **watermark** reaches
  that stamp plus ``ttl``; with a watermark delay ``d`` that is once events ``ttl + d``
  later have arrived. Time does not pass without input, so entries never expire on an idle
  stream; when the watermark moves they expire in every partition, input or not.

An expired entry is invisible from then on and is deleted at the end of the first micro-batch
that sees it expired (a sorted TTL index makes that cost proportional to what expires). A
change of ``ttl`` applies to later writes: an entry keeps the expiry it was written with, also
when the TTL is removed (the state keeps its clock in the operator record for them). A change
of ``ttl_on`` is refused (:func:`entry_clock`).

**Reads cost what they must.** When the runner tells the handle the batch's keys in the
order it will visit them (:meth:`StatefulProcessorHandle.visit_keys`), the first read of a
value state (or append to a list state) in a window of the next keys fetches that state for
the whole window with one ``multi_get``; later reads of the window are dict lookups. Only the
states a processor touches are fetched. Every write through a handle also lands in that
cache, so a read always sees the latest write (the store keeps the writes themselves until
the commit). Codec methods and TTL choices are bound once per state, not looked up per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from statekeeper.errors import ConfigMismatchError, StateKeeperError
from statekeeper.keyed._layout import (
    META_KEY,
    OperatorRecord,
    StateDecl,
    check_key_groups,
    check_keys,
    check_time_mode,
    group_prefix,
    validate_key_groups,
    validate_state_name,
)
from statekeeper.keyed._schema import Migrate, SchemaCodec, declare_schema
from statekeeper.keyed._states import (
    TTL_CLOCKS,
    ListState,
    MapState,
    Ttl,
    ValueState,
    _State,
    ttl_ms,
)
from statekeeper.keyed._timers import Timers, TimerValues, validate_time_mode, validate_timer
from statekeeper.keyed._tuples import encode_key
from statekeeper.keyed._values import Codec, DefaultCodec
from statekeeper.store import StateStore

__all__ = ["ListState", "MapState", "StatefulProcessorHandle", "ValueState"]


_S = TypeVar("_S", bound="_State")
_WINDOW = 2048
"""Keys per prefetch: large enough to amortize a multi_get, small enough to bound memory."""


def entry_clock(name: str, ttl: int | None, ttl_on: str, stored: StateDecl | None) -> str:
    """The clock a state's entries expire on: the declared ``ttl_on``, except that a state
    declared without a TTL keeps the clock its ``stored`` declaration had, so entries written
    while it had one still expire when they were promised to (on the watermark, not the
    micro-batch time, for an event-time TTL).

    Raises:
        ConfigMismatchError: ``ttl_on`` differs from the clock the stored entries' expiries
            were stamped on, which would read them on the wrong clock (event times lag the
            micro-batch time by the stream's delay: a move to processing time expired them
            all at once).
    """
    if stored is None:
        return ttl_on
    if ttl is None:
        return stored.ttl_on
    if stored.stamped and stored.ttl_on != ttl_on:
        raise ConfigMismatchError(
            f"state {name!r} holds entries whose TTL runs on {stored.ttl_on} in this "
            f"checkpoint root, but the processor now declares ttl_on={ttl_on!r}: their "
            "expiries would be read on the other clock. Keep "
            f"ttl_on={stored.ttl_on!r}, or declare the state under another name"
        )
    return ttl_on


def check_declaration(
    name: str,
    *,
    ttl: Ttl,
    codec: Codec | None,
    ttl_on: object,
    time_mode: str | None,
    kind: str,
    earlier: str | None,
) -> tuple[Codec, int | None]:
    """The checks of a state declaration that need no store (the state's name, its TTL and
    the TTL's clock against the operator's ``time_mode``, the codec, and the ``kind`` of
    state against the kind ``earlier`` declared under that name by the same ``init``, if
    any); returns the codec (the default one for ``None``) and the TTL in milliseconds.

    Raises:
        TypeError, ValueError: a malformed argument.
        StateKeeperError: ``name`` was declared as another kind of state.
    """
    validate_state_name(name)
    if ttl_on not in TTL_CLOCKS:
        raise ValueError(
            f"state {name!r}: ttl_on must be 'processing_time' or 'event_time', got {ttl_on!r}"
        )
    if ttl_on == "event_time" and ttl is None:
        raise ValueError(
            f"state {name!r}: ttl_on='event_time' says which clock a ttl runs on, but no "
            "ttl was given"
        )
    if ttl_on == "event_time" and time_mode != "event_time":
        raise ValueError(
            f"state {name!r}: ttl_on='event_time' expires entries by the watermark, which "
            "only an operator with time_mode='event_time' has; this operator has "
            f"time_mode={time_mode!r}. Pass time_mode='event_time' (with "
            "event_time_column) or use ttl_on='processing_time'"
        )
    codec = DefaultCodec() if codec is None else codec
    if not (hasattr(codec, "encode") and hasattr(codec, "decode") and hasattr(codec, "name")):
        raise TypeError(f"codec must have name, encode and decode; got {codec!r}")
    ttl_at = ttl_ms(ttl)
    if earlier is not None and earlier != kind:
        raise StateKeeperError(
            f"state {name!r} is already declared as a {earlier} state in this processor"
        )
    return codec, ttl_at


class StatefulProcessorHandle:
    """Gives a processor its state; passed to :meth:`StatefulProcessor.init`.

    States declared here are bound to the grouping key whose rows are being handled.
    """

    def __init__(
        self,
        store: StateStore,
        *,
        now_ms: int | None,
        batch_id: int,
        partition: int,
        key_groups: int | None = None,
        time_mode: str | None = None,
        timer_values: TimerValues | None = None,
        event_time_ms: int | None = None,
    ) -> None:
        """Wrap ``store`` for one partition and micro-batch; ``now_ms`` is the processing-time
        TTL clock.

        ``time_mode`` (``None``, ``"processing_time"`` or ``"event_time"``) says whether
        timers may be registered; ``timer_values`` are the batch's clocks. With event time,
        ``event_time_ms`` is the largest event time seen up to and including this batch:
        event-time TTL stamps writes with it (the watermark if ``None``).

        ``key_groups`` is the operator's number of key groups as the root records it: every
        data key then starts with the current key's key group (see ``_layout``); ``None``
        for an operator of statekeeper 0.1, whose keys carry none.

        Raises:
            ValueError: ``key_groups`` is out of range, or ``time_mode`` unknown.
        """
        self._store = store
        self._time_mode = validate_time_mode(time_mode)
        self._timer_values = timer_values or TimerValues(-1 if now_ms is None else now_ms)
        self._timers = Timers(store, grouped=key_groups is not None)
        self._now_ms = now_ms
        self._event_time_ms = event_time_ms
        self._batch_id = batch_id
        self._partition = partition
        self._key_groups = None if key_groups is None else validate_key_groups(key_groups)
        self._key: tuple[Any, ...] | None = None
        self._key_bytes: bytes | None = None
        self._group = b""
        """The current key's key-group prefix (empty without key groups)."""
        self._states: dict[str, _State] = {}
        self._record: tuple[bytes | None, OperatorRecord | None] | None = None
        """The store's operator record (bytes, parsed), read once for all declarations and
        :meth:`record_operator`."""
        # Prefetch: the batch's encoded keys and their key-group prefixes, the position of
        # the current one, the window [position, _window_end) cached, and which (state
        # prefix + suffix) were fetched.
        self._keys: list[bytes] = []
        self._groups: list[bytes] = []
        self._position = -1
        self._window_end = 0
        self._cache: dict[bytes, bytes | None] = {}
        self._filled: set[bytes] = set()

    @property
    def batch_id(self) -> int:
        """The micro-batch being processed."""
        return self._batch_id

    @property
    def partition(self) -> int:
        """The state partition being processed."""
        return self._partition

    @property
    def batch_timestamp_ms(self) -> int | None:
        """The micro-batch timestamp (ms since the epoch) TTL is measured with."""
        return self._now_ms

    @property
    def time_mode(self) -> str | None:
        """The operator's time mode: ``None``, ``"processing_time"`` or ``"event_time"``."""
        return self._time_mode

    @property
    def timer_values(self) -> TimerValues:
        """The micro-batch's processing time and watermark (what timers are compared to)."""
        return self._timer_values

    def register_timer(self, expiry_ms: int) -> None:
        """Register a timer of the current key at ``expiry_ms`` (ms since the epoch; processing
        time or event time as the operator's ``time_mode``); registering it twice keeps one.

        The timer fires once, in the first micro-batch whose clock (batch timestamp, or
        watermark) is at or after ``expiry_ms``: ``handle_expired_timer`` is then called for
        the key, whether or not it has input. A timer is state: committed with the batch.

        Raises:
            StateKeeperError: the operator has no time mode, or there is no current key.
            TypeError, ValueError: ``expiry_ms`` is not an int in ``[0, 2**64)``.
        """
        key = self._timer_key("register_timer")
        self._timers.register(self._group, key, validate_timer(expiry_ms))

    def delete_timer(self, expiry_ms: int) -> None:
        """Delete the current key's timer at ``expiry_ms`` (nothing if there is none).

        Raises:
            StateKeeperError: the operator has no time mode, or there is no current key.
            TypeError, ValueError: ``expiry_ms`` is not an int in ``[0, 2**64)``.
        """
        key = self._timer_key("delete_timer")
        self._timers.delete(self._group, key, validate_timer(expiry_ms))

    def list_timers(self) -> list[int]:
        """The current key's registered timers, ascending.

        Raises:
            StateKeeperError: the operator has no time mode, or there is no current key.
        """
        return self._timers.of_key(self._group, self._timer_key("list_timers"))

    def _timer_key(self, call: str) -> bytes:
        if self._time_mode is None:
            raise StateKeeperError(
                f"{call} needs an operator with a time mode: pass time_mode='processing_time' "
                "or time_mode='event_time' to transform_with_state; this operator has "
                "time_mode=None"
            )
        return self.current_key_bytes()

    def bind_timer_key(self, key: tuple[Any, ...], key_bytes: bytes, group: bytes) -> None:
        """Bind the states to a key whose timer fires: its tuple, encoded bytes and key-group
        prefix as the timer index holds them (called by the runner)."""
        self.set_key(None)
        self._key, self._key_bytes, self._group = key, key_bytes, group

    @property
    def key_groups(self) -> int | None:
        """The operator's number of key groups (``None``: keys carry no key group)."""
        return self._key_groups

    @property
    def grouping_key(self) -> tuple[Any, ...] | None:
        """The key whose rows are being handled, or ``None`` outside ``handle_input_rows``."""
        return self._key

    def value_state(
        self,
        name: str,
        *,
        ttl: Ttl = None,
        codec: Codec | None = None,
        ttl_on: str = "processing_time",
        schema: Any = None,
        version: int | None = None,
        migrate: Migrate | None = None,
    ) -> ValueState:
        """Declare a single value per grouping key.

        **Schemas.** With ``schema=`` (a dataclass, or a pyspark ``StructType`` or pyarrow
        ``Schema``, whose values are dicts) values are records of its fields:
        :meth:`ValueState.update` takes the dataclass (or a dict of its fields; fields with
        defaults may be left out), ``get`` returns the declared type. Each value is stored
        with its schema ``version`` (an int from 1; one byte per value), and the store's
        operator record keeps the fields of every version, so ``read_state`` and
        ``statekeeper inspect`` decode values without the processor (each as a dict of the
        fields of the version it was written in). To change a schema, declare it with a
        higher ``version``. A value of an older version is converted **when it is read**,
        and stored in the new version only when its key is next written (the store is never
        rewritten; keys not written stay in their old version, which a later processor must
        still read):

        * with ``migrate=``, by ``migrate(old, from_version)``: ``old`` is a dict of the
          fields of the version the value was written in, and it returns the new value (the
          dataclass or a dict of its fields). It is called for every older version, so any
          change is allowed: renaming, retyping, computing fields. A state that held
          values before it had a schema gets them with ``from_version=0``, as the codec
          decoded them.
        * without, by name, which allows only these changes: adding a field that has a
          default (or is ``Optional``, or nullable in a ``StructType`` or pyarrow schema:
          it reads as ``None``); dropping a field (its stored values are ignored);
          reordering fields; widening a field from an integer type to a wider one or to a
          double (``int`` to ``float`` in a dataclass: converted on read), or from float to
          double; making a field nullable. A renamed field, without ``migrate``, is a
          dropped field plus an added one.

        Anything else raises :class:`~statekeeper.errors.ConfigMismatchError` naming the
        state, the stored schema and the declared one, here in ``init``, before any value is
        read or written, so nothing committed is touched: the change of a field's type, a
        field made non-nullable, an added field without a default, the same version with
        other fields, a lower version than the store holds, and dropping ``schema=`` from a
        state that has one. Fix the processor and restart. Field types are checked as
        declared (dataclass annotations: ``bool``, ``int``, ``float``, ``str``, ``bytes``,
        ``datetime``, ``date``, ``time``, ``timedelta``, ``Decimal``, lists, homogeneous
        tuples, dicts, ``Optional`` and ``Any``, which is never checked); values are not
        checked against them on write, except that a field which is not nullable may not
        be ``None``. The stored form is in ``docs/format.md`` (*State values with a
        schema*).

        Args:
            name: the state's name, unique within the processor.
            ttl: seconds (or a timedelta) after its last update when a value expires.
            codec: how values become bytes; the safe :class:`DefaultCodec` if ``None``
                (with a schema: the default codec or the :class:`PickleCodec`).
            ttl_on: the clock ``ttl`` runs on: ``"processing_time"`` (micro-batch
                timestamps) or ``"event_time"`` (the watermark; see the module docstring).
            schema: a dataclass, ``StructType`` or ``pyarrow.Schema`` the values follow;
                ``None``: any value the codec stores.
            version: the schema's version (1 if ``None``); needs ``schema``.
            migrate: ``migrate(old_value_as_dict, from_version) -> new value``; needs
                ``schema``.

        Raises:
            TypeError, ValueError: a malformed name, ttl, ttl_on, codec, schema, version or
                migrate, ``ttl_on`` without ``ttl``, or ``ttl_on="event_time"`` in an
                operator whose time mode is not ``"event_time"``.
            ConfigMismatchError: the schema cannot read what the store holds (see above).
            StateKeeperError: ``name`` was declared as another kind of state.
        """
        return self._declare(ValueState, name, ttl, codec, ttl_on, (schema, version, migrate))

    def map_state(
        self,
        name: str,
        *,
        ttl: Ttl = None,
        codec: Codec | None = None,
        ttl_on: str = "processing_time",
        schema: Any = None,
        version: int | None = None,
        migrate: Migrate | None = None,
    ) -> MapState:
        """Declare a map per grouping key (map keys: anything a grouping key may hold);
        arguments as :meth:`value_state`, TTL and schema version per entry.

        Raises:
            TypeError, ValueError, ConfigMismatchError, StateKeeperError: as
                :meth:`value_state`.
        """
        return self._declare(MapState, name, ttl, codec, ttl_on, (schema, version, migrate))

    def list_state(
        self,
        name: str,
        *,
        ttl: Ttl = None,
        codec: Codec | None = None,
        ttl_on: str = "processing_time",
        schema: Any = None,
        version: int | None = None,
        migrate: Migrate | None = None,
    ) -> ListState:
        """Declare an append-friendly list per grouping key; arguments as
        :meth:`value_state`, TTL and schema version per element.

        Raises:
            TypeError, ValueError, ConfigMismatchError, StateKeeperError: as
                :meth:`value_state`.
        """
        return self._declare(ListState, name, ttl, codec, ttl_on, (schema, version, migrate))

    def _declare(
        self,
        cls: type[_S],
        name: str,
        ttl: Ttl,
        codec: Codec | None,
        ttl_on: str,
        schema: tuple[Any, int | None, Migrate | None],
    ) -> _S:
        old = self._states.get(name) if isinstance(name, str) else None
        codec, ttl_at = check_declaration(
            name, ttl=ttl, codec=codec, ttl_on=ttl_on, time_mode=self._time_mode,
            kind=cls.kind, earlier=None if old is None else old.kind,
        )  # fmt: skip
        stored = self._stored_record()
        decl = None if stored is None else stored.states.get(name)
        if decl is not None and decl.kind != cls.kind:
            decl = None  # refused by record_operator, with its own message
        schemas = None if decl is None else decl.schemas
        declared, version, migrate = schema
        codec = declare_schema(
            name, codec, declared, version=version, migrate=migrate, stored=schemas
        )
        state = cls(self, name, ttl_at, codec, entry_clock(name, ttl_at, ttl_on, decl))
        self._states[name] = state
        return state

    def _stored_record(self) -> OperatorRecord | None:
        """The store's operator record as it was before this handle wrote one.

        Raises:
            CorruptStateError: the stored record is not valid.
            ConfigMismatchError: it was written by a newer format version.
        """
        if self._record is None:
            raw = self._store.get(META_KEY)
            self._record = (raw, None if raw is None else OperatorRecord.from_bytes(raw))
        return self._record[1]

    # -- called by statekeeper around the processor (processors need not call these) -----

    def declared(self) -> dict[str, StateDecl]:
        """The states declared so far, for the operator record. A state whose
        processing-time TTL was removed stays marked as such (``ttl_removed``): its older
        entries still carry expiries, on the clock its record names."""
        stored = self._stored_record()
        declared: dict[str, StateDecl] = {}
        for name, s in self._states.items():
            old = None if stored is None else stored.states.get(name)
            declared[name] = StateDecl(
                s.kind,
                s.ttl_ms,
                str(s.codec.name),
                s.ttl_on,
                s.codec.recorded if isinstance(s.codec, SchemaCodec) else (),
                ttl_removed=s.ttl_ms is None
                and s.ttl_on == "processing_time"
                and old is not None
                and old.kind == s.kind
                and old.stamped,
            )
        return declared

    def record_operator(
        self, keys: Sequence[str], *, key_schema: str | None, operator: str
    ) -> None:
        """Keep the store's operator record (key columns, declared states) up to date.

        Args:
            keys: the grouping key columns.
            key_schema: the key columns' type as the engine describes it (Spark JSON), for
                typed reading; ``None`` keeps what is recorded.
            operator: the operator's name, for errors.

        Raises:
            ConfigMismatchError: the keys, the key groups or a state's kind differ from what
                the store holds.
            CorruptStateError: the stored record is not valid.
        """
        stored = self._stored_record()
        raw = None if self._record is None else self._record[0]
        if stored is None:
            record = OperatorRecord(tuple(keys), key_schema, key_groups=self._key_groups)
        else:
            record = stored
            check_keys(record, tuple(keys), operator)
            check_key_groups(record, self._key_groups, operator, self._partition)
            check_time_mode(record, self._time_mode, operator)
            if key_schema is not None:
                record = dataclasses.replace(record, key_schema=key_schema)
        if self._time_mode is not None:
            record = dataclasses.replace(record, time_mode=self._time_mode)
        data = record.merged(self.declared()).to_bytes()
        if data != raw:
            self._store.put(META_KEY, data)
            self._record = None

    def set_key(self, key: tuple[Any, ...] | None, key_group: int | None = None) -> None:
        """Bind the states to ``key`` (``None``: unbind), without prefetching.

        Args:
            key: the grouping key.
            key_group: its key group (computed by the engine from the key); required with
                key groups, ignored without.

        Raises:
            TypeError: a key element has a type keys cannot hold.
            ValueError: with key groups, ``key_group`` is missing or out of range.
        """
        self._key = key
        self._key_bytes = None if key is None else encode_key(key)
        self._group = b"" if key is None else self._prefix_of(key_group)
        self._keys, self._groups, self._position, self._window_end = [], [], -1, 0
        self._cache.clear()
        self._filled.clear()

    def visit_keys(self, encoded: list[bytes], key_groups: Sequence[int] | None = None) -> None:
        """Announce the encoded keys of the batch and their key groups (required with key
        groups), in the order :meth:`select` will visit them, so that the states read for
        them can be prefetched in windows.

        Raises:
            ValueError: with key groups, ``key_groups`` is missing, of another length than
                ``encoded`` or out of range.
        """
        self.set_key(None)
        self._keys = encoded
        if self._key_groups is not None:
            if key_groups is None or len(key_groups) != len(encoded):
                found = "none" if key_groups is None else len(key_groups)
                raise ValueError(
                    f"expected the key groups of {len(encoded)} keys, got {found}: this "
                    f"operator has {self._key_groups} key groups"
                )
            self._groups = [self._prefix_of(g) for g in key_groups]

    def _prefix_of(self, key_group: int | None) -> bytes:
        """The data-key prefix of ``key_group`` (empty without key groups).

        Raises:
            ValueError: with key groups, ``key_group`` is missing or out of range.
        """
        groups = self._key_groups
        if groups is None:
            return b""
        if key_group is None or not 0 <= key_group < groups:
            raise ValueError(
                f"expected a key group in [0, {groups}) for each key of this operator, got "
                f"{key_group!r}"
            )
        return group_prefix(key_group)

    def select(self, position: int, key: tuple[Any, ...]) -> None:
        """Bind the states to the key at ``position`` of :meth:`visit_keys` (``key`` is its
        tuple); positions must not decrease."""
        self._key = key
        self._key_bytes = self._keys[position]
        if self._groups:
            self._group = self._groups[position]
        self._position = position
        if position >= self._window_end:
            self._window_end = position + _WINDOW
            self._cache = {}
            self._filled = set()

    def _prefetched(self, data_key: bytes, prefix: bytes, suffix: bytes) -> bytes | None:
        """The raw value of ``data_key`` = key group + ``prefix`` + current key + ``suffix``,
        fetching the same for the rest of the window on the first read."""
        fill = prefix + suffix
        if fill not in self._filled and self._position >= 0:
            self._filled.add(fill)
            window = slice(self._position, self._window_end)
            if self._groups:
                pairs = zip(self._groups[window], self._keys[window], strict=True)
                keys = [g + prefix + k + suffix for g, k in pairs]
            else:
                keys = [prefix + k + suffix for k in self._keys[window]]
            self._cache.update(zip(keys, self._store.multi_get(keys), strict=True))
        return self._get(data_key)

    def _get(self, data_key: bytes) -> bytes | None:
        cache = self._cache
        if data_key in cache:
            return cache[data_key]
        return self._store.get(data_key)

    def _put(self, data_key: bytes, raw: bytes) -> None:
        self._store.put(data_key, raw)
        self._cache[data_key] = raw

    def _delete(self, data_key: bytes) -> None:
        self._store.delete(data_key)
        self._cache[data_key] = None

    def expire(self) -> int:
        """Delete every entry whose TTL has passed; returns how many entries were deleted."""
        deleted = 0
        for state in self._states.values():
            if state.ttl_on == "event_time":
                deleted += state.expire(self._timer_values.watermark_ms)
            elif self._now_ms is not None:
                deleted += state.expire(self._now_ms)
        return deleted

    def lacks_ttl_clock(self) -> bool:
        """Whether a state with a processing-time TTL is declared and the micro-batch
        timestamp is unknown (a task without input, in a batch without heartbeats): its
        entries can be neither read nor written then."""
        return self._now_ms is None and any(
            s.ttl_ms is not None and s.ttl_on != "event_time" for s in self._states.values()
        )

    def ttl_now_ms(self, ttl_on: str) -> int:
        """The clock TTL expiries are compared with: the watermark for ``"event_time"``,
        the micro-batch timestamp otherwise.

        Raises:
            StateKeeperError: processing time, and the micro-batch timestamp is unknown.
        """
        if ttl_on == "event_time":
            return self._timer_values.watermark_ms
        return self.now_ms()

    def ttl_stamp_ms(self, ttl_on: str) -> int:
        """The time a write is stamped with (its expiry is this plus the ttl): the largest
        event time seen for ``"event_time"``, the micro-batch timestamp otherwise.

        Raises:
            StateKeeperError: processing time, and the micro-batch timestamp is unknown.
        """
        if ttl_on == "event_time":
            seen = self._event_time_ms
            return max(0, self._timer_values.watermark_ms if seen is None else seen)
        return self.now_ms()

    def current_key_bytes(self) -> bytes:
        """The encoded grouping key.

        Raises:
            StateKeeperError: called outside ``handle_input_rows``.
        """
        if self._key_bytes is None:
            raise StateKeeperError(
                "state can only be read or written inside handle_input_rows (or "
                "handle_expired_timer, as timers): there is no current grouping key in init "
                "or close"
            )
        return self._key_bytes

    def now_ms(self) -> int:
        """The TTL clock.

        Raises:
            StateKeeperError: the micro-batch timestamp is unknown.
        """
        if self._now_ms is None:
            raise StateKeeperError("the micro-batch timestamp is unknown: TTL cannot be applied")
        return self._now_ms
