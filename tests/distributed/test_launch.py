"""``launch_local``: torchrun's own launcher run in this process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kaisoku.distributed.launch import launch_local


@pytest.mark.timeout(120)
def test_a_launch_leaves_the_callers_environment_as_it_was(tmp_path: Path) -> None:
    """The ranks get the launcher's marks (its pid, the variables given); the caller keeps none of them, so a
    later run started from the same process (a benchmark, a test) is not taken for a launched rank."""
    script = tmp_path / "rank.py"
    seen = tmp_path / "seen"
    script.write_text(
        "import os, sys\n"
        f"open({str(seen)!r} + os.environ['RANK'], 'w').write(os.environ.get('KAISOKU_TEST_MARK', ''))\n"
    )
    before = dict(os.environ)
    result = launch_local([str(script)], nproc=2, env={"KAISOKU_TEST_MARK": "given"})
    assert result.ok
    assert [(tmp_path / f"seen{rank}").read_text() for rank in (0, 1)] == ["given", "given"]
    assert dict(os.environ) == before
