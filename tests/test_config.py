"""StoreConfig's resource fields: defaults, and bad values refused naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import statekeeper as sk


def test_resource_defaults_bound_a_worker() -> None:
    config = sk.StoreConfig()
    assert config.rocksdb_memory_mb == 256
    assert config.max_open_stores == 256
    assert config.local_copy_ttl_s == 24 * 3600.0
    assert config.write_buffer_mb <= config.rocksdb_memory_mb // 2


@pytest.mark.parametrize("field", ["rocksdb_memory_mb", "max_open_stores"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "64"])
def test_resource_counts_must_be_positive_ints(field: str, value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"StoreConfig\.{field} must be an int (>= 1|in \[1, )"
    ) as info:
        sk.StoreConfig(**{field: value})  # type: ignore[arg-type]
    assert f"got {value!r}" in str(info.value)


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "3600", False])
def test_local_copy_ttl_must_be_finite_seconds(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"StoreConfig\.local_copy_ttl_s must be a finite number of seconds"
    ) as info:
        sk.StoreConfig(local_copy_ttl_s=value)  # type: ignore[arg-type]
    assert f"got {value!r}" in str(info.value)


@pytest.mark.parametrize(
    ("field", "high"),
    [
        ("chunk_size", 5 * 2**30),
        ("io_threads", 1024),
        ("rocksdb_memory_mb", 2**20),
        ("write_buffer_mb", 2**20),
        ("background_write_mb_s", 2**20),
    ],
)
def test_sizes_no_machine_has_are_refused_here_not_deep_in_rocksdb_or_an_upload(
    field: str, high: int
) -> None:
    """``rocksdb_memory_mb=10**30`` was an OverflowError at open, ``chunk_size=2**62`` a
    MemoryError at snapshot."""
    assert getattr(sk.StoreConfig(**{field: high}), field) == high  # type: ignore[arg-type]
    for value in (high + 1, 10**30):
        with pytest.raises(ValueError, match=rf"StoreConfig\.{field} must be an int in \[") as info:
            sk.StoreConfig(**{field: value})  # type: ignore[arg-type]
        assert f"{high}], got {value!r}" in str(info.value)


def test_a_zero_ttl_is_allowed() -> None:
    assert sk.StoreConfig(local_copy_ttl_s=0).local_copy_ttl_s == 0


@pytest.mark.parametrize("value", [-1, 2.5, True, "24"])
def test_the_background_write_rate_is_a_non_negative_int(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"StoreConfig\.background_write_mb_s must be an int in \[0, 1048576\]"
    ) as info:
        sk.StoreConfig(background_write_mb_s=value)  # type: ignore[arg-type]
    assert f"got {value!r}" in str(info.value)


def test_a_working_copy_opens_with_a_write_rate_limit_and_without(tmp_path: Path) -> None:
    for rate in (0, 24):
        config = sk.StoreConfig(local_dir=str(tmp_path / str(rate)), background_write_mb_s=rate)
        root = str(tmp_path / f"root{rate}")
        with sk.StateBackend(root, config=config) as backend, backend.open("op", 0) as store:
            store.put(b"k", b"v")
            store.commit()
        with sk.StateBackend(root, config=config) as backend, backend.open("op", 0) as store:
            assert store.get(b"k") == b"v"
