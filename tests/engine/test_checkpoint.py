"""Checkpoints: atomic, newest K kept, damaged ones named and skipped on auto-resume."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
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


def test_before_rename_sees_the_complete_temp_file_beside_no_checkpoint(tmp_path: Path) -> None:
    seen: list[tuple[Path, dict, list[Path], bool]] = []

    def record(tmp: Path) -> None:
        state = torch.load(tmp, weights_only=True)
        seen.append((tmp, state, manager.list(), manager.path_for(2).exists()))

    manager = CheckpointManager(tmp_path, keep=3, before_rename=record)
    manager.save(_state(1))
    final = manager.save(_state(2))
    assert len(seen) == 2
    tmp, state, listed, final_existed = seen[1]
    assert tmp.parent == tmp_path and tmp.name.startswith(".step-00000002.pt.") and tmp.suffix == ".tmp"
    assert state["step"] == 2 and torch.equal(state["model"]["w"], torch.full((2,), 2.0))
    assert [p.name for p in listed] == ["step-00000001.pt"]
    assert not final_existed
    assert not tmp.exists() and final.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt", "step-00000002.pt"]


def test_before_rename_that_raises_leaves_no_temp_file_and_no_checkpoint(tmp_path: Path) -> None:
    temps: list[Path] = []

    def fail(tmp: Path) -> None:
        temps.append(tmp)
        raise RuntimeError("writer stopped before the rename")

    CheckpointManager(tmp_path, keep=3).save(_state(1))
    manager = CheckpointManager(tmp_path, keep=3, before_rename=fail)
    with pytest.raises(RuntimeError, match="before the rename"):
        manager.save(_state(2))
    assert len(temps) == 1 and not temps[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]
    found = manager.latest_valid()
    assert found is not None and found[1]["step"] == 1


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from kaisoku.engine.checkpoint import CheckpointManager

def die(tmp: Path) -> None:
    print(tmp, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

state = {"model": {}, "optimizer": {}, "scheduler": {}, "data": {}, "rng": {}}
directory = Path(sys.argv[1])
CheckpointManager(directory, keep=3).save({**state, "step": 1})
CheckpointManager(directory, keep=3, before_rename=die).save({**state, "step": 2})
"""


def test_writer_killed_before_the_rename_leaves_only_complete_checkpoints(tmp_path: Path) -> None:
    """A SIGKILL runs no cleanup: the temp file stays, is never taken as a checkpoint, and is removed."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tmp = Path(proc.stdout.strip())
    assert tmp.exists() and tmp.parent == tmp_path
    assert torch.load(tmp, weights_only=True)["step"] == 2  # complete, only not renamed
    manager = CheckpointManager(tmp_path, keep=3)
    assert [p.name for p in manager.list()] == ["step-00000001.pt"]
    found = manager.latest_valid()
    assert found is not None and found[1]["step"] == 1
    manager.remove_partial()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 64 KiB tmpfs: a real full disk (chmod proves nothing to root)."""
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
    with pytest.raises(
        KaisokuError, match="could not write checkpoint .*step-00000002.pt.*free space"
    ) as full:
        manager.save(big)
    assert str(full.value).endswith(
        "; --resume auto then continues from checkpoint step 1, the newest written"
    )
    assert [p.name for p in (tiny_disk / "checkpoints").iterdir()] == [small.name]
    assert CheckpointManager.load(small)["step"] == 1


def test_full_disk_during_a_sharded_save_is_one_line_and_gives_the_space_back(tiny_disk: Path) -> None:
    """torch's writer says only 'unexpected pos' when its file stops part-way, inside DCP's CheckpointException
    (a BaseException): the line still names the full disk and the step --resume auto continues from."""
    manager = CheckpointManager(tiny_disk / "checkpoints", keep=3, sharded=True)
    small = manager.save(_state(1), is_main=True)
    big = _state(2)
    big["model"]["w"] = torch.zeros(1 << 16)
    with pytest.raises(
        KaisokuError, match="could not write checkpoint .*step-00000002: No space left"
    ) as full:
        manager.save(big, is_main=True)
    assert str(full.value).endswith(
        "; --resume auto then continues from checkpoint step 1, the newest written"
    )
    assert [p.name for p in (tiny_disk / "checkpoints").iterdir()] == [small.name]  # the partial folder gone
    assert CheckpointManager.load(small)["step"] == 1
