"""StoreConfig's resource fields: defaults, and bad values refused naming the field."""

from __future__ import annotations

import math

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
    with pytest.raises(ValueError, match=rf"StoreConfig\.{field} must be an int >= 1") as info:
        sk.StoreConfig(**{field: value})  # type: ignore[arg-type]
    assert f"got {value!r}" in str(info.value)


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "3600", False])
def test_local_copy_ttl_must_be_finite_seconds(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"StoreConfig\.local_copy_ttl_s must be a finite number of seconds"
    ) as info:
        sk.StoreConfig(local_copy_ttl_s=value)  # type: ignore[arg-type]
    assert f"got {value!r}" in str(info.value)


def test_a_zero_ttl_is_allowed() -> None:
    assert sk.StoreConfig(local_copy_ttl_s=0).local_copy_ttl_s == 0
