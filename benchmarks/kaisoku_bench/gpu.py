"""``kaisoku bench gpu``: every benchmark row that needs a GPU, recorded in one prepared run.

GPU time is scarce and short, so the run is planned before it starts: :data:`GPU_ROWS` lists each row, the
benchmark (and case) whose own GPU path records it, and the seconds it is expected to take. The rows run
in that order, each as ``kaisoku bench NAME`` in a child process (the benchmarks' own code, their own
checks on where records go) writing into ``benchmarks/results/<gpu>/``, each stopped at the time left of
:data:`LIMIT_S`; a row whose expected time no longer fits is not started. At the end one line per row that
could not be recorded says why: no benchmark measures it yet, it did not fit, it failed or ran out of time.
Without CUDA the command prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kaisoku.command_parser import CommandParser
from kaisoku_bench.common import RESULTS, check_out_dir, checked_data_path, source_repo

#: The whole run's limit in seconds.
LIMIT_S = 8 * 60.0


@dataclass(frozen=True)
class GpuRow:
    """One row of the GPU run."""

    name: str
    what: str
    benchmark: str = ""
    """The ``kaisoku bench`` benchmark whose GPU path records the row ("" where none measures it yet)."""
    case: str = ""
    """``--case`` of that benchmark ("" runs every case the GPU machine can run)."""
    expected_s: float = 0.0
    """Seconds the row is expected to take on one H100/H200-class GPU (with its host's cores)."""
    missing: str = ""
    """Why no benchmark records the row yet."""

    def command(self, out_dir: Path, allow_dirty: bool) -> list[str]:
        """The child process that records the row into ``out_dir``."""
        argv = [sys.executable, "-m", "kaisoku", "bench", self.benchmark, "--out", str(out_dir)]
        if self.case:
            argv += ["--case", self.case]
        return argv + (["--allow-dirty"] if allow_dirty else [])


#: Every row that needs a GPU, most needed first (K-FAC's speed fixes and the ResNet-50 training row were
#: never measured on a GPU).
GPU_ROWS: tuple[GpuRow, ...] = (
    GpuRow(
        "kfac-resnet10",
        "K-FAC resnet10-shapes: step time and time to target against SGD and LARS",
        benchmark="kfac",
        case="resnet10-shapes",
        expected_s=180.0,
    ),
    GpuRow(
        "resnet50-train",
        "kaisoku train ResNet-50 images/s on one GPU (bf16, channels-last) against a hand-written torch loop, "
        "with synthetic data and with kaisoku's loader",
        benchmark="throughput",
        expected_s=180.0,
    ),
    GpuRow(
        "optim",
        "CUDA kernels per step of eager LARS, foreach and fused SGD; LARS eager/compiled against fused SGD",
        benchmark="optim",
        expected_s=200.0,
    ),
    GpuRow(
        "sharded",
        "the sharded (FSDP) rows",
        missing="kaisoku bench shard runs 4 gloo ranks on the CPU; on GPUs NCCL needs one GPU per rank, and "
        "this run plans for one GPU",
    ),
    GpuRow(
        "gpu-decode",
        "data.decode gpu against the host path on the same node: samples/s, host CPU per sample, pixel difference",
        missing="kaisoku bench loader records it (gpu_decode_vs_host_*) on a CUDA machine, but its whole run "
        "(peers, 20k-image sets) does not fit this run's limit; it needs a loader case of the GPU rows alone",
    ),
    GpuRow(
        "compile",
        "--compile auto against eager on the GPU (small-cnn, resnet10)",
        benchmark="compile",
        expected_s=240.0,
    ),
    GpuRow(
        "memory",
        "activation memory techniques and the budget planner on the GPU",
        benchmark="memory",
        expected_s=420.0,
    ),
)


def gpu_folder(device_name: str) -> str:
    """The records folder's name for a CUDA device: its name in lower case without the vendor, runs of
    other characters as one ``-`` (``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` ->
    ``h100-80gb-hbm3``)."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


@dataclass
class Outcome:
    """What became of one row."""

    row: GpuRow
    recorded: bool
    why: str = ""
    seconds: float = 0.0


def run_rows(
    rows: Sequence[GpuRow],
    record: Callable[[GpuRow, float], tuple[bool, str]],
    *,
    limit_s: float = LIMIT_S,
    clock: Callable[[], float] = time.monotonic,
) -> list[Outcome]:
    """Record each row in order by ``record(row, seconds_left)`` -> (recorded, why not), within ``limit_s``.

    A row with no benchmark is not recorded (its ``missing``); a row whose expected time exceeds the time
    left is not started.
    """
    started = clock()
    outcomes = []
    for row in rows:
        left = limit_s - (clock() - started)
        if not row.benchmark:
            outcomes.append(Outcome(row, False, row.missing))
            continue
        if row.expected_s > left:
            outcomes.append(
                Outcome(
                    row,
                    False,
                    f"not started: it takes about {row.expected_s:.0f} s and {max(0.0, left):.0f} s were left "
                    f"of the {limit_s / 60:.0f} minutes",
                )
            )
            continue
        begun = clock()
        recorded, why = record(row, left)
        outcomes.append(Outcome(row, recorded, why, clock() - begun))
    return outcomes


def could_not_record(outcomes: Sequence[Outcome]) -> list[str]:
    """One line per row that was not recorded, saying why."""
    return [
        f"kaisoku bench gpu: could not record {o.row.name} ({o.row.what}): {o.why}"
        for o in outcomes
        if not o.recorded
    ]


def _record_in_child(
    out_dir: Path, allow_dirty: bool, logs: Path
) -> Callable[[GpuRow, float], tuple[bool, str]]:
    """A ``record`` for :func:`run_rows` that runs the row's benchmark in a child process, its output in
    ``logs/<row>.log``."""

    def record(row: GpuRow, left: float) -> tuple[bool, str]:
        log = logs / f"{row.name}.log"
        print(f"kaisoku bench gpu: {row.name} ({' '.join(row.command(out_dir, allow_dirty)[2:])}), "
              f"{left:.0f} s left", flush=True)  # fmt: skip
        with open(log, "w") as handle:
            try:
                done = subprocess.run(
                    row.command(out_dir, allow_dirty), stdout=handle, stderr=subprocess.STDOUT, timeout=left
                )
            except subprocess.TimeoutExpired:
                return False, f"stopped at the {LIMIT_S / 60:.0f}-minute limit (output in {log})"
        if done.returncode != 0:
            return False, f"kaisoku bench {row.benchmark} exited {done.returncode} (output in {log})"
        if not (out_dir / f"{row.benchmark}.json").is_file():
            return False, f"kaisoku bench {row.benchmark} wrote no record (output in {log})"
        return True, ""

    return record


def parser() -> argparse.ArgumentParser:
    """The parser of ``kaisoku bench gpu``."""
    p = CommandParser(
        prog="kaisoku bench gpu",
        description=f"Record every benchmark row that needs a GPU into {RESULTS}/<gpu>/ within "
        f"{LIMIT_S / 60:.0f} minutes; print what could not be recorded and why.",
    )
    p.add_argument("--out", default="", help=f"folder for the records (default: {RESULTS}/<gpu>)")
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help=f"record into {RESULTS} from a tree with uncommitted changes (the diff's sha256 is recorded)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    """``kaisoku bench gpu [--out DIR] [--allow-dirty]``: 0 whatever was recorded (the lines say what was
    not), and 0 with one line on a machine without CUDA."""
    args = parser().parse_args(list(argv))
    if not torch.cuda.is_available():
        print(
            "kaisoku bench gpu: no CUDA device on this machine; nothing to record (run it on a GPU machine)"
        )
        return 0
    repo = source_repo()
    out_dir = Path(args.out) if args.out else repo / RESULTS / gpu_folder(torch.cuda.get_device_name())
    check_out_dir(out_dir, quick=False, allow_dirty=args.allow_dirty, repo=repo)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = checked_data_path(Path(tempfile.mkdtemp(prefix="kaisoku-bench-gpu-")), "the log folder")
    print(f"kaisoku bench gpu: each row's output goes to {logs}")
    outcomes = run_rows(GPU_ROWS, _record_in_child(out_dir, args.allow_dirty, logs))
    for outcome in outcomes:
        if outcome.recorded:
            print(f"kaisoku bench gpu: recorded {outcome.row.name} in {outcome.seconds:.0f} s")
    for line in could_not_record(outcomes):
        print(line)
    print(f"kaisoku bench gpu: records in {out_dir}")
    return 0
