"""``kaisoku report RUN_DIR``: one self-contained HTML page of a run, from its files alone.

It reads ``metrics.jsonl`` (tolerating a torn last line, as a crashed run leaves), ``config.toml`` and
``run.json``, draws each series with matplotlib (the ``plot`` extra, imported only here) into
``RUN_DIR/report/*.png`` and embeds them in ``RUN_DIR/report.html`` as data URIs, so the page is one
file to copy or mail.
"""

from __future__ import annotations

import base64
import html
import json
import math
import platform
from pathlib import Path
from typing import Any

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text

#: (title, y label, metrics key) of each plot over steps.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("Training loss", "loss", "loss"),
    ("Validation accuracy", "accuracy", "val_accuracy"),
    ("Validation MAE", "MAE", "val_mae"),
    ("Learning rate", "lr", "lr"),
    ("Throughput", "samples/s", "samples_per_s"),
    ("Data-wait fraction", "fraction of step time", "data_wait_fraction"),
    ("Peak memory", "MiB", "peak_memory_mib"),
    ("Shuffle quality", "quality", "shuffle_quality"),
    ("Skipped records per epoch", "records", "skipped_records"),
)
_NOT_EVENTS = {"validation", "epoch"}  # logged as events, shown as series instead

INSTALL_HINT = "the run report needs matplotlib; pip install 'kaisoku[plot]'"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable line of ``metrics.jsonl`` (a torn or foreign line is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the finite numeric values of ``key``."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(float(record.get("step", 0)))
            values.append(float(value))
    return steps, values


def _plot(path: Path, title: str, ylabel: str, xs: list[float], ys: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=90)
    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _environment(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    import torch

    start = next((r for r in records if r.get("event") == "start"), {})
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [
        ("torch", torch.__version__),
        ("python", platform.python_version()),
        ("CPU", platform.processor() or platform.machine()),
        ("GPU", gpu),
        ("device", str(start.get("device", "?"))),
        ("world size", str(start.get("world_size", "?"))),
    ]


def write_report(run_dir: Path) -> Path:
    """Write ``RUN_DIR/report.html`` (and its PNGs under ``RUN_DIR/report/``); its path.

    KaisokuError when the folder holds no run or matplotlib is missing.
    """
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.toml").exists():
        raise KaisokuError(f"{run_dir} holds no kaisoku run (no metrics.jsonl or config.toml)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KaisokuError(INSTALL_HINT) from None
    records = read_metrics(run_dir)
    figures = run_dir / "report"
    figures.mkdir(parents=True, exist_ok=True)
    images = []
    for title, ylabel, key in SERIES:
        xs, ys = series(records, key)
        if not xs:
            continue
        png = figures / f"{key}.png"
        _plot(png, title, ylabel, xs, ys)
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        images.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
    events = [r for r in records if "event" in r and r["event"] not in _NOT_EVENTS]
    event_rows = [
        (
            str(r.get("time", "")),
            ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("time", "elapsed_s")),
        )
        for r in events
    ]
    status = {}
    if (run_dir / "run.json").exists():
        try:
            status = json.loads((run_dir / "run.json").read_text())
        except ValueError:
            status = {}
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").exists() else "(none)"
    status_rows = [(str(k), str(v)) for k, v in status.items()]
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kaisoku run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}figure{{display:inline-block;margin:.3em}}
table{{border-collapse:collapse}}th,td{{border:1px solid #ccc;padding:.2em .5em;text-align:left;font-size:90%}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style></head><body>
<h1>kaisoku run: {html.escape(str(run_dir))}</h1>
<h2>Status</h2>{_table(status_rows) if status_rows else "<p>no run.json</p>"}
<h2>Plots</h2>
<div class="plots">{"".join(images) or "<p>no metrics yet</p>"}</div>
<h2>Events</h2>{_table(event_rows) if event_rows else "<p>none</p>"}
<h2>Environment</h2>{_table(_environment(records))}
<h2>Resolved config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""
    out = run_dir / "report.html"
    atomic_write_text(out, page)
    return out


def finish_line(summary: dict[str, Any], run_dir: Path) -> str:
    """The last line of a finished run: steps, accuracy, skipped records, and the report's path (after a
    one-line data hint where :func:`data_hint` has one).

    The report is written here; without matplotlib the line says how to get it.
    """
    parts = [f"kaisoku: done at step {summary.get('steps')}"]
    if "val_accuracy" in summary:
        parts.append(f"val accuracy {100 * summary['val_accuracy']:.2f}%")
    skipped = int(summary.get("skipped_records", 0))
    parts.append(f"{skipped} record{'' if skipped == 1 else 's'} skipped")
    if summary.get("skipped_steps"):
        parts.append(f"{summary['skipped_steps']} non-finite steps skipped")
    if summary.get("rollbacks"):
        parts.append(f"{summary['rollbacks']} rollbacks")
    try:
        parts.append(f"report {write_report(run_dir)}")
    except KaisokuError as error:
        parts.append(str(error))
    hint = data_hint(run_dir)  # its own line, before the finish line (which stays last)
    return (f"{hint}\n" if hint else "") + "; ".join(parts)


def data_hint(run_dir: Path, mounts_file: str = "/proc/self/mounts") -> str | None:
    """``kaisoku plan``'s one-line hint from the run's mean data-wait fraction and its data settings: only
    for a packed dataset on a network or FUSE mount (image folders get the loader's pack hint).
    ``mounts_file``: the mount table the data path's file-system type is looked up in."""
    import tomllib

    from kaisoku.data.folder import is_slow_mount, mount_type
    from kaisoku.plan.model import strategy_hint

    waits = series(read_metrics(run_dir), "data_wait_fraction")[1][1:]  # the first window holds start-up
    config_file = run_dir / "config.toml"
    if not waits or not config_file.exists():
        return None
    data = tomllib.loads(config_file.read_text()).get("data", {})
    path = Path(str(data.get("path") or "")).expanduser()
    if (
        not data.get("path")
        or not (path / "index.json").exists()
        or not is_slow_mount(mount_type(path, mounts_file))
    ):
        return None  # image folders have their own pack hint; a local source is not the I/O model's case
    return strategy_hint(
        sum(waits) / len(waits),
        staged=True,
        shuffle=str(data.get("shuffle", "global")),
        exchange=float(data.get("exchange", 0.0)),
        local_cache=bool(data.get("local_cache")),
    )
