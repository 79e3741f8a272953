"""Checkpoints: atomic, newest K kept, damaged ones named and skipped on auto-resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_open


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((2,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "step": step,
        "data": {"epoch": 0, "step_in_epoch": step},
        "rng": {"torch": torch.get_rng_state()},
    }


def test_keeps_newest_k_and_loads_back(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(_state(step))
    assert [p.name for p in manager.list()] == ["step-00000002.pt", "step-00000003.pt"]
    found = manager.latest_valid()
    assert found is not None
    assert found[1]["step"] == 3
    assert torch.equal(found[1]["model"]["w"], torch.full((2,), 3.0))


def test_corrupt_newest_is_named_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(_state(1))
    newest = manager.save(_state(2))
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(KaisokuError, match=f"checkpoint {newest} is corrupt"):
        CheckpointManager.load(newest)
    found = manager.latest_valid()
    assert found is not None and found[1]["step"] == 1
    assert str(newest) in capsys.readouterr().err


def test_foreign_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "step-00000001.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    with pytest.raises(KaisokuError, match="is not a kaisoku checkpoint"):
        CheckpointManager.load(path)


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(target) as handle:
        handle.write(b"half")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 64 KiB tmpfs: a real full disk (chmod proves nothing to root)."""
    import subprocess

    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_is_a_clear_error_and_keeps_old_checkpoints(tiny_disk: Path) -> None:
    manager = CheckpointManager(tiny_disk / "checkpoints", keep=3)
    small = manager.save(_state(1))
    big = _state(2)
    big["model"]["w"] = torch.zeros(1 << 16)  # 256 KiB: does not fit
    with pytest.raises(KaisokuError, match="could not write checkpoint .*step-00000002.pt.*free space"):
        manager.save(big)
    assert [p.name for p in (tiny_disk / "checkpoints").iterdir()] == [small.name]
    assert CheckpointManager.load(small)["step"] == 1
