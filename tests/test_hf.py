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
