"""What every benchmark record must hold, and a fingerprint of the recorded results folder."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def fingerprint(folder: Path = RECORDED) -> dict[str, tuple[int, str]]:
    """Each file under ``folder``: (mtime in ns, sha256)."""
    return {
        str(path.relative_to(folder)): (
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def check_record(record: dict[str, Any], expected_goals: set[str]) -> None:
    """Assert the provenance fields, that ``expected_goals`` are all in the summary, and that every goal
    there has value/goal/met (and a reason where it has no value)."""
    for key in (
        "command",
        "argv",
        "commit",
        "dirty",
        "torch",
        "python",
        "cpu",
        "cpu_capability",
        "cpu_cores",
        "gpu",
        "wall_seconds",
    ):
        assert key in record, key
    assert record["command"].startswith("kaisoku bench ")
    assert "+dirty" not in record["commit"]
    assert len(record["commit"]) == 40 or record["commit"] == "unknown"
    assert isinstance(record["dirty"], bool)
    if record["dirty"]:
        assert len(record["diff_sha256"]) == 64
    assert len(record["load_average"]["before"]) == 3 and len(record["load_average"]["after"]) == 3
    assert record["cpu_cores"] >= 1 and record["wall_seconds"] >= 0
    assert isinstance(record["cpu_capability"], str) and record["cpu_capability"], record
    assert record["quick"] is True
    # Benchmarks gain goals as their issues land; the ones named here must never go missing.
    assert expected_goals <= set(record["summary"]), expected_goals - set(record["summary"])
    for name, entry in record["summary"].items():
        assert {"value", "goal", "met"} <= set(entry), name
        assert isinstance(entry["met"], bool), name
        if entry["value"] is None:
            assert entry["met"] is False and entry["reason"], name
        if "reason" in entry:
            assert entry["met"] is False, name
        # A met goal cleared its whole interval, or its figure is exact by nature and says why.
        if entry["met"]:
            assert entry.get("exact") or len(entry.get("interval", [])) == 2, name
        if "interval" in entry:
            assert entry["interval"][0] <= entry["interval"][1] and entry["interval_method"], name
