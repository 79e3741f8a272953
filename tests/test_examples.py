"""The Python examples under examples/ run and print progress as they go."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_large_batch_example_prints_a_line_per_step() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "large_batch.py"), "--samples", "96", "--batch", "32",
         "--epochs", "2"],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "small-cnn, 96 samples, batch 32: 3 steps per epoch, 2 epochs"
    steps = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in steps] == [
        f"epoch {e}/2 step {s}/3" for e in (1, 2) for s in (1, 2, 3)
    ]
    assert all(", lr " in line and line.endswith(" s") for line in steps)
    assert lines[-1].startswith("done: 6 steps in ")
