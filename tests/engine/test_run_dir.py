"""engine/run_dir.py: one run per folder (the lock), no new run into another's files, a matching resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaisoku.config import Config, to_dict
from kaisoku.engine.run_dir import (
    LOCK_NAME,
    NON_TRAJECTORY_KEYS,
    RunFolderLock,
    claim,
    config_differences,
    flat_config,
)
from kaisoku.errors import ConfigError
from kaisoku.owner import this_process


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _config(run_dir: Path, **values: object) -> Config:
    cfg = Config(run_dir=str(run_dir))
    for key, value in values.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_second_run_on_a_locked_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import sys, time; from pathlib import Path; from kaisoku.engine.run_dir import RunFolderLock; "
            "RunFolderLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"run folder {tmp_path} is in use by pid {holder.pid} on "):
            claim(_config(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    claim(_config(tmp_path)).release()  # the kernel dropped the killed holder's lock


def test_a_lock_left_by_a_dead_process_is_taken_over_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps({**this_process(), "pid": 4242}))
    lock = RunFolderLock(tmp_path)
    lock.acquire()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "taking over run folder" in err[0] and "pid 4242" in err[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == this_process()["pid"]
    with pytest.raises(ConfigError, match="is in use"):
        RunFolderLock(tmp_path).acquire()  # another open of the file: flock refuses it
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released cleanly: nothing to take over next time


def test_a_new_run_into_a_folder_where_another_trained_is_refused_unless_resumed(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("")  # a run that failed before training leaves no objection
    claim(_config(tmp_path)).release()
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n{"step": 12, "loss": 1.0}\n')
    with pytest.raises(
        ConfigError, match=r"holds another run \(metrics.jsonl up to step 12\); pass --resume"
    ):
        claim(_config(tmp_path))
    claim(_config(tmp_path, checkpoint__resume="auto")).release()


def test_resume_auto_refuses_a_checkpoint_of_another_config_naming_the_keys(tmp_path: Path) -> None:
    saved = _config(tmp_path, train__seed=0)
    (tmp_path / "checkpoints").mkdir()
    torch.save({"step": 4, "config": to_dict(saved)}, tmp_path / "checkpoints" / "step-00000004.pt")
    with pytest.raises(
        ConfigError, match=r"another config \(train.seed 0 -> 7\).*--resume .*step-00000004.pt"
    ):
        claim(_config(tmp_path, train__seed=7, checkpoint__resume="auto"))
    # What does not change the trajectory may differ.
    same = _config(
        tmp_path, checkpoint__resume="auto", train__max_steps=99, dist__nproc=4, train__log_every=3
    )
    claim(same).release()
    # An explicit checkpoint path is the user's choice.
    claim(_config(tmp_path, train__seed=7, checkpoint__resume=str(tmp_path / "x.pt"))).release()


def test_the_keys_that_may_differ_exist_and_the_trajectory_keys_count() -> None:
    keys = set(flat_config(to_dict(Config())))
    assert NON_TRAJECTORY_KEYS <= keys, NON_TRAJECTORY_KEYS - keys
    for key in ("train.seed", "train.epochs", "optim.lr", "model.name", "data.global_batch", "sched.name"):
        assert key not in NON_TRAJECTORY_KEYS
    old = to_dict(Config())
    new = to_dict(_config(Path("."), optim__lr=0.1, train__max_steps=5))
    assert config_differences(old, new) == [("optim.lr", 0.2, 0.1)]


def test_a_running_run_json_whose_owner_is_gone_is_marked_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    owner = {**this_process(), "pid": _dead_pid()}
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", "owner": owner}))
    with pytest.raises(ConfigError):
        (tmp_path / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
        claim(_config(tmp_path))
    state = json.loads((tmp_path / "run.json").read_text())
    assert state["status"] == "failed" and f"pid {owner['pid']}" in state["cause"]
    assert "marked failed in run.json" in capsys.readouterr().err


def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        ConfigError, match=rf"cannot write to run folder {blocker}/run .*choose a writable --run-dir"
    ):
        claim(_config(blocker / "run"))
