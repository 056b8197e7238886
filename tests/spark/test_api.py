"""The public names of statekeeper.spark."""

from __future__ import annotations

import statekeeper.spark as sks


def test_all_is_sorted_and_importable() -> None:
    assert sks.__all__ == sorted(sks.__all__)
    for name in sks.__all__:
        assert getattr(sks, name) is not None, name
    assert {"StatefulProcessor", "transform_with_state", "read_state"} <= set(sks.__all__)


def test_errors_belong_to_the_statekeeper_hierarchy() -> None:
    from statekeeper import StateKeeperError

    assert issubclass(sks.OutputSchemaError, StateKeeperError)
    assert issubclass(sks.OutputSchemaError, TypeError)
    assert issubclass(sks.StoreBusyError, StateKeeperError)
    assert issubclass(sks.StoreBusyError, TimeoutError)
