"""The command line: one-line errors with exit 2, printed config, README and CI kept in step."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.train_harness import kaisoku_in_process

ROOT = Path(__file__).resolve().parents[1]


def _kaisoku(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kaisoku", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


#: The first mistake goes through a real ``python -m kaisoku`` process; the others through the same code in
#: this process (each process start imports torch).
@pytest.mark.parametrize(
    ("args", "expected", "own_process"),
    [
        (["train", "--optim.lrr", "1"], "unknown config key 'optim.lrr'", True),
        (["train", "--optim.name", "adam"], "choose one of: sgd, lars, lamb, adamw", False),
        (["train", "--preset", "nope"], "choose one of: cpu-demo", False),
        (["train", "--train.epochs", "x"], "train.epochs: 'x' is not a float", False),
        (["bench", "nosuch"], "unknown benchmark 'nosuch'", False),
    ],
)
def test_user_mistakes_are_one_line_exit_2(
    args: list[str], expected: str, own_process: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    result = _kaisoku(*args) if own_process else kaisoku_in_process(capfd, *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_print_config_is_resolved_toml(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    extra = tmp_path / "extra.toml"
    extra.write_text("[optim]\nlr = 0.7\n[train]\nseed = 3\n")
    result = kaisoku_in_process(capfd, "train", "--config", str(extra), "--train.seed", "5", "--print-config")
    assert result.returncode == 0, result.stderr
    parsed = tomllib.loads(result.stdout)
    assert parsed["optim"]["lr"] == 0.7
    assert parsed["train"]["seed"] == 5  # the command line wins over the file


def _readme_blocks() -> list[list[str]]:
    """The README's fenced blocks, each as its non-empty lines."""
    parts = (ROOT / "README.md").read_text().split("```")
    return [[line.strip() for line in block.splitlines()[1:] if line.strip()] for block in parts[1::2]]


def test_readme_gives_two_commands_and_ci_runs_the_test_one() -> None:
    first, cpu_wheels = _readme_blocks()[:2]
    assert len(first) == 2
    train, tests = first
    assert train.startswith("python3.11 -m venv .venv") and train.endswith("kaisoku train")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci
    # The CPU-only line comes next: the same venv, torch and torchvision from PyTorch's CPU index. CI takes
    # its wheels from its own index instead, so it does not run this line.
    assert cpu_wheels == [
        "python3.11 -m venv .venv && .venv/bin/pip install torch torchvision "
        "--index-url https://download.pytorch.org/whl/cpu"
    ]


@pytest.mark.parametrize("args", [[], ["--help"], ["-h"]])
def test_bare_kaisoku_and_help_list_every_command_with_one_line(args: list[str]) -> None:
    from kaisoku.cli import _COMMANDS

    result = _kaisoku(*args)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    for name in _COMMANDS:
        rows = [line for line in result.stdout.splitlines() if line.split()[:1] == [name]]
        assert len(rows) == 1 and len(rows[0].split()) > 3, (name, result.stdout)
    assert "--version" in result.stdout


def test_version_prints_the_package_version() -> None:
    from importlib.metadata import version

    result = _kaisoku("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kaisoku {version('kaisoku')}"


def test_train_help_prints_help_texts_with_a_percent_sign_as_written(
    capfd: pytest.CaptureFixture[str],
) -> None:
    result = kaisoku_in_process(capfd, "train", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps the help text
    assert "about 0.5% relative error" in text
    assert "{'" not in result.stdout  # a help text read as a %-format printed argparse's own dict


def test_bench_without_the_benchmarks_installed_says_how_to_install_them(tmp_path: Path) -> None:
    """The benchmarks are not part of the library: where ``kaisoku_bench`` cannot be imported (a plain install of
    kaisoku), ``kaisoku bench`` says in one line how to install it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # the library alone, not the tests' benchmarks path
    installed = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('kaisoku_bench') is not None)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    if installed.stdout.strip() == "True":
        pytest.skip("the benchmarks are installed in this environment: a plain install's message cannot show")
    result = subprocess.run(
        [sys.executable, "-m", "kaisoku", "bench", "loader", "--quick"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "kaisoku: error: kaisoku bench needs the benchmarks, which are not installed: from a clone of the "
        "repository, pip install -e './benchmarks' (and -e '.[bench]' for the peers they measure against)"
    ]
