"""The shared benchmark machinery: goals, the tree's state, where results may go, ``--strict``."""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import pytest

from kaisoku.errors import ConfigError
from kaisoku_bench import RESULTS, main, resolve_out
from kaisoku_bench.common import (
    checked_data_path,
    dirt,
    end_run,
    goal,
    start_run,
    tree_state,
    unmet_goals,
    write_result,
)
from kaisoku_bench.goals import ONE_MEASUREMENT, bootstrap_interval, paired_iqr, ratio_interval, worst_goal
from kaisoku_bench.imagesets import data_root
from kaisoku_bench.parallel_mnist import mnist_goals
from tests.bench.schema import RECORDED, check_record, fingerprint
from tests.bench.test_quick_runs import GOALS

LARGEBATCH_GOALS = GOALS["largebatch"]


# ------------------------------------------------------------------------------------------------ goal()


def test_goal_of_one_measurement_is_unmet_unless_exact() -> None:
    single = goal(1.02, "<= 1.03")
    assert single["met"] is False and single["reason"] == ONE_MEASUREMENT and single["value"] == 1.02
    assert goal(28.0, "<= 30", exact="a count of kernels") == {
        "value": 28.0,
        "goal": "<= 30",
        "met": True,
        "exact": "a count of kernels",
    }
    assert goal(31.0, "<= 30", exact="a count")["met"] is False
    assert goal(1.0, "> 1.0", exact="a count")["met"] is False
    assert goal(12.0, ">= 10", exact="a count", spread=[11.0, 13.0])["spread"] == [11.0, 13.0]


def test_goal_inside_its_interval_is_unmet_within_noise() -> None:
    # The median (1.27) clears 1.25, but the spread of the repeats straddles it.
    entry = goal(None, ">= 1.25", samples=[1.27, 1.30, 1.21, 1.28, 1.23])
    assert entry["value"] == pytest.approx(1.27)
    assert entry["met"] is False
    low, high = entry["interval"]
    assert low < 1.25 < high
    assert entry["reason"] == f"within noise: [{low:.4g}, {high:.4g}] vs >= 1.25"
    assert "bootstrap" in entry["interval_method"] and "seed 0" in entry["interval_method"]
    assert entry["samples"] == [1.27, 1.3, 1.21, 1.28, 1.23]
    # A measured interval (a paired IQR) is judged the same way.
    iqr = goal(1.011, "<= 1.03", interval=paired_iqr([1.0, 1.01, 1.02, 1.04, 1.05]))
    assert iqr["met"] is False and iqr["reason"].startswith("within noise")
    assert iqr["interval_method"] == "paired IQR over 5 rounds"


def test_goal_clearing_its_whole_interval_is_met_and_reproducible() -> None:
    samples = [1.37, 1.40, 1.42, 1.38, 1.41]
    entry = goal(None, ">= 1.25", samples=samples)
    assert entry["met"] is True and "reason" not in entry
    assert 1.25 < entry["interval"][0] <= entry["value"] <= entry["interval"][1]
    assert goal(None, ">= 1.25", samples=samples) == entry  # fixed resampling seed: the same interval
    below = goal(None, "<= 1.03", samples=[0.98, 0.99, 1.0, 0.99])
    assert below["met"] is True and below["interval"][1] <= 1.03
    # Wholly on the wrong side: plainly missed, not noise.
    missed = goal(None, ">= 1.25", samples=[1.0, 1.02, 1.01])
    assert missed["met"] is False and "reason" not in missed


def test_signed_gap_keeps_its_sign_with_its_interval() -> None:
    # Per-seed gaps +0.16, -0.48, +0.32: the mean is 0.0 by cancellation, not by agreement.
    mixed = goal(None, ">= -0.2", samples=[0.16, -0.48, 0.32], statistic="mean", unit="seeds")
    assert mixed["value"] == pytest.approx(0.0, abs=1e-9)
    assert mixed["interval"][0] < -0.2 < mixed["interval"][1]
    assert mixed["met"] is False and mixed["reason"].startswith("within noise")
    worse = goal(None, ">= -0.5", samples=[-1.1, -0.9, -1.0], statistic="mean", unit="seeds")
    assert worse["value"] == pytest.approx(-1.0) and worse["interval"][1] < 0
    assert worse["met"] is False
    assert "over 3 seeds" in worse["interval_method"]


def test_the_worst_of_several_cases_is_met_only_when_every_case_clears() -> None:
    settled = {"small-cnn": [1.0, 1.01, 1.0, 1.02], "resnet10": [0.99, 1.0, 1.0, 1.01]}
    entry = worst_goal(settled, "<= 1.03", unit="rounds")
    assert entry["met"] is True and entry["worst_case"] == "small-cnn"
    # resnet10's median is the lower one, but its rounds straddle the target: the goal is not settled.
    noisy = {"small-cnn": [1.0, 1.01, 1.0, 1.02], "resnet10": [0.98, 0.99, 1.0, 1.06]}
    entry = worst_goal(noisy, "<= 1.03", unit="rounds")
    assert entry["value"] == pytest.approx(1.005) and entry["met"] is False
    assert entry["reason"].startswith("within noise") and entry["per_case"]["resnet10"]["interval"][1] > 1.03
    once = worst_goal({"a": [1.0, 1.0], "b": [1.0]}, "<= 1.03")
    assert once["met"] is False and once["reason"].startswith(ONE_MEASUREMENT)


def test_a_ratio_of_runs_measured_apart_resamples_each_side() -> None:
    interval = ratio_interval([10.0, 11.0, 12.0], [5.0, 5.5, 6.0])
    assert interval.low < 2.0 < interval.high and "apart" in interval.method
    assert goal(2.0, ">= 1.5", interval=interval)["met"] is True
    assert goal(2.0, ">= 1.9", interval=interval)["reason"].startswith("within noise")


def test_goal_with_a_reason_is_never_met() -> None:
    entry = goal(0.5, "<= 1.03", reason="round cap hit")
    assert entry == {"value": 0.5, "goal": "<= 1.03", "met": False, "reason": "round cap hit"}
    assert goal(None, ">= 1.25", reason="peer missing") == {
        "value": None,
        "goal": ">= 1.25",
        "met": False,
        "reason": "peer missing",
    }
    cleared = goal(None, ">= 1.25", samples=[2.0, 2.1, 2.2], reason="peer not at its best")
    assert cleared["met"] is False and cleared["reason"] == "peer not at its best"


def test_goal_without_value_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        goal(None, "<= 1.0")
    entry = goal(math.nan, "<= 1.0")
    assert entry["value"] is None and entry["met"] is False and "nan" in entry["reason"]
    assert unmet_goals({"a": goal(1.0, "<= 2", exact="a count"), "b": entry}) == ["b"]
    partial = goal(None, ">= 1.0", samples=[2.0, math.nan, 2.1])
    assert partial["met"] is False and "1 of 3 repeats" in partial["reason"]


def test_bootstrap_interval_is_keyed_by_a_fixed_seed_only() -> None:
    first = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0], "mean")
    assert first == bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0], "mean")
    assert 1.0 <= first.low < 3.0 < first.high <= 5.0
    # Three samples: about their whole range, so a figure they straddle is never settled.
    three = bootstrap_interval([0.9, 1.0, 1.1])
    assert (three.low, three.high) == (0.9, 1.1)


def test_mnist_goals_stay_in_the_summary_whatever_happens() -> None:
    missing = mnist_goals({}, "mnist.npz not found")
    assert set(missing) == {"switch_accuracy_gap_points", "switch_speedup_vs_dp"}
    assert all(e["value"] is None and not e["met"] and e["reason"] for e in missing.values())

    def config(accuracy: float, speed: float) -> dict[str, object]:
        return {
            "accuracy_mean": accuracy,
            "accuracy_per_seed": [accuracy - 0.001, accuracy, accuracy + 0.001],
            "speed_vs_dp_median": speed,
            "speed_vs_dp_range": [speed - 0.1, speed + 0.1],
            "speed_vs_dp_per_seed": [speed - 0.1, speed, speed + 0.1],
        }

    faster = mnist_goals(
        {
            "dp-only": config(0.98, 1.0),
            "hybrid-only": config(0.97, 1.2),
            "switch": config(0.975, 1.1),
        }
    )
    assert faster["switch_accuracy_gap_points"]["met"] is True
    assert faster["switch_speedup_vs_dp"]["met"] is False
    assert faster["switch_speedup_vs_dp"]["reason"].startswith("within noise")
    # Switch half a point below dp-only in every seed: a signed gap of -0.5 points, inside the goal.
    assert faster["switch_accuracy_gap_points"]["value"] == pytest.approx(-0.5)
    assert faster["switch_accuracy_gap_points"]["switch_minus_dp_points_per_seed"] == pytest.approx(
        [-0.5] * 3
    )
    assert faster["switch_speedup_vs_dp"]["per_seed"] == pytest.approx([1.0, 1.1, 1.2])
    # Per-seed ratios 1.0 / 1.1 / 1.2: their interval reaches 1.0 itself, so "> 1.0" is not settled.
    assert faster["switch_speedup_vs_dp"]["interval"][0] == pytest.approx(1.0)
    slower = mnist_goals(
        {
            "dp-only": config(0.98, 1.0),
            "hybrid-only": config(0.97, 0.8),
            "switch": config(0.9, 1.1),
        }
    )
    assert slower["switch_speedup_vs_dp"]["met"] is False
    assert "not applicable" in slower["switch_speedup_vs_dp"]["reason"]
    assert slower["switch_speedup_vs_dp"]["value"] == 1.1
    assert slower["switch_accuracy_gap_points"]["met"] is False
    assert slower["switch_accuracy_gap_points"]["value"] == pytest.approx(-8.0)
    # Gaps of -0.2, -0.9 and -1.6 points: a mean of -0.9 above the goal, but an interval reaching below it.
    straddling = mnist_goals(
        {
            "dp-only": {**config(0.98, 1.0), "accuracy_per_seed": [0.98, 0.98, 0.98]},
            "hybrid-only": config(0.97, 1.2),
            "switch": {**config(0.971, 1.1), "accuracy_per_seed": [0.978, 0.971, 0.964]},
        }
    )
    entry = straddling["switch_accuracy_gap_points"]
    assert entry["value"] == pytest.approx(-0.9)
    assert entry["met"] is False and entry["reason"].startswith("within noise")


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
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "module.py").write_text("v = 1\n")
    (root / ".gitignore").write_text("__pycache__/\n")
    (root / RESULTS).mkdir(parents=True)
    (root / RESULTS / "engine.json").write_text("{}\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "start")
    return root


def test_tree_state_sees_tracked_changes_and_new_source_files(repo: Path) -> None:
    clean = tree_state(repo)
    assert not clean.dirty and clean.diff_sha256 is None and len(clean.commit) == 40
    (repo / "untracked.txt").write_text("scratch\n")  # outside the code folders: not measured code
    assert not tree_state(repo).dirty
    (repo / "code.py").write_text("x = 2\n")
    dirty = tree_state(repo)
    assert dirty.dirty and dirty.commit == clean.commit and len(dirty.diff_sha256 or "") == 64
    (repo / "code.py").write_text("x = 3\n")
    assert tree_state(repo).diff_sha256 != dirty.diff_sha256


def test_a_new_uncommitted_source_file_makes_the_tree_dirty(repo: Path) -> None:
    (repo / "src" / "pkg" / "new_module.py").write_text("y = 1\n")
    state = tree_state(repo)
    assert state.dirty and state.untracked == ["src/pkg/new_module.py"]
    assert "src/pkg/new_module.py" in dirt(state)
    first_hash = state.diff_sha256
    (repo / "src" / "pkg" / "new_module.py").write_text("y = 2\n")
    assert tree_state(repo).diff_sha256 != first_hash  # the hash covers the new file's bytes
    with pytest.raises(ConfigError, match="new source files"):
        resolve_out("", quick=False, allow_dirty=False, repo=repo, name="engine")
    (repo / "src" / "pkg" / "new_module.py").unlink()
    (repo / "benchmarks" / "helper.py").write_text("z = 1\n")  # benchmark code beside the records
    assert tree_state(repo).untracked == ["benchmarks/helper.py"]
    (repo / "benchmarks" / "helper.py").unlink()
    # Ignored files (caches, build outputs) and new records are not code.
    (repo / "src" / "pkg" / "__pycache__").mkdir()
    (repo / "src" / "pkg" / "__pycache__" / "code.cpython.pyc").write_bytes(b"\0")
    (repo / RESULTS / "new.json").write_text("{}\n")
    assert not tree_state(repo).dirty


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


def test_data_and_out_paths_inside_results_are_refused(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo)  # the working directory's benchmarks/results is protected too
    inside = repo / RESULTS / "data"
    with pytest.raises(ConfigError, match="lies inside benchmarks/results"):
        checked_data_path(inside, "$KAISOKU_BENCH_DATA")
    assert checked_data_path(tmp_path / "data", "$KAISOKU_BENCH_DATA") == tmp_path / "data"
    monkeypatch.setenv("KAISOKU_BENCH_DATA", str(inside))
    with pytest.raises(ConfigError, match=r"\$KAISOKU_BENCH_DATA"):
        data_root()
    monkeypatch.setenv("KAISOKU_BENCH_DATA", str(tmp_path / "sets"))
    assert data_root() == tmp_path / "sets"
    # A benchmark's run called directly writes through write_result, which obeys the same rules.
    start_run(["engine", "--quick"], quick=True)
    try:
        with pytest.raises(ConfigError, match="--quick never writes"):
            write_result("engine", repo / RESULTS, {}, [], quick=True)
        assert not (repo / RESULTS / "engine.json").read_text().strip("{}\n")
        written = write_result("engine", tmp_path / "out", {}, [], quick=True)
        assert written["quick"] is True and (tmp_path / "out" / "engine.json").is_file()
    finally:
        end_run()
    monkeypatch.setenv("TMPDIR", str(repo / RESULTS))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again
    try:
        with pytest.raises(ConfigError, match="temporary folder"):
            start_run(["engine"], quick=False)
    finally:
        monkeypatch.delenv("TMPDIR")
        tempfile.tempdir = None
        end_run()


# -------------------------------------------------------------------------------------------- main()


def test_user_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown benchmark 'nosuch'"):
        main(["nosuch"])
    with pytest.raises(ConfigError, match="--mnist"):
        main(["largebatch", "--quick", "--mnist", str(tmp_path / "absent.npz")])
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        main(["engine", "--quik"])


@pytest.mark.slow  # a benchmark's quick path (kfac's runs its procedure without MNIST)
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
