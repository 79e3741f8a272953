"""``kaisoku bench gpu``: its rows, the records folder's name, the plan within 8 minutes and the lines that
say what could not be recorded (the CPU-side logic; the GPU run itself needs a CUDA machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kaisoku_bench import BENCHMARKS, CASES, RESULTS, main
from kaisoku_bench.gpu import GPU_ROWS, LIMIT_S, GpuRow, could_not_record, gpu_folder, run_rows


def test_every_gpu_row_is_a_benchmark_of_its_own_or_says_why_not() -> None:
    names = [row.name for row in GPU_ROWS]
    assert len(names) == len(set(names))
    for row in GPU_ROWS:
        if row.benchmark:
            assert row.benchmark in BENCHMARKS, row
            assert not row.case or row.case in CASES[row.benchmark], row
            assert 0 < row.expected_s <= LIMIT_S and not row.missing, row
        else:
            assert row.missing and not row.case, row
    # The rows: K-FAC's resnet10 case and the kernel counts first, the ResNet-50 training row named.
    assert GPU_ROWS[0].benchmark == "kfac" and GPU_ROWS[0].case == "resnet10-shapes"
    assert {"optim", "resnet50-train", "sharded", "gpu-decode"} <= set(names)
    assert LIMIT_S == 480.0


def test_a_row_runs_its_benchmark_in_a_child_writing_to_the_folder() -> None:
    kfac = GPU_ROWS[0]
    out = Path("benchmarks/results/h200")
    argv = kfac.command(out, allow_dirty=False)
    assert argv[:4] == [sys.executable, "-m", "kaisoku", "bench"]
    assert argv[4:] == ["kfac", "--out", str(out), "--case", "resnet10-shapes"]
    assert kfac.command(out, allow_dirty=True)[-1] == "--allow-dirty"


@pytest.mark.parametrize(
    ("device", "folder"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb"),
        ("  ", "gpu"),
    ],
)
def test_the_records_folder_is_named_after_the_gpu(device: str, folder: str) -> None:
    assert gpu_folder(device) == folder
    assert "/" not in gpu_folder(device)


class Clock:
    """A clock that each recorded row moves on by its own seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rows_run_in_order_within_the_limit_and_the_rest_say_why() -> None:
    clock = Clock()
    spent = {"a": 200.0, "b": 250.0, "c": 10.0}
    ran: list[tuple[str, float]] = []

    def record(row: GpuRow, left: float) -> tuple[bool, str]:
        ran.append((row.name, left))
        clock.now += spent[row.name]
        return (row.name != "b", "" if row.name != "b" else "kaisoku bench b exited 1 (output in b.log)")

    rows = (
        GpuRow("a", "row a", benchmark="optim", expected_s=180.0),
        GpuRow("todo", "a row no benchmark has", missing="no benchmark measures it yet"),
        GpuRow("b", "row b", benchmark="kfac", expected_s=200.0),
        GpuRow("big", "row too long for what is left", benchmark="memory", expected_s=60.0),
        GpuRow("c", "row c", benchmark="compile", expected_s=10.0),
    )
    outcomes = run_rows(rows, record, limit_s=480.0, clock=clock)
    assert ran == [("a", 480.0), ("b", 280.0), ("c", 30.0)]
    assert [(o.row.name, o.recorded) for o in outcomes] == [
        ("a", True),
        ("todo", False),
        ("b", False),
        ("big", False),
        ("c", True),
    ]
    lines = could_not_record(outcomes)
    assert lines == [
        "kaisoku bench gpu: could not record todo (a row no benchmark has): no benchmark measures it yet",
        "kaisoku bench gpu: could not record b (row b): kaisoku bench b exited 1 (output in b.log)",
        "kaisoku bench gpu: could not record big (row too long for what is left): not started: it takes "
        "about 60 s and 30 s were left of the 8 minutes",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the run would start")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "kaisoku bench gpu: no CUDA device on this machine; nothing to record (run it on a GPU machine)"
    ]
    assert not any(tmp_path.iterdir())
    assert not (Path(RESULTS) / "gpu").exists()
