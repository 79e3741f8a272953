"""A Hugging Face causal language model (GPT-2 built from its config) trained by ``kaisoku.fit`` on a
``datasets.Dataset`` of token ids, as written: examples/hf_causal_lm.py on 2 ranks, data parallel, sharded, in
bf16, and under K-FAC."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = [name for name in ("transformers", "datasets") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install -e '.[hf]'"),
    pytest.mark.slow,  # 2-rank runs of 15-40 s each
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("args", "steps", "least_accuracy"),
    [
        ([], 96, 50.0),  # data parallel, 6 epochs: the counting pattern is mostly learned (chance: 3.1%)
        (["--shard", "full", "--epochs", "2"], 32, 15.0),
        (["--precision", "bf16", "--epochs", "2"], 32, 15.0),
        (["--kfac", "--epochs", "1"], 16, 15.0),
    ],
    ids=["dp", "shard-full", "bf16", "kfac"],
)
def test_a_hugging_face_causal_lm_trains_on_its_own_loss(
    tmp_path: Path, args: list[str], steps: int, least_accuracy: float
) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--run-dir", str(tmp_path / "run"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=380, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"hf causal lm: (\d+) steps, token accuracy ([\d.]+)%, perplexity", result.stdout)
    assert found is not None, result.stdout[-2000:]
    assert int(found[1]) == steps
    assert float(found[2]) > least_accuracy, found[0]


USER_FILES = ROOT / "tests" / "user_files"


def _cli(run_dir: Path, *extra: str) -> list[str]:
    """The example's parts through `kaisoku train`'s import paths, 2 ranks, one epoch of 16 steps."""
    return [
        sys.executable, "-m", "kaisoku", "train", "--nproc", "2", "--run-dir", str(run_dir),
        "--model.name", "user_hf:tiny_gpt2", "--data.dataset", "user_hf:data",
        "--train.metrics", "user_hf:next_token_accuracy",
        "--optim.name", "adamw", "--optim.lr", "3e-3", "--data.global-batch", "32", "--data.workers", "0",
        "--train.epochs", "1", "--checkpoint.every-steps", "4", "--train.log-every", "4",
        "--metrics.progress", "false", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(600)
def test_a_hugging_face_model_by_import_path_resumes_bit_identically_after_a_kill(tmp_path: Path) -> None:
    import torch

    from kaisoku.engine.checkpoint import CheckpointManager
    from tests.train_harness import kill_and_collect, train_env, wait_for

    env = train_env()
    whole = subprocess.run(
        _cli(tmp_path / "whole"), cwd=USER_FILES, capture_output=True, text=True, timeout=280, env=env
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "val_next_token_accuracy" in whole.stdout and "tokens_per_s" in whole.stdout, whole.stdout[-3000:]
    held = tmp_path / "killed" / "checkpoints" / "step-00000008.pt"
    proc = subprocess.Popen(
        _cli(tmp_path / "killed"), cwd=USER_FILES, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "USER_HF_HOLD_AT": str(held)},
    )  # fmt: skip
    assert wait_for(held.exists, 240), "the step-8 checkpoint never appeared"
    _, stderr = kill_and_collect(proc, rank=1)
    assert proc.returncode != 0 and "rank 1" in stderr, stderr[-2000:]
    resumed = subprocess.run(
        _cli(tmp_path / "killed", "--resume", "auto"), cwd=USER_FILES, capture_output=True, text=True, timeout=280, env=env
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 8" in resumed.stdout, resumed.stdout[-2000:]
    finals = [
        CheckpointManager(tmp_path / name / "checkpoints", keep=3).latest_valid()
        for name in ("whole", "killed")
    ]
    assert finals[0] is not None and finals[1] is not None
    a, b = finals[0][1], finals[1][1]
    assert a["step"] == b["step"] == 16
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
