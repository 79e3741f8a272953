"""A user's own model, dataset and loss (tests/user_files/user_net.py, not kaisoku's) trained on 2 ranks
through ``kaisoku train``'s import paths and through ``kaisoku.fit``, with each feature, and resumed
bit-identically after a rank is killed mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaisoku.engine.checkpoint import CheckpointManager
from tests.dist_harness import run_ranks
from tests.train_harness import kaisoku_in_process, kill_and_collect, rank_pid, train_env, wait_for

USER_FILES = Path(__file__).resolve().parents[1] / "user_files"
STEPS = 8  # one epoch of 256 samples at a global batch of 32

FEATURES: dict[str, list[str]] = {
    "dp": [],
    "pp2": ["--parallel.pp", "2", "--parallel.microbatches", "2"],
    "budget": ["--memory.budget", "2MiB"],
    "kfac": ["--optim.kfac.enabled", "true", "--optim.kfac.inv-update-steps", "2"],
    "lars": ["--optim.name", "lars", "--sched.name", "arccot", "--train.label-smoothing", "0.1"],
    "bf16": ["--precision.mode", "bf16"],
}
#: Killed through `kaisoku train` (a torchrun launch each); the others stop and resume in-process ranks, which
#: load the same kind of checkpoint the same way for a fraction of the start-up time. The kill and the
#: launcher's report are alike for every feature, so one feature goes through them.
KILLED = ("dp",)


def _args(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kaisoku", "train",
        "--nproc", "2",
        "--run-dir", str(run_dir),
        "--model.name", "user_net:net",
        "--data.dataset", "user_net:digits",
        "--data.global-batch", "32",
        "--data.workers", "0",
        "--train.epochs", "1",
        "--optim.lr", "0.05",
        "--checkpoint.every-steps", "2",
        "--train.log-every", "2",
        "--metrics.progress", "false",
        *extra,
    ]  # fmt: skip


def _succeeds(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``args`` to its end; it must exit 0 (its stderr's end is the failure message)."""
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _final_state(run_dir: Path) -> dict:
    newest = CheckpointManager(run_dir / "checkpoints", keep=3).latest_valid()
    assert newest is not None
    return newest[1]


def _assert_same_weights(first: dict, second: dict) -> None:
    assert first["step"] == second["step"] == STEPS
    a, b = first["model"], second["model"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


#: The user's own loss too: the kill test's runs and the `kaisoku.fit` test share one uninterrupted CLI run.
USER_LOSS = ("--train.loss", "user_net:smooth_loss")


@pytest.fixture(scope="module")
def whole_cli_run(tmp_path_factory: pytest.TempPathFactory, mnist_path: Path) -> tuple[Path, str]:
    """One `kaisoku train` of the user's model, data and loss to its end (a checkpoint every 2 steps): its
    folder and stdout."""
    run_dir = tmp_path_factory.mktemp("user-cli") / "whole"
    env = train_env(USER_NET_MNIST=str(mnist_path))
    whole = _succeeds(_args(run_dir, *FEATURES[KILLED[0]], *USER_LOSS), USER_FILES, env, 300)
    return run_dir, whole.stdout


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("feature", KILLED)
def test_user_model_trains_with_each_feature_and_resumes_exactly_after_a_kill(
    tmp_path: Path, mnist_path: Path, whole_cli_run: tuple[Path, str], feature: str
) -> None:
    env = train_env(USER_NET_MNIST=str(mnist_path))
    extra = [*FEATURES[feature], *USER_LOSS]
    whole_dir, whole_stdout = whole_cli_run
    assert "val_accuracy" in whole_stdout
    # The same run, a rank killed once the step-4 checkpoint exists (the data holds until then)...
    held = tmp_path / "killed" / "checkpoints" / "step-00000004.pt"
    proc = subprocess.Popen(
        _args(tmp_path / "killed", *extra),
        cwd=USER_FILES,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "USER_NET_HOLD_AT": str(held)},
    )
    assert wait_for(held.exists, 240), "the step-4 checkpoint never appeared"
    _, stderr = kill_and_collect(proc, rank=1)
    assert proc.returncode != 0
    assert "rank 1" in stderr, stderr[-2000:]
    # ... then resumed: the same weights as the run that never stopped.
    resumed = _succeeds(_args(tmp_path / "killed", *extra, "--resume", "auto"), USER_FILES, env, 300)
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    _assert_same_weights(_final_state(whole_dir), _final_state(tmp_path / "killed"))


def _whole_and_resumed(rank: int, world_size: int, tmp: Path, extra: list[str], mnist: str) -> int:
    """On this rank: the run to its end, then the same run stopped after step 4 and resumed by a new trainer
    (the user's module imported from its folder, as `kaisoku train` run there would)."""
    import sys as _sys

    from kaisoku.cli import resolve_config
    from kaisoku.distributed.env import World
    from kaisoku.engine.build import build_trainer

    os.environ["USER_NET_MNIST"] = mnist
    _sys.path.append(str(USER_FILES))
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    for name, more in (("whole", []), ("split", ["--max-steps", "4"]), ("split", ["--resume", "auto"])):
        cfg, _ = resolve_config(_args(tmp / name, *extra, *more)[4:])
        trainer = build_trainer(cfg, world, resume=cfg.checkpoint.resume)
        start = trainer.state.step
        trainer.fit()
        trainer.metrics.close()
    return start


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("feature", [name for name in FEATURES if name not in KILLED])
def test_user_model_with_each_feature_resumes_exactly(tmp_path: Path, mnist_path: Path, feature: str) -> None:
    starts = run_ranks(_whole_and_resumed, 2, tmp_path, FEATURES[feature], str(mnist_path), timeout=240)
    assert starts == [4, 4]
    root = tmp_path / "ranks2"
    _assert_same_weights(_final_state(root / "whole"), _final_state(root / "split"))


@pytest.mark.timeout(300)
def test_user_loss_and_python_fit_on_two_ranks(
    tmp_path: Path, mnist_path: Path, whole_cli_run: tuple[Path, str]
) -> None:
    """``kaisoku.launch`` starts a user script on 2 ranks; ``kaisoku.fit`` trains the user's objects with the
    user's loss, and the run equals the CLI run of the same parts (whose checkpoints along the way change
    nothing)."""
    script = tmp_path / "train_script.py"
    script.write_text(
        "import sys\n"
        "import kaisoku\n"
        "from user_net import digits, net, smooth_loss\n\n"
        "def main() -> None:\n"
        "    cfg = kaisoku.Config(run_dir=sys.argv[1])\n"
        "    cfg.data.global_batch, cfg.data.workers, cfg.train.epochs, cfg.optim.lr = 32, 0, 1, 0.05\n"
        "    cfg.metrics.progress = False\n"
        "    train, val = digits()\n"
        "    summary = kaisoku.fit(cfg, model=net, data=train, val_data=val, loss=smooth_loss)\n"
        "    sys.stdout.write(f\"fit steps {summary['steps']}\\n\")  # one write: the ranks share the pipe\n\n"
        "if __name__ == '__main__':\n"
        "    kaisoku.launch(main, nproc=2)\n"
    )
    env = train_env(
        USER_NET_MNIST=str(mnist_path),
        PYTHONPATH=os.pathsep.join([str(USER_FILES), os.environ.get("PYTHONPATH", "")]),
    )
    python = _succeeds([sys.executable, str(script), str(tmp_path / "python")], tmp_path, env, 240)
    assert f"fit steps {STEPS}" in python.stdout
    _assert_same_weights(_final_state(tmp_path / "python"), _final_state(whole_cli_run[0]))


#: The first goes through a real ``python -m kaisoku train`` process; the others through the same code in this
#: process (each process start imports torch), run in the user's folder as that command would be.
@pytest.mark.parametrize(
    ("flag", "value", "expected", "own_process"),
    [
        ("--model.name", "user_net:nosuch", "model.name: user_net has no nosuch", True),
        ("--model.name", "no_such_module:net", "model.name: cannot import no_such_module", False),
        ("--data.dataset", "user_net:smooth_loss", "data.dataset: smooth_loss failed", False),
        ("--train.loss", "user_net", "train.loss: 'user_net' is not valid", False),
    ],
)
def test_import_path_errors_are_one_line_before_launch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    expected: str,
    own_process: bool,
) -> None:
    argv = ["train", "--run-dir", str(tmp_path / "run"), flag, value]
    if own_process:
        result = subprocess.run(
            [sys.executable, "-m", "kaisoku", *argv],
            cwd=USER_FILES,
            capture_output=True,
            text=True,
            timeout=120,
            env=train_env(USER_NET_MNIST="/nonexistent"),
        )
    else:
        monkeypatch.chdir(USER_FILES)
        monkeypatch.syspath_prepend(str(USER_FILES))  # `python -m` puts the working folder first
        monkeypatch.setenv("USER_NET_MNIST", "/nonexistent")
        try:
            result = kaisoku_in_process(capfd, *argv)
        finally:
            sys.modules.pop("user_net", None)  # the next test imports it afresh
    code, stderr = result.returncode, result.stderr
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], stderr
    assert not (tmp_path / "run").exists()


def _launch_script(path: Path, settings: str) -> Path:
    """A user's script at ``path``: ``kaisoku.fit`` of a linear model on 64 samples under ``settings`` (one
    line of Python on ``cfg``), run by ``kaisoku.launch`` on 2 ranks; its run folder is ``run`` beside it."""
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "import kaisoku\n\n"
        "def main() -> None:\n"
        f"    cfg = kaisoku.Config(run_dir={str(path.parent / 'run')!r})\n"
        f"    {settings}\n"
        "    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))\n"
        "    kaisoku.fit(cfg, model=nn.Linear(4, 2), data=data)\n\n"
        "if __name__ == '__main__':\n"
        "    kaisoku.launch(main, nproc=2)\n"
    )
    return path


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_exits_with_the_ranks_own_line_and_code(tmp_path: Path) -> None:
    """Settings ``kaisoku.fit`` refuses on every rank of ``kaisoku.launch``: rank 0's one line, exit 2, as
    ``kaisoku train`` says it (no second line pointing at a run folder that was never made)."""
    script = _launch_script(tmp_path / "refused.py", "cfg.data.global_batch = 33")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
        env=train_env(),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.global_batch 33 is not a multiple of the world size 2" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_launch_script_takes_its_ranks_down(tmp_path: Path) -> None:
    """``kaisoku.launch``'s ranks stop when the script that launched them is killed (no rank trains on alone)."""
    script = _launch_script(
        tmp_path / "long.py", "cfg.data.global_batch, cfg.data.workers, cfg.train.epochs = 8, 0, 10000"
    )
    launcher = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        assert wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 120), "the run never started"
        ranks = [rank_pid(launcher.pid, rank) for rank in (0, 1)]
        assert None not in ranks
        launcher.kill()
        launcher.communicate(timeout=30)
        assert wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 60), (
            "ranks still run"
        )
    finally:
        launcher.kill()
