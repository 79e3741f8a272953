"""Every Python example in the manual (``docs/*.md``) runs as written, each in a folder of its own."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
EXAMPLES = [
    (page.name, index, code)
    for page in sorted((ROOT / "docs").glob("*.md"))
    for index, code in enumerate(BLOCK.findall(page.read_text()))
]


#: Optional packages a docs example may import (the hf and metrics extras); without them it is skipped.
OPTIONAL = ("transformers", "datasets", "torchmetrics")

#: Examples that train for a while (several ranks, or a recipe over many steps) run in the slow tier, so that
#: the default tier stays within minutes; the README's own-model example keeps a 2-rank fit in it.
SLOW = {"large-batch.md-0", "own-model.md-0"}


def test_the_manual_has_examples_to_run() -> None:
    assert {page for page, _, _ in EXAMPLES} >= {"own-model.md", "large-batch.md", "memory-precision.md"}
    assert SLOW <= {f"{page}-{index}" for page, index, _ in EXAMPLES}  # a renamed example stays in a tier


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("page", "index", "code"),
    [
        pytest.param(
            page, index, code, id=f"{page}-{index}", marks=[pytest.mark.slow] * (f"{page}-{index}" in SLOW)
        )
        for page, index, code in EXAMPLES
    ],
)
def test_a_docs_example_runs(tmp_path: Path, page: str, index: int, code: str) -> None:
    optional = [name for name in OPTIONAL if re.search(rf"^(import|from) {name}\b", code, re.MULTILINE)]
    missing = [name for name in optional if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{page} example {index} needs {', '.join(missing)}: pip install -e '.[dev]'")
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, f"{page} example {index}:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
