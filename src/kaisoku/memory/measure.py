"""Peak memory of one training step, measured so that it is true on the CPU as well as on CUDA.

On the CPU a process's resident set is the only honest figure, and it needs care: freed memory must go
back to the OS (``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc serve every allocation of 64 KiB or more
with its own mapping, unmapped on free), the peak must start at the step (``/proc/self/clear_refs``
with ``5`` resets ``VmHWM`` to the current resident set), and earlier configurations must not leave
memory behind (each configuration runs in its own subprocess). The recipe: build, one warm-up step
(first-touch allocations, optimizer state), reset the peak, one step, read ``VmHWM``. On CUDA the
same with ``torch.cuda.reset_peak_memory_stats`` and ``torch.cuda.max_memory_allocated``.

A configuration is named by ``"module:function"`` and JSON keyword arguments; the function builds
everything and returns the step to measure (a zero-argument callable).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisoku.errors import KaisokuError

#: glibc: allocations of this many bytes or more get their own mapping, returned to the OS on free.
MMAP_THRESHOLD = 65536
_MARK = "KAISOKU_MEMORY_RESULT "


@dataclass(frozen=True)
class PeakReading:
    """Peak memory of one step: ``peak_bytes`` (VmHWM or CUDA peak) and the baseline before the step."""

    peak_bytes: int
    """Highest resident set (CPU) or allocated bytes (CUDA) during the measured step."""
    before_bytes: int
    """Resident set (CPU) or allocated bytes (CUDA) when the measured step began."""
    source: str
    """How it was measured: "VmHWM" or "cuda.max_memory_allocated"."""
    extra: dict[str, Any]
    """Whatever the step returned that is JSON (e.g. its loss), for the caller."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KaisokuError(f"/proc/self/status has no {field}; peak memory needs Linux procfs")


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current resident set (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def read_peak_bytes() -> int:
    """This process's ``VmHWM`` (peak resident set since start or the last :func:`reset_peak`), in bytes."""
    return _status_kib("VmHWM") * 1024


def read_rss_bytes() -> int:
    """This process's current resident set (``VmRSS``), in bytes."""
    return _status_kib("VmRSS") * 1024


def measure_step(step: Callable[[], Any], device: torch.device) -> PeakReading:
    """Warm up ``step`` once, reset the peak, run it once more and read the peak (in this process)."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = step()
        torch.cuda.synchronize(device)
        peak, source = torch.cuda.max_memory_allocated(device), "cuda.max_memory_allocated"
    else:
        reset_peak()
        before = read_rss_bytes()
        result = step()
        peak, source = read_peak_bytes(), "VmHWM"
    extra = result if isinstance(result, dict) else {}
    return PeakReading(peak_bytes=int(peak), before_bytes=int(before), source=source, extra=extra)


def measure_in_subprocess(
    target: str, kwargs: dict[str, Any], *, timeout: float = 600.0, threads: int = 0
) -> PeakReading:
    """Peak memory of the step that ``target(**kwargs)`` builds, measured in a fresh subprocess.

    ``target`` is ``"module:function"``; the function returns ``(step, device)`` or just ``step``
    (on the CPU). ``threads``: torch threads in the child (0: torch's default).
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    payload = json.dumps({"target": target, "kwargs": kwargs})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kaisoku.memory.measure", payload],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise KaisokuError(
            f"measuring {target} took over {timeout:.0f} s; make the configuration smaller"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise KaisokuError(f"measuring {target} {kwargs} failed (exit {done.returncode}): {tail}")
    data = json.loads(lines[-1][len(_MARK) :])
    return PeakReading(**data)


def _child(payload: str) -> None:
    spec = json.loads(payload)
    module, _, name = spec["target"].partition(":")
    built = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    step, device = built if isinstance(built, tuple) else (built, torch.device("cpu"))
    reading = measure_step(step, device)
    print(_MARK + json.dumps(reading.__dict__), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
