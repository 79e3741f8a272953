"""Every checkpoint carries content checksums; a damaged one is named, skipped by ``auto`` and refused by name.

The checkpoints here are written by the same save the trainer calls, then damaged as a disk or a copy
would: bytes flipped in the middle of a tensor's data, which torch loads without a word.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from kaisoku.cli import main
from kaisoku.distributed.sharded_checkpoint import UnreadableCheckpointError
from kaisoku.engine import checksums, failures, run_dir
from kaisoku.engine.checkpoint import CheckpointManager, newest_step, write_trainer_file


def _state(step: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed + step)
    return {
        "model": {"layer.weight": torch.randn(512, 512, generator=generator), "layer.bias": torch.zeros(512)},
        "optimizer": {
            "state": {0: {"momentum_buffer": torch.ones(8)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "param_names": ["layer.weight", "layer.bias"]}],
        },
        "scheduler": {"last_epoch": step},
        "step": step,
        "data": {"epoch": 0},
        "rng": {"torch": torch.random.get_rng_state()},
        "config": {"train": {"seed": 0}},
    }


def _flip_middle(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (inside the big tensor's data)."""
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size // 2)
        data = handle.read(count)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in data))


def test_a_flipped_tensor_is_named_and_auto_resumes_from_the_one_before(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (9, 18, 27):
        manager.save(_state(step))
    newest = manager.path_for(27)
    assert torch.load(newest, weights_only=True)[checksums.STATE_KEY]["model.layer.weight"]
    _flip_middle(newest)
    torch.load(newest, weights_only=True)  # torch itself loads the damaged file without a word

    with pytest.raises(UnreadableCheckpointError) as damaged:
        CheckpointManager.load(newest)
    assert str(damaged.value) == "checkpoint step 27 is damaged (checksum of model.layer.weight differs)"
    assert damaged.value.exit_code == 3

    said: list[str] = []
    found = manager.latest_valid(on_skip=said.append)
    assert found is not None and found[0] == manager.path_for(18)
    assert said == ["checkpoint step 27 is damaged (checksum of model.layer.weight differs); skipped"]
    assert torch.equal(found[1]["model"]["layer.weight"], _state(18)["model"]["layer.weight"])


def test_a_checkpoint_without_checksums_still_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / "step-00000004.pt"
    torch.save({**_state(4), "format": 1}, old)  # as an older kaisoku wrote it
    with caplog.at_level(logging.WARNING, logger="kaisoku.checkpoint"):
        state = CheckpointManager.load(old)
    assert state["step"] == 4
    assert "has no checksums" in caplog.text and "cannot be verified" in caplog.text


def _folder(tmp_path: Path, step: int) -> Path:
    """A sharded checkpoint folder of ``step`` (one shard, through ``kaisoku ckpt convert``)."""
    single = tmp_path / "single" / f"step-{step:08d}.pt"
    CheckpointManager(single.parent, keep=5).save(_state(step))
    folder = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "convert", str(single), str(folder)])
    assert exited.value.code in (0, None)
    return folder


def test_a_sharded_folder_lists_its_files_and_names_the_damaged_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, 8)
    listed = json.loads((folder / checksums.FOLDER_FILE).read_text())
    shard = next(name for name in listed if name.endswith(".distcp"))
    assert {".metadata", "trainer.pt", shard} <= set(listed)
    assert CheckpointManager.load(folder)["step"] == 8
    _flip_middle(folder / shard)
    with pytest.raises(
        UnreadableCheckpointError, match=rf"step 8 is damaged \(checksum of {shard} differs\)"
    ):
        CheckpointManager.load(folder)
    # Convert refuses it (damaged data: exit 3), and verify names it.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "convert", str(folder), str(tmp_path / "out.pt")])
    assert exited.value.code == 3 and not (tmp_path / "out.pt").exists()
    assert f"checksum of {shard} differs" in capsys.readouterr().err


def test_ckpt_verify_checks_every_checkpoint_of_a_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = _folder(tmp_path, 8), _folder(tmp_path, 16)
    run = good.parents[1]
    CheckpointManager(good.parent, keep=5).save(_state(20))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "verify", str(run)])
    assert exited.value.code in (0, None)
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["ok", "ok", "ok"]

    (bad / "trainer.pt").write_bytes((bad / "trainer.pt").read_bytes()[:-8] + bytes(8))
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "verify", str(run)])
    lines = capsys.readouterr().out.splitlines()
    assert exited.value.code == 3
    assert lines[0].startswith(f"ok       {good} (step 8)")
    assert lines[1].startswith(f"damaged  {bad}: ") and "trainer.pt" in lines[1], lines
    assert lines[2].startswith("ok") and lines[2].endswith("(step 20)")
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "verify", str(bad)])
    assert exited.value.code == 3


def test_every_message_sees_sharded_checkpoint_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest-checkpoint lookup behind the failure, interrupt, restart and refusal lines knows folders."""
    run = tmp_path / "run"
    for step in (8, 16):
        _folder(tmp_path, step)
    capsys.readouterr()
    assert newest_step(run / "checkpoints") == 16

    failures.print_failure(failures.Failure("peer", "rank 1 died", resumable=True, step=19), run)
    assert "rerun with --resume auto to continue from checkpoint step 16" in capsys.readouterr().err
    failures.print_failure(failures.Failure("interrupt", "interrupted", step=19), run)
    assert "interrupted at step 19; checkpoint step 16 is the newest" in capsys.readouterr().err
    failures.report_restart(run, [(1, "SIGKILL", True)], restart=1, limit=1)
    assert "restart 1 of 1 continues from checkpoint step 16" in capsys.readouterr().err
    assert run_dir.trained_steps(run) == "checkpoints up to step 16"
    found = run_dir.newest_checkpoint_config(run)
    assert found is not None and found[0].name == "step-00000016" and found[1] == {"train": {"seed": 0}}


def test_a_folder_without_a_checksum_file_is_unverified_not_damaged(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 8)
    (folder / checksums.FOLDER_FILE).unlink()  # as an older kaisoku wrote it
    assert not checksums.verify_folder(folder)
    assert CheckpointManager.load(folder)["step"] == 8
    # The trainer's part of a folder is written without the per-tensor digests (the file list covers it).
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    write_trainer_file(copy, {**_state(8), "format": 1, checksums.STATE_KEY: {"x": "0"}})
    assert checksums.STATE_KEY not in torch.load(copy / "trainer.pt", weights_only=True)
