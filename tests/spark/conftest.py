"""One SparkSession for the whole Spark test session (``local[2,4]``: 2 cores, 4 attempts).

Workers run this venv's interpreter (``PYSPARK_PYTHON``); processors used inside Spark live
in :mod:`tests.spark.processors`, which is pickled by value so workers need not import the
test package. The restart test needs a new SparkSession: :meth:`SparkHolder.restart` stops
the current one and starts another with the same settings, and the ``spark`` fixture always
hands out the live one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession

from statekeeper.spark._cache import CACHE
from tests.spark import processors

MASTER = "local[2,4]"
_CONNECT_ENV = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")


def _build() -> SparkSession:
    session = (
        SparkSession.builder.master(MASTER)
        .appName("statekeeper-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.streaming.stopTimeout", "30s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


@dataclass
class SparkHolder:
    """The test session's SparkSession, which one test replaces."""

    session: SparkSession | None = None
    sessions_started: int = field(default=0)

    def get(self) -> SparkSession:
        """The live session, started on first use."""
        if self.session is None:
            self.session = _build()
            self.sessions_started += 1
        return self.session

    def stop(self) -> None:
        """Stop the session (its Python workers die with it); ``get`` starts a new one."""
        if self.session is not None:
            self.session.stop()
            self.session = None

    def restart(self) -> SparkSession:
        """Stop the session and start a new one."""
        self.stop()
        return self.get()


@pytest.fixture(scope="session")
def spark_holder() -> Iterator[SparkHolder]:
    """Environment for Spark's Python workers, and the holder of the one SparkSession."""
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    cloudpickle.register_pickle_by_value(processors)
    holder = SparkHolder()
    try:
        yield holder
    finally:
        if holder.session is not None:
            holder.session.stop()
        cloudpickle.unregister_pickle_by_value(processors)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def no_classic_session(spark_holder: SparkHolder) -> Iterator[SparkHolder]:
    """Stop the suite's classic session for a module that needs its own: a process holds one
    SparkContext at a time, and a Spark Connect client refuses to start while one runs. The
    next test that asks for ``spark`` starts it again.

    A Connect client marks the process as in Connect mode through environment variables
    that outlive its sessions (then a classic builder asks for a Connect URL); those it set
    are removed after the module.
    """
    spark_holder.stop()
    before = {k for k in _CONNECT_ENV if k in os.environ}
    yield spark_holder
    for key in _CONNECT_ENV:
        if key not in before:
            os.environ.pop(key, None)


@pytest.fixture
def spark(spark_holder: SparkHolder) -> SparkSession:
    """The live SparkSession."""
    return spark_holder.get()


@pytest.fixture(autouse=True)
def _clean_store_cache() -> Iterator[None]:
    """Stores opened by in-process tests must not outlive them (they hold file locks)."""
    yield
    CACHE.close_all()
