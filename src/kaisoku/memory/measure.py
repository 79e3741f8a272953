"""Peak memory of one training step, measured so that it is true on the CPU as well as on CUDA.

On the CPU a process's resident set is the only honest figure, and it needs care: freed memory must go
back to the OS (``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc serve every allocation of 64 KiB or more
with its own mapping, unmapped on free), the peak must start at the step (``/proc/self/clear_refs``
with ``5`` resets ``VmHWM`` to the current resident set), and earlier configurations must not leave
memory behind (each configuration runs in its own process). The recipe: build, one warm-up step
(first-touch allocations, optimizer state), reset the peak, one step, read ``VmHWM``. On CUDA the
same with ``torch.cuda.reset_peak_memory_stats`` and ``torch.cuda.max_memory_allocated``.

A configuration is named by ``"module:function"`` and JSON keyword arguments; the function builds
everything and returns the step to measure (a zero-argument callable). The processes are forked from
a small fork server (``python -m kaisoku.memory.measure --serve``, started once with the malloc
setting) that imports torch and the target's module and never computes anything: each configuration
still gets a fresh process of its own, without paying the seconds of a Python and torch start-up.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisoku.errors import KaisokuError

#: glibc: allocations of this many bytes or more get their own mapping, returned to the OS on free.
MMAP_THRESHOLD = 65536
#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc).
_M_MMAP_THRESHOLD = -3


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


class _Server:
    """The fork server: one ``--serve`` process; a request is a JSON line, the answer too."""

    def __init__(self) -> None:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kaisoku.memory.measure", "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its forked children share its group: one kill ends them all
        )

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The answer to ``request``, or None after ``timeout`` seconds (the server is then stopped)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.stop()
            return None
        return json.loads(line)

    def stop(self) -> None:
        """End the server and any child it is running."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


_SERVER: _Server | None = None


def _server() -> _Server:
    global _SERVER
    if _SERVER is None or _SERVER.process.poll() is not None:
        _SERVER = _Server()
        atexit.register(_SERVER.stop)
    return _SERVER


def measure_in_subprocess(
    target: str, kwargs: dict[str, Any], *, timeout: float = 600.0, threads: int = 0
) -> PeakReading:
    """Peak memory of the step that ``target(**kwargs)`` builds, measured in a process of its own.

    ``target`` is ``"module:function"``; the function returns ``(step, device)`` or just ``step``
    (on the CPU). ``threads``: torch threads in the child (0: torch's default). A failure is one
    :class:`KaisokuError` line ending with the child's own last line (e.g. ``ConfigError: ...``).
    """
    answer = _server().ask({"target": target, "kwargs": kwargs, "threads": threads}, timeout)
    if answer is None:
        raise KaisokuError(f"measuring {target} took over {timeout:.0f} s; make the configuration smaller")
    if answer["status"] != "ok":
        raise KaisokuError(f"measuring {target} {kwargs} failed: {answer['data']}")
    return PeakReading(**answer["data"])


def _measure(request: dict[str, Any]) -> dict[str, Any]:
    """In the forked process: build the target, measure its step."""
    try:
        with contextlib.suppress(OSError, AttributeError):  # glibc: big blocks go back to the OS on free
            ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        if request["threads"]:
            torch.set_num_threads(request["threads"])
        module, _, name = request["target"].partition(":")
        built = getattr(importlib.import_module(module), name)(**request["kwargs"])
        step, device = built if isinstance(built, tuple) else (built, torch.device("cpu"))
        return {"status": "ok", "data": measure_step(step, device).__dict__}
    except BaseException as exc:  # noqa: BLE001 - the parent words the one line
        return {"status": "error", "data": traceback.format_exception_only(type(exc), exc)[-1].strip()}


def _serve() -> None:
    """The fork server's loop: per request line, import the target's module here, fork, answer."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # what a configuration prints stays out of the answers
    for line in sys.stdin:
        request = json.loads(line)
        with contextlib.suppress(Exception):  # the child reports a failed import itself
            importlib.import_module(request["target"].partition(":")[0])
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the configuration's own process
            os.close(read)
            answer = json.dumps(_measure(request)).encode()
            with os.fdopen(write, "wb") as out:
                out.write(answer)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as source:
            data = source.read()
        _, status = os.waitpid(pid, 0)
        if not data:
            answer = {"status": "error", "data": f"the process ended without a result (status {status})"}
        else:
            answer = json.loads(data)
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
