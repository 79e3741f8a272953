"""Run metrics: a rich progress bar, JSONL lines, optional TensorBoard, and the closing summary table."""

from __future__ import annotations

import datetime
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text
from kaisoku.memory.measure import read_peak_bytes, reset_peak

_RUN_PEAK_MIB = [0.0]  # the highest interval peak so far (interval peaks reset the counters)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated on a GPU, else the resident-set high-water mark."""
    if device.type == "cuda":
        return max(_RUN_PEAK_MIB[0], torch.cuda.max_memory_allocated(device) / 2**20)
    # ru_maxrss is in KiB on Linux (never reset, unlike VmHWM).
    return max(_RUN_PEAK_MIB[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def interval_peak_memory_mib(device: torch.device) -> float:
    """Peak memory since the previous call (one log interval), then the peak is reset.

    CUDA: ``max_memory_allocated`` and ``reset_peak_memory_stats``. CPU on Linux: ``VmHWM`` and
    ``/proc/self/clear_refs`` 5 (the peak restarts at the current resident set); where that is not
    allowed, the process's peak so far (``ru_maxrss``).
    """
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            peak = read_peak_bytes() / 2**20
            reset_peak()
        except (OSError, KaisokuError):  # no procfs, or clear_refs not permitted
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _RUN_PEAK_MIB[0] = max(_RUN_PEAK_MIB[0], peak)
    return peak


class MetricsLogger:
    """Writes one JSON object per line to ``metrics.jsonl`` and drives the progress bar (rank 0 only).

    On other ranks every method is a no-op, so the trainer can call it unconditionally.
    """

    def __init__(
        self,
        run_dir: Path | None,
        *,
        enabled: bool,
        total_steps: int,
        progress: bool,
        tensorboard: bool,
    ) -> None:
        self.enabled = enabled
        self.start_time = time.monotonic()
        self._file = None
        self._progress = None
        self._task = None
        self._tb = None
        if not enabled:
            return
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    print("kaisoku: tensorboard is not installed; pip install tensorboard", file=sys.stderr)
                else:
                    self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if progress:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[rate]:.0f} samples/s"),
                TimeRemainingColumn(),
                transient=False,
                # Drawn when it changes (advance, message): its fields change only at log intervals, and a
                # refresh thread redrawing it 10 times a second took 1-3% of a core from rank 0.
                auto_refresh=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, loss=float("nan"), rate=0.0)

    def advance(self, step: int, *, loss: float | None = None, rate: float | None = None) -> None:
        """Move the progress bar to ``step``."""
        if self._progress is not None and self._task is not None:
            fields: dict[str, Any] = {}
            if loss is not None:
                fields["loss"] = loss
            if rate is not None:
                fields["rate"] = rate
            self._progress.update(self._task, completed=step, refresh=True, **fields)

    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics line (and its scalars to TensorBoard), stamped with the time.

        Every line is valid JSON: a non-finite value is written as ``null`` and its key listed under
        ``"nonfinite"``. ``time`` is the wall clock (UTC, ISO 8601), ``elapsed_s`` the seconds since
        this process started logging.
        """
        if not self.enabled:
            return
        record = clean_record(record)
        record.setdefault("time", datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"))
        record.setdefault("elapsed_s", round(time.monotonic() - self.start_time, 3))
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def continue_from(self, step: int, *, restart: int = 0) -> None:
        """A resumed run continues after optimizer step ``step``: drop the lines of later steps (the run
        that wrote them ended without a checkpoint of them; they are trained again), then log a
        ``resume`` event, so that metrics.jsonl holds each step once.
        """
        if not self.enabled or self._file is None:
            return
        path = Path(self._file.name)
        self._file.close()
        kept = []
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    line_step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue  # a line cut short by a kill
                if not isinstance(line_step, int) or line_step <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        atomic_write_text(path, "".join(kept))
        self._file = path.open("a", encoding="utf-8")
        self.log({"step": step, "event": "resume", "restart": restart})

    def message(self, text: str) -> None:
        """Print a line above the progress bar (never wrapped: one message, one line)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text, soft_wrap=True, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Stop the progress bar and close the files."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def clean_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with non-finite floats replaced by None and their keys listed under ``"nonfinite"``."""
    bad = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if not bad:
        return dict(record)
    out = {key: (None if key in bad else value) for key, value in record.items()}
    out["nonfinite"] = bad
    return out


STAGING_KEYS = (
    "source_reads",
    "source_bytes",
    "served_ram_bytes",
    "served_local_bytes",
    "served_source_bytes",
)
"""Summary counters of the node cache's tiers: shown when the run stages shards (a cache tier is on)."""
EXCHANGE_KEYS = ("exchanged_bytes",)
"""Summary counters of the sample exchange between nodes: shown when the run exchanges samples."""


def summary_rows(
    summary: dict[str, Any], *, staging: bool = False, exchange: bool = False
) -> list[tuple[str, str]]:
    """The (metric, value) rows the summary table shows: the I/O counters only where that data path is in
    play (``staging``: a node cache tier, ``exchange``: samples swapped between nodes), skipped records
    only when there were some. metrics.jsonl keeps every counter."""
    hidden = set()
    if not staging:
        hidden.update(STAGING_KEYS)
    if not exchange:
        hidden.update(EXCHANGE_KEYS)
    if not summary.get("skipped_records"):
        hidden.add("skipped_records")
    return [
        (key, f"{value:.4g}" if isinstance(value, float) else str(value))
        for key, value in summary.items()
        if key not in hidden
    ]


def print_summary(summary: dict[str, Any], *, staging: bool = False, exchange: bool = False) -> None:
    """Print the end-of-run summary as a table (the rows of :func:`summary_rows`)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kaisoku train: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary_rows(summary, staging=staging, exchange=exchange):
        table.add_row(key, value)
    Console().print(table)
