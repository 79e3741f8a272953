"""The shared benchmark machinery: goals, the tree's state, where results may go, ``--strict``."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from kaisoku.bench import RESULTS, main, resolve_out
from kaisoku.bench.common import goal, tree_state, unmet_goals
from kaisoku.bench.parallel_mnist import mnist_goals
from kaisoku.errors import ConfigError
from tests.bench.schema import RECORDED, check_record, fingerprint
from tests.bench.test_quick_runs import GOALS

LARGEBATCH_GOALS = GOALS["largebatch"]


# ------------------------------------------------------------------------------------------------ goal()


def test_goal_compares_value_with_target() -> None:
    assert goal(1.02, "<= 1.03") == {"value": 1.02, "goal": "<= 1.03", "met": True}
    assert goal(1.04, "<= 1.03")["met"] is False
    assert goal(1.0, "> 1.0")["met"] is False
    assert goal(12.0, ">= 10", spread=[11.0, 13.0])["spread"] == [11.0, 13.0]


def test_goal_with_a_reason_is_never_met() -> None:
    entry = goal(0.5, "<= 1.03", reason="round cap hit")
    assert entry == {"value": 0.5, "goal": "<= 1.03", "met": False, "reason": "round cap hit"}
    assert goal(None, ">= 1.25", reason="peer missing") == {
        "value": None,
        "goal": ">= 1.25",
        "met": False,
        "reason": "peer missing",
    }


def test_goal_without_value_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        goal(None, "<= 1.0")
    entry = goal(math.nan, "<= 1.0")
    assert entry["value"] is None and entry["met"] is False and "nan" in entry["reason"]
    assert unmet_goals({"a": goal(1.0, "<= 2"), "b": entry}) == ["b"]


def test_mnist_goals_stay_in_the_summary_whatever_happens() -> None:
    missing = mnist_goals({}, "mnist.npz not found")
    assert set(missing) == {"switch_accuracy_gap_in_dp_stds", "switch_speedup_vs_dp"}
    assert all(e["value"] is None and not e["met"] and e["reason"] for e in missing.values())

    def config(accuracy: float, std: float, speed: float) -> dict[str, object]:
        return {
            "accuracy_mean": accuracy,
            "accuracy_std": std,
            "speed_vs_dp_median": speed,
            "speed_vs_dp_range": [speed - 0.1, speed + 0.1],
            "speed_vs_dp_per_seed": [speed - 0.1, speed, speed + 0.1],
        }

    faster = mnist_goals(
        {
            "dp-only": config(0.98, 0.01, 1.0),
            "hybrid-only": config(0.97, 0.01, 1.2),
            "switch": config(0.975, 0.01, 1.1),
        }
    )
    assert faster["switch_accuracy_gap_in_dp_stds"]["met"] is True
    assert faster["switch_speedup_vs_dp"]["met"] is True
    assert faster["switch_speedup_vs_dp"]["per_seed"] == pytest.approx([1.0, 1.1, 1.2])
    slower = mnist_goals(
        {
            "dp-only": config(0.98, 0.01, 1.0),
            "hybrid-only": config(0.97, 0.01, 0.8),
            "switch": config(0.9, 0.01, 1.1),
        }
    )
    assert slower["switch_speedup_vs_dp"]["met"] is False
    assert "not applicable" in slower["switch_speedup_vs_dp"]["reason"]
    assert slower["switch_speedup_vs_dp"]["value"] == 1.1
    assert slower["switch_accuracy_gap_in_dp_stds"]["met"] is False


# ---------------------------------------------------------------------------------------- tree and out


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "bench@example.invalid")
    _git(root, "config", "user.name", "bench")
    (root / "code.py").write_text("x = 1\n")
    (root / RESULTS).mkdir(parents=True)
    (root / RESULTS / "engine.json").write_text("{}\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "start")
    return root


def test_tree_state_sees_tracked_changes_only(repo: Path) -> None:
    clean = tree_state(repo)
    assert not clean.dirty and clean.diff_sha256 is None and len(clean.commit) == 40
    (repo / "untracked.txt").write_text("scratch\n")
    assert not tree_state(repo).dirty
    (repo / "code.py").write_text("x = 2\n")
    dirty = tree_state(repo)
    assert dirty.dirty and dirty.commit == clean.commit and len(dirty.diff_sha256 or "") == 64
    (repo / "code.py").write_text("x = 3\n")
    assert tree_state(repo).diff_sha256 != dirty.diff_sha256


def test_a_recorded_result_does_not_make_the_next_recording_dirty(repo: Path) -> None:
    (repo / RESULTS / "engine.json").write_text('{"summary": {}}\n')  # the previous benchmark's output
    assert not tree_state(repo).dirty
    (repo / "code.py").write_text("x = 2\n")
    state = tree_state(repo)
    assert state.dirty
    (repo / RESULTS / "engine.json").write_text('{"summary": {"other": 1}}\n')
    assert tree_state(repo).diff_sha256 == state.diff_sha256  # the hash covers code, not outputs


def test_full_run_refuses_to_record_from_a_dirty_tree(repo: Path) -> None:
    results = repo / RESULTS
    assert resolve_out("", quick=False, allow_dirty=False, repo=repo, name="engine") == results
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(ConfigError, match="uncommitted changes") as error:
        resolve_out("", quick=False, allow_dirty=False, repo=repo, name="engine")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError):
        resolve_out(str(results / "sub"), quick=False, allow_dirty=False, repo=repo, name="engine")
    assert resolve_out("", quick=False, allow_dirty=True, repo=repo, name="engine") == results
    elsewhere = repo.parent / "elsewhere"
    assert resolve_out(str(elsewhere), quick=False, allow_dirty=False, repo=repo, name="engine") == elsewhere


def test_quick_run_goes_to_a_fresh_temporary_folder_never_to_results(repo: Path) -> None:
    first = resolve_out("", quick=True, allow_dirty=False, repo=repo, name="engine")
    second = resolve_out("", quick=True, allow_dirty=False, repo=repo, name="engine")
    assert first != second and first.is_dir() and not any(first.iterdir())
    assert repo not in first.parents
    with pytest.raises(ConfigError, match="--quick never writes"):
        resolve_out(str(repo / RESULTS), quick=True, allow_dirty=True, repo=repo, name="engine")
    first.rmdir()
    second.rmdir()


# -------------------------------------------------------------------------------------------- main()


def test_user_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown benchmark 'nosuch'"):
        main(["nosuch"])
    with pytest.raises(ConfigError, match="--mnist"):
        main(["largebatch", "--quick", "--mnist", str(tmp_path / "absent.npz")])
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        main(["engine", "--quik"])


@pytest.mark.parametrize("name", ["largebatch", "kfac"])
def test_missing_mnist_keeps_every_goal_and_strict_fails(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAISOKU_MNIST", str(tmp_path / "absent.npz"))
    before = fingerprint(RECORDED)
    assert main([name, "--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"{name}.json").read_text())
    goals = LARGEBATCH_GOALS if name == "largebatch" else {"kfac_time_to_target_vs_sgd"}
    check_record(record, goals)
    # Every goal of an MNIST case names the missing archive (kfac's resnet10 case needs no MNIST).
    mnist_goals = [entry for goal, entry in record["summary"].items() if "resnet10" not in goal]
    assert mnist_goals and all("MNIST" in entry["reason"] for entry in mnist_goals)
    assert main([name, "--quick", "--out", str(tmp_path), "--strict"]) == 1
    assert "goals not met" in capsys.readouterr().err
    assert fingerprint(RECORDED) == before


def test_quick_without_out_prints_its_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAISOKU_MNIST", str(tmp_path / "absent.npz"))
    assert main(["largebatch", "--quick"]) == 0
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.startswith("kaisoku bench largebatch: wrote")
    )
    written = Path(line.rsplit(" ", 1)[1])
    try:
        assert written.is_file() and written.name == "largebatch.json"
        assert RECORDED not in written.parents
        check_record(json.loads(written.read_text()), LARGEBATCH_GOALS)
    finally:
        written.unlink()
        written.parent.rmdir()
