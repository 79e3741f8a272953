"""End to end: `kaisoku train` on 2 ranks with recompute + update-in-backward ends with the plain run's weights."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.engine.checkpoint import CheckpointManager
from tests.dist_harness import run_ranks
from tests.train_harness import train_args, train_env, train_to_the_end

# Slow tier: 2-rank runs with each memory technique.
pytestmark = pytest.mark.slow


def _final_model(data: Path, run_dir: Path, *extra: str, launched: bool = True) -> dict[str, torch.Tensor]:
    """The weights at the end of the run: launched through `kaisoku train`, or on 2 in-process ranks."""
    args = train_args(
        data, run_dir, "--max-steps", "3", "--checkpoint.every-steps", "3", "--optim.name", "lars", *extra
    )
    if launched:
        done = subprocess.run(args, capture_output=True, text=True, timeout=240, env=train_env())
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        run_ranks(train_to_the_end, 2, run_dir.parent, args[4:], timeout=240)
    found = CheckpointManager(run_dir / "checkpoints", keep=3).latest_valid()
    assert found is not None
    return CheckpointManager.load(Path(found[0]))["model"]


@pytest.mark.timeout(600)
def test_two_rank_training_with_memory_techniques_is_exact(tmp_path: Path) -> None:
    data = generate(tmp_path / "shapes", count=64, size=20, val_count=16, workers=1)
    plain = _final_model(data, tmp_path / "plain", launched=False)  # the reference: no launch of its own
    memory = _final_model(
        data, tmp_path / "memory", "--memory.recompute", "blocks", "--memory.update-in-backward", "true"
    )
    assert plain.keys() == memory.keys()
    for key in plain:
        assert torch.equal(plain[key], memory[key]), key
