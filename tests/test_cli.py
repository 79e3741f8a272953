"""The command line: one-line errors with exit 2, printed config, README and CI kept in step."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kaisoku(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kaisoku", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--optim.lrr", "1"], "unknown config key 'optim.lrr'"),
        (["train", "--optim.name", "adam"], "choose one of: sgd, lars, lamb, adamw"),
        (["train", "--preset", "nope"], "choose one of: cpu-demo"),
        (["train", "--train.epochs", "x"], "train.epochs: 'x' is not a float"),
        (["bench", "nosuch"], "unknown benchmark 'nosuch'"),
    ],
)
def test_user_mistakes_are_one_line_exit_2(args: list[str], expected: str) -> None:
    result = _kaisoku(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_print_config_is_resolved_toml(tmp_path: Path) -> None:
    extra = tmp_path / "extra.toml"
    extra.write_text("[optim]\nlr = 0.7\n[train]\nseed = 3\n")
    result = _kaisoku("train", "--config", str(extra), "--train.seed", "5", "--print-config")
    assert result.returncode == 0, result.stderr
    parsed = tomllib.loads(result.stdout)
    assert parsed["optim"]["lr"] == 0.7
    assert parsed["train"]["seed"] == 5  # the command line wins over the file


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()[:30]
    return [line.strip() for line in lines if line.strip().startswith("python3.11 -m venv")]


def test_readme_gives_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    train, tests = commands
    assert train.endswith("kaisoku train")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci
