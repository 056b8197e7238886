"""docs/format.md states what the code does for key groups and task reports."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from statekeeper import layout
from statekeeper.epochs import FORMAT_VERSION as EPOCH_FORMAT_VERSION
from statekeeper.epochs import EpochManifest, StoreEntry
from statekeeper.keyed import MAX_KEY_GROUPS
from statekeeper.keyed._layout import (
    EVENT_TIME,
    GROUPED_TIMER_INDEX,
    GROUPED_TTL_INDEX,
    META_KEY,
    TIMER,
)
from statekeeper.reports import KEEP_BATCHES, PRUNE_EVERY, TaskReport, encode_report
from statekeeper.store import DEFAULT_KEY_GROUPS
from tests.spark.helpers import json_key_names

DOC = (Path(__file__).parents[2] / "docs" / "format.md").read_text()


def _section(title: str, *, raw: bool = False) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    text = DOC[start : end if end >= 0 else None]
    return text if raw else " ".join(text.split())  # one space between words


def test_the_key_group_section_matches_the_layout() -> None:
    text = _section("Key groups")
    assert f"({DEFAULT_KEY_GROUPS} by default, at most {MAX_KEY_GROUPS})" in text
    assert f'0x{META_KEY[0]:02X} "{META_KEY[1:].decode()}"' in text
    assert "0x{:02X} 0x{:02X} <state> <expiry ms:u64> <data key>".format(*GROUPED_TTL_INDEX) in text
    assert "`g * P div keyGroups == p`" in text


def test_the_key_group_section_names_the_timer_layout() -> None:
    text = _section("Key groups")
    index = "0x{:02X} 0x{:02X} <expiry ms:u64> <kg:u16> <grouping key>".format(*GROUPED_TIMER_INDEX)
    assert index in text
    assert f"<kg:u16> 0x{TIMER[0]:02X} <grouping key> <expiry ms:u64>" in text
    assert f'0xFF 0x{EVENT_TIME[0]:02X} "{EVENT_TIME[1:].decode()}"' in text


def test_the_report_section_names_every_field_and_the_key() -> None:
    text = _section("Task reports")
    assert "_reports/<operator>/<batch:020d>/<partition:06d>.json" in text
    assert layout.report_key("op", 7, 3) == "_reports/op/00000000000000000007/000003.json"
    assert f"Every {PRUNE_EVERY}" in text
    assert f"older than {KEEP_BATCHES} batches" in text
    values = {f.name: 0 for f in dataclasses.fields(TaskReport)}
    doc = json.loads(encode_report(TaskReport(**values)))  # type: ignore[arg-type]
    rows = re.findall(r"^\| (.+?) \|", _section("Task reports", raw=True), re.MULTILINE)
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert documented == set(doc) - {"format", "formatVersion"}


def test_the_epoch_manifest_section_names_every_field() -> None:
    text = _section("Epoch manifests", raw=True)
    start = text.index("```json\n")
    block = text[start : text.index("```", start + 3)]
    entry = StoreEntry(0, 8, "c", 5, "i")
    manifest = EpochManifest(7, "q", "r", 1, {"counts": 2}, {"counts": [entry]})
    doc = json.loads(manifest.to_json())
    assert set(re.findall(r'"(\w+)":', block)) == json_key_names(doc)
    assert f'"formatVersion": {EPOCH_FORMAT_VERSION}' in block
