"""Shared benchmark plumbing: goal figures, interleaved repeats, provenance, the JSON record and the table.

Every benchmark writes its record through :func:`write_result`, which adds what the result depends on:
the command line, the commit and whether the tree had uncommitted changes (with the diff's hash), the
torch and Python versions, the CPU model and core count, the load average before and after the run and
its wall time. :func:`start_run` (called by ``kaisoku bench``) marks the run's start; a benchmark's
``run`` called directly starts one implicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import kaisoku
from kaisoku.errors import ConfigError
from kaisoku.fsutil import atomic_write_text
from kaisoku_bench.goals import goal as goal  # the benchmarks take goal entries from here
from kaisoku_bench.goals import unmet_goals as unmet_goals

#: Where recorded results live, relative to a checkout.
RESULTS = Path("benchmarks") / "results"


def slowest_rank_seconds(block: Callable[[], None], steps: int) -> float:
    """Seconds per step of ``block`` (``steps`` steps) on the slowest rank: every rank starts together and
    gets the same figure. A collective."""
    dist.barrier()
    start = time.perf_counter()
    block()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()) / steps


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


# ------------------------------------------------------------------------------------------ provenance


@dataclass
class TreeState:
    """The commit of a checkout and whether its code differs from it (changed tracked files, or new
    source files git does not ignore)."""

    commit: str
    dirty: bool
    diff_sha256: str | None = None
    untracked: list[str] = field(default_factory=list)
    """New, not ignored files under the measured code's folders (:data:`SOURCE_DIRS`)."""


#: Where the measured code lives: a new file there that git does not ignore makes the tree dirty.
SOURCE_DIRS = ("src", "benchmarks")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=True, timeout=30)


def tree_state(repo: Path) -> TreeState:
    """``repo``'s HEAD commit, and for a tree whose code changed the sha256 of ``git diff HEAD`` followed by
    each untracked source file's path and bytes.

    Code is every tracked file, and every untracked, not ignored file under :data:`SOURCE_DIRS` (a new
    module the run imports is measured code). Recorded results (``benchmarks/results``) are outputs, not
    measured code: benchmarks recorded one after another do not make the tree dirty for the next. Outside
    a git checkout the commit is ``"unknown"`` and the tree counts as clean.
    """
    outputs = f":(exclude){RESULTS.as_posix()}"
    try:
        commit = _git(repo, "rev-parse", "HEAD").stdout.decode().strip()
        status = _git(
            repo, "status", "--porcelain", "--untracked-files=no", "--", ".", outputs
        ).stdout.strip()
        untracked = sorted(
            _git(repo, "ls-files", "-z", "--others", "--exclude-standard", "--", *SOURCE_DIRS, outputs)
            .stdout.decode()
            .split("\0")
        )
        untracked = [name for name in untracked if name]
        if not status and not untracked:
            return TreeState(commit=commit, dirty=False)
        digest = hashlib.sha256(_git(repo, "diff", "HEAD", "--binary", "--", ".", outputs).stdout)
        for name in untracked:
            digest.update(b"\0untracked\0" + name.encode() + b"\0")
            try:
                digest.update((repo / name).read_bytes())
            except OSError:  # removed since the listing: its name still marks the tree
                pass
        return TreeState(commit=commit, dirty=True, diff_sha256=digest.hexdigest(), untracked=untracked)
    except (OSError, subprocess.SubprocessError):
        return TreeState(commit="unknown", dirty=False)


def dirt(tree: TreeState) -> str:
    """What makes ``tree`` dirty, in words ("" for a clean tree)."""
    if not tree.dirty:
        return ""
    if not tree.untracked:
        return "tracked files have uncommitted changes"
    shown = ", ".join(tree.untracked[:3]) + (
        f" and {len(tree.untracked) - 3} more" if len(tree.untracked) > 3 else ""
    )
    return f"uncommitted changes or new source files ({shown})"


def check_out_dir(
    path: Path, *, quick: bool, allow_dirty: bool, tree: TreeState | None = None, repo: Path | None = None
) -> None:
    """ConfigError where a record may not go to ``path``: a quick run never writes into a recorded-results
    folder, and a full run records there only from a clean tree (``tree``, else ``repo``'s now) unless
    ``allow_dirty``."""
    repo = repo or source_repo()
    if not inside_any(path, protected_dirs(repo)):
        return
    if quick:
        raise ConfigError(
            f"kaisoku bench --quick never writes into {RESULTS}; pass another --out or none (a temporary folder)"
        )
    tree = tree or tree_state(repo)
    if tree.dirty and not allow_dirty:
        raise ConfigError(
            f"refusing to record into {RESULTS}: {dirt(tree)}; commit them, pass --out elsewhere, or "
            "--allow-dirty to record the diff's sha256"
        )


def protected_dirs(repo: Path) -> list[Path]:
    """The recorded-results folders: the checkout's and the working directory's ``benchmarks/results``."""
    return list(dict.fromkeys([(repo / RESULTS).resolve(), (Path.cwd() / RESULTS).resolve()]))


def inside_any(path: Path, folders: Sequence[Path]) -> bool:
    """Whether ``path`` (resolved) is one of ``folders`` or lies under one."""
    resolved = Path(path).expanduser().resolve()
    return any(resolved == folder or folder in resolved.parents for folder in folders)


def checked_data_path(path: Path, what: str) -> Path:
    """``path`` where a benchmark keeps scratch or generated data; ConfigError when it lies inside a
    recorded-results folder (data there would be mistaken for records, and records overwritten)."""
    if inside_any(path, protected_dirs(source_repo())):
        raise ConfigError(
            f"{what} {path} lies inside {RESULTS}, which holds only records; point it elsewhere"
        )
    return Path(path)


def python_path(extra: str = "") -> str:
    """A ``PYTHONPATH`` for a process a benchmark starts: where kaisoku and kaisoku_bench were imported from
    (so the process runs the same code, installed or not), then ``extra``."""
    places = (
        str(Path(kaisoku.__file__).resolve().parents[1]),
        str(Path(__file__).resolve().parents[1]),
        extra,
    )
    return os.pathsep.join(dict.fromkeys(p for p in places if p))


def source_repo() -> Path:
    """The checkout these benchmarks were imported from (where the measured code lives), else the cwd."""
    repo = Path(__file__).resolve().parents[2]
    return repo if (repo / ".git").exists() else Path.cwd()


def cpu_model() -> str:
    """The CPU model as /proc/cpuinfo names it."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def process_table() -> dict[int, tuple[int, float]]:
    """Every running process's parent pid and CPU seconds (user + system), by pid, from ``/proc/PID/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # the name (field 2) may hold spaces: count after it
        # ppid, utime and stime are fields 4, 14 and 15 of stat(5)
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class RunInfo:
    """One benchmark run's provenance, taken when it starts."""

    argv: list[str]
    quick: bool
    tree: TreeState
    mnist: Path | None = None
    via_cli: bool = True
    case: str = ""
    """``kaisoku bench --case``: the one case to run of a benchmark that has several ("" runs them all)."""
    allow_dirty: bool = False
    """``kaisoku bench --allow-dirty``: a record may go into ``benchmarks/results`` from a dirty tree."""
    started: float = field(default_factory=time.perf_counter)
    load_before: list[float] = field(default_factory=load_average)

    def command(self) -> str:
        """The command line that reproduces the run (``kaisoku bench ...``, or the process's own)."""
        return shlex.join(["kaisoku", "bench", *self.argv] if self.via_cli else self.argv)


_CURRENT: list[RunInfo] = []


def start_run(
    argv: Sequence[str],
    *,
    quick: bool,
    mnist: Path | None = None,
    via_cli: bool = True,
    case: str = "",
    allow_dirty: bool = False,
) -> RunInfo:
    """Mark the start of a run: the command line, the tree's state and the load average, now.

    ``argv``: the arguments of ``kaisoku bench`` (``via_cli``), else the process's whole command line.
    ConfigError where the temporary folder, which holds every run's scratch data, lies inside
    ``benchmarks/results``.
    """
    checked_data_path(Path(tempfile.gettempdir()), "the temporary folder ($TMPDIR)")
    info = RunInfo(
        argv=list(argv),
        quick=quick,
        tree=tree_state(source_repo()),
        mnist=mnist,
        via_cli=via_cli,
        case=case,
        allow_dirty=allow_dirty,
    )
    _CURRENT[:] = [info]
    return info


def end_run() -> None:
    """Forget the run under way (the next record starts its own)."""
    _CURRENT.clear()


def current_run(quick: bool = False) -> RunInfo:
    """The run under way; a benchmark run outside ``kaisoku bench`` gets one started now."""
    if not _CURRENT:
        start_run(sys.argv, quick=quick, via_cli=False)
    return _CURRENT[0]


def selected_case() -> str:
    """The case ``kaisoku bench --case`` asked for ("" when none)."""
    return _CURRENT[0].case if _CURRENT else ""


def locate_mnist() -> Path | None:
    """The MNIST archive: ``kaisoku bench --mnist``, ``$KAISOKU_MNIST``, else ``shared/data/mnist.npz``
    in or beside the working directory or the source tree; None where it is absent."""
    if _CURRENT and _CURRENT[0].mnist is not None:
        return _CURRENT[0].mnist
    env = os.environ.get("KAISOKU_MNIST")
    if env:
        path = Path(env).expanduser()
        return path if path.exists() else None
    repo = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), Path.cwd().parent, repo, repo.parent):
        candidate = base / "shared" / "data" / "mnist.npz"
        if candidate.exists():
            return candidate
    return None


def provenance(info: RunInfo) -> dict[str, Any]:
    """What a result depends on: command, commit and tree state, versions, CPU, GPU (None without one), load and wall time."""
    record: dict[str, Any] = {
        "command": info.command(),
        "argv": info.argv,
        "commit": info.tree.commit,
        "dirty": info.tree.dirty,
    }
    if info.tree.dirty:
        record["diff_sha256"] = info.tree.diff_sha256
    record.update(
        {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": cpu_model(),
            # The vector level torch dispatches to: a VM may name only "AMD EPYC", and AVX2 against
            # AVX512 alone changes convolution times several-fold between records.
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_cores": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average": {"before": info.load_before, "after": load_average()},
            "wall_seconds": round(time.perf_counter() - info.started, 1),
        }
    )
    return record


def check_record_dir(out_dir: Path, quick: bool) -> RunInfo:
    """The run under way, once :func:`check_out_dir` allows its records (and plots) in ``out_dir``; a
    benchmark that draws before it writes its record calls this first."""
    info = current_run(quick)
    check_out_dir(out_dir, quick=quick, allow_dirty=info.allow_dirty, tree=info.tree)
    return info


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
    """Write ``<out_dir>/<name>.json`` atomically (with the run's provenance) and return the record.

    ConfigError where the rules of :func:`check_out_dir` forbid ``out_dir``, checked here too, so that a
    benchmark's ``run`` called directly obeys them as ``kaisoku bench`` does.
    """
    info = check_record_dir(out_dir, quick)
    record: dict[str, Any] = {
        "summary": summary,
        "rows": rows,
        "quick": quick,
        "notes": notes,
        **(extra or {}),
        **provenance(info),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / f"{name}.json", json.dumps(record, indent=2, default=str) + "\n")
    return record


def record_and_show(
    name: str,
    out_dir: Path,
    summary: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    columns: dict[str, str],
    plot: Callable[[list[dict[str, Any]], Path], None] | None = None,
    cell: Callable[[Any], Any] = lambda value: value,
    **options: Any,
) -> dict[str, Any]:
    """Write the record (``options`` go to :func:`write_result`); draw ``plot(rows, <name>.png)`` (a failed
    plot is only reported: the JSON is the record); print the rows' ``columns`` (key -> title, values
    through ``cell``) and the goals, wide enough off a terminal."""
    record = write_result(name, out_dir, summary, rows, **options)
    if plot is not None:
        try:
            plot(rows, out_dir / f"{name}.png")
        except Exception as error:
            print(f"kaisoku bench {name}: plot failed: {error}", file=sys.stderr)
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "170")  # rich's default of 80 columns off a terminal wraps cells
    table = [{title: cell(row[key]) for key, title in columns.items() if key in row} for row in rows]
    print_table(f"kaisoku bench {name}", table, summary)
    return record


def print_table(title: str, rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> None:
    """Print the raw rows and the goal summary as rich tables."""
    from rich.console import Console
    from rich.table import Table

    columns = list(dict.fromkeys(key for row in rows for key in row))
    # Redirected to a file, rich assumes 80 columns and crushes a wide table into empty cells.
    console = Console() if sys.stdout.isatty() else Console(width=max(160, 12 * len(columns)))
    if rows:
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(_fmt(row.get(column)) for column in columns))
        console.print(table)
    if not summary:
        return
    goals = Table(title=f"{title}: goals")
    for column in ("figure", "value", "goal", "met"):
        goals.add_column(column)
    for figure, entry in summary.items():
        met = "yes" if entry["met"] else f"NO ({entry['reason']})" if "reason" in entry else "NO"
        goals.add_row(figure, _fmt(entry["value"]), entry["goal"], met)
    console.print(goals)


def _fmt(value: Any) -> str:
    numbers = isinstance(value, list) and len(value) > 4 and all(isinstance(v, (int, float)) for v in value)
    nested = isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values())
    if numbers or nested:
        return f"({len(value)} values)"  # per-round and per-seed samples: in the JSON, not the table
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def fast_bf16(device: torch.device) -> bool:
    """True where bf16 autocast is not far slower than fp32: CUDA, or a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bench_device() -> torch.device:
    """Where a single-process benchmark runs its cases: the GPU where one is visible (the record's ``gpu``
    names it), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
