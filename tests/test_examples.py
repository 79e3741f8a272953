"""The Python examples under examples/ run and print progress as they go."""

from __future__ import annotations

import os
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


def _readme_block(heading: str) -> str:
    """The first ```python block under ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


@pytest.mark.timeout(300)
def test_readme_own_model_example_runs_on_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "mine.py"
    script.write_text(_readme_block("## Train your own model"))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kaisoku: done at step 28;" in result.stdout
    assert (tmp_path / "runs" / "mine" / "checkpoints" / "step-00000028.pt").is_file()
    # It learns: the last line (rank 0's) reports an accuracy far above chance (33%).
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("learned: validation accuracy ") and last.endswith("% (chance 33%)"), last
    assert float(last.split()[3].rstrip("%")) > 70.0, last

    # A second run in the same folder is refused in one line naming the Python setting, with no traceback.
    again = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"kaisoku: error: run folder {Path('runs') / 'mine'} holds another run"), line
    assert 'set cfg.checkpoint.resume = "auto" to continue it, or choose a new cfg.run_dir' in line


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("args", "done"),
    [
        (["--model", "transformer", "--max-steps", "3", "--", "--parallel.pp", "2"], "transformer: 3 steps"),
        (["--model", "resnet18", "--nproc", "1", "--max-steps", "2"], "resnet18: 2 steps"),
    ],
)
def test_own_model_example_trains_a_transformer_pipeline_and_a_torchvision_resnet(
    tmp_path: Path, args: list[str], done: str
) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_model.py"), "--run-dir", str(tmp_path / "run"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=380, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert done in result.stdout
