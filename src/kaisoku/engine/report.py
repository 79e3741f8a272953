"""``kaisoku report RUN_DIR``: one self-contained HTML page of a run, from its files alone.

It reads ``metrics.jsonl`` (tolerating a torn last line, as a crashed run leaves), ``config.toml`` and
``run.json``, draws each series with matplotlib into ``RUN_DIR/report/*.png`` and embeds them in
``RUN_DIR/report.html`` as data URIs, so the page is one file to copy or mail. Every file is written
atomically: a full disk leaves no truncated PNG, and it is one line (:func:`kaisoku.fsutil.write_failure`).
Times are shown in local date-time.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import html
import io
import json
import logging
import math
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_bytes, atomic_write_text, write_failure

#: (title, y label, metrics key) of each plot over steps.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("Training loss", "loss", "loss"),
    ("Validation accuracy", "accuracy", "val_accuracy"),
    ("Validation token accuracy", "token accuracy", "val_token_accuracy"),
    ("Validation MAE", "MAE", "val_mae"),
    ("Learning rate", "lr", "lr"),
    ("Throughput", "samples/s", "samples_per_s"),
    ("Token throughput", "tokens/s", "tokens_per_s"),
    ("Data-wait fraction", "fraction of step time", "data_wait_fraction"),
    ("Peak memory", "MiB", "peak_memory_mib"),
    ("Shuffle quality", "quality", "shuffle_quality"),
    ("Skipped records per epoch", "records", "skipped_records"),
)
_NOT_EVENTS = {"validation", "epoch"}  # logged as events, shown as series instead
_TIME_KEYS = ("started", "ended", "time")  # run.json's Unix times, shown as local date-time


#: Validation figures that are counts, not plotted.
_VALIDATION_COUNTS = {"val_samples", "val_tokens", "val_skipped_records"}


def _validation_series(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """A plot for each other validation figure (the loss, perplexity, the user's own metrics), in the order
    the records name them."""
    covered = {key for _, _, key in SERIES} | _VALIDATION_COUNTS
    keys: dict[str, None] = {}
    for record in records:
        if record.get("event") == "validation":
            keys.update((key, None) for key in record if key.startswith("val_") and key not in covered)
    return [(f"Validation {key[4:].replace('_', ' ')}", key[4:], key) for key in keys]


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


@contextlib.contextmanager
def _quiet_matplotlib() -> Iterator[None]:
    """Hold back matplotlib's warnings while it loads (the font cache it builds on a first run, a cache
    folder it cannot write): the report is written either way, and a run's last lines stay its own."""
    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _plot(title: str, ylabel: str, xs: list[float], ys: list[float]) -> bytes:
    """One series drawn as a PNG, returned as bytes."""
    # Imported here for start-up time: every kaisoku command imports this module, few draw.
    with _quiet_matplotlib():
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
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def local_time(value: object) -> str:
    """A Unix time (run.json) or an ISO 8601 time with its zone (metrics.jsonl) as local date-time,
    ``2025-01-31 14:05:09 CET``; anything else as it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        moment = datetime.datetime.fromtimestamp(float(value)).astimezone()
    elif isinstance(value, str):
        try:
            moment = datetime.datetime.fromisoformat(value).astimezone()
        except ValueError:
            return value
    else:
        return str(value)
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z")


def _status_rows(status: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (str(k), local_time(v) if k in _TIME_KEYS and v is not None else str(v)) for k, v in status.items()
    ]
    started, ended = status.get("started"), status.get("ended")
    if isinstance(started, (int, float)) and isinstance(ended, (int, float)):
        rows.append(("duration", f"{ended - started:.1f} s"))
    return rows


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

    KaisokuError, one line, when the folder holds no run or the report cannot be written there (a full
    disk, a read-only folder); every file written is whole (temp file, fsync, rename).
    """
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.toml").exists():
        raise KaisokuError(f"{run_dir} holds no kaisoku run (no metrics.jsonl or config.toml)")
    try:
        return _write_report(run_dir)
    except OSError as error:
        failure = write_failure(error, run_dir, "the run report")
        if failure is None:
            raise
        raise failure from None


def _write_report(run_dir: Path) -> Path:
    records = read_metrics(run_dir)
    figures = run_dir / "report"
    images = []
    for title, ylabel, key in (*SERIES, *_validation_series(records)):
        xs, ys = series(records, key)
        if not xs:
            continue
        png = _plot(title, ylabel, xs, ys)
        atomic_write_bytes(figures / f"{key}.png", png)
        data = base64.b64encode(png).decode("ascii")
        images.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
    events = [r for r in records if "event" in r and r["event"] not in _NOT_EVENTS]
    event_rows = [
        (
            local_time(r.get("time", "")),
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
    status_rows = _status_rows(status)
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
    """The last line of a finished run: steps, accuracy, skipped records, the run folder and the report's
    path (after a one-line data hint where :func:`data_hint` has one).

    The report is written here; where it cannot be, the line says why instead of naming it.
    """
    parts = [f"kaisoku: done at step {summary.get('steps')}"]
    if "val_accuracy" in summary:
        parts.append(f"val accuracy {100 * summary['val_accuracy']:.2f}%")
    if "val_token_accuracy" in summary:
        parts.append(f"val token accuracy {100 * summary['val_token_accuracy']:.2f}%")
    parts.append(
        _skipped_text(int(summary.get("skipped_records", 0)), int(summary.get("val_skipped_records", 0)))
    )
    if summary.get("skipped_steps"):
        parts.append(f"{summary['skipped_steps']} non-finite steps skipped")
    if summary.get("rollbacks"):
        parts.append(f"{summary['rollbacks']} rollbacks")
    held = [name for name in ("metrics.jsonl", "checkpoints/", "logs/") if (run_dir / name).exists()]
    parts.append(f"run folder {run_dir}" + (f" ({', '.join(held)})" if held else ""))
    try:
        parts.append(f"report {write_report(run_dir)}")
    except KaisokuError as error:
        parts.append(f"no report: {error}")
    hint = data_hint(run_dir)  # its own line, before the finish line (which stays last)
    return (f"{hint}\n" if hint else "") + "; ".join(parts)


def _skipped_text(train: int, validation: int) -> str:
    """``N records skipped``, with the validation share said where validation skipped any."""
    total = train + validation
    text = f"{total} record{'' if total == 1 else 's'} skipped"
    return f"{text} ({validation} in validation)" if validation else text


def data_hint(run_dir: Path, mounts_file: str = "/proc/self/mounts") -> str | None:
    """``kaisoku plan``'s one-line hint from the run's mean data-wait fraction and its data settings: only
    for a packed dataset on a network or FUSE mount (image folders get the loader's pack hint).
    ``mounts_file``: the mount table the data path's file-system type is looked up in."""
    import tomllib

    # start-up: the hint's modules load only when a report has data to judge
    from kaisoku.data.loading.folder import is_slow_mount, mount_type
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
