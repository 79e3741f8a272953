"""Shared benchmark plumbing: goal figures, interleaved repeats, the JSON record and the table."""

from __future__ import annotations

import json
import operator
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.fsutil import atomic_write_text

_COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


def goal(value: float | None, target: str) -> dict[str, Any]:
    """A summary entry ``{"value", "goal", "met"}``; ``target`` reads like ``"<= 1.03"``.

    A missing value (the peer or run could not be measured) is never met.
    """
    op_text, _, number = target.partition(" ")
    compare = _COMPARATORS[op_text]
    met = value is not None and bool(np.isfinite(value)) and compare(float(value), float(number))
    return {"value": None if value is None else round(float(value), 4), "goal": target, "met": met}


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and inter-quartile range of ``values``."""
    arr = np.asarray(values, dtype=np.float64)
    q1, med, q3 = np.percentile(arr, [25, 50, 75])
    return float(med), float(q3 - q1)


def interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each run once per round, A/B/A/B..., ``repeats`` rounds; return each run's measurements.

    The order rotates every round so that no run always goes first on a warming machine.
    """
    names = list(runs)
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(float(runs[name]()))
    return results


def locate_mnist() -> Path | None:
    """The MNIST archive the benchmarks train on: ``$KAISOKU_MNIST``, else ``shared/data/mnist.npz``
    in or beside the working directory or the source tree; None where it is absent."""
    env = os.environ.get("KAISOKU_MNIST")
    if env:
        path = Path(env).expanduser()
        return path if path.exists() else None
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd(), Path.cwd().parent, repo, repo.parent):
        candidate = base / "shared" / "data" / "mnist.npz"
        if candidate.exists():
            return candidate
    return None


def git_commit() -> str:
    """The commit of the working tree, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it, with the usable core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({len(os.sched_getaffinity(0))} cores)"


def environment() -> dict[str, Any]:
    """What a result depends on: commit, command, versions and CPU."""
    return {
        "commit": git_commit(),
        "command": " ".join(["kaisoku", *sys.argv[1:]]) if sys.argv else "kaisoku",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
    }


def write_result(
    name: str,
    out_dir: Path,
    summary: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    *,
    quick: bool,
    notes: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``<out_dir>/<name>.json`` atomically and return the record."""
    record: dict[str, Any] = {
        "summary": summary,
        "rows": rows,
        "quick": quick,
        "notes": notes,
        **environment(),
        **(extra or {}),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / f"{name}.json", json.dumps(record, indent=2, default=str) + "\n")
    return record


def print_table(title: str, rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> None:
    """Print the raw rows and the goal summary as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if rows:
        table = Table(title=title)
        columns = list(dict.fromkeys(key for row in rows for key in row))
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(_fmt(row.get(column)) for column in columns))
        console.print(table)
    goals = Table(title=f"{title}: goals")
    for column in ("figure", "value", "goal", "met"):
        goals.add_column(column)
    for figure, entry in summary.items():
        goals.add_row(figure, _fmt(entry["value"]), entry["goal"], "yes" if entry["met"] else "NO")
    console.print(goals)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
